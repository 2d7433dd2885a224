#!/usr/bin/env python3
"""Streamed decode of a model whose experts are >= 3x the RAM it may use, under a cgroup limit.

Builds (once) a seeded random Qwen3-Next-shaped pack whose bf16 experts total --experts-gib
(default 12 GiB), then runs greedy decode in worker processes and reports, side by side:

* inside a cgroup v1 memory limit (--limit-gib, page cache counted): uniform routing (random
  routers) and skewed routing, each with prefetch on and off: decode tokens/s, bytes read per
  token, achieved read GB/s, the I/O bound (bytes per token / the engine's bandwidth for the same
  record size measured in the same worker), our fraction of it, stall fraction, prefetch
  precision/recall, hit rate, peak cgroup memory vs the limit;
* without a limit: the same model with every expert in the host cache vs ResidentExperts
  (the cost of the caching machinery when nothing is read).

With --quant PRESET (default q4_k_m; "none" skips it) the same model is also requantized record by
record (resident tensors hard-linked, experts re-encoded with our quantizer) and every streamed
run is repeated on it under the same limit and host cache: bytes per token, tok/s, fraction of
the I/O bound, and the quantized/bf16 tok/s ratio (goal of the quantized-experts issue: >= 3x).

Skewed routing: each router row e is multiplied by s_e = 1 + 7 * (rank_e + 1) ** -1.2, with a
seeded random rank permutation per layer. Large rows produce large logits, so a few experts per
layer win top-k for a large share of tokens (a Zipf-like popularity, as measured on real MoEs),
without changing anything else in the model.

Needs root (cgroup v1 under /sys/fs/cgroup/memory); without it the limited runs are skipped and
the table says so. Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402

from lean_qwenflash.store import format as fmt  # noqa: E402
from lean_qwenflash.store.checkpoint import StreamingSafetensorsWriter  # noqa: E402

from common import can_limit_memory, run_json_worker  # noqa: E402


EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def model_config(experts_gib: float, family: str = "qwen3_next") -> dict:
    """The synthetic model: Qwen3-Next's shape at --experts-gib, or another family's bench/decode.py
    shape with as many experts per layer as make --experts-gib (a multiple of 8)."""
    if family != "qwen3_next":
        from decode import BENCH_CONFIGS
        from lean_qwenflash.families import moe_facts

        arch, values = BENCH_CONFIGS[family]
        config = dict(values, architectures=[arch])
        facts = moe_facts(config)
        record = fmt.align_up(3 * facts.hidden_size * facts.expert_intermediate * 2)
        experts = max(16, int(experts_gib * 2**30 / (record * len(facts.moe_layers))) // 8 * 8)
        key = next(k for k in EXPERT_COUNT_KEYS if k in config)
        config[key] = experts
        return config
    hidden, inter, layers = 2048, 512, 16
    record = fmt.align_up(3 * hidden * inter * 2)
    experts = max(16, int(experts_gib * 2**30 / (record * layers)))
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 32000,
        "hidden_size": hidden, "intermediate_size": 4096, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 8,
        "linear_num_value_heads": 16, "moe_intermediate_size": inter, "shared_expert_intermediate_size": inter,
        "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "full_attention_interval": 4, "tie_word_embeddings": False, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
    }


def build_pack(out: Path, config: dict, seed: int = 0) -> None:
    """Write a pack directly (no HF checkpoint in between: that would double the disk writes)."""
    from lean_qwenflash.families import family_for, moe_facts
    from lean_qwenflash.io_engine import crc32c
    from lean_qwenflash.families import family_for

    if (out / "manifest.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = family_for(config).build(config)
    entries = [(k, tuple(v.shape), torch.bfloat16) for k, v in model.state_dict().items()]
    writer = StreamingSafetensorsWriter(out / fmt.RESIDENT, entries)
    from decode import ZERO_CENTRED

    zero_centred = family_for(config).name in ZERO_CENTRED
    for name, shape, dtype in entries:
        t = torch.randn(shape, generator=gen)
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            t = t * 0.01                        # selection-only biases: small, or they alone pick the experts
        elif len(shape) == 1:
            t = t * 0.1 + (0.0 if zero_centred or not name.endswith("norm.weight") else 1.0)
        else:
            t = t * shape[-1] ** -0.5
        writer.write(name, t.to(dtype))
    writer.close()
    facts = moe_facts(config)
    hidden, inter, num_experts = facts.hidden_size, facts.expert_intermediate, facts.num_experts
    layers, offset = [], 0
    for n, i in enumerate(facts.moe_layers):
        rec = fmt.layout_layer(i, num_experts, hidden, inter, "bf16", offset, n * num_experts)
        layers.append(rec)
        offset += rec.num_experts * rec.record_bytes
    crcs = []
    t0 = time.perf_counter()
    with open(out / fmt.EXPERTS, "wb") as f:
        for rec in layers:
            for e in range(rec.num_experts):
                buf = bytearray(rec.record_bytes)
                body = (torch.randn(3 * hidden * inter, generator=gen) * hidden ** -0.5).to(torch.bfloat16)
                buf[: body.numel() * 2] = body.view(torch.uint8).numpy().tobytes()
                crcs.append(crc32c(buf))
                f.write(buf)
            print(f"  layer {rec.layer_idx}: {offset / 2**30 * (rec.layer_idx + 1) / len(layers):.1f} GiB written "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        f.flush()
        os.fsync(f.fileno())
    (out / fmt.EXPERTS_IDX).write_bytes(fmt.encode_idx(crcs))
    manifest = fmt.Manifest(config["architectures"][0], family_for(config).name, config, layers, offset,
                            created_by="bench/stream.py (synthetic)")
    (out / fmt.MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))


def skew_pack(src: Path, out: Path, seed: int = 1) -> None:
    """Same experts (hard links), routers rescaled for skewed popularity (see the docstring)."""
    from safetensors.torch import load_file, save_file

    from decode import ROUTER_SUFFIXES

    if (out / "manifest.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in (fmt.EXPERTS, fmt.EXPERTS_IDX):
        if not (out / name).exists():
            os.link(src / name, out / name)
    tensors = load_file(str(src / fmt.RESIDENT))
    gen = torch.Generator().manual_seed(seed)
    for k, v in tensors.items():
        if k.endswith(ROUTER_SUFFIXES):
            ranks = torch.randperm(v.shape[0], generator=gen).float()
            scale = 1 + 7 * (ranks + 1) ** -1.2
            tensors[k] = (v.float() * scale[:, None]).to(v.dtype)
    save_file(tensors, str(out / fmt.RESIDENT))
    (out / fmt.MANIFEST).write_text((src / fmt.MANIFEST).read_text())


def quantize_pack(src: Path, out: Path, preset: str) -> None:
    """``src``'s model with its experts re-encoded by ``preset`` (the resident file is hard-linked)."""
    from lean_qwenflash.io_engine import crc32c
    from lean_qwenflash.quant import get_encoding
    from lean_qwenflash.store.packer import plan_records

    if (out / "manifest.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    if not (out / fmt.RESIDENT).exists():
        os.link(src / fmt.RESIDENT, out / fmt.RESIDENT)
    doc = json.loads((src / fmt.MANIFEST).read_text())
    old = fmt.parse_manifest(doc, str(src))
    inter, hidden = old.layers[0].tensors[0].shape[0] // 2, old.layers[0].tensors[0].shape[1]
    layers, offset, _ = plan_records([l.layer_idx for l in old.layers], old.layers[0].num_experts, hidden, inter,
                                     preset, "bf16")
    crcs, t0 = [], time.perf_counter()
    with open(src / fmt.EXPERTS, "rb") as fin, open(out / fmt.EXPERTS, "wb") as fout:
        for rec_old, rec in zip(old.layers, layers):
            for e in range(rec.num_experts):
                fin.seek(rec_old.offset(e))
                raw = torch.frombuffer(bytearray(fin.read(rec_old.record_bytes)), dtype=torch.uint8)
                buf = bytearray(rec.record_bytes)
                for t_old, t_new in zip(rec_old.tensors, rec.tensors):
                    w = raw[t_old.offset:t_old.offset + t_old.nbytes].view(torch.bfloat16).view(t_old.shape)
                    data = get_encoding(t_new.encoding).quantize(w).contiguous().view(torch.uint8).numpy()
                    buf[t_new.offset:t_new.offset + t_new.nbytes] = data.tobytes()
                crcs.append(crc32c(buf))
                fout.write(buf)
            print(f"  {preset}: layer {rec.layer_idx} re-encoded ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
        fout.flush()
        os.fsync(fout.fileno())
    (out / fmt.EXPERTS_IDX).write_bytes(fmt.encode_idx(crcs))
    manifest = fmt.Manifest(old.architecture, old.family, old.config, layers, offset,
                            created_by=f"bench/stream.py (synthetic, {preset})")
    (out / fmt.MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))


# -- worker ---------------------------------------------------------------------------------------

def probe_bandwidth(store, seconds: float = 3.0) -> float:
    """GB/s of random record reads with this store's engine and depth (what the I/O bound uses).
    Records are uniform and contiguous, so record-sized aligned blocks are records."""
    from lean_qwenflash.io_engine import measure_random_reads
    block = store.manifest.layers[0].record_bytes
    done, dt = measure_random_reads(store.engine, block, seconds)
    return done * block / dt / 1e9


def worker(spec: dict) -> dict:
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate.generator import Generator
    from lean_qwenflash.generate.sampling import SamplingParams
    from lean_qwenflash.runtime import Runtime

    torch.set_num_threads(spec["threads"])
    cfg = load_config(model=spec["pack"], dtype="bfloat16", host_cache_bytes=spec["host_cache_bytes"],
                      prefetch=spec["prefetch"], io_queue_depth=spec["depth"], io_engine=spec["engine"])
    rt = Runtime.open(cfg, resident_experts=spec["mode"] == "resident")
    out = {"mode": spec["mode"], "prefetch": spec["prefetch"]}
    if spec["mode"] == "cached":
        rt.provider.preload()
    if spec["mode"] == "streamed":
        out["probe_gbps"] = probe_bandwidth(rt.store, spec["probe_seconds"])
    prompt = torch.randint(0, rt.store.config["vocab_size"], (spec["prompt_tokens"],),
                           generator=torch.Generator().manual_seed(5)).tolist()
    gen = Generator(rt.model)
    t0 = time.perf_counter()
    times, tokens = [], []
    for tok in gen.generate(prompt, SamplingParams(temperature=0.0), spec["warmup_tokens"] + spec["tokens"]):
        times.append(time.perf_counter())
        tokens.append(tok)
        if len(tokens) == spec["warmup_tokens"] and hasattr(rt.provider, "stats"):
            rt.provider.reset_stats()   # measure steady decode, not prefill
    decode_s = times[-1] - times[spec["warmup_tokens"] - 1] if spec["warmup_tokens"] else times[-1] - t0
    out.update(tokens=spec["tokens"], decode_tok_s=spec["tokens"] / decode_s, prefill_s=times[0] - t0,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, token_ids=tokens)
    snap = rt.stats()   # {} when every expert is resident: nothing streamed, nothing to report
    if snap:
        t = snap["total"]
        out.update({k: t[k] for k in ("lookups", "misses", "bytes_read", "stall_time_s", "read_time_s",
                                      "prefetch_issued", "prefetch_useful", "prefetch_wasted",
                                      "prefetch_precision", "prefetch_recall", "hit_rate")})
        out["bytes_per_token"] = t["bytes_read"] / spec["tokens"]
        out["achieved_gbps"] = t["bytes_read"] / decode_s / 1e9
        out["stall_fraction"] = t["stall_time_s"] / decode_s
        if "probe_gbps" in out and out["bytes_per_token"]:
            out["io_bound_tok_s"] = out["probe_gbps"] * 1e9 / out["bytes_per_token"]
            out["fraction_of_io_bound"] = out["decode_tok_s"] / out["io_bound_tok_s"]
    rt.close()
    return out


# -- orchestration ---------------------------------------------------------------------------------

def run_worker(spec: dict, limit_bytes: int | None) -> dict:
    return run_json_worker([sys.executable, __file__, "--worker", json.dumps(spec)], limit_bytes, "lqf-bench")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/lqf-stream", help="where the synthetic packs live (an SSD path)")
    ap.add_argument("--experts-gib", type=float, default=12.0)
    ap.add_argument("--limit-gib", type=float, default=4.0, help="cgroup memory limit for the streamed runs")
    ap.add_argument("--host-cache-gib", type=float, default=2.0)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--engine", default="auto", choices=["auto", "uring", "pread"])
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens measured")
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--probe-seconds", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in the workers")
    ap.add_argument("--skip-cached", action="store_true", help="skip the fully cached vs resident comparison")
    ap.add_argument("--quant", default="q4_k_m", help="also run a pack re-encoded with this preset (none: skip)")
    ap.add_argument("--family", default="qwen3_next", help="model family of the synthetic pack (bench/decode.py's "
                                                          "shapes for the others)")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/stream[-FAMILY].json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    root = Path(args.dir) if args.family == "qwen3_next" else Path(args.dir) / args.family
    if args.out is None:
        args.out = str(REPO / "bench" / "results" / ("stream.json" if args.family == "qwen3_next"
                                                      else f"stream-{args.family}.json"))
    config = model_config(args.experts_gib, args.family)
    uniform, skewed = root / "uniform", root / "skewed"
    print(f"building the synthetic pack in {root} (once) ...", file=sys.stderr)
    build_pack(uniform, config)
    skew_pack(uniform, skewed)
    packs = {"bf16": {"uniform": uniform, "skewed": skewed}}
    if args.quant != "none":
        packs[args.quant] = {}
        for routing, src in (("uniform", uniform), ("skewed", skewed)):
            dst = root / f"{routing}-{args.quant}"
            if routing == "skewed":      # same experts as uniform: link them, take skewed's routers
                if not (dst / "manifest.json").is_file():
                    dst.mkdir(parents=True, exist_ok=True)
                    q_uniform = root / f"uniform-{args.quant}"
                    for name in (fmt.EXPERTS, fmt.EXPERTS_IDX, fmt.MANIFEST):
                        if not (dst / name).exists():
                            os.link(q_uniform / name, dst / name)
                    if not (dst / fmt.RESIDENT).exists():
                        os.link(skewed / fmt.RESIDENT, dst / fmt.RESIDENT)
            else:
                quantize_pack(src, dst, args.quant)
            packs[args.quant][routing] = dst
    manifest = json.loads((uniform / "manifest.json").read_text())
    experts_bytes = manifest["experts_bytes"]
    limit = int(args.limit_gib * 2**30)
    can_limit = can_limit_memory()
    base = dict(host_cache_bytes=int(args.host_cache_gib * 2**30), depth=args.depth, engine=args.engine,
                tokens=args.tokens, warmup_tokens=args.warmup_tokens, prompt_tokens=args.prompt_tokens,
                probe_seconds=args.probe_seconds, threads=args.threads)
    print(f"experts {experts_bytes / 2**30:.1f} GiB ({experts_bytes / limit:.1f}x the {args.limit_gib} GiB limit); "
          f"host cache {args.host_cache_gib} GiB; "
          f"record {manifest['layers'][0]['record_bytes'] / 2**20:.1f} MiB; "
          f"top-{config['num_experts_per_tok']} of {manifest['layers'][0]['num_experts']} experts x "
          f"{config['num_hidden_layers']} layers", file=sys.stderr)

    rows = []
    for encoding, by_routing in packs.items():
        for routing, pack_dir in by_routing.items():
            for prefetch in (False, True):
                spec = dict(base, pack=str(pack_dir), mode="streamed", prefetch=prefetch)
                res = run_worker(spec, limit if can_limit else None) if can_limit else {"error": "needs root + cgroup v1"}
                res.update(routing=routing, prefetch=prefetch, mode="streamed", encoding=encoding)
                rows.append(res)
                print(f"  {encoding} {routing} prefetch={prefetch}: {res.get('decode_tok_s', float('nan')):.2f} tok/s "
                      f"{res.get('error', '')}", file=sys.stderr, flush=True)
    if not args.skip_cached:
        for mode in ("resident", "cached"):
            spec = dict(base, pack=str(uniform), mode=mode, prefetch=False,
                        host_cache_bytes=experts_bytes + 2**20)
            res = run_worker(spec, None)
            res.update(routing="uniform", mode=mode, prefetch=False, encoding="bf16")
            rows.append(res)
            print(f"  {mode}: {res.get('decode_tok_s', float('nan')):.2f} tok/s {res.get('error', '')}",
                  file=sys.stderr, flush=True)

    def f(r, k, fmt_="{:.2f}", scale=1.0):
        v = r.get(k)
        return "-" if v is None else fmt_.format(v * scale)

    hdr = ("encoding", "routing", "mode", "prefetch", "tok/s", "MiB/token", "read GB/s", "probe GB/s", "I/O bound",
           "of bound", "stall", "hit%", "pf prec", "pf recall", "peak MiB", "limit MiB")
    table = [hdr]
    for r in rows:
        table.append((r["encoding"], r["routing"], r["mode"], "on" if r["prefetch"] else "off", f(r, "decode_tok_s"),
                      f(r, "bytes_per_token", "{:.0f}", 2**-20), f(r, "achieved_gbps"), f(r, "probe_gbps"),
                      f(r, "io_bound_tok_s"), f(r, "fraction_of_io_bound", "{:.0%}"), f(r, "stall_fraction", "{:.0%}"),
                      f(r, "hit_rate", "{:.0f}", 100), f(r, "prefetch_precision"), f(r, "prefetch_recall"),
                      f(r, "cgroup_peak_bytes", "{:.0f}", 2**-20) if "cgroup_peak_bytes" in r
                      else f(r, "peak_rss_bytes", "{:.0f}", 2**-20),
                      f(r, "cgroup_limit_bytes", "{:.0f}", 2**-20)))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(hdr))]
    for row in table:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    cached = {r["mode"]: r for r in rows if r["mode"] in ("cached", "resident") and "decode_tok_s" in r}
    summary = {}
    if len(cached) == 2:
        summary["cached_over_resident"] = cached["cached"]["decode_tok_s"] / cached["resident"]["decode_tok_s"]
        summary["cached_tokens_equal_resident"] = cached["cached"]["token_ids"] == cached["resident"]["token_ids"]
        print(f"\nfully cached / resident decode: {summary['cached_over_resident']:.2f} "
              f"(same tokens: {summary['cached_tokens_equal_resident']})")
    streamed = [r for r in rows if r["mode"] == "streamed" and "decode_tok_s" in r]
    if streamed:
        summary["best_fraction_of_io_bound"] = max(r.get("fraction_of_io_bound", 0) for r in streamed)
        summary["all_under_limit"] = (len(streamed) == sum(r["mode"] == "streamed" for r in rows) and
                                      all(r.get("cgroup_peak_bytes", 0) <= limit for r in streamed))
        print(f"best fraction of the I/O bound: {summary['best_fraction_of_io_bound']:.0%}; "
              f"all streamed runs under the {args.limit_gib} GiB limit: {summary['all_under_limit']}")
    if args.quant != "none":
        ratios = {}
        for r in streamed:
            if r["encoding"] == args.quant:
                twin = next((b for b in streamed if b["encoding"] == "bf16" and b["routing"] == r["routing"]
                             and b["prefetch"] == r["prefetch"]), None)
                if twin:
                    ratios[f"{r['routing']} prefetch {'on' if r['prefetch'] else 'off'}"] = \
                        r["decode_tok_s"] / twin["decode_tok_s"]
        summary[f"{args.quant}_over_bf16_tok_s"] = ratios
        if ratios:
            print(f"{args.quant} / bf16 decode tok/s under the same limit: " +
                  ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " (goal >= 3x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("token_ids", None)
    out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "worker"},
                               "experts_bytes": experts_bytes, "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
