"""Prefill and decode speed of our runtime vs transformers (eager) on the same random weights of one
model family, on this machine's CPU.

    python bench/decode.py [--family qwen3_next] [--out FILE] [--prompt-tokens 512] [--decode-tokens 128]
    python bench/decode.py --family all              # every family in BENCH_CONFIGS, one table
    python bench/decode.py --device cuda --dtype bfloat16      # the same comparison on a GPU

Builds a seeded random checkpoint (~1-2 GB fp32) of the family's shape in a temp dir with
transformers, packs it and opens the pack with ``Runtime`` (all experts resident: what a user
runs; on CUDA ``load_hf_checkpoint``), then times both runtimes: prefill = one forward
over the prompt that fills the cache (best of two); decode = greedy one-token steps continuing
that cache, timed in segments that alternate between the runtimes so that other load on a shared
machine hits both alike. With ``--streamed`` (CPU) the checkpoint is also packed and decoded
streamed from the pack with the host cache at half the expert records and prefetch on: tok/s
and the prefetcher's precision / recall with the family's routing rule.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402

from lean_qwenflash.generate import Generator, new_state  # noqa: E402
from lean_qwenflash.loader import load_hf_checkpoint  # noqa: E402

# Qwen3-Next's proportions scaled to ~1.8 GB: many layers (3 DeltaNet : 1 attention), many small
# experts (I = H/4), top-10 plus a shared expert of the same size, partial rotary.
QWEN3_NEXT = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=80, num_experts_per_tok=10,
    norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


_DS = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
           num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128,
           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=8,
           first_k_dense_replace=1, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096)
# Each family's proportions at ~1-2 GB fp32 (architecture, config).
BENCH_CONFIGS = {
    "qwen3_next": ("Qwen3NextForCausalLM", QWEN3_NEXT),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {k: v for k, v in QWEN3_NEXT.items()
                                              if k not in ("intermediate_size", "norm_topk_prob")}),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=16,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, n_routed_experts=64, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        _DS, q_lora_rank=256, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        _DS, q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=6, topk_method="greedy",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt_oss": ("GptOssForCausalLM", dict(
        vocab_size=32000, hidden_size=512, intermediate_size=512, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024})),
    "afmoe": ("AfmoeForCausalLM", dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=6,
        num_shared_experts=1, num_dense_layers=1, global_attn_every_n_layers=4, sliding_window=256, route_scale=2.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
ZERO_CENTRED = ("qwen3_next", "qwen3_5_moe")
ROUTER_SUFFIXES = ("mlp.gate.weight", "mlp.router.weight", "mlp.router.gate.weight")


def make_checkpoint(path: str, seed: int, family: str = "qwen3_next"):
    import transformers

    arch, values = BENCH_CONFIGS[family]
    torch.manual_seed(seed)
    cls = getattr(transformers, arch)
    config = cls.config_class(**values)
    config.architectures = [arch]
    model = cls(config).eval()
    with torch.no_grad():
        # Non-trivial norms and routing, so the work is representative.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
                if family not in ZERO_CENTRED:
                    p.add_(1.0)
            elif name.endswith(ROUTER_SUFFIXES):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model


class OursRunner:
    """Our runtime: prefill fills a fresh state; decode continues it greedily."""

    def __init__(self, model, device):
        self.model = model
        self.gen = Generator(model, prefill_chunk_tokens=1 << 20)
        self.token = torch.empty(1, 1, dtype=torch.long, device=device)

    def prefill(self, prompt: torch.Tensor) -> None:
        self.state = new_state(self.model)
        self.logits = self.gen.prefill(prompt[0].tolist(), self.state)
        self.tokens = []

    def decode(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            tok = int(torch.argmax(self.logits))
            self.tokens.append(tok)
            self.token.fill_(tok)
            self.logits = self.model(self.token, self.state)[0, -1]


class TransformersRunner:
    """transformers eager forward with its DynamicCache (what ``generate`` runs, minus processors)."""

    def __init__(self, model, device):
        self.model = model
        self.device = device

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        out = self.model(prompt, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.logits = out.logits[0, -1]
        self.tokens = []

    @torch.inference_mode()
    def decode(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            tok = int(torch.argmax(self.logits))
            self.tokens.append(tok)
            self.logits = self.model(torch.tensor([[tok]], device=self.device), cache=self.cache, use_cache=True).logits[0, -1]


def timed(fn, *args) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - t0


def compare(runners: dict, prompt: torch.Tensor, num_decode: int, rounds: int = 4) -> dict:
    """Seconds per runner for prefill (best of two, alternating) and decode (interleaved segments),
    so that load from other processes on a shared machine hits both runtimes alike."""
    for r in runners.values():            # warm-up: allocator, kernels, rotary tables
        r.prefill(prompt[:, :16])
        r.decode(3)
    prefill_s = {name: float("inf") for name in runners}
    for _ in range(2):
        for name, r in runners.items():
            prefill_s[name] = min(prefill_s[name], timed(r.prefill, prompt))
    decode_s = dict.fromkeys(runners, 0.0)
    segment = -(-num_decode // rounds)
    done = 0
    while done < num_decode:
        n = min(segment, num_decode - done)
        for name, r in runners.items():
            decode_s[name] += timed(r.decode, n)
        done += n
    return {name: (prefill_s[name], decode_s[name], runners[name].tokens) for name in runners}


def streamed(out: str, prompt: torch.Tensor, num_decode: int) -> dict:
    """Decode from the pack, host cache = half the expert records, prefetch on."""
    from lean_qwenflash.config import load_config
    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.store import ExpertStore

    with ExpertStore.open(out) as store:
        cache = (store.manifest.num_records // 2) * store.max_record_bytes
    with Runtime.open(load_config(model=out, host_cache_bytes=cache, prefetch=True)) as rt:
        runner = OursRunner(rt.model, "cpu")
        runner.prefill(prompt[:, :16])
        runner.decode(3)
        runner.prefill(prompt)
        seconds = timed(runner.decode, num_decode)
        total = rt.stats()["total"]
    return {"decode_tok_s": num_decode / seconds, "host_cache_bytes": cache,
            "prefetch_precision": total["prefetch_precision"], "prefetch_recall": total["prefetch_recall"],
            "hit_rate": total.get("hit_rate")}


def run_family(family: str, args) -> dict:
    dtype = getattr(torch, args.dtype)
    arch, config = BENCH_CONFIGS[family]
    from lean_qwenflash.config import load_config
    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.store import pack

    with tempfile.TemporaryDirectory(prefix="lqf-bench-") as tmp:
        t0 = time.perf_counter()
        hf_model = make_checkpoint(tmp, args.seed, family).to(device=args.device, dtype=dtype)
        rt = None
        if args.device == "cpu":
            # What a user runs: the pack, opened by Runtime (native kernels, decode thread setup),
            # every expert resident.
            out = os.path.join(tmp, "pack")
            pack(tmp, out, dtype=args.dtype, progress=False)
            rt = Runtime.open(load_config(model=out, dtype=args.dtype), resident_experts=True)
            ours, size_bytes = rt.model, sum(p.nbytes for p in rt.model.parameters()) + rt.provider.nbytes()
        else:
            ours, provider = load_hf_checkpoint(tmp, dtype=dtype, device=args.device)
            size_bytes = sum(p.nbytes for p in ours.parameters()) + provider.nbytes()
        setup_s = time.perf_counter() - t0
        prompt = torch.randint(0, config["vocab_size"], (1, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(1)).to(args.device)
        load_before = os.getloadavg()[0]
        results = compare({"ours": OursRunner(ours, args.device),
                           "transformers": TransformersRunner(hf_model, args.device)}, prompt, args.decode_tokens)
        load_after = os.getloadavg()[0]
        del hf_model
        if rt is not None:
            rt.close()
        stream = streamed(out, prompt, args.decode_tokens) if args.streamed and rt is not None else None
    (ours_prefill, ours_decode, ours_tokens), (hf_prefill, hf_decode, hf_tokens) = results["ours"], results["transformers"]
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), len(ours_tokens))
    rows = {
        "prefill_tok_s": (args.prompt_tokens / ours_prefill, args.prompt_tokens / hf_prefill),
        "decode_tok_s": (args.decode_tokens / ours_decode, args.decode_tokens / hf_decode),
    }
    return {
        "family": family, "architecture": arch, "model": {"bytes": size_bytes, "dtype": args.dtype,
                                                          "device": args.device, "config": config},
        "setup_s": setup_s, "threads": args.threads, "load_average_1min": [load_before, load_after],
        "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "ours": {"prefill_s": ours_prefill, "decode_s": ours_decode,
                 "prefill_tok_s": rows["prefill_tok_s"][0], "decode_tok_s": rows["decode_tok_s"][0]},
        "transformers": {"prefill_s": hf_prefill, "decode_s": hf_decode,
                         "prefill_tok_s": rows["prefill_tok_s"][1], "decode_tok_s": rows["decode_tok_s"][1]},
        "ratio": {k: a / b for k, (a, b) in rows.items()},
        "greedy_identical_steps": same, "streamed": stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_next", help=f"one of {', '.join(BENCH_CONFIGS)}, or all")
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/decode[-FAMILY].json)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device for both runtimes (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--streamed", action="store_true", help="also decode streamed from a pack (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = list(BENCH_CONFIGS) if args.family == "all" else [args.family]
    unknown = [f for f in families if f not in BENCH_CONFIGS]
    if unknown:
        parser.error(f"unknown family {unknown[0]!r}; choose from {', '.join(BENCH_CONFIGS)} or all")
    results = []
    for family in families:
        r = run_family(family, args)
        results.append(r)
        print(f"{family}: {r['model']['bytes'] / 1e9:.2f} GB {args.dtype} on {args.device}, setup {r['setup_s']:.0f}s, "
              f"load {r['load_average_1min'][0]:.1f}->{r['load_average_1min'][1]:.1f}", flush=True)
    head = f"{'family':<13}{'GB':>6}{'prefill ours':>14}{'hf':>9}{'ratio':>7}{'decode ours':>13}{'hf':>8}{'ratio':>7}" \
           f"{'same':>9}"
    if args.streamed:
        head += f"{'streamed':>10}{'pf prec':>9}{'pf rec':>8}"
    print(head)
    for r in results:
        line = (f"{r['family']:<13}{r['model']['bytes'] / 1e9:>6.2f}{r['ours']['prefill_tok_s']:>14.1f}"
                f"{r['transformers']['prefill_tok_s']:>9.1f}{r['ratio']['prefill_tok_s']:>7.2f}"
                f"{r['ours']['decode_tok_s']:>13.2f}{r['transformers']['decode_tok_s']:>8.2f}"
                f"{r['ratio']['decode_tok_s']:>7.2f}{str(r['greedy_identical_steps']) + '/' + str(args.decode_tokens):>9}")
        if r["streamed"]:
            st = r["streamed"]
            line += f"{st['decode_tok_s']:>10.2f}{st['prefetch_precision']:>9.2f}{st['prefetch_recall']:>8.2f}"
        print(line)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "decode.json" if args.family == "qwen3_next" else f"decode-{args.family}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results[0] if len(results) == 1 else results, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
