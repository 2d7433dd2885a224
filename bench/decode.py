"""Prefill and decode speed of our runtime vs transformers (eager) on the same random Qwen3-Next-shaped
weights, on this machine's CPU.

    python bench/decode.py [--out bench/results/decode.json] [--prompt-tokens 512] [--decode-tokens 128]
    python bench/decode.py --device cuda --dtype bfloat16      # the same comparison on a GPU

Builds a seeded random checkpoint (~1.8 GB fp32) in a temp dir with transformers, loads it with
``load_hf_checkpoint``, then times both runtimes: prefill = one forward over the prompt that fills
the cache (best of two); decode = greedy one-token steps continuing that cache, timed in segments
that alternate between the runtimes so that other load on a shared machine hits both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lean_qwenflash.generate import Generator, new_state  # noqa: E402
from lean_qwenflash.models import load_hf_checkpoint  # noqa: E402

# Qwen3-Next's proportions scaled to ~1.8 GB: many layers (3 DeltaNet : 1 attention), many small
# experts (I = H/4), top-10 plus a shared expert of the same size, partial rotary.
CONFIG = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=80, num_experts_per_tok=10,
    norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def make_checkpoint(path: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3NextConfig(**CONFIG)
    config.architectures = ["Qwen3NextForCausalLM"]
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        # Non-trivial norms and routing, so the work is representative.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode.json"))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device for both runtimes (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory(prefix="lqf-bench-") as tmp:
        t0 = time.perf_counter()
        hf_model = make_checkpoint(tmp, args.seed).to(device=args.device, dtype=dtype)
        ours, provider = load_hf_checkpoint(tmp, dtype=dtype, device=args.device)
        setup_s = time.perf_counter() - t0
    size_bytes = sum(p.nbytes for p in ours.parameters()) + provider.nbytes()
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(1)).to(args.device)

    load_before = os.getloadavg()[0]
    results = compare({"ours": OursRunner(ours, args.device), "transformers": TransformersRunner(hf_model, args.device)}, prompt,
                      args.decode_tokens)
    (ours_prefill, ours_decode, ours_tokens), (hf_prefill, hf_decode, hf_tokens) = results["ours"], results["transformers"]
    load_after = os.getloadavg()[0]
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), len(ours_tokens))

    rows = {
        "prefill_tok_s": (args.prompt_tokens / ours_prefill, args.prompt_tokens / hf_prefill),
        "decode_tok_s": (args.decode_tokens / ours_decode, args.decode_tokens / hf_decode),
    }
    print(f"model: Qwen3-Next shape, {size_bytes / 1e9:.2f} GB {args.dtype} on {args.device}, "
          f"{CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_experts']} experts top-{CONFIG['num_experts_per_tok']}; threads={args.threads}; "
          f"setup {setup_s:.0f}s; 1-min load average {load_before:.1f} -> {load_after:.1f}")
    print(f"{'metric':<16}{'ours':>12}{'transformers':>14}{'ratio':>8}")
    for name, (a, b) in rows.items():
        print(f"{name:<16}{a:>12.2f}{b:>14.2f}{a / b:>8.2f}")
    print(f"greedy tokens identical for the first {same}/{args.decode_tokens} steps")
    result = {
        "model": {"family": "qwen3_next", "bytes": size_bytes, "dtype": args.dtype, "device": args.device,
                  "config": CONFIG},
        "threads": args.threads, "load_average_1min": [load_before, load_after], "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "ours": {"prefill_s": ours_prefill, "decode_s": ours_decode,
                 "prefill_tok_s": rows["prefill_tok_s"][0], "decode_tok_s": rows["decode_tok_s"][0]},
        "transformers": {"prefill_s": hf_prefill, "decode_s": hf_decode,
                         "prefill_tok_s": rows["prefill_tok_s"][1], "decode_tok_s": rows["decode_tok_s"][1]},
        "ratio": {k: a / b for k, (a, b) in rows.items()},
        "greedy_identical_steps": same,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
