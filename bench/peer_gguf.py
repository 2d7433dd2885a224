#!/usr/bin/env python3
"""The same GGUF file, llama.cpp vs us, timing what users wait for: the prompt and the first pass.

Builds once under --work: a seeded random Qwen3-MoE-shaped checkpoint (bench/peer.py's builder;
--experts-gib of bf16 routed experts, 3 MiB each, over --layers layers, top-8, hidden 1024),
exported to a bf16 GGUF and quantized by llama.cpp to Q4_K_M; the bf16 files are deleted once the
Q4_K_M file exists. We pack that GGUF file (experts copied byte for byte). The hybrid case is a
Qwen3.5-MoE-shaped model with the same experts (``hybrid_config``), exported to llama.cpp's
qwen35moe and quantized the same way.

Routing. With a plain random init, routing collapses with depth, so the model is built with o_proj
and expert down weights scaled by RESIDUAL_SCALE (0.1): routing stays token-dependent at every
layer ("uniform"). "skewed" is a copy whose router rows e are scaled by s_e = 1 + 7 * (rank_e + 1)
** -1.2 (seeded random rank per layer): a Zipf-like popularity.

Each engine runs in its own process. Per run: the model is opened, then for each --prompt-sizes n
a fresh sequence prefills n prompt tokens (timed: the first time this process sees a prompt of
that size), then a fresh sequence prefills the smallest prompt and --tokens decode steps follow
(timed, the first and only pass: no warm-up replay), fed a fixed random token stream (greedy
decoding of a random model loops over a few tokens, so over a few experts).

Settings (--settings):
* warm: the file in the page cache (read once before the run); llama.cpp mmaps it, ours holds every
  expert resident; f32 KV cache on llama.cpp, fast kernels on ours;
* cached: ours streamed with a host cache that holds the whole model (prefetch on), filled before
  the timed runs (a prefill, then every record once); llama.cpp's figure is its warm one;
* nice19 / nice0: as warm, beside one single-threaded busy loop at that nice level (the same for
  both engines), started before the engine's process and stopped after it;
* capped: cold page cache, the process inside a cgroup v1 memory limit (--cap-gib, default half
  the file; page cache counts), llama.cpp mmapping the file (its CPU weight repacking turned off:
  it copies every K-quant weight into anonymous memory and gets killed under the cap), ours
  streaming through a host cache of --host-cache-gib with prefetch. Our decode is also given as
  a fraction of its I/O bound, the disk's speed over our bytes read per token. The disk is measured
  as `doctor` does (record-sized random reads at depth 8, 1 s), in the same minute as the decode
  (its speed drifts from minute to minute on some machines): into a small buffer in a fresh
  process right before our worker and right after it (doctor's first figure; in a process that
  has just run a long prompt this probe can read at half the speed), and twice inside our worker
  after the decode, landing across our host cache's own arena (doctor's second figure: the speed
  reads into the cache can reach; some VMs read slower into spread-out memory). Both ratios are
  printed.

``--repeats N`` runs each engine N times per setting (fresh processes, taking turns) and reports
each figure's median. Prints prefill and decode tok/s per setting and engine, MiB read per decode token (/proc/self/io),
our expert hit rate, ours/llama.cpp ratios and each engine's contended/idle ratio. Writes JSON to
--out. ``--ours-repo DIR`` runs our side from another checkout (a before/after comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("LQF_OURS_REPO") or str(REPO))   # --ours-repo: the worker runs that checkout
sys.path.insert(0, str(REPO / "bench"))

from common import can_limit_memory, drop_page_cache, run_json_worker  # noqa: E402

# Each engine's worker gets the environment this bench was started with: importing lean_qwenflash
# here (building the files) sets GOMP_SPINCOUNT for our process, which must not reach llama.cpp's.
WORKER_ENV = dict(os.environ)


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def prepare(work: Path, experts_gib: float, layers: int, threads: int, cases: list) -> dict:
    import peer
    from lean_qwenflash.store import pack
    from lean_qwenflash.store.gguf_export import export_gguf
    work.mkdir(parents=True, exist_ok=True)
    config = peer.model_config(experts_gib, layers)
    files = {"uniform": work / "model-Q4_K_M.gguf", "skewed": work / "model-skewed-Q4_K_M.gguf",
             "bf16": work / "model-bf16.gguf"}
    keep_bf16 = "bf16" in cases
    if not files["uniform"].is_file() or (keep_bf16 and not files["bf16"].is_file()):
        ckpt, bf16 = work / "checkpoint", files["bf16"]
        if not bf16.is_file():
            peer.build_checkpoint(ckpt, config, residual_scale=RESIDUAL_SCALE)
            print("exporting GGUF bf16 ...", file=sys.stderr, flush=True)
            export_gguf(ckpt, bf16, "bf16")
            shutil.rmtree(ckpt)
    if not files["uniform"].is_file():
        _llama_q4_k_m(files["bf16"], files["uniform"], threads)
    if not keep_bf16 and files["bf16"].is_file():
        files["bf16"].unlink()          # (the bf16 case keeps it: ~3.5x the Q4_K_M file)
    if not keep_bf16:
        del files["bf16"]
    if not files["skewed"].is_file():
        _skewed_copy(files)
    if "hybrid" in cases:
        files["hybrid"] = _hybrid_file(work, experts_gib, layers, threads)
    packs = {}
    for case, path in files.items():
        packs[case] = work / f"pack-{case}"
        if not (packs[case] / "manifest.json").is_file():
            print(f"packing {path.name} ...", file=sys.stderr, flush=True)
            pack(path, packs[case], force=True)
    return {"config": config, "gguf": files, "pack": packs}


RESIDUAL_SCALE = 0.1     # what each layer adds to the residual stream, relative to a plain random init


def hybrid_config(experts_gib: float, layers: int) -> dict:
    """A Qwen3.5-MoE shape at the uniform model's size: the same experts (hidden 1024, width 512,
    top-8, as many per layer), three Gated-DeltaNet layers to each full-attention layer (gated
    queries, a quarter of each head rotated), a sigmoid-gated shared expert of width 512."""
    import peer
    base = peer.model_config(experts_gib, layers)
    keep = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "rms_norm_eps",
            "tie_word_embeddings", "max_position_embeddings")
    return dict({k: base[k] for k in keep}, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe",
                shared_expert_intermediate_size=512, full_attention_interval=4, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                linear_num_value_heads=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def _hybrid_file(work: Path, experts_gib: float, layers: int, threads: int) -> Path:
    """The hybrid model's GGUF: the checkpoint exported to bf16 (llama.cpp's qwen35moe), quantized by
    llama.cpp to Q4_K_M; the checkpoint and the bf16 file are deleted once it exists."""
    import peer
    from lean_qwenflash.store.gguf_export import export_gguf
    out = work / "model-hybrid-Q4_K_M.gguf"
    if out.is_file():
        return out
    ckpt, bf16 = work / "checkpoint-hybrid", work / "model-hybrid-bf16.gguf"
    if not bf16.is_file():
        peer.build_checkpoint(ckpt, hybrid_config(experts_gib, layers), residual_scale=RESIDUAL_SCALE)
        print("exporting the hybrid model to GGUF bf16 ...", file=sys.stderr, flush=True)
        export_gguf(ckpt, bf16, "bf16")
        shutil.rmtree(ckpt)
    _llama_q4_k_m(bf16, out, threads)
    bf16.unlink()
    return out


def _llama_q4_k_m(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's own quantizer: ``src`` to a Q4_K_M file at ``dst`` (written aside, then renamed)."""
    import llama_cpp
    print(f"quantizing {src.name} with llama.cpp to Q4_K_M ...", file=sys.stderr, flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, threads
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")
    tmp.rename(dst)


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
    if spec["setting"] == "capped":
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
    sizes, stream = spec["prompt_sizes"], spec["stream"]
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=max(sizes) + len(stream) + 8, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], n_batch=512, n_ubatch=512, type_k=0, type_v=0,
                          logits_all=False, verbose=False)
    out = {"prefill_s": {}}
    for n in sizes:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(spec["prompt"][:n])
        out["prefill_s"][str(n)] = time.perf_counter() - t0
    llm.reset()
    llm.eval(spec["prompt"][:min(sizes)])
    before, t0 = read_bytes(), time.perf_counter()
    for tok in stream:
        llm.eval([tok])
    out["decode_s"], out["bytes_per_token"] = time.perf_counter() - t0, (read_bytes() - before) / len(stream)
    return out


