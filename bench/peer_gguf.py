#!/usr/bin/env python3
"""The same GGUF file, llama.cpp vs us: warm in RAM, and under a cgroup memory cap of half the file.

Builds once under --work: a seeded random Qwen3-MoE-shaped checkpoint (bench/peer.py's builder;
default 16 layers x 309 experts x 3 MiB bf16, top-8, hidden 1024), exported to a bf16 GGUF and
quantized by llama.cpp to Q4_K_M (about 4.3 GiB, ~4.2 GiB of it routed experts); the bf16 files
are deleted once the Q4_K_M file exists. We pack that GGUF file (experts copied byte for byte).

Routing. With a plain random init, routing collapses with depth (the residual stream of deep
layers is dominated by token-independent directions; an earlier run of this script measured:
the busiest expert of layer 13 is picked for every token, 49-67 distinct experts in layers 12-15
over 48 steps; projecting the router input's principal directions out of the routers did not
change that). So the model is built with o_proj and expert down weights scaled by
RESIDUAL_SCALE (0.1): the token embedding stays dominant, and routing stays token-dependent at
every layer ("uniform"). "skewed" is a copy of that file whose router rows e are scaled by
s_e = 1 + 7 * (rank_e + 1) ** -1.2 (seeded random rank per layer): a Zipf-like popularity. Each
file is packed; both engines read the same file of each case. The table reports distinct experts
per layer (mean over layers) over the timed steps, the busiest expert's share of picks (max over
layers; 1/top_k means: picked for every token), and our hit rate.

Runs, each engine in its own process, cold page cache, the same prompt ids, then decode steps fed
the same fixed random token stream (greedy decoding of a random model loops over a few tokens and
therefore a few experts; a fixed stream keeps routing varied and the work identical):

* warm: llama.cpp (mmap, every page faulted in by a first pass) and ours with every expert
  resident; f32 KV cache on llama.cpp, fast kernels on ours;
* capped: the process inside a cgroup v1 memory limit (--cap-gib, default half the file; page
  cache counts), llama.cpp mmapping the file (its CPU weight repacking, which copies every
  K-quant weight into anonymous memory and gets it killed under the cap, turned off), ours
  streaming through a host cache of --host-cache-gib with prefetch.

Prints tok/s, bytes read per token (/proc/self/io), expert hit rate (ours), distinct experts per
layer and the busiest expert's share, and the ratios ours/llama.cpp. Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import can_limit_memory, drop_page_cache, recorded_routing, routing_summary, run_json_worker  # noqa: E402


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def prepare(work: Path, experts_gib: float, layers: int, threads: int) -> dict:
    import peer
    from lean_qwenflash.store import pack
    from lean_qwenflash.store.gguf_export import export_gguf
    work.mkdir(parents=True, exist_ok=True)
    config = peer.model_config(experts_gib, layers)
    files = {"uniform": work / "model-Q4_K_M.gguf", "skewed": work / "model-skewed-Q4_K_M.gguf"}
    if not files["uniform"].is_file():
        ckpt, bf16 = work / "checkpoint", work / "model-bf16.gguf"
        peer.build_checkpoint(ckpt, config, residual_scale=RESIDUAL_SCALE)
        if not bf16.is_file():
            print("exporting GGUF bf16 ...", file=sys.stderr, flush=True)
            export_gguf(ckpt, bf16, "bf16")
        shutil.rmtree(ckpt)
        print("quantizing with llama.cpp to Q4_K_M ...", file=sys.stderr, flush=True)
        import llama_cpp
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, threads
        tmp = files["uniform"].with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(bf16).encode(), str(tmp).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
        tmp.rename(files["uniform"])
        bf16.unlink()
    if not files["skewed"].is_file():
        _skewed_copy(files)
    packs = {}
    for case, path in files.items():
        packs[case] = work / f"pack-{case}"
        if not (packs[case] / "manifest.json").is_file():
            print(f"packing {path.name} ...", file=sys.stderr, flush=True)
            pack(path, packs[case], force=True)
    return {"config": config, "gguf": files, "pack": packs}


RESIDUAL_SCALE = 0.1     # what each layer adds to the residual stream, relative to a plain random init


def _skewed_copy(files: dict) -> None:
    """The skewed copy of the file (only the f32 router tensors change): router row e scaled by
    s_e = 1 + 7 * (rank_e + 1) ** -1.2 (a seeded random rank per layer), a Zipf-like popularity."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(1)
    tmp = files["skewed"].with_suffix(".tmp")
    shutil.copyfile(files["uniform"], tmp)
    reader = gguf.GGUFReader(str(tmp), "r+")
    for t in reader.tensors:
        if t.name.endswith("ffn_gate_inp.weight"):
            scale = 1 + 7 * (rng.permutation(t.data.shape[0]) + 1.0) ** -1.2
            t.data[...] = (t.data * scale[:, None]).astype(np.float32)
    reader.data.flush()
    del reader
    tmp.rename(files["skewed"])


