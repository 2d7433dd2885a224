"""Per-layer cost of a decode step outside the expert products, per family, before and after.

For each family of the test registry (tests/hf_models.py), its tiny "quant"-shaped checkpoint
(hidden 256, expert rows of 256) is packed with ``--quant q4_k_m`` (resident matrices encoded, as
a GGUF user has them), opened resident in fast mode, fp32, on ``--threads`` threads, and decodes
``--tokens`` tokens after a 32-token prompt. The experts are tiny, so a step is almost all
per-layer work (norms, projections, rope, attention, DeltaNet, routing, dispatch); the script
also subtracts the time inside the native MoE calls and reports

    us/layer = (step time - time in moe_decode) / layers

Each tree (``--trees``: checkouts, e.g. a baseline worktree and this one) runs in its own process
on the same packs, alternately, best of ``--rounds``. Prints a table, writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (not bench/ itself, which Python put first: its kernels.py would shadow the `kernels` package
# transformers imports when it is installed, and building the packs would fail)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))

WORKER = r'''
import json, sys, time, torch
from lean_qwenflash.config import load_config
from lean_qwenflash.generate.state import new_state
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.models import native
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
cfg = load_config(model=spec["pack"], dtype="float32", expert_kernels="fast", cpu_threads=spec["threads"])
inner = {"s": 0.0}
real = native._K.moe_decode
def timed(*a, **kw):
    t = time.perf_counter(); r = real(*a, **kw); inner["s"] += time.perf_counter() - t; return r
with Runtime.open(cfg, resident_experts=True) as rt, torch.inference_mode():
    m = rt.model
    vocab = int(m.config["vocab_size"])
    st = new_state(m); m(torch.arange(32).view(1, -1) % vocab, st, last_logits_only=True)
    toks = [(7 * i + 3) % vocab for i in range(spec["tokens"] + 8)]
    for t in toks[:8]:
        m(torch.tensor([[t]]), st)
    class K:          # count the native MoE time
        def __getattr__(self, n):
            return timed if n == "moe_decode" else getattr(native._real_K, n)
    native._real_K, native._K = native._K, K()
    t0 = time.perf_counter()
    for t in toks[8:]:
        m(torch.tensor([[t]]), st)
    step = (time.perf_counter() - t0) / spec["tokens"]
    native._K = native._real_K
print(json.dumps({"step_us": step * 1e6, "moe_us": inner["s"] / spec["tokens"] * 1e6,
                  "layers": len(m.layer_types)}))
'''


def make_packs(families: list, work: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    import hf_models
    from lean_qwenflash.store import pack
    packs = {}
    for family in families:
        out = work / f"pack-{family}"
        if not (out / "manifest.json").is_file():
            variant = "quant" if "quant" in hf_models.VARIANTS[family] else "base"
            model, _ = hf_models.make_hf_model(family, variant)
            ckpt = hf_models.save_checkpoint(model, str(work / f"ckpt-{family}"))
            pack(ckpt, out, force=True, progress=False, quant="q4_k_m")
        packs[family] = out
    return packs


def run(tree: str, pack: Path, tokens: int, threads: int) -> dict:
    spec = json.dumps({"pack": str(pack), "tokens": tokens, "threads": threads})
    # (cwd: the tree too, since `python -c` puts the working directory ahead of PYTHONPATH: run
    # from another checkout, it would import that one's package for every tree)
    p = subprocess.run([sys.executable, "-c", WORKER, spec], capture_output=True, text=True, cwd=tree,
                       env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"})
    if p.returncode:
        return {"error": p.stderr[-800:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=str(REPO), help="comma-separated checkouts to compare (first = before)")
    ap.add_argument("--families", help="comma-separated (default: every family of tests/hf_models.py)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "lqf-decode-layers"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "decode_layers.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import hf_models
    families = args.families.split(",") if args.families else list(hf_models.FAMILIES)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    packs = make_packs(families, work)
    trees = args.trees.split(",")
    results = {f: {t: None for t in trees} for f in families}
    for _ in range(args.rounds):
        for family in families:
            for tree in trees:
                r = run(tree, packs[family], args.tokens, args.threads)
                best = results[family][tree]
                if "error" in r:
                    results[family][tree] = best or r
                elif best is None or "error" in best or r["step_us"] < best["step_us"]:
                    results[family][tree] = r
    names = [Path(t).name or t for t in trees]
    head = f"{'family':14s} {'layers':>6s} " + " ".join(f"{n + ' us/layer':>18s}" for n in names)
    if len(trees) > 1:
        head += f" {'after/before':>12s}"
    print(f"decode step outside the expert products (fast, fp32, q4_k_m, {args.threads} threads, best of {args.rounds})")
    print(head)
    for family in families:
        cells, per = [], []
        for tree in trees:
            r = results[family][tree]
            if r is None or "error" in r:
                cells.append(f"{'error':>18s}")
                per.append(None)
                continue
            us = (r["step_us"] - r["moe_us"]) / r["layers"]
            per.append(us)
            cells.append(f"{us:18.1f}")
        line = f"{family:14s} {results[family][trees[0]].get('layers', 0) if results[family][trees[0]] else 0:6d} " + " ".join(cells)
        if len(trees) > 1 and per[0] and per[-1]:
            line += f" {per[-1] / per[0]:12.2f}"
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"trees": trees, "threads": args.threads, "tokens": args.tokens,
                                          "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
