"""Decode throughput with 1, 2, 4, 8 concurrent streams: batched (``Generator.step_all``, one
forward per step for every stream: what the server's engine does) against interleaved (each stream
stepped alone in turn: the engine before batching), side by side in one run.

For each model and tier, one worker process: N streams with different random prompts (lengths
24..52 tokens) are prefilled, then each decodes ``--tokens`` greedy tokens; the decode is timed
(aggregate tok/s over all streams) and the expert bytes read from the pack per generated token are
counted. Both drivers produce the same tokens in exact mode (tests/test_batched.py); here the
policy is the config's (fast by default).

    python bench/concurrency.py                       # default model resident; the peer packs if built
    python bench/concurrency.py --pack /tmp/peer/work/pack-skewed --streams 1 2 4 8
    python bench/concurrency.py --worker ...          # (internal: one model/tier)

The big random MoEs are bench/peer_gguf.py's Q4_K_M packs (16 layers x 128 experts, 1.98 GB; near
uniform and skewed routing): each is
run resident, streamed with a host cache of a quarter of its expert records (a step's experts stay
cached between streams either way), and "streamed-small" with a cache of half of one token's
experts (as a 100B+ model on a small-RAM machine: whatever one stream reads is gone before the next
stream needs it, unless the streams step together).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import run_json_worker  # noqa: E402

PEER_PACKS = [Path("/tmp/peer/work/pack-uniform"), Path("/tmp/peer/work/pack-skewed")]


def _bytes_read(rt) -> int:
    return rt.stats().get("total", {}).get("bytes_read", 0)     # (resident: no store reads)


def worker(args) -> dict:
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate import Generator, SamplingParams
    from lean_qwenflash.runtime import Runtime, default_pack
    from lean_qwenflash.store import ExpertStore

    pack_dir = Path(args.pack[0]) if args.pack else default_pack()
    overrides = {}
    if args.tier != "resident":
        store = ExpertStore.open(pack_dir)
        layers = store.manifest.layers
        if args.tier == "streamed":             # a quarter of the model's expert records
            slots = sum(l.num_experts for l in layers) // 4
        else:                                   # half of one token's experts over all layers
            slots = len(store.moe_layers) * int(store.config.get("num_experts_per_tok", 8)) // 2
        overrides["host_cache_bytes"] = max(1, slots) * store.max_record_bytes
        store.close()
    cfg = load_config(args.config, model=str(pack_dir), **overrides)
    greedy = SamplingParams(temperature=0.0)
    rows = []
    with Runtime.open(cfg, resident_experts=args.tier == "resident") as rt:
        vocab = rt.model.model.embed_tokens.num_embeddings
        g = Generator(rt.model, rt.prefill_chunk_tokens)
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(24 + 4 * i)] for i in range(max(args.streams))]
        # warm the code paths (not the caches: each measurement starts from a fresh prefill)
        list(g.start(prompts[0], greedy, 4))
        for n in args.streams:
            for how in ("interleaved", "batched"):
                gens = [g.start(p, greedy, args.tokens) for p in prompts[:n]]
                for x in gens:
                    while not x.prefilled and not x.done:
                        x.step()
                produced = sum(x.num_generated for x in gens)
                read0 = _bytes_read(rt)
                t0 = time.perf_counter()
                while not all(x.done for x in gens):
                    live = [x for x in gens if not x.done]
                    if how == "batched":
                        for r in g.step_all(live):
                            if isinstance(r, Exception):
                                raise r
                    else:
                        for x in live:
                            x.step()
                dt = time.perf_counter() - t0
                tokens = sum(x.num_generated for x in gens) - produced
                read = _bytes_read(rt) - read0
                rows.append({"streams": n, "driver": how, "tokens": tokens, "seconds": dt,
                             "tok_s": tokens / dt, "bytes_per_token": read / tokens})
    return {"pack": str(pack_dir), "tier": args.tier, "kernels": cfg.expert_kernels, "rows": rows,
            "host_cache_bytes": overrides.get("host_cache_bytes")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pack", nargs="+", default=None,
                    help="packs to run beside the default model (default: bench/peer_gguf.py's uniform and skewed packs, if built)")
    ap.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=32, help="tokens each stream decodes")
    ap.add_argument("--out", default="bench/results/concurrency.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tier", choices=["resident", "streamed", "streamed-small"], default="resident", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = [(None, "resident")]
    packs = [Path(p) for p in args.pack] if args.pack else [p for p in PEER_PACKS if (p / "manifest.json").exists()]
    for pack in packs:
        runs += [(pack, "resident"), (pack, "streamed"), (pack, "streamed-small")]
    if not packs:
        print(f"(no big pack: pass --pack, or build {PEER_PACKS[0].parent} with bench/peer_gguf.py)", file=sys.stderr)
    results = []
    for pack_dir, tier in runs:
        cmd = [sys.executable, __file__, "--worker", "--tier", tier, "--tokens", str(args.tokens),
               "--streams", *map(str, args.streams)]
        if pack_dir is not None:
            cmd += ["--pack", str(pack_dir)]
        if args.config:
            cmd += ["--config", args.config]
        res = run_json_worker(cmd)
        res.setdefault("pack", str(pack_dir or "default model"))
        res.setdefault("tier", tier)
        results.append(res)
    print(f"\n{'model':<28} {'tier':<9} {'streams':>7} {'interleaved tok/s':>18} {'batched tok/s':>14} "
          f"{'batched/1 stream':>17} {'MiB/token inter.':>17} {'MiB/token batched':>18}")
    for res in results:
        if "error" in res:
            print(f"{Path(res['pack']).name:<28} {res['tier']:<9} error: {res['error'][-300:]}")
            continue
        by = {(r["streams"], r["driver"]): r for r in res["rows"]}
        base = by.get((1, "batched"), {}).get("tok_s")
        for n in args.streams:
            i, b = by[(n, "interleaved")], by[(n, "batched")]
            print(f"{Path(res['pack']).name:<28} {res['tier']:<9} {n:>7} {i['tok_s']:>18.1f} {b['tok_s']:>14.1f} "
                  f"{b['tok_s'] / base:>16.2f}x {i['bytes_per_token'] / 2**20:>17.2f} {b['bytes_per_token'] / 2**20:>18.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