# -- workers ---------------------------------------------------------------------------------------

def worker_llama(spec: dict) -> dict:
    import llama_cpp
    if not spec["warm"]:
        # llama.cpp's CPU backend repacks K-quant weights into its interleaved layout in anonymous
        # memory (a full copy: killed under the cap); without that extra buffer type it computes
        # straight from the mmapped file, which is how it can run in less RAM than the file.
        import llama_cpp.llama_cpp as C
        default = C.llama_model_default_params

        def no_repack():
            params = default()
            params.use_extra_bufts = False
            return params
        C.llama_model_default_params = no_repack
    steps = spec["stream"]
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=spec["prompt_tokens"] + len(steps) + 8,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], n_batch=64,
                          type_k=0, type_v=0, logits_all=True, verbose=False)

    def run(stream):
        llm.reset()
        llm.eval(spec["prompt"])
        out, before, t0 = [], read_bytes(), time.perf_counter()
        for tok in stream:
            out.append(int(llm.scores[llm.n_tokens - 1].argmax()))
            llm.eval([tok])
        return out, time.perf_counter() - t0, read_bytes() - before
    run(steps if spec["warm"] else steps[:2])     # warm: fault every page in; capped: settle
    argmax, dt, nbytes = run(steps)
    return {"argmax": argmax, "decode_s": dt, "bytes_per_token": nbytes / len(steps)}


def worker_ours(spec: dict) -> dict:
    import torch
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate.state import new_state
    from lean_qwenflash.runtime import Runtime

    torch.set_num_threads(spec["threads"])
    extra = {} if spec["warm"] else {"host_cache_bytes": int(spec["host_cache_gib"] * 2**30), "prefetch": True}
    cfg = load_config(model=spec["path"], dtype="float32", expert_kernels="fast", **extra)
    steps = spec["stream"]
    with Runtime.open(cfg, resident_experts=spec["warm"]) as rt:
        model = rt.model

        def run(stream):
            state = new_state(model)
            with torch.inference_mode():
                logits = model(torch.tensor([spec["prompt"]]), state, last_logits_only=True)
                if hasattr(rt.provider, "stats"):
                    rt.provider.reset_stats()
                out, before, t0 = [], read_bytes(), time.perf_counter()
                for tok in stream:
                    out.append(int(logits[0, -1].argmax()))
                    logits = model(torch.tensor([[tok]]), state)
            return out, time.perf_counter() - t0, read_bytes() - before
        run(steps if spec["warm"] else steps[:2])
        argmax, dt, nbytes = run(steps)
        stats = rt.stats()
        # Routing statistics from one more pass over the same stream, after the timing.
        with recorded_routing(model) as routed:
            run(steps)
    out = {"argmax": argmax, "decode_s": dt, "bytes_per_token": nbytes / len(steps), **routing_summary(routed)}
    if stats:
        out["hit_rate"] = stats["total"]["hit_rate"]
    return out


