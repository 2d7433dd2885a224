#!/usr/bin/env python3
"""Long contexts on a hybrid model: resident memory and decode speed by KV cache type, ours vs
llama.cpp on the same GGUF file, and follow-up TTFT from a RAM snapshot, a disk snapshot or none.

Builds once under --work a seeded random Qwen3.5-MoE-shaped checkpoint (family qwen3_5_moe, the
last of every four layers full attention, the rest Gated DeltaNet; max_position_embeddings 262144),
exports it to an f32 GGUF file (llama.cpp's "qwen35moe") and packs that file for us. Then:

* context runs: for each --contexts n and --kv type (f32, q8_0, q4_0), each engine in its own
  process prefills n random tokens and decodes --tokens steps (a fixed random token stream, one
  token per step); reported: prefill time, decode tok/s, VmRSS after the decode and the process's
  peak (VmHWM), both less the RSS right after the model was opened ("KV+act") and whole. llama.cpp:
  n_ctx = n + tokens, type_k = type_v of that type (ggml ids f32 0, q8_0 8, q4_0 2), flash attention
  on (llama.cpp needs it for a quantized V cache), n_batch 512; ours: kv_cache_dtype of that type,
  fast kernels, every expert resident, prefill chunks of --chunk tokens. Runs go context by context
  (all of 8k, then 32k, ...) and stop starting new ones once --budget-s has passed;
* follow-up TTFT (ours, --ttft-contexts n): an n-token prefix is prefilled (that time, plus the
  follow-up, is the TTFT without a snapshot), its state written to a disk snapshot
  (generate/snapshots.py) and kept in RAM; a follow-up turn of --followup tokens then starts from a
  copy of the RAM state (PrefixCache's restore), from the disk file with its pages evicted (cold)
  and from nothing (prefill prefix + follow-up): time to the first sampled token. Each restored
  state is checked to give the same greedy tokens as the live one.

--quick runs small sizes (contexts 1024/2048, TTFT at 1024) as a smoke test. Prints the tables
and writes JSON to --out (bench/results/long_context.json) and the printed tables beside it (.txt).
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

from common import evict_page_cache, run_json_worker  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 4096,
    "hidden_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
GGML_TYPES = {"f32": 0, "q8_0": 8, "q4_0": 2}
KV_BYTES = {"f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def random_tokens(seed: int, n: int) -> list:
    """The prompt / decode stream: ``n`` seeded random ids (made in each worker: too long for argv)."""
    import random
    rng = random.Random(seed)
    return [rng.randrange(16, CONFIG["vocab_size"]) for _ in range(n)]


def with_tokens(spec: dict) -> dict:
    return dict(spec, prompt=random_tokens(0, spec["prompt_tokens"]), stream=random_tokens(1, spec["stream_tokens"]))


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def build_checkpoint(out: Path, config: dict, seed: int = 0) -> None:
    """A random HF checkpoint of ``config`` (stacked expert tensors, f32): bench/peer.py's scheme,
    with Qwen3.5's DeltaNet parameters in their ranges (A_log, dt_bias, zero-centred norms)."""
    import torch
    from safetensors.torch import save_file
    from lean_qwenflash.families import family_for

    if (out / "config.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = family_for(config).build(config)
    tensors = {}
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif leaf == "dt_bias":
            t = torch.ones(shape)
        elif len(shape) == 1:       # norms: zero-centred (weight = 1 + w) except the DeltaNet output norm
            t = (1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn(shape, generator=gen)
        elif "conv1d" in name:
            t = 0.3 * torch.randn(shape, generator=gen)
        else:
            scale = shape[-1] ** -0.5 * (0.3 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj")) else 1.0)
            t = scale * torch.randn(shape, generator=gen)
        tensors[name] = t.float().contiguous()
    hidden, inter, experts = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        tensors[prefix + "gate_up_proj"] = hidden ** -0.5 * torch.randn((experts, 2 * inter, hidden), generator=gen)
        tensors[prefix + "down_proj"] = 0.3 * inter ** -0.5 * torch.randn((experts, hidden, inter), generator=gen)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def prepare(work: Path, config: dict) -> dict:
    from lean_qwenflash.store import pack
    from lean_qwenflash.store.gguf_export import export_gguf
    work.mkdir(parents=True, exist_ok=True)
    ckpt, gguf_path, pack_dir = work / "checkpoint", work / "model-f32.gguf", work / "pack"
    if not gguf_path.is_file():
        build_checkpoint(ckpt, config)
        print("exporting GGUF f32 ...", file=sys.stderr, flush=True)
        tmp = gguf_path.with_suffix(".tmp.gguf")
        export_gguf(ckpt, tmp, "f32")
        tmp.rename(gguf_path)
    if not (pack_dir / "manifest.json").is_file():
        print("packing the GGUF file ...", file=sys.stderr, flush=True)
        pack(gguf_path, pack_dir, progress=False, force=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"gguf": gguf_path, "pack": pack_dir}


# -- workers (one process each) ----------------------------------------------------------------------

def worker_llama(spec: dict) -> dict:
    import llama_cpp
    n, stream, kv = spec["context"], spec["stream"], spec["kv"]
    rss0 = status("VmRSS")
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=n + len(stream) + 8, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], n_batch=512, n_ubatch=512, type_k=GGML_TYPES[kv],
                          type_v=GGML_TYPES[kv], flash_attn=True, logits_all=False, verbose=False)
    rss_open = status("VmRSS")
    t0 = time.perf_counter()
    llm.eval(spec["prompt"][:n])
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for tok in stream:
        llm.eval([tok])
    decode = time.perf_counter() - t0
    return {"rss_start": rss0, "rss_open": rss_open, "rss_end": status("VmRSS"), "peak": status("VmHWM"),
            "prefill_s": prefill, "decode_s": decode}


def worker_ours(spec: dict) -> dict:
    import torch
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate import Generator
    from lean_qwenflash.runtime import Runtime
    torch.set_num_threads(spec["threads"])
    n, stream = spec["context"], spec["stream"]
    rss0 = status("VmRSS")
    cfg = load_config(model=spec["pack"], kv_cache_dtype=spec["kv"], cpu_threads=spec["threads"],
                      generation={"prefill_chunk_tokens": spec["chunk"]})
    with Runtime.open(cfg, resident_experts=True) as rt, torch.inference_mode():
        gen = Generator(rt.model, spec["chunk"])
        rss_open = status("VmRSS")
        state = gen.new_state()
        t0 = time.perf_counter()
        gen.prefill(spec["prompt"][:n], state)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for tok in stream:
            gen.feed([tok], state)
        decode = time.perf_counter() - t0
        state_bytes = state.nbytes()
    return {"rss_start": rss0, "rss_open": rss_open, "rss_end": status("VmRSS"), "peak": status("VmHWM"),
            "prefill_s": prefill, "decode_s": decode, "state_bytes": state_bytes}


def worker_ttft(spec: dict) -> dict:
    """Follow-up TTFT at one prefix length (see the module docstring)."""
    import torch
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate import Generator, SamplingParams
    from lean_qwenflash.generate.snapshots import SnapshotDir
    from lean_qwenflash.runtime import Runtime
    torch.set_num_threads(spec["threads"])
    n, follow = spec["context"], spec["followup"]
    ids = spec["prompt"][:n + follow]
    greedy = SamplingParams(temperature=0.0)
    cfg = load_config(model=spec["pack"], kv_cache_dtype=spec["kv"], cpu_threads=spec["threads"],
                      generation={"prefill_chunk_tokens": spec["chunk"]})
    snap_dir = Path(spec["snapshot_dir"])
    shutil.rmtree(snap_dir, ignore_errors=True)
    with Runtime.open(cfg, resident_experts=True) as rt, torch.inference_mode():
        gen = Generator(rt.model, spec["chunk"])

        def first_token(state):
            t0 = time.perf_counter()
            run = gen.start(ids, greedy, spec["check_tokens"], state=state)
            it = iter(run)
            first = next(it)
            ttft = time.perf_counter() - t0
            return ttft, [first] + list(it)

        gen.prefill(ids[:256], gen.new_state())          # warm-up
        t0 = time.perf_counter()
        live = gen.new_state()
        gen.prefill(ids[:n], live)                       # the prefix (the first turn's prompt)
        prefix_s = time.perf_counter() - t0
        disk = SnapshotDir(snap_dir, 1 << 40, "bench-long-context")
        t0 = time.perf_counter()
        disk.write(live)
        write_s = time.perf_counter() - t0
        file = snap_dir / disk.name_for(tuple(ids[:n]))
        file_bytes = file.stat().st_size

        def from_ram():
            return live.clone()

        def from_disk():
            return disk.read(tuple(ids[:n]))

        first_token(from_ram())                          # warm-up: the follow-up's shapes once
        t0 = time.perf_counter()
        s = from_ram()
        ram_restore = time.perf_counter() - t0
        ram_ttft, ram_tokens = first_token(s)
        evict_page_cache(file)
        t0 = time.perf_counter()
        s = from_disk()
        disk_restore = time.perf_counter() - t0
        disk_ttft, disk_tokens = first_token(s)
        none_ttft, none_tokens = first_token(gen.new_state())
        state_bytes = live.nbytes()
    shutil.rmtree(snap_dir, ignore_errors=True)
    return {"prefix_s": prefix_s, "write_s": write_s, "file_bytes": file_bytes, "state_bytes": state_bytes,
            "ram_s": ram_restore + ram_ttft, "ram_restore_s": ram_restore,
            "disk_s": disk_restore + disk_ttft, "disk_restore_s": disk_restore,
            "none_s": none_ttft, "same_tokens": ram_tokens == disk_tokens == none_tokens}


WORKERS = {"llama": worker_llama, "ours": worker_ours, "ttft": worker_ttft}


def run(kind: str, spec: dict) -> dict:
    t0 = time.perf_counter()
    res = run_json_worker([sys.executable, __file__, "--worker", kind, json.dumps(spec)], name="lqf-long-context")
    res["wall_s"] = time.perf_counter() - t0
    return res


def mib(x) -> str:
    return f"{x / 2**20:8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--kv", default="f32,q8_0,q4_0")
    ap.add_argument("--engines", default="llama,ours")
    ap.add_argument("--ttft-contexts", default="10000,50000")
    ap.add_argument("--followup", type=int, default=64, help="tokens of the follow-up turn")
    ap.add_argument("--ttft-kv", default="q4_0", help="the KV cache type of the TTFT runs")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per context run")
    ap.add_argument("--threads", type=int, default=1, help="threads per engine (1: immune to a busy neighbour)")
    ap.add_argument("--chunk", type=int, default=1024, help="our prefill chunk (generation.prefill_chunk_tokens)")
    ap.add_argument("--llama-max-context", type=int, default=0,
                    help="run llama.cpp only up to this context (0: every one; its CPU prefill with a quantized "
                         "KV cache is slow: 250 s for 32k q4_0 on the dev machine)")
    ap.add_argument("--budget-s", type=float, default=1020, help="start no new run after this many seconds")
    ap.add_argument("--quick", action="store_true", help="smoke test: small contexts")
    ap.add_argument("--work", default=str(REPO / "bench" / "results" / "long_context"))
    ap.add_argument("--snapshot-dir", default="/tmp/lqf-bench-long-context-snapshots")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "long_context.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](with_tokens(json.loads(args.spec)))))
        return 0
    if args.quick:
        args.contexts, args.ttft_contexts, args.tokens = "1024,2048", "1024", 4
        if args.out == ap.get_default("out"):
            args.out = str(Path(args.out).with_name("long_context_quick.json"))

    started = time.perf_counter()
    files = prepare(Path(args.work), CONFIG)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    ttft_contexts = [int(x) for x in args.ttft_contexts.split(",") if x]
    longest = max(contexts + [n + args.followup for n in ttft_contexts])
    base = {"prompt_tokens": longest, "stream_tokens": args.tokens, "threads": args.threads, "chunk": args.chunk,
            "gguf": str(files["gguf"]), "pack": str(files["pack"])}
    rows, skipped = [], []
    for n in contexts:
        for kv in args.kv.split(","):
            row = {"context": n, "kv": kv}
            for engine in args.engines.split(","):
                if time.perf_counter() - started > args.budget_s:
                    skipped.append(f"{engine} {kv} {n}")
                    continue
                if engine == "llama" and 0 < args.llama_max_context < n:
                    skipped.append(f"{engine} {kv} {n} (--llama-max-context {args.llama_max_context})")
                    continue
                row[engine] = run(engine, dict(base, context=n, kv=kv))
                m = row[engine]
                print(f"  {engine} {kv} {n}: " + (f"error {m['error'][-300:]}" if "error" in m else
                      f"prefill {m['prefill_s']:.1f} s, decode {args.tokens / m['decode_s']:.1f} tok/s, "
                      f"peak {m['peak'] / 2**20:.0f} MiB ({m['wall_s']:.0f} s)"), file=sys.stderr, flush=True)
            rows.append(row)
    ttft = []
    for n in ttft_contexts:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(f"ttft {n}")
            continue
        r = run("ttft", dict(base, context=n, kv=args.ttft_kv, followup=args.followup, check_tokens=4,
                             snapshot_dir=args.snapshot_dir))
        r["context"] = n
        ttft.append(r)
        print(f"  ttft {n}: " + (f"error {r['error'][-300:]}" if "error" in r else
              f"none {r['none_s']:.2f} s, RAM {r['ram_s']:.3f} s, disk {r['disk_s']:.3f} s"), file=sys.stderr, flush=True)

    c = CONFIG
    full = c["num_hidden_layers"] // c["full_attention_interval"]
    lines = [f"Random Qwen3.5-MoE-shaped hybrid model ({c['num_hidden_layers']} layers: {full} full attention "
             f"({c['num_attention_heads']} heads, {c['num_key_value_heads']} KV head x {c['head_dim']}), "
             f"{c['num_hidden_layers'] - full} Gated DeltaNet; {c['num_experts']} experts top-{c['num_experts_per_tok']}, "
             f"hidden {c['hidden_size']}), f32 GGUF {files['gguf'].stat().st_size / 2**20:.0f} MiB, the same file for "
             f"both engines. {args.threads} threads, {args.tokens} decode steps after an n-token prefill; our prefill "
             f"chunk {args.chunk}. RSS: after the decode; peak: VmHWM; KV+act: less the RSS once the model was open. "
             f"KV bytes: the cache's own size at n tokens (K+V, {full} layers).", "",
             f"{'context':>8} {'KV':>5} {'KV MiB':>8} | {'engine':>9} {'prefill s':>9} {'decode t/s':>10} "
             f"{'RSS MiB':>8} {'peak MiB':>8} {'KV+act':>8}"]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        kv_mib = full * 2 * c["num_key_value_heads"] * c["head_dim"] * KV_BYTES[r["kv"]] * r["context"]
        for engine in ("llama", "ours"):
            m = r.get(engine)
            if m is None:
                continue
            name = "llama.cpp" if engine == "llama" else "ours"
            if "error" in m:
                lines.append(f"{r['context']:>8} {r['kv']:>5} {mib(kv_mib)} | {name:>9} error: {m['error'][-200:]!r}")
                continue
            m["decode_tok_s"] = args.tokens / m["decode_s"]
            lines.append(f"{r['context']:>8} {r['kv']:>5} {mib(kv_mib)} | {name:>9} {m['prefill_s']:9.1f} "
                         f"{m['decode_tok_s']:10.1f} {mib(m['rss_end'])} {mib(m['peak'])} "
                         f"{mib(m['peak'] - m['rss_open'])}")
    if ttft:
        lines += ["", f"Follow-up TTFT (ours, KV {args.ttft_kv}): an n-token prefix, then a {args.followup}-token "
                  "follow-up turn, time to its first token: from a RAM snapshot (copy of the state), from a disk "
                  "snapshot (file evicted from the page cache first), from nothing (prefix + follow-up prefilled).", "",
                  f"{'prefix':>7} {'state MiB':>9} {'file MiB':>8} {'write s':>8} | {'none s':>8} {'RAM s':>8} "
                  f"{'disk s':>8} {'disk read s':>11}  same tokens"]
        lines.append("-" * len(lines[-1]))
        for r in ttft:
            if "error" in r:
                lines.append(f"{r['context']:>7} error: {r['error'][-200:]!r}")
                continue
            lines.append(f"{r['context']:>7} {mib(r['state_bytes']):>9} {mib(r['file_bytes'])} {r['write_s']:8.3f} | "
                         f"{r['none_s']:8.2f} {r['ram_s']:8.3f} {r['disk_s']:8.3f} {r['disk_restore_s']:11.3f}  "
                         f"{r['same_tokens']}")
    if skipped:
        lines += ["", f"Not run (past --budget-s {args.budget_s:.0f} s, or as noted): {', '.join(skipped)}"]
    lines.append(f"\nTotal {time.perf_counter() - started:.0f} s.")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": CONFIG, "threads": args.threads, "chunk": args.chunk, "tokens": args.tokens,
                               "rows": rows, "ttft": ttft, "skipped": skipped}, indent=1))
    out.with_suffix(".txt").write_text(table + "\n")
    print(f"wrote {out} and {out.with_suffix('.txt')}")
    bad = [r for r in ttft if "error" in r or not r.get("same_tokens")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
