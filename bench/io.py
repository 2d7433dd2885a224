#!/usr/bin/env python3
"""Read bandwidth of our I/O engines next to fio on the same file, block size and queue depth.

Makes a store file (default 4 GiB) once, then for each record size and queue depth reads random
record-aligned blocks for a fixed time with each of our engines (uring, pread) and with fio
(io_uring, O_DIRECT, randread), in one run; each contender runs --repeats times in rotating order
and the median is reported. Prints GB/s, IOPS and ours/fio, and writes JSON.

    python bench/io.py                     # full sweep: 1/4/8 MiB x depth 1,4,16,64
    python bench/io.py --sizes 4 --depths 1 8 --seconds 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lean_qwenflash.io_engine import measure_random_reads, open_engine, uring_compiled  # noqa: E402

MiB = 1 << 20


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    print(f"writing {size / 2**30:.1f} GiB test store at {path} ...", file=sys.stderr)
    chunk = np.random.default_rng(0).integers(0, 256, size=64 * MiB, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def ensure_fio() -> str | None:
    fio = shutil.which("fio")
    if fio is None and os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing fio with apt-get ...", file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        fio = shutil.which("fio")
    return fio


def run_ours(path: Path, kind: str, block: int, depth: int, seconds: float) -> dict:
    eng = open_engine(path, kind, queue_depth=depth)
    done, dt = measure_random_reads(eng, block, seconds)
    eng.close()
    return {"gbps": done * block / dt / 1e9, "iops": done / dt}


def run_fio(fio: str, path: Path, block: int, depth: int, seconds: float) -> dict:
    cmd = [fio, "--name=lqf", f"--filename={path}", "--rw=randread", f"--bs={block}", f"--iodepth={depth}",
           "--ioengine=io_uring", "--direct=1", f"--runtime={seconds}", "--time_based", "--readonly",
           "--output-format=json", "--norandommap", "--randrepeat=0", "--thread"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"gbps": float("nan"), "iops": float("nan"), "error": out.stderr.strip()[-300:]}
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    return {"gbps": job["bw_bytes"] / 1e9, "iops": job["iops"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/lqf-bench", help="where the test store lives (an NVMe/SSD path)")
    ap.add_argument("--size-gib", type=float, default=4.0, help="store size (default 4 GiB)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8], help="record sizes in MiB")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per contender and shape (median kept)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "io.json"))
    ap.add_argument("--keep", action="store_true", help="keep the test store afterwards")
    args = ap.parse_args()

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "experts.bin"
    make_file(path, int(args.size_gib * 2**30) // (64 * MiB) * (64 * MiB))
    fio = ensure_fio()
    engines = (["uring"] if uring_compiled() else []) + ["pread"]
    rows = []
    print(f"{'record':>7} {'depth':>5} | " + " | ".join(f"{e + ' GB/s':>11} {'IOPS':>6}" for e in engines)
          + f" | {'fio GB/s':>8} {'IOPS':>6} | " + " ".join(f"{e + '/fio':>10}" for e in engines))
    for size in args.sizes:
        for depth in args.depths:
            block = size * MiB
            row = {"record_mib": size, "depth": depth}
            # The disk bursts and drifts: each contender runs --repeats times in rotating order and
            # the median counts, so no one always gets the first (burst) slot.
            contenders = engines + ["fio"]
            samples = {c: [] for c in contenders}
            for rep in range(args.repeats):
                for c in contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]:
                    if c == "fio":
                        samples[c].append(run_fio(fio, path, block, depth, args.seconds) if fio
                                          else {"gbps": float("nan"), "iops": float("nan")})
                    else:
                        samples[c].append(run_ours(path, c, block, depth, args.seconds))
            for c in contenders:
                med = sorted(samples[c], key=lambda r: r["gbps"])[len(samples[c]) // 2]
                row[c] = dict(med, samples_gbps=[r["gbps"] for r in samples[c]])
            for e in engines:
                row[f"{e}_over_fio"] = row[e]["gbps"] / row["fio"]["gbps"] if row["fio"]["gbps"] else float("nan")
            rows.append(row)
            print(f"{size:>5}Mi {depth:>5} | "
                  + " | ".join(f"{row[e]['gbps']:>11.2f} {row[e]['iops']:>6.0f}" for e in engines)
                  + f" | {row['fio']['gbps']:>8.2f} {row['fio']['iops']:>6.0f} | "
                  + " ".join(f"{row[e + '_over_fio']:>10.2f}" for e in engines), flush=True)
    best = max(rows, key=lambda r: max(r[e]["gbps"] for e in engines))
    best_fio = max(r["fio"]["gbps"] for r in rows)
    best_ours = max(best[e]["gbps"] for e in engines)
    summary = {"best_ours_gbps": best_ours, "best_ours_config": {"record_mib": best["record_mib"], "depth": best["depth"]},
               "best_fio_gbps": best_fio, "best_ratio": best_ours / best_fio if best_fio else float("nan")}
    print(f"\nbest ours {best_ours:.2f} GB/s ({best['record_mib']} MiB, depth {best['depth']}); "
          f"best fio {best_fio:.2f} GB/s; ratio {summary['best_ratio']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "file": str(path)}, indent=1))
    print(f"wrote {out}")
    if not args.keep:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