def run_worker(kind: str, spec: dict, cap_bytes: int | None) -> dict:
    if os.geteuid() == 0:
        drop_page_cache()
    return run_json_worker([sys.executable, __file__, "--worker", kind, json.dumps(spec)], cap_bytes, "lqf-peer-gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts-gib", type=float, default=14.5, help="bf16 size of the routed experts before Q4_K_M")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--cap-gib", type=float, help="cgroup memory cap (default: half the GGUF file)")
    ap.add_argument("--host-cache-gib", type=float, help="our host expert cache under the cap (default: cap - 1 GiB)")
    ap.add_argument("--cases", default="uniform,skewed")
    ap.add_argument("--work", default=str(REPO / "bench" / "results" / "peer_gguf"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peer_gguf.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = worker_llama if args.worker == "llama" else worker_ours
        print(json.dumps(fn(json.loads(args.spec))))
        return 0

    files = prepare(Path(args.work), args.experts_gib, args.layers, args.threads)
    config = files["config"]
    file_bytes = files["gguf"]["uniform"].stat().st_size
    cap = int(args.cap_gib * 2**30) if args.cap_gib else file_bytes // 2
    host_cache = args.host_cache_gib if args.host_cache_gib else cap / 2**30 - 1.0
    can_cap = can_limit_memory()
    import random
    rng = random.Random(0)
    prompt = [rng.randrange(259, config["vocab_size"]) for _ in range(args.prompt_tokens)]
    # Decode steps are fed a fixed random token stream (teacher forcing), the same for both
    # engines: a greedy decode of a random model loops over a few tokens, and so over a few experts.
    stream = [rng.randrange(259, config["vocab_size"]) for _ in range(args.tokens)]
    base = {"prompt": prompt, "stream": stream, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
            "host_cache_gib": host_cache}
    rows = []
    for case in args.cases.split(","):
        for setting in ("warm", "capped"):
            if setting == "capped" and not can_cap:
                rows.append({"case": case, "setting": setting, "error": "needs root and cgroup v1"})
                continue
            limit = cap if setting == "capped" else None
            spec = dict(base, warm=setting == "warm")
            ll = run_worker("llama", dict(spec, path=str(files["gguf"][case])), limit)
            ours = run_worker("ours", dict(spec, path=str(files["pack"][case])), limit)
            row = {"case": case, "setting": setting, "llama": ll, "ours": ours}
            if "error" not in ll and "error" not in ours:
                row["ratio"] = ll["decode_s"] / ours["decode_s"]
                row["same_argmax"] = sum(a == b for a, b in zip(ll["argmax"], ours["argmax"])) / args.tokens
            rows.append(row)
            print(f"  {case} {setting} done", file=sys.stderr, flush=True)

    print(f"\nGGUF Q4_K_M made by llama.cpp from a random Qwen3-MoE-shaped model: {file_bytes / 2**30:.2f} GiB, "
          f"{config['num_hidden_layers']} layers x {config['num_experts']} experts, top-{config['num_experts_per_tok']}; "
          f"{args.threads} threads; {args.tokens} decode steps (a fixed random token stream) after a "
          f"{args.prompt_tokens}-token prompt; page cache dropped before each run. "
          f"Capped: cgroup limit {cap / 2**30:.2f} GiB (page cache counted), our host cache {host_cache:.2f} GiB.")
    print(f"{'routing':8s} {'setting':7s} {'engine':10s} {'tok/s':>7s} {'MiB read/tok':>13s} {'hit rate':>9s} "
          f"{'experts/layer':>14s} {'top share':>10s} {'ours/llama':>11s} {'same argmax':>12s}")
    for r in rows:
        if "ratio" not in r:
            errors = [r.get("error")] + [f"{e}: {r[e].get('error') or 'exit status only (killed?)'}"
                                         for e in ("llama", "ours") if e in r and "error" in r[e]]
            print(f"{r['case']:8s} {r['setting']:7s} error: {'; '.join(str(e)[-300:] for e in errors if e)}")
            continue
        for engine in ("llama", "ours"):
            m = r[engine]
            m["tok_s"] = args.tokens / m["decode_s"]
            print(f"{r['case']:8s} {r['setting']:7s} {'llama.cpp' if engine == 'llama' else 'ours':10s} "
                  f"{m['tok_s']:7.2f} {m['bytes_per_token'] / 2**20:13.1f} "
                  f"{m.get('hit_rate', float('nan')):9.2f} {m.get('distinct_experts_per_layer', float('nan')):14.1f} "
                  f"{m.get('top_expert_share', float('nan')):10.2f} "
                  + (f"{r['ratio']:10.2f}x {100 * r['same_argmax']:11.0f}%" if engine == "ours" else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "file_bytes": file_bytes, "cap_bytes": cap,
                                          "host_cache_gib": host_cache, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
