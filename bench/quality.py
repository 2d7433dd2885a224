#!/usr/bin/env python3
"""What each expert encoding costs in quality: perplexity and KL divergence vs the unquantized model.

For each model (a trained Hugging Face checkpoint directory) the script packs the unquantized
reference and one pack per --presets entry, then evaluates on held-out text: Python standard
library files that the built-in model's training script never trained on (the same seeded split
it uses, read with its own functions).

* exact kernels (dequantize exactly, torch matmul), full forward over --windows windows of
  --window-tokens tokens: perplexity, mean KL(reference || quantized) of next-token distributions,
  top-1 agreement with the reference;
* fast kernels (native decode, int8 activations): token by token over the first --fast-windows
  windows, KL(exact || fast) and KL(reference || fast) on the same positions.

Models: the built-in default model (hidden 128, expert width 64: only the 32-value block formats
q8_0 and q4_0 fit its rows; K-quants need 256 and fall back to float there, which the table says),
and a "check model" with 256-wide rows so every encoding applies: trained by
scripts/train_default_model.py with the arguments in CHECK_MODEL_ARGS (made on first use, ~15 min
on one core, kept in --check-dir).

Against llama.cpp (llama-cpp-python), on a random Qwen3-MoE-shaped model (256-wide rows, f32): the
f32 checkpoint is exported to GGUF and quantized by llama.cpp's own quantizer (Q8_0, Q6_K,
Q4_K_M); llama.cpp's quantized-vs-f32 KL (its compute quantizes activations too; f32 KV cache) is
set beside ours for the same presets made by our quantizer from the same f32 weights: exact vs
f32, fast vs exact, fast vs f32. The issue's bar: our fast-vs-exact KL <= llama.cpp's
quantized-vs-f32 KL. Prints the tables, writes JSON to --out and, with --markdown, the tables to
that file (docs/QUALITY.md is made this way; "## " sections already there that it does not write,
such as "## KV cache", are kept).

``--kv-cache`` measures the KV cache encodings instead (kv_cache_dtype q8_0 / q4_0 vs f32, weights
unchanged) on the built-in default model, fast kernels: over --kv-windows held-out windows of
--kv-tokens tokens, every position's next-token distribution (KL vs the f32 cache, top-1
agreement, perplexity) when the window is prefilled in chunks of --kv-chunk tokens (the blocked
attention) and, on the first window, fed one token per step (the native decode kernel); and a
greedy run (the window's first half as prompt, --kv-greedy tokens generated) compared token for
token with the f32 cache's. ``--kv-markdown FILE`` writes that table as the "## KV cache" section
of FILE (replacing only that section).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402

from lean_qwenflash.chat import Tokenizer  # noqa: E402
from lean_qwenflash.config import load_config  # noqa: E402
from lean_qwenflash.generate.state import new_state  # noqa: E402
from lean_qwenflash.runtime import DEFAULT_MODEL_DIR, Runtime  # noqa: E402
from lean_qwenflash.store import ExpertStore, pack  # noqa: E402

CHECK_MODEL_ARGS = ["--hidden-size", "256", "--moe-intermediate-size", "256", "--shared-expert-intermediate-size",
                    "256", "--num-experts", "16", "--top-k", "2", "--num-layers", "4", "--max-minutes", "14",
                    "--threads", "1", "--num-dialogues", "8000", "--seed", "0"]


def training_script():
    spec = importlib.util.spec_from_file_location("train_default_model", REPO / "scripts" / "train_default_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def held_out_windows(tokenizer: Tokenizer, num: int, tokens: int) -> torch.Tensor:
    """[num, tokens] windows of held-out stdlib code (the training script's split, seed 0)."""
    train = training_script()
    files = train.stdlib_files(0)
    held = train.read_code(files[:max(4, len(files) // 20)], 300_000, 30_000)
    ids = []
    for text in held:
        ids += tokenizer.encode(text)
        if len(ids) >= num * tokens:
            break
    if len(ids) < num * tokens:
        raise SystemExit(f"held-out text gives only {len(ids)} tokens; lower --windows or --window-tokens")
    return torch.tensor(ids[:num * tokens]).view(num, tokens)


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def nll(logits: torch.Tensor, windows: torch.Tensor) -> float:
    logp = logits[:, :-1].double().log_softmax(-1)
    return float(-logp.gather(-1, windows[:, 1:, None]).mean())


def evaluate(pack_dir: Path, windows: torch.Tensor, fast_windows: int) -> dict:
    out = {}
    with Runtime.open(load_config(model=str(pack_dir), expert_kernels="exact"), resident_experts=True) as rt:
        out["exact"] = torch.cat([rt.model(w[None]) for w in windows])
        steps = {}
        for mode in ("exact", "fast"):
            rt.model.set_policy(rt.model.policy.with_kernels(mode))
            rows = []
            for w in windows[:fast_windows]:
                state = new_state(rt.model)
                rows.append(torch.cat([rt.model(w[None, i:i + 1], state) for i in range(w.numel())], dim=1))
            steps[mode] = torch.cat(rows)
        out["steps_exact"], out["steps_fast"] = steps["exact"], steps["fast"]
        with ExpertStore.open(pack_dir) as store:
            out["experts_bytes"] = store.manifest.experts_bytes
            out["encodings"] = sorted({t.encoding for l in store.manifest.layers for t in l.tensors})
            out["notes"] = store.manifest.notes
    return out


LLAMA_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def llama_logits(path: Path, ids: list) -> torch.Tensor:
    import numpy as np
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=len(ids), n_threads=2, logits_all=True,
                          type_k=0, type_v=0, verbose=False)
    llm.eval(ids)
    out = torch.tensor(np.array(llm.scores[:len(ids)]))
    llm.close()
    return out


def versus_llama(tmp: Path, tokens: int) -> list:
    """Rows of the llama.cpp comparison (see the module docstring)."""
    import random
    import llama_cpp
    sys.path.insert(0, str(REPO / "bench"))
    from peer import build_checkpoint
    from lean_qwenflash.store.gguf_export import export_gguf
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
              "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
              "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    ckpt = tmp / "llama-ckpt"
    build_checkpoint(ckpt, config, seed=3, dtype=torch.float32)
    f32 = export_gguf(ckpt, tmp / "f32.gguf", "f32")
    rng = random.Random(0)
    ids = [rng.randrange(259, config["vocab_size"]) for _ in range(tokens)]
    windows = torch.tensor([ids])
    ll_f32 = llama_logits(f32, ids)
    ref_dir = tmp / "llama-ref"
    pack(ckpt, ref_dir, progress=False)
    ours_ref = evaluate(ref_dir, windows, 1)
    rows = [{"preset": "f32", "llama_vs_f32": 0.0, "ours_f32_vs_llama_f32": kl(ll_f32, ours_ref["exact"][0]),
             "exact_vs_f32": 0.0, "fast_vs_exact": kl(ours_ref["steps_exact"], ours_ref["steps_fast"]),
             "fast_vs_f32": kl(ours_ref["steps_exact"], ours_ref["steps_fast"])}]
    for preset, ftype in LLAMA_FTYPES.items():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.nthread = 2
        q = tmp / f"{preset}.gguf"
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(q).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize to {preset}")
        ll_q = llama_logits(q, ids)
        d = tmp / f"llama-{preset}"
        pack(ckpt, d, quant=preset, progress=False)
        r = evaluate(d, windows, 1)
        rows.append({"preset": preset, "llama_vs_f32": kl(ll_f32, ll_q),
                     "llama_top1": float((ll_f32.argmax(-1) == ll_q.argmax(-1)).float().mean()),
                     "exact_vs_f32": kl(ours_ref["steps_exact"], r["steps_exact"]),
                     "fast_vs_exact": kl(r["steps_exact"], r["steps_fast"]),
                     "fast_vs_f32": kl(ours_ref["steps_exact"], r["steps_fast"]),
                     "fast_top1": float((ours_ref["steps_exact"].argmax(-1) == r["steps_fast"].argmax(-1)).float().mean())})
        print(f"  vs llama.cpp {preset}: llama {rows[-1]['llama_vs_f32']:.2e}, ours fast-vs-exact "
              f"{rows[-1]['fast_vs_exact']:.2e}", file=sys.stderr)
    return rows


KV_SECTION = "## KV cache"


def kv_cache_quality(args) -> int:
    """The --kv-cache table (see the module docstring)."""
    import hashlib

    from lean_qwenflash.generate import Generator, SamplingParams

    hf_dir = DEFAULT_MODEL_DIR
    digest = hashlib.sha256((hf_dir / "model.safetensors").read_bytes()).hexdigest()
    tokenizer = Tokenizer.from_dir(hf_dir)
    windows = held_out_windows(tokenizer, args.kv_windows, args.kv_tokens)
    half = args.kv_tokens // 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        pack_dir = Path(tmp) / "pack"
        pack(hf_dir, pack_dir, progress=False)
        for dtype in ("f32", "q8_0", "q4_0"):
            t0 = time.time()
            cfg = load_config(model=str(pack_dir), kv_cache_dtype=dtype)
            with Runtime.open(cfg, resident_experts=True) as rt, torch.inference_mode():
                model = rt.model
                chunked = []
                for w in windows:
                    state = new_state(model)
                    chunked.append(torch.cat([model(w[None, i:i + args.kv_chunk], state)
                                              for i in range(0, w.numel(), args.kv_chunk)], dim=1))
                state = new_state(model)
                steps = torch.cat([model(windows[0][None, i:i + 1], state) for i in range(windows.shape[1])], dim=1)
                gen = Generator(model, args.kv_chunk)
                greedy = list(gen.start(windows[0][:half].tolist(), SamplingParams(temperature=0.0), args.kv_greedy))
            results[dtype] = {"chunked": torch.cat(chunked), "steps": steps, "greedy": greedy}
            print(f"  kv {dtype}: {time.time() - t0:.0f} s", file=sys.stderr)
    ref = results["f32"]
    rows = []
    for dtype, r in results.items():
        same = [a == b for a, b in zip(ref["greedy"], r["greedy"])]
        first = same.index(False) if False in same else len(same)
        rows.append({"kv_cache_dtype": dtype, "bytes_per_value": {"f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}[dtype],
                     "ppl_chunked": float(torch.tensor(nll(r["chunked"], windows)).exp()),
                     "kl_chunked": kl(ref["chunked"], r["chunked"]),
                     "top1_chunked": float((ref["chunked"].argmax(-1) == r["chunked"].argmax(-1)).float().mean()),
                     "kl_steps": kl(ref["steps"], r["steps"]),
                     "top1_steps": float((ref["steps"].argmax(-1) == r["steps"].argmax(-1)).float().mean()),
                     "greedy_same_first": first, "greedy_same_share": sum(same) / max(1, len(same)),
                     "greedy_tokens": len(r["greedy"])})
    positions = windows.numel()
    lines = [KV_SECTION, "",
             f"Made by `python bench/quality.py --kv-cache --kv-markdown docs/QUALITY.md`: the built-in default model "
             f"(model.safetensors sha256 {digest[:16]}), fast kernels, its weights unchanged; only "
             f"`kv_cache_dtype` differs. Held-out text as above: {args.kv_windows} windows x {args.kv_tokens} tokens "
             f"({positions} positions) prefilled in chunks of {args.kv_chunk} (the blocked attention: every key, "
             f"the chunk's own included, read back from the quantized cache), and the first window's "
             f"{args.kv_tokens} positions fed one token per step (the native decode kernel). Greedy: the first "
             f"window's first {half} tokens as the prompt, {args.kv_greedy} tokens generated, compared token for "
             f"token with the f32 cache's run. KL in nats/token vs the f32 cache.", "",
             "| KV cache | bytes / value | perplexity (chunked) | KL chunked | top-1 = f32 chunked "
             "| KL per-token steps | top-1 = f32 steps | greedy: same tokens | greedy: first difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = "none" if r["greedy_same_first"] == r["greedy_tokens"] else f"token {r['greedy_same_first']}"
        lines.append(f"| {r['kv_cache_dtype']} | {r['bytes_per_value']:.3f} | {r['ppl_chunked']:.3f} "
                     f"| {r['kl_chunked']:.2e} | {100 * r['top1_chunked']:.1f}% | {r['kl_steps']:.2e} "
                     f"| {100 * r['top1_steps']:.1f}% | {100 * r['greedy_same_share']:.1f}% of {r['greedy_tokens']} "
                     f"| {first} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model_sha256": digest, "windows": args.kv_windows, "tokens": args.kv_tokens,
                               "chunk": args.kv_chunk, "rows": rows}, indent=1))
    if args.kv_markdown:
        replace_section(Path(args.kv_markdown), KV_SECTION, table)
    print(f"wrote {out}")
    return 0


def replace_section(path: Path, heading: str, text: str) -> None:
    """Put ``text`` (which starts with ``heading``) in ``path`` in place of the section under that
    heading (up to the next heading of the same level), or at the end if there is none."""
    old = path.read_text() if path.is_file() else ""
    lines = old.splitlines()
    level = heading.split(" ")[0] + " "
    try:
        start = lines.index(heading)
    except ValueError:
        body = old.rstrip("\n")
        path.write_text((body + "\n\n" if body else "") + text + "\n")
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    new = lines[:start] + text.splitlines() + ([""] + lines[end:] if end < len(lines) else [])
    path.write_text("\n".join(new) + "\n")


def kept_sections(path: Path, table: str) -> str:
    """The "## " sections of ``path`` that ``table`` does not write ("" if none): --markdown rewrites
    the file but keeps the sections made elsewhere (the KV cache table, the built-in model's context)."""
    if not path.is_file():
        return ""
    own = {line for line in table.splitlines() if line.startswith("## ")}
    kept, keep = [], False
    for line in path.read_text().splitlines():
        if line.startswith("## ") or line.startswith("# "):
            keep = line.startswith("## ") and line not in own
        if keep:
            kept.append(line)
    return "\n".join(kept).rstrip("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="q8_0,q6_k,q5_k_m,q5_k,q4_k_m,q4_k,q4_0")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window-tokens", type=int, default=256)
    ap.add_argument("--fast-windows", type=int, default=2)
    ap.add_argument("--check-dir", default=str(REPO / "bench" / "results" / "check_model"),
                    help="the 256-wide check model (trained here if missing)")
    ap.add_argument("--no-check-model", action="store_true", help="only the built-in default model")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp comparison")
    ap.add_argument("--llama-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "quality.json"))
    ap.add_argument("--markdown", help="also write the table as markdown to this file")
    ap.add_argument("--kv-cache", action="store_true", help="measure the KV cache encodings instead (see above)")
    ap.add_argument("--kv-windows", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=2048)
    ap.add_argument("--kv-chunk", type=int, default=256)
    ap.add_argument("--kv-greedy", type=int, default=256)
    ap.add_argument("--kv-markdown", help="write the KV cache table as the '## KV cache' section of this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.kv_cache:
        if args.out == str(REPO / "bench" / "results" / "quality.json"):
            args.out = str(REPO / "bench" / "results" / "quality_kv_cache.json")
        return kv_cache_quality(args)

    models = {"default model (H 128, I 64)": DEFAULT_MODEL_DIR}
    if not args.no_check_model:
        check = Path(args.check_dir)
        if not (check / "config.json").is_file():
            print(f"training the check model into {check} (~15 min) ...", file=sys.stderr)
            subprocess.run([sys.executable, str(REPO / "scripts" / "train_default_model.py"), *CHECK_MODEL_ARGS,
                            "--out", str(check)], check=True)
        models["check model (H 256, I 256)"] = check

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, hf_dir in models.items():
            tokenizer = Tokenizer.from_dir(hf_dir)
            windows = held_out_windows(tokenizer, args.windows, args.window_tokens)
            t0 = time.time()
            ref_dir = Path(tmp) / f"{len(results)}-ref"
            pack(hf_dir, ref_dir, progress=False)
            ref = evaluate(ref_dir, windows, args.fast_windows)
            ref_nll = nll(ref["exact"], windows)
            results.append({"model": label, "preset": "f32 (reference)", "encodings": ref["encodings"],
                            "experts_bytes": ref["experts_bytes"], "ppl": float(torch.tensor(ref_nll).exp()),
                            "kl": 0.0, "top1": 1.0, "kl_fast_vs_exact": kl(ref["steps_exact"], ref["steps_fast"]),
                            "kl_exact_vs_ref_fast_windows": 0.0,
                            "kl_fast_vs_ref": kl(ref["steps_exact"], ref["steps_fast"]), "notes": []})
            for preset in args.presets.split(","):
                d = Path(tmp) / f"{len(results)}-{preset}"
                pack(hf_dir, d, quant=preset, progress=False)
                r = evaluate(d, windows, args.fast_windows)
                results.append({
                    "model": label, "preset": preset, "encodings": r["encodings"], "experts_bytes": r["experts_bytes"],
                    "ppl": float(torch.tensor(nll(r["exact"], windows)).exp()), "kl": kl(ref["exact"], r["exact"]),
                    "top1": float((ref["exact"].argmax(-1) == r["exact"].argmax(-1)).float().mean()),
                    "kl_fast_vs_exact": kl(r["steps_exact"], r["steps_fast"]),
                    "kl_exact_vs_ref_fast_windows": kl(ref["steps_exact"], r["steps_exact"]),
                    "kl_fast_vs_ref": kl(ref["steps_exact"], r["steps_fast"]), "notes": r["notes"]})
                print(f"  {label} {preset}: ppl {results[-1]['ppl']:.3f} kl {results[-1]['kl']:.2e}", file=sys.stderr)
            print(f"  {label}: {time.time() - t0:.0f} s", file=sys.stderr)
        llama_rows = [] if args.no_llama else versus_llama(Path(tmp), args.llama_tokens)

    lines = [f"Held-out text: {args.windows} windows x {args.window_tokens} tokens of Python stdlib source the models "
             f"never trained on. Exact kernels over all windows; fast kernels (int8 activations) token by token "
             f"over the first {args.fast_windows} windows. KL in nats/token, vs the f32 reference unless noted.", "",
             "| model | preset | stored encodings | experts MiB | perplexity | KL vs f32 | top-1 = f32 "
             "| fast windows: exact vs f32 | fast vs exact | fast vs f32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['preset']} | {', '.join(r['encodings'])} | {r['experts_bytes'] / 2**20:.2f} "
                     f"| {r['ppl']:.3f} | {r['kl']:.2e} | {100 * r['top1']:.1f}% | {r['kl_exact_vs_ref_fast_windows']:.2e} "
                     f"| {r['kl_fast_vs_exact']:.2e} | {r['kl_fast_vs_ref']:.2e} |")
    if llama_rows:
        lines += ["", f"Against llama.cpp on a random Qwen3-MoE-shaped model (4 layers, 16 experts top-4, hidden 512, "
                  f"expert width 256, f32), {args.llama_tokens} random prompt tokens. llama.cpp: its quantizer, its "
                  "compute (activations quantized), f32 KV cache. Ours: our quantizer on the same f32 weights. "
                  "KL in nats/token.", "",
                  "| preset | llama.cpp quantized vs f32 | ours exact vs f32 | ours fast vs exact | ours fast vs f32 "
                  "| fast vs exact <= llama.cpp? |", "|---|---|---|---|---|---|"]
        for r in llama_rows[1:]:
            lines.append(f"| {r['preset']} | {r['llama_vs_f32']:.2e} | {r['exact_vs_f32']:.2e} | {r['fast_vs_exact']:.2e} "
                         f"| {r['fast_vs_f32']:.2e} | {'yes' if r['fast_vs_exact'] <= r['llama_vs_f32'] else 'NO'} |")
        lines.append(f"\n(f32: ours exact vs llama.cpp f32, same weights: KL {llama_rows[0]['ours_f32_vs_llama_f32']:.2e}.)")
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"models": results, "versus_llama": llama_rows}, indent=1))
    if args.markdown:
        kept = kept_sections(Path(args.markdown), table)
        Path(args.markdown).write_text(table + "\n" + ("\n" + kept + "\n" if kept else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