def worker_ours(spec: dict) -> dict:
    import lean_qwenflash  # noqa: F401  (before torch, as the CLI and server load it)
    import torch
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate.state import new_state
    from lean_qwenflash.runtime import Runtime

    torch.set_num_threads(spec["threads"])
    resident = spec["setting"] in ("warm", "nice19", "nice0")
    extra = {} if resident else {"host_cache_bytes": int(spec["host_cache_gib"] * 2**30), "prefetch": True}
    cfg = load_config(model=spec["path"], dtype="float32", expert_kernels="fast", **extra)
    sizes, stream = spec["prompt_sizes"], spec["stream"]
    out = {"prefill_s": {}}
    with Runtime.open(cfg, resident_experts=resident) as rt, torch.inference_mode():
        # (the runtime's chunk; a baseline checkout from before it had one: its config's)
        model, chunk = rt.model, getattr(rt, "prefill_chunk_tokens", cfg.generation.prefill_chunk_tokens)
        out["chunk"] = chunk

        def prefill(n):
            state, ids = new_state(model), torch.tensor([spec["prompt"][:n]])
            for i in range(0, n, chunk):           # the generator's chunked prefill
                model(ids[:, i:i + chunk], state, last_logits_only=True)
            return state
        if spec["setting"] == "cached":        # the host cache holds the model: fill it first
            prefill(max(sizes))
            top_k = model.moe_blocks()[0].top_k
            for layer in rt.store.moe_layers:       # and every record the prompt did not touch
                num = rt.store.layer(layer).num_experts
                for ids in (list(range(e, min(e + top_k, num))) for e in range(0, num, top_k)):
                    rt.provider.acquire(layer, ids)
                    rt.provider.release(layer, ids)
        for n in sizes:
            t0 = time.perf_counter()
            prefill(n)
            out["prefill_s"][str(n)] = time.perf_counter() - t0
        state = prefill(min(sizes))
        if hasattr(rt.provider, "reset_stats"):
            rt.provider.reset_stats()
        before, t0 = read_bytes(), time.perf_counter()
        for tok in stream:
            model(torch.tensor([[tok]]), state)
        out["decode_s"], out["bytes_per_token"] = time.perf_counter() - t0, (read_bytes() - before) / len(stream)
        stats = rt.stats()
        if spec["setting"] == "capped":
            # The disk right after the decode, landing across the host cache's own arena (its
            # contents are spoilt: nothing runs on this runtime afterwards). doctor's own figure,
            # into a small buffer, is taken in fresh processes around this one (run_worker): in a
            # process that has just run a 4096-token prompt, that probe read 1.6-2.4 GB/s here
            # against 3.8-4.3 in a fresh one, which made the bound meaningless.
            rt.provider.drain()
            out["disk_probes"] = {"arena": [_disk_probe(spec["path"], rt.provider.arena) for _ in range(2)]}
    if stats:
        out["hit_rate"] = stats["total"]["hit_rate"]
    return out


