#!/usr/bin/env python3
"""Decode-shape kernel bandwidth: GB/s of weights streamed per encoding, next to torch on bf16.

For each encoding, matrices of --rows x --cols are made (random blocks with a fixed normal f16
scale: speed does not depend on the values) until they cover --working-gib, far beyond the
last-level cache, and one-row products are run over them in rotation, so every byte comes from
DRAM. Measured in the same run, on the same threads:

* DRAM read bandwidth (torch sum of a --working-gib fp32 buffer): the ceiling;
* torch bf16 one-row F.linear (a GEMV on one core) and our kernels.linear row split, on the same
  bf16 matrices: today's bf16 decode path;
* our native kernels (csrc/) for every encoding at every ISA this CPU has, 1 and 2 threads;
* one fused MoE layer call (moe_decode: 8 experts of a Qwen3-30B-A3B-sized layer, H 2048,
  I 768) per encoding, against the exact path (dequantize + torch) on the same experts.

* one MoE layer of many tokens (moe_prefill: --prefill-tokens through 128 experts of H 1024, I 512,
  top-8, random routing: the issue-21 model's layer) per gate_up/down encoding pair; with
  --baseline DIR the same calls also run on DIR's build (a worktree of the tree before a change),
  each tree in its own process, rounds interleaved, so the two are compared side by side.

Goal (issue: quantized experts): q4_k decode at >= 70% of the DRAM read bandwidth.
Prints a table and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a --baseline worker imports the package from the baseline tree instead
sys.path.insert(0, os.environ.get("LQF_BENCH_TREE") or str(REPO))

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lean_qwenflash.experts.provider import ExpertWeights  # noqa: E402
from lean_qwenflash.models import kernels, native  # noqa: E402
from lean_qwenflash.models.policy import ExecContext, ExecPolicy  # noqa: E402
from lean_qwenflash.quant import ENCODINGS, QuantTensor  # noqa: E402

F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_weight(name: str, rows: int, cols: int, gen: torch.Generator):
    enc = ENCODINGS[name]
    if enc.is_float:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(enc.torch_dtype)
    raw = torch.randint(0, 256, (rows, enc.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, enc.block_bytes)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    for off in F16_FIELDS[name]:
        blocks[:, off:off + 2] = scale
    if name == "q6_k":   # int8 sub-block scales: keep them small and positive
        blocks[:, 192:208] = 1
    return QuantTensor(raw, enc, (rows, cols))


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()


def best_rate(fn, total_bytes: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return total_bytes / best / 1e9


def dram_read_gbs(gib: float, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * 2**30) // 4)
    return best_rate(lambda: buf.sum(), buf.numel() * 4, repeats)


PREFILL_SHAPE = {"hidden": 1024, "inter": 512, "experts": 128, "top_k": 8}


def prefill_rows(pairs: list, tokens_list: list, threads_list, repeats: int, isa: str = "auto") -> list:
    """ms per moe_prefill call of one layer (all 128 experts' weights: beyond the last-level cache)."""
    hidden, inter, num, top_k = (PREFILL_SHAPE[k] for k in ("hidden", "inter", "experts", "top_k"))
    rows = []
    for pair in pairs:
        gu_name, dn_name = pair.split("/")
        gen = torch.Generator().manual_seed(1)
        experts = [ExpertWeights(random_weight(gu_name, 2 * inter, hidden, gen), random_weight(dn_name, hidden, inter, gen))
                   for _ in range(num)]
        for n in tokens_list:
            x = torch.randn(n, hidden, generator=gen)
            picks = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(n)])
            order = torch.argsort(picks.reshape(-1), stable=True)
            ids, counts = torch.unique(picks.reshape(-1), return_counts=True)
            chosen = [experts[i] for i in ids.tolist()]
            tokens = (order // top_k).to(torch.int32)
            weights = torch.rand(n * top_k, generator=gen)
            out = torch.zeros_like(x)
            for t in threads_list:
                def call():
                    native.moe_prefill(x, chosen, counts, tokens, weights, out, threads=t, isa=isa)
                call()
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    call()
                    best = min(best, time.perf_counter() - t0)
                rows.append({"pair": pair, "tokens": n, "threads": t, "ms": best * 1e3})
        del experts
    return rows


def prefill_compare(args, threads_list) -> dict:
    """moe_prefill rows of this tree (and --baseline's), each tree in its own worker process, rounds
    interleaved; the best of all rounds per row."""
    trees = {"this": str(REPO)}
    if args.baseline:
        trees = {"baseline": str(Path(args.baseline).resolve()), **trees}
    best: dict = {}
    for _ in range(args.prefill_rounds):
        for label, tree in trees.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--prefill-worker", "--prefill-pairs", args.prefill_pairs,
                   "--prefill-tokens", args.prefill_tokens, "--repeats", str(args.repeats),
                   "--threads", ",".join(map(str, threads_list)), "--prefill-isa", args.prefill_isa]
            res = subprocess.run(cmd, env={**os.environ, "LQF_BENCH_TREE": tree}, capture_output=True, text=True, check=True)
            for r in json.loads(res.stdout.strip().splitlines()[-1]):
                key = (r["pair"], r["tokens"], r["threads"])
                cell = best.setdefault(key, {})
                cell[label] = min(cell.get(label, float("inf")), r["ms"])
    return {"trees": trees, "isa": args.prefill_isa, "rows": [{"pair": k[0], "tokens": k[1], "threads": k[2], **v} for k, v in best.items()]}


