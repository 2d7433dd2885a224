#!/usr/bin/env python3
"""Needle in a haystack: does a model use its whole context?

A passcode (five random digits) is stated once, at a chosen depth, inside held-out Python standard
library source (files the built-in model's training script never trained on: its own seeded split,
read with its own functions), and asked for at the end, in the phrasing of the script's retrieval
task (NEEDLE / NEEDLE_QUESTION). The model runs through our runtime (Runtime + Generator, prefill
in chunks, greedy); a needle counts as retrieved when the generated text starts with the passcode.
The control runs the same haystacks without the needle: the model cannot know the passcode, so
it measures chance (1 in 90000 per guess) and shows the needle is what the answers come from.

Prints a table (context x depth) and writes JSON to --out. Default: the built-in model at 4k,
16k and 32k tokens, depths 10/30/50/70/90%, 4 needles per cell:

    python bench/needle.py
    python bench/needle.py --model /tmp/stage3 --contexts 4096,16384 --needles 2
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lean_qwenflash.config import load_config  # noqa: E402
from lean_qwenflash.generate.generator import Generator  # noqa: E402
from lean_qwenflash.generate.sampling import SamplingParams  # noqa: E402
from lean_qwenflash.runtime import DEFAULT_MODEL_DIR, Runtime  # noqa: E402


def training_script():
    spec = importlib.util.spec_from_file_location("train_default_model", REPO / "scripts" / "train_default_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TRAIN = training_script()


def filler_ids(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """At least ``num_tokens`` token ids of held-out stdlib source, file after file."""
    files = TRAIN.stdlib_files(seed)
    held = files[:max(4, len(files) // 20)]
    ids: list[int] = []
    for text in TRAIN.read_code(held, 10**9, 30_000):
        ids += tokenizer.encode(text + "\n")
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise SystemExit(f"the held-out stdlib files give only {len(ids)} tokens; ask for a shorter context")
    return ids


def haystack(tokenizer, filler: list[int], context: int, depth: float, code: str,
             with_needle: bool = True, offset: int = 0) -> list[int]:
    """A prompt of exactly ``context`` tokens: filler (from ``offset``) with the needle at the
    line start nearest ``depth`` (0 = start, 1 = just before the question), then the question."""
    needle = tokenizer.encode(TRAIN.NEEDLE.format(code=code)) if with_needle else []
    question = tokenizer.encode(TRAIN.NEEDLE_QUESTION)
    n_fill = context - len(needle) - len(question)
    fill = (filler[offset:] + filler[:offset])[:n_fill]
    newline = {i for i in range(len(fill) - 1) if tokenizer.decode([fill[i]]).endswith("\n")}
    target = int(depth * n_fill)
    p = min((i + 1 for i in newline), key=lambda i: abs(i - target), default=0)
    return fill[:p] + needle + fill[p:] + question


def retrieve(rt, prompt: list[int], code: str) -> tuple[bool, str]:
    """Greedy answer through the runtime; (starts with the passcode, the text)."""
    out = list(Generator(rt.model).generate(prompt, SamplingParams(temperature=0.0), 6))
    text = rt.tokenizer.decode(out)
    return text.strip().startswith(code), text


def open_runtime(model_dir: Path, tmp: Path, cfg_path=None):
    """A Runtime on a pack of the checkpoint in model_dir (packed into tmp)."""
    from lean_qwenflash.store.packer import pack
    pack_dir = tmp / "pack"
    pack(model_dir, pack_dir, progress=False, force=True)
    return Runtime.open(load_config(cfg_path, model=str(pack_dir)))


def run(rt, contexts, depths, needles: int, seed: int, log=print, save=lambda res: None) -> dict:
    tok = rt.tokenizer
    filler = filler_ids(tok, max(contexts))
    rng = random.Random(seed)
    cells, control = [], []
    for context in contexts:
        for depth in depths:
            hits, answers, t0 = 0, [], time.time()
            for i in range(needles):
                code = TRAIN.passcode(rng)
                prompt = haystack(tok, filler, context, depth, code, offset=rng.randrange(len(filler)))
                ok, text = retrieve(rt, prompt, code)
                hits += ok
                answers.append({"passcode": code, "answer": text})
            cells.append({"context": context, "depth": depth, "needles": needles, "retrieved": hits / needles,
                          "seconds_per_needle": (time.time() - t0) / needles, "answers": answers})
            log(f"context {context:6d} depth {depth:.0%}: {hits}/{needles} "
                f"({cells[-1]['seconds_per_needle']:.1f} s each) {[a['answer'] for a in answers]!r} "
                f"for {[a['passcode'] for a in answers]}")
            save({"cells": cells, "control": control})
        hits = 0
        for i in range(needles):
            code = TRAIN.passcode(rng)
            ok, text = retrieve(rt, haystack(tok, filler, context, 0.5, code, with_needle=False,
                                             offset=rng.randrange(len(filler))), code)
            hits += ok
        control.append({"context": context, "needles": needles, "retrieved": hits / needles})
        log(f"context {context:6d} without the needle: {hits}/{needles}")
        save({"cells": cells, "control": control})
    return {"cells": cells, "control": control}


def table(res: dict, depths) -> str:
    contexts = sorted({c["context"] for c in res["cells"]})
    lines = ["| context | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | all depths | without the needle |",
             "|---|" + "---|" * (len(depths) + 2)]
    for ctx in contexts:
        row = [c for c in res["cells"] if c["context"] == ctx]
        total = sum(c["retrieved"] * c["needles"] for c in row) / sum(c["needles"] for c in row)
        ctrl = next(c for c in res["control"] if c["context"] == ctx)
        lines.append(f"| {ctx} | " + " | ".join(f"{c['retrieved']:.0%}" for c in row)
                     + f" | {total:.0%} | {ctrl['retrieved']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="Hugging Face checkpoint directory")
    ap.add_argument("--contexts", default="4096,16384,32768", help="prompt lengths in tokens")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle positions (share of the filler)")
    ap.add_argument("--needles", type=int, default=4, help="needles per (context, depth) cell and controls per context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="runtime config YAML (default: the defaults)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "needle.json"))
    args = ap.parse_args()
    contexts = [int(v) for v in args.contexts.split(",")]
    depths = [float(v) for v in args.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        with open_runtime(Path(args.model), Path(tmp), args.config) as rt:
            limit = int(rt.store.config.get("max_position_embeddings") or 0)
            if limit and max(contexts) > limit:
                raise SystemExit(f"--contexts goes to {max(contexts)} tokens but the model's context is {limit}")
            t0 = time.time()
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)

            def save(res, done=False):      # after every cell: a long run stopped early keeps its cells
                res = dict(res, model=str(args.model), contexts=contexts, depths=depths, seed=args.seed,
                           max_position_embeddings=limit, seconds=round(time.time() - t0, 1), complete=done)
                out.write_text(json.dumps(res, indent=2))
            res = run(rt, contexts, depths, args.needles, args.seed, save=save)
            save(res, done=True)
    print()
    print(table(res, depths))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
