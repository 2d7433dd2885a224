#!/usr/bin/env python3
"""Whole-model decode, every expert in RAM: ours vs llama.cpp on the same model, in one run.

Builds (once, under --work) a seeded random Qwen3-MoE-shaped checkpoint (default 16 layers x 128
experts x 3 MiB bf16 = 6 GiB of experts, top-8, hidden 1024), exports it to GGUF bf16 with
lean_qwenflash.store.gguf_export (llama.cpp reads the same bf16 weights), quantizes that file to
Q4_K_M with llama.cpp's own quantizer, and packs the checkpoint twice: bf16 and --quant q4_k_m.
Then each engine decodes greedily from the same prompt ids in its own process, warm (a first
pass faults every page in; llama.cpp mmaps its file, so the machine needs RAM for it):

* llama.cpp (llama-cpp-python), --threads threads, f32 KV cache, mmap;
* ours, every expert resident (ResidentExperts), expert_kernels fast, at cpu_isa auto and at
  avx2 (the ISA the llama.cpp wheel was built for, so the ISA is the same on both sides).

Routing: random routers on a random model pick experts near-uniformly; the table reports how many
distinct experts per layer the decode used and the busiest expert's share. The Q4_K_M rows are
not identical bytes yet: llama.cpp quantizes with its quantizer, we with ours (same formats,
same bytes per weight; identical bytes come with GGUF import). Both quantize the attention
matrices and the output head; llama.cpp also quantizes the token embeddings (we keep them bf16:
only one row of them is read per token). Prints a table, writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import recorded_routing, routing_summary  # noqa: E402


def model_config(experts_gib: float, layers: int) -> dict:
    hidden, inter = 1024, 512
    per_expert = 3 * hidden * inter * 2
    experts = max(16, int(experts_gib * 2**30 / (per_expert * layers)))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 32000,
        "hidden_size": hidden, "intermediate_size": 2048, "moe_intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
        "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 4096,
    }


def build_checkpoint(out: Path, config: dict, seed: int = 0, dtype=None, residual_scale: float = 1.0) -> None:
    """An HF checkpoint dir: one safetensors shard per layer, stacked expert tensors, bf16 (or ``dtype``).
    ``residual_scale`` scales what each layer adds to the residual stream (o_proj, a DeltaNet's
    out_proj, expert and shared-expert down):
    below 1 the token embedding stays dominant in deep layers, so routing stays token-dependent."""
    import torch
    from safetensors.torch import save_file
    from lean_qwenflash.families import family_for

    if (out / "config.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = family_for(config).build(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def rand(shape, scale):
        return (torch.randn(shape, generator=gen) * scale).to(dtype)
    hidden, inter, experts = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        t = {k: (1 + 0.1 * torch.randn(s, generator=gen)).to(dtype) if len(s) == 1 else
             rand(s, s[-1] ** -0.5 * (residual_scale if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0))
             for k, s in shapes.items() if k.startswith(prefix)}
        t[prefix + "mlp.experts.gate_up_proj"] = rand((experts, 2 * inter, hidden), hidden ** -0.5)
        t[prefix + "mlp.experts.down_proj"] = rand((experts, hidden, inter), inter ** -0.5 * residual_scale)
        save_file(t, str(out / f"layer-{layer:03d}.safetensors"))
        print(f"  checkpoint layer {layer}", file=sys.stderr, flush=True)
    rest = {k: rand(s, 1.0 if "embed" in k else s[-1] ** -0.5) if len(s) > 1 else torch.ones(s, dtype=dtype)
            for k, s in shapes.items() if not k.startswith("model.layers.")}
    save_file(rest, str(out / "rest.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def prepare(work: Path, config: dict, threads: int) -> dict:
    from lean_qwenflash.store import pack
    from lean_qwenflash.store.gguf_export import export_gguf
    ckpt = work / "checkpoint"
    build_checkpoint(ckpt, config)
    files = {"gguf_bf16": work / "model-bf16.gguf", "gguf_q4_k_m": work / "model-Q4_K_M.gguf",
             "pack_bf16": work / "pack-bf16", "pack_q4_k_m": work / "pack-q4_k_m"}
    if not files["gguf_bf16"].is_file():
        print("exporting GGUF bf16 ...", file=sys.stderr)
        export_gguf(ckpt, files["gguf_bf16"], "bf16")
    if not files["gguf_q4_k_m"].is_file():
        print("quantizing with llama.cpp to Q4_K_M ...", file=sys.stderr)
        import llama_cpp
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = threads
        tmp = files["gguf_q4_k_m"].with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(files["gguf_bf16"]).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize failed ({rc})")
        tmp.rename(files["gguf_q4_k_m"])
    for preset in ("bf16", "q4_k_m"):
        if not (files[f"pack_{preset}"] / "manifest.json").is_file():
            print(f"packing ours {preset} ...", file=sys.stderr)
            pack(ckpt, files[f"pack_{preset}"], quant=preset if preset != "bf16" else None, force=True)
    return files


# -- workers (one process per measurement) ----------------------------------------------------------

def worker_llama(spec: dict) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=spec["prompt_tokens"] + spec["tokens"] + 8,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], n_batch=64,
                          type_k=0, type_v=0, logits_all=True, verbose=False)
    prompt = spec["prompt"]

    def run():
        llm.reset()
        llm.eval(prompt)
        out, t0 = [], time.perf_counter()
        for _ in range(spec["tokens"]):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            out.append(tok)
            llm.eval([tok])
        return out, time.perf_counter() - t0
    run()                               # warm: every page of the mapping faulted in
    tokens, dt = run()
    return {"tokens": tokens, "decode_s": dt}


def worker_ours(spec: dict) -> dict:
    import torch
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate.generator import Generator
    from lean_qwenflash.generate.sampling import SamplingParams
    from lean_qwenflash.runtime import Runtime

    torch.set_num_threads(spec["threads"])
    # bf16 pack: resident weights must be its float dtype. Quantized pack: the float residents
    # (norms, embeddings, routers) compute in fp32, which this CPU (no bf16 math) runs faster.
    dtype = "bfloat16" if spec["path"].endswith("bf16") else "float32"
    cfg = load_config(model=spec["path"], dtype=dtype, expert_kernels="fast", cpu_isa=spec["isa"])
    with Runtime.open(cfg, resident_experts=True) as rt:
        gen = Generator(rt.model)

        def run():
            it = gen.generate(spec["prompt"], SamplingParams(temperature=0.0), spec["tokens"])
            first = next(it)                  # prefill + first token
            t0 = time.perf_counter()
            rest = list(it)
            return [first] + rest, time.perf_counter() - t0
        run()
        tokens, dt = run()
        with recorded_routing(rt.model) as routed:     # after the timing: the hooks cost ~15% of a step
            run()
    return {"tokens": tokens, "decode_s": dt * spec["tokens"] / max(1, spec["tokens"] - 1), **routing_summary(routed)}


def run_worker(kind: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts-gib", type=float, default=6.0)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48, help="decode steps timed")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--work", default=str(REPO / "bench" / "results" / "peer"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peer.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = worker_llama if args.worker == "llama" else worker_ours
        print(json.dumps(fn(json.loads(args.spec))))
        return 0

    work = Path(args.work)
    config = model_config(args.experts_gib, args.layers)
    files = prepare(work, config, args.threads)
    import random
    rng = random.Random(0)
    prompt = [rng.randrange(259, config["vocab_size"]) for _ in range(args.prompt_tokens)]
    base = {"prompt": prompt, "tokens": args.tokens, "threads": args.threads, "prompt_tokens": args.prompt_tokens}
    rows = []
    for weights in ("bf16", "q4_k_m"):
        gguf = files[f"gguf_{weights}"]
        ll = run_worker("llama", dict(base, path=str(gguf)))
        rows.append({"engine": "llama.cpp", "weights": weights, "file_gib": gguf.stat().st_size / 2**30, **ll})
        for isa in ("auto", "avx2"):
            ours = run_worker("ours", dict(base, path=str(files[f"pack_{weights}"]), isa=isa))
            size = sum(f.stat().st_size for f in files[f"pack_{weights}"].iterdir()) / 2**30
            agree = sum(a == b for a, b in zip(ours["tokens"], ll["tokens"])) / args.tokens
            rows.append({"engine": f"ours ({isa})", "weights": weights, "file_gib": size, "agree_with_llama": agree,
                         "vs_llama": ll["decode_s"] / ours["decode_s"], **ours})
        print(f"  {weights} done", file=sys.stderr)
    print(f"\nQwen3-MoE-shaped random model: {config['num_hidden_layers']} layers x {config['num_experts']} experts, "
          f"top-{config['num_experts_per_tok']}, hidden {config['hidden_size']}; {args.threads} threads; "
          f"{args.tokens} greedy decode steps after a {args.prompt_tokens}-token prompt; every weight in RAM")
    print(f"{'engine':14s} {'weights':8s} {'GiB':>6s} {'tok/s':>7s} {'vs llama.cpp':>13s} {'same tokens':>12s} "
          f"{'experts/layer':>14s} {'top share':>10s}")
    for r in rows:
        tps = args.tokens / r["decode_s"]
        print(f"{r['engine']:14s} {r['weights']:8s} {r['file_gib']:6.2f} {tps:7.2f} "
              f"{r.get('vs_llama', 1.0):12.2f}x {100 * r.get('agree_with_llama', 1.0):11.0f}% "
              f"{r.get('distinct_experts_per_layer', float('nan')):14.1f} {r.get('top_expert_share', float('nan')):10.2f}")
        r["tok_s"] = tps
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
