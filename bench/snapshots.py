"""Restoring a prefix snapshot from disk vs computing the prefix again (re-prefill).

For each context length: the prefill of that many tokens on the default model (the work a snapshot
saves), writing its snapshot (generate/snapshots.py), restoring it with the file in the page cache
(warm) and after evicting the file's pages (cold: POSIX_FADV_DONTNEED), and a RAM snapshot's copy
(PrefixCache's own restore). Every restored state is checked to continue to the same greedy tokens
as the live one. Prints a table and writes JSON.

    python bench/snapshots.py [--lengths 256 1024 2048 4000] [--dir /tmp/lqf-snapshots]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402

from bench.common import evict_page_cache  # noqa: E402


def _timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4000])
    ap.add_argument("--dir", default="/tmp/lqf-bench-snapshots", help="snapshot directory (on the disk to measure)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median kept)")
    ap.add_argument("--config", help="runtime config (default: the built-in default model, defaults)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "snapshots.json"))
    args = ap.parse_args()

    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate import Generator, SamplingParams
    from lean_qwenflash.generate.snapshots import SnapshotDir
    from lean_qwenflash.runtime import Runtime

    cfg = load_config(args.config)
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    with Runtime.open(cfg) as rt:
        gen = Generator(rt.model, rt.prefill_chunk_tokens)
        context = int(rt.store.config.get("max_position_embeddings") or 32768)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, gen.vocab_size, (max(args.lengths) + 1,), generator=g).tolist()
        disk = SnapshotDir(args.dir, 1 << 40, "bench")
        greedy = SamplingParams(temperature=0.0)
        gen.prefill(ids[:64], gen.new_state())          # warm-up
        for n in args.lengths:
            if n >= context:
                print(f"skipping {n}: the model's context is {context}")
                continue

            def prefill():
                s = gen.new_state()
                gen.prefill(ids[:n], s)
                return s

            t_prefill, live = _timed(prefill, args.repeats)
            fresh = iter(range(args.repeats))
            t_write, _ = _timed(lambda: SnapshotDir(Path(args.dir) / f"w{n}-{next(fresh)}", 1 << 40, "bench").write(live),
                                args.repeats)
            disk.write(live)
            file = Path(args.dir) / disk.name_for(tuple(ids[:n]))
            t_warm, restored = _timed(lambda: disk.read(tuple(ids[:n])), args.repeats)
            colds = []
            for _ in range(args.repeats):
                evict_page_cache(file)
                t0 = time.perf_counter()
                disk.read(tuple(ids[:n]))
                colds.append(time.perf_counter() - t0)
            t_cold = statistics.median(colds)
            t_ram, _ = _timed(live.clone, args.repeats)
            # The restored state continues exactly as the live one.
            a = list(gen.start(ids[:n + 1], greedy, 8, state=restored))
            b = list(gen.start(ids[:n + 1], greedy, 8, state=live.clone()))
            rows.append({"tokens": n, "state_bytes": live.clone().nbytes(), "file_bytes": file.stat().st_size,
                         "prefill_s": t_prefill, "write_s": t_write, "restore_warm_s": t_warm,
                         "restore_cold_s": t_cold, "ram_copy_s": t_ram, "same_tokens": a == b,
                         "speedup_cold": t_prefill / t_cold, "speedup_warm": t_prefill / t_warm})
    shutil.rmtree(args.dir, ignore_errors=True)

    head = (f"{'tokens':>7} {'state':>9} {'prefill':>9} {'write':>8} {'disk cold':>10} {'disk warm':>10} "
            f"{'RAM copy':>9} {'x cold':>7} {'x warm':>7}  same tokens")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['tokens']:>7} {r['state_bytes'] / 2**20:>7.2f}Mi {r['prefill_s'] * 1e3:>7.1f}ms "
              f"{r['write_s'] * 1e3:>6.2f}ms {r['restore_cold_s'] * 1e3:>8.2f}ms {r['restore_warm_s'] * 1e3:>8.2f}ms "
              f"{r['ram_copy_s'] * 1e3:>7.3f}ms {r['speedup_cold']:>6.0f}x {r['speedup_warm']:>6.0f}x  {r['same_tokens']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(cfg.model), "device": cfg.device, "dtype": cfg.dtype,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