def print_prefill(pre: dict) -> None:
    shape = PREFILL_SHAPE
    print(f"\none MoE layer, many tokens (moe_prefill, isa {pre.get('isa', 'auto')}): {shape['experts']} experts x (gate_up [{2 * shape['inter']}, "
          f"{shape['hidden']}] + down [{shape['hidden']}, {shape['inter']}]), top-{shape['top_k']}; ms per call, "
          "best of all rounds (tok/s of this layer alone)")
    labels = list(pre["trees"])
    head = f"{'gate_up/down':13s} {'tokens':>6s} {'thr':>3s} " + " ".join(f"{lab:>22s}" for lab in labels)
    print(head + (f" {'speed-up':>9s}" if len(labels) > 1 else ""))
    for r in pre["rows"]:
        cells = [f"{r[lab]:9.2f} ({r['tokens'] / r[lab] * 1e3:8.0f}/s)" for lab in labels]
        extra = f" {r['baseline'] / r['this']:8.2f}x" if len(labels) > 1 else ""
        print(f"{r['pair']:13s} {r['tokens']:>6d} {r['threads']:>3d} " + " ".join(f"{c:>22s}" for c in cells) + extra)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--working-gib", type=float, default=1.5, help="weights per encoding (>> last-level cache)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--encodings", default="bf16,q8_0,q4_0,q4_k,q5_k,q6_k")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "kernels.json"))
    ap.add_argument("--threads", default="1,2", help="thread counts to time")
    ap.add_argument("--prefill-tokens", default="32,512", help="tokens per moe_prefill call ('' to skip)")
    ap.add_argument("--prefill-pairs", default="q4_k/q6_k,q4_k/q4_k,q5_k/q6_k,q8_0/q8_0",
                    help="gate_up/down encodings of the moe_prefill rows")
    ap.add_argument("--prefill-rounds", type=int, default=2, help="interleaved rounds of the moe_prefill rows per tree")
    ap.add_argument("--baseline", help="a checkout with its native build (e.g. a worktree of the tree before a change): "
                    "its moe_prefill rows are timed beside this tree's")
    ap.add_argument("--prefill-only", action="store_true", help="only the moe_prefill rows")
    ap.add_argument("--prefill-isa", default="auto", help="the moe_prefill rows' kernel path: auto (the best this CPU "
                    "has), avx2, avx512 or scalar (e.g. avx2 on an AVX-512 machine, to time the AVX2 kernels)")
    ap.add_argument("--prefill-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    threads_list = tuple(int(t) for t in args.threads.split(","))
    tokens_list = [int(t) for t in args.prefill_tokens.split(",") if t]
    if args.prefill_worker:
        print(json.dumps(prefill_rows(args.prefill_pairs.split(","), tokens_list, threads_list, args.repeats, args.prefill_isa)))
        return 0
    if args.prefill_only:
        pre = prefill_compare(args, threads_list)
        print_prefill(pre)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"moe_prefill": pre}, indent=1))
        print(f"wrote {args.out}")
        return 0
    gen = torch.Generator().manual_seed(0)
    results = {"rows": args.rows, "cols": args.cols, "working_gib": args.working_gib, "isas": native.ISAS,
               "dram_gbs": {}, "gemv": [], "moe_layer": []}
    for t in threads_list:
        results["dram_gbs"][t] = dram_read_gbs(args.working_gib, t, args.repeats)
    x = torch.randn(args.cols, generator=gen)

    for name in args.encodings.split(","):
        one = nbytes(random_weight(name, args.rows, args.cols, gen))
        count = max(2, int(args.working_gib * 2**30 // one))
        mats = [random_weight(name, args.rows, args.cols, gen) for _ in range(count)]
        total = one * count
        for t in threads_list:
            row = {"encoding": name, "threads": t, "bytes": total}
            if name == "bf16":
                torch.set_num_threads(t)
                xb = x.to(torch.bfloat16).view(1, -1)
                row["torch_f_linear"] = best_rate(lambda: [F.linear(xb, m) for m in mats], total, args.repeats)
                row["torch_split"] = best_rate(lambda: [kernels.linear(xb, m) for m in mats], total, args.repeats)
            for isa in native.ISAS:
                row[isa] = best_rate(lambda: [native.gemv(m, x, isa=isa, threads=t) for m in mats], total, args.repeats)
            results["gemv"].append(row)
            print(f"  {name} {t}t: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float)),
                  file=sys.stderr)
        del mats

    # One MoE layer call: 8 experts of H 2048, I 768, from a pool of experts far beyond the cache.
    hidden, inter, top_k = 2048, 768, 8
    for name in args.encodings.split(","):
        one = nbytes(random_weight(name, 2 * inter, hidden, gen)) + nbytes(random_weight(name, hidden, inter, gen))
        pool = [ExpertWeights(random_weight(name, 2 * inter, hidden, gen), random_weight(name, hidden, inter, gen))
                for _ in range(max(top_k * 2, int(args.working_gib * 2**30 // one)))]
        groups = [pool[i:i + top_k] for i in range(0, len(pool) - top_k + 1, top_k)]
        xs = torch.randn(1, hidden, generator=gen)
        x_c = xs.to(ENCODINGS[name].torch_dtype) if ENCODINGS[name].is_float else xs
        w = [1.0 / top_k] * top_k
        for t in threads_list:
            torch.set_num_threads(t)
            layer_bytes = one * top_k
            contexts = {m: ExecContext(ExecPolicy(kernel_mode=m)) for m in ("fast", "exact")}

            def run(mode):
                t0 = time.perf_counter()
                for g in groups:
                    kernels.experts_decode(x_c, g, w, contexts[mode])
                return (time.perf_counter() - t0) / len(groups)
            run("fast")
            fast = min(run("fast") for _ in range(args.repeats))
            exact = min(run("exact") for _ in range(max(1, args.repeats // 2)))
            results["moe_layer"].append({"encoding": name, "threads": t, "layer_bytes": layer_bytes,
                                         "fast_ms": fast * 1e3, "exact_ms": exact * 1e3,
                                         "fast_gbs": layer_bytes / fast / 1e9})
        del pool, groups

    if tokens_list:
        results["moe_prefill"] = prefill_compare(args, threads_list)

    dram = results["dram_gbs"]
    print(f"\nDRAM read (torch sum of {args.working_gib} GiB fp32): " +
          ", ".join(f"{t} thread{'s' if t > 1 else ''} {dram[t]:.1f} GB/s" for t in threads_list))
    print(f"\none-row product, {args.rows} x {args.cols} matrices rotated over {args.working_gib} GiB; GB/s of weights "
          "(and % of DRAM read at the same thread count)")
    cols = ["torch_f_linear", "torch_split"] + native.ISAS
    print(f"{'encoding':9s} {'thr':>3s} " + " ".join(f"{c:>15s}" for c in cols))
    for row in results["gemv"]:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:6.1f} ({100 * v / dram[row['threads']]:3.0f}%)" if v else f"{'-':>15s}")
        print(f"{row['encoding']:9s} {row['threads']:>3d} " + " ".join(f"{c:>15s}" for c in cells))
    print(f"\none MoE layer, one token: {top_k} experts x (gate_up [{2 * inter}, {hidden}] + down [{hidden}, {inter}])")
    print(f"{'encoding':9s} {'thr':>3s} {'MiB':>6s} {'fast ms':>8s} {'exact ms':>9s} {'speed-up':>9s} {'fast GB/s':>10s}")
    for r in results["moe_layer"]:
        print(f"{r['encoding']:9s} {r['threads']:>3d} {r['layer_bytes'] / 2**20:6.1f} {r['fast_ms']:8.3f} "
              f"{r['exact_ms']:9.3f} {r['exact_ms'] / r['fast_ms']:8.1f}x {r['fast_gbs']:10.1f}")
    if "moe_prefill" in results:
        print_prefill(results["moe_prefill"])
    q4 = [r for r in results["gemv"] if r["encoding"] == "q4_k" and r["threads"] == 2]
    if q4:
        best = max(q4[0].get(i, 0) for i in native.ISAS)
        print(f"\nq4_k, 2 threads: {best:.1f} GB/s = {100 * best / dram[2]:.0f}% of DRAM read (goal >= 70%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
