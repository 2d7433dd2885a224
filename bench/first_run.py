"""How long a new user waits for the first answer: `./scripts/run.sh` on a fresh clone, in a fresh
virtual environment, with an empty pip cache and an empty HOME (so the default model is packed on
first use, as on a new machine). System packages (liburing-dev) are assumed present, as after the
first `apt-get`; torch comes from the package index like any download (the one big one).

Prints a table (setup: venv + pip + the native build; then the first answer) and writes JSON.

    python bench/first_run.py [--work /tmp/lqf-first-run] [--out bench/results/first_run.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/lqf-first-run", help="scratch directory (deleted and made again)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "first_run.json"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    clone, venv, home = work / "clone", work / "venv", work / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = dict(os.environ, HOME=str(home), PIP_CACHE_DIR=str(work / "pip-cache"), PYTHON=str(venv / "bin" / "python"),
               PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    t_venv = time.perf_counter()
    p = subprocess.run(["./scripts/run.sh", "--max-tokens", "24"], cwd=clone, env=env, capture_output=True, text=True)
    t_end = time.perf_counter()
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        raise SystemExit(f"run.sh failed with exit status {p.returncode}")
    setup = re.search(r"setup: native I/O engine built", p.stdout + p.stderr) is not None
    res = {"venv_s": t_venv - t0, "run_sh_s": t_end - t_venv, "total_s": t_end - t0, "native_built": setup,
           "answer": p.stdout.strip()[-400:], "cpus": os.cpu_count()}
    print(f"\n{'step':<44} {'seconds':>8}")
    print(f"{'python -m venv':<44} {res['venv_s']:>8.1f}")
    print(f"{'./scripts/run.sh (setup + first answer)':<44} {res['run_sh_s']:>8.1f}")
    print(f"{'total, fresh clone to first answer':<44} {res['total_s']:>8.1f}   (goal: <= 120)")
    print(f"\nanswer: {res['answer'][:200]!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