def _disk_probe(pack: str, dest=None):
    """GB/s of doctor's read probe (1 s) on the pack, into a small buffer or landing across
    ``dest``; None where the checkout under test has no such probe (an older --ours-repo)."""
    from lean_qwenflash.doctor import measure_disk_gbps
    try:
        return measure_disk_gbps(pack, 1.0) if dest is None else measure_disk_gbps(pack, 1.0, dest=dest)
    except Exception:           # (never lose the run's own figures to the probe)
        return None


def warm_file(path: Path) -> None:
    """Read a file once so that it sits in the page cache (the warm settings)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


@contextmanager
def neighbour(setting: str):
    """One single-threaded busy loop at nice 19 or 0 beside the run (nothing for other settings)."""
    if setting not in ("nice19", "nice0"):
        yield
        return
    busy = subprocess.Popen(["nice", "-n", setting[4:], sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        busy.kill()
        busy.wait()


def run_worker(kind: str, spec: dict, cap_bytes: int | None, files: dict, case: str, ours_repo: str | None) -> dict:
    path = files["gguf" if kind == "llama" else "pack"][case]
    if spec["setting"] == "capped" and os.geteuid() == 0:
        drop_page_cache()
    elif spec["setting"] != "capped":
        for f in ([path] if kind == "llama" else sorted(Path(path).glob("*"))):
            warm_file(f)
    cmd = [sys.executable, __file__, "--worker", kind, json.dumps(dict(spec, path=str(path)))]
    env = dict(WORKER_ENV)
    if kind == "ours" and ours_repo:
        env.update(PYTHONPATH=ours_repo, LQF_OURS_REPO=ours_repo)
    doctor = kind == "ours" and spec["setting"] == "capped"
    small = [_doctor_probe(path, env)] if doctor else []
    with neighbour(spec["setting"]):
        out = run_json_worker(cmd, cap_bytes, "lqf-peer-gguf", env=env)
    if doctor and "error" not in out:
        small.append(_doctor_probe(path, env))
        out.setdefault("disk_probes", {})["small"] = small
    return out


def _doctor_probe(pack, env: dict):
    """doctor's read probe (1 s, into a small buffer) in a fresh process, as a user runs it."""
    code = "import sys; from lean_qwenflash.doctor import measure_disk_gbps; print(measure_disk_gbps(sys.argv[1], 1.0))"
    r = subprocess.run([sys.executable, "-c", code, str(pack)], capture_output=True, text=True,
                       env=dict(env, PYTHONPATH=env.get("PYTHONPATH") or str(REPO)))
    try:       # (never lose the run's own figures to the probe)
        return float(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts-gib", type=float, default=6.0, help="bf16 size of the routed experts before Q4_K_M "
                    "(6: 128 experts x 16 layers, a 1.98 GB Q4_K_M file)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--prompt-sizes", default="32,512,4096", help="prompt lengths whose prefill is timed")
    ap.add_argument("--settings", default="warm,cached,nice19,nice0,capped")
    ap.add_argument("--cap-gib", type=float, help="cgroup memory cap (default: half the GGUF file)")
    ap.add_argument("--host-cache-gib", type=float, help="our host expert cache under the cap (default: cap - 1 GiB, at least half the cap)")
    ap.add_argument("--cases", default="uniform,skewed", help="uniform / skewed (Q4_K_M files, near-uniform and "
                    "Zipf-like routing), bf16 (the uniform model's bf16 GGUF, ~3.5x larger) and hybrid (a "
                    "Qwen3.5-MoE-shaped Q4_K_M file: Gated-DeltaNet layers, a shared expert, the same experts)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per engine and setting, the engines taking "
                    "turns; each figure is their median (each run times its first pass)")
    ap.add_argument("--engines", default="llama,ours", help="which engines to run (e.g. ours, for a before/after)")
    ap.add_argument("--ours-repo", help="run our side from this checkout (PYTHONPATH), e.g. a baseline worktree")
    ap.add_argument("--work", default=str(REPO / "bench" / "results" / "peer_gguf"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peer_gguf.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = worker_llama if args.worker == "llama" else worker_ours
        print(json.dumps(fn(json.loads(args.spec))))
        return 0

    files = prepare(Path(args.work), args.experts_gib, args.layers, args.threads, args.cases.split(","))
    config = files["config"]
    file_bytes = files["gguf"]["uniform"].stat().st_size
    sizes = [int(n) for n in args.prompt_sizes.split(",")]
    import random
    rng = random.Random(0)
    prompt = [rng.randrange(259, config["vocab_size"]) for _ in range(max(sizes))]
    stream = [rng.randrange(259, config["vocab_size"]) for _ in range(args.tokens)]
    base = {"prompt": prompt, "stream": stream, "threads": args.threads, "prompt_sizes": sizes}
    rows = []
    for case in args.cases.split(","):
        for setting in args.settings.split(","):
            if setting == "capped" and not can_limit_memory():
                rows.append({"case": case, "setting": setting, "error": "needs root and cgroup v1"})
                continue
            # the cached setting: a host cache holding every record (file size is an upper bound)
            case_bytes = files["gguf"][case].stat().st_size
            cap, capped_cache = _cap(args, case_bytes)
            spec = dict(base, setting=setting,
                        host_cache_gib=capped_cache if setting == "capped" else case_bytes / 2**30 + 0.5)
            limit = cap if setting == "capped" else None
            row = {"case": case, "setting": setting, "file_bytes": case_bytes}
            if setting == "capped":
                row.update(cap_bytes=cap, host_cache_gib=capped_cache)
            engines = args.engines.split(",")
            runs = {"llama": [], "ours": []}
            for _ in range(args.repeats):          # (engines take turns: drift hits both alike)
                if setting != "cached" and "llama" in engines:     # llama.cpp's cached figure is its warm one
                    runs["llama"].append(run_worker("llama", spec, limit, files, case, None))
                if "ours" in engines:
                    runs["ours"].append(run_worker("ours", spec, limit, files, case, args.ours_repo))
            row.update({engine: _median_run(r) for engine, r in runs.items() if r})
            if setting == "capped" and "ours" in row and "error" not in row["ours"]:
                # The disk speeds `doctor` measures, taken around our decodes (worker_ours): the
                # I/O bound of a decode step is its bytes over that speed.
                import statistics
                for kind, key in (("small", "disk_gbps"), ("arena", "arena_gbps")):
                    got = [g for r in runs["ours"] for g in r.get("disk_probes", {}).get(kind, []) if g]
                    if got:
                        row[key] = statistics.median(got)
            rows.append(row)
            print(f"  {case} {setting} done", file=sys.stderr, flush=True)
    print_table(rows, sizes, args, config, file_bytes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "file_bytes": file_bytes, "ours_repo": args.ours_repo,
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


def _cap(args, case_bytes: int) -> tuple:
    """(cgroup limit in bytes, our host cache in GiB) for the capped setting of a file of
    ``case_bytes``: --cap-gib, else half the file; the rest of the cap holds the resident weights,
    the runtime and the page cache of the reads (a cap under 2 GiB leaves the host cache half of it)."""
    cap = int(args.cap_gib * 2**30) if args.cap_gib else case_bytes // 2
    return cap, args.host_cache_gib if args.host_cache_gib else max(cap / 2**30 - 1.0, cap / 2**30 / 2)


def _median_run(runs: list) -> dict:
    """One engine's figures over --repeats fresh processes: each time the median (every run is a
    first pass; the spread is kept under "runs"); a failed run stands for all."""
    import statistics
    failed = [r for r in runs if "error" in r]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    out = dict(runs[0], runs=runs)
    out["prefill_s"] = {n: statistics.median(r["prefill_s"][n] for r in runs) for n in runs[0]["prefill_s"]}
    for key in ("decode_s", "bytes_per_token", "hit_rate"):
        if key in runs[0]:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _rates(m: dict, sizes: list, tokens: int) -> list:
    return [int(n) / m["prefill_s"][str(n)] for n in sizes] + [tokens / m["decode_s"]]


def print_table(rows, sizes, args, config, file_bytes) -> None:
    bf16 = next((r for r in rows if r["case"] == "bf16"), None)
    bf16_note = f" (bf16: the same model's bf16 GGUF, {bf16['file_bytes'] / 2**30:.2f} GiB)" if bf16 else ""
    print(f"\nGGUF Q4_K_M made by llama.cpp from a random Qwen3-MoE-shaped model (hybrid: Qwen3.5-MoE-shaped, "
          f"the same experts): {file_bytes / 2**30:.2f} GiB{bf16_note}, "
          f"{config['num_hidden_layers']} layers x {config['num_experts']} experts, top-{config['num_experts_per_tok']}; "
          f"{args.threads} threads; prefill of a fresh {'/'.join(map(str, sizes))}-token prompt, then {args.tokens} "
          f"decode steps (a fixed random token stream) after the {min(sizes)}-token prompt, first pass each"
          f"{f', median of {args.repeats} processes' if args.repeats > 1 else ''}."
          + "".join(f" Capped {r['case']}: cgroup limit {r['cap_bytes'] / 2**30:.2f} GiB (page cache counted), our "
                    f"host cache {r['host_cache_gib']:.2f} GiB." for r in rows if "cap_bytes" in r))
    cols = [f"prefill {n}" for n in sizes] + ["decode"]
    print(f"{'routing':8s} {'setting':8s} {'engine':10s} " + " ".join(f"{c:>12s}" for c in cols)
          + f" {'MiB/tok':>8s} {'hit':>5s}   ours/llama (prefill..., decode)   vs idle")
    idle = {}
    for r in rows:
        for engine in ("llama", "ours"):
            m = r.get(engine)
            if m is None:
                continue
            if "error" in m or "error" in r:
                print(f"{r['case']:8s} {r['setting']:8s} {engine:10s} error: {str(m.get('error') or r.get('error'))[-300:]}")
                continue
            rates = _rates(m, sizes, args.tokens)
            m["prefill_tok_s"] = dict(zip(map(str, sizes), rates[:-1]))
            m["decode_tok_s"] = rates[-1]
            if r["setting"] == "warm":
                idle[r["case"], engine] = rates
            extra = ""
            if engine == "ours":
                ref = r.get("llama") or next((x.get("llama") for x in rows if x["case"] == r["case"]
                                              and x["setting"] == "warm"), None)
                if ref and "error" not in ref:
                    ratio = [a / b for a, b in zip(rates, _rates(ref, sizes, args.tokens))]
                    r["ratio_ours_llama"] = ratio
                    extra += "  " + " ".join(f"{x:5.2f}" for x in ratio)
            base = idle.get((r["case"], engine))
            if base and r["setting"] in ("nice19", "nice0", "cached"):
                rel = [a / b for a, b in zip(rates, base)]
                m["vs_idle"] = rel
                extra += "   idle x " + " ".join(f"{x:4.2f}" for x in rel)
            if engine == "ours" and r.get("disk_gbps") and m["bytes_per_token"]:
                r["io_bound_tok_s"] = r["disk_gbps"] * 1e9 / m["bytes_per_token"]
                r["of_io_bound"] = rates[-1] / r["io_bound_tok_s"]
                extra += (f"   decode {r['of_io_bound']:.2f} of the I/O bound ({r['io_bound_tok_s']:.1f} tok/s: "
                          f"disk {r['disk_gbps']:.2f} GB/s into a small buffer")
                if r.get("arena_gbps"):
                    r["arena_bound_tok_s"] = r["arena_gbps"] * 1e9 / m["bytes_per_token"]
                    r["of_arena_bound"] = rates[-1] / r["arena_bound_tok_s"]
                    extra += (f"; {r['of_arena_bound']:.2f} of {r['arena_bound_tok_s']:.1f} tok/s at "
                              f"{r['arena_gbps']:.2f} GB/s across our host cache")
                extra += ")"
            print(f"{r['case']:8s} {r['setting']:8s} {'llama.cpp' if engine == 'llama' else 'ours':10s} "
                  + " ".join(f"{x:12.1f}" for x in rates)
                  + f" {m['bytes_per_token'] / 2**20:8.1f} {m.get('hit_rate', float('nan')):5.2f}" + extra)


if __name__ == "__main__":
    sys.exit(main())
