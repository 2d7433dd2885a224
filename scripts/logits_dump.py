#!/usr/bin/env python3
"""Before/after evidence for refactors: dump every test family's logits, then compare two dumps bit for bit.

    python scripts/logits_dump.py make DIR          # checkpoints + packs of every test case (once)
    python scripts/logits_dump.py dump DIR OUT.pt   # logits of every pack x kernel mode x tier
    python scripts/logits_dump.py compare A.pt B.pt # exit 1 unless every tensor is bit-identical

``make`` writes, for every (family, variant) of tests/hf_models.py, the checkpoint and a float32 pack,
plus q4_k_m and q8_0 packs of the "quant" variants. ``dump`` opens each pack through ``Runtime``
(the public API a refactor must keep) in ``exact`` and ``fast`` modes, with the experts resident and
streamed, on 2 torch threads; it records the stateless logits of the prompt, the logits of a
chunked prefill (16-token chunks) and of 6 greedy one-token steps after it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def make(out_dir: Path) -> None:
    import hf_models
    from lean_qwenflash.store import pack

    out_dir.mkdir(parents=True, exist_ok=True)
    packs = []
    for family, variant in hf_models.ALL_CASES:
        model, _ = hf_models.make_hf_model(family, variant)
        ckpt = hf_models.save_checkpoint(model, str(out_dir / "ckpt" / f"{family}-{variant}"))
        presets = [None] + (["q4_k_m", "q8_0"] if variant == "quant" else [])
        for preset in presets:
            name = f"{family}-{variant}-{preset or 'f32'}"
            pack(ckpt, out_dir / "packs" / name, quant=preset, progress=False)
            packs.append(name)
        print("made", family, variant, flush=True)
    (out_dir / "packs.json").write_text(json.dumps(packs))


def dump(pack_dir: Path, out: Path) -> None:
    from lean_qwenflash.config import load_config
    from lean_qwenflash.generate.state import new_state
    from lean_qwenflash.runtime import Runtime

    torch.set_num_threads(2)
    result = {}
    for name in json.loads((pack_dir / "packs.json").read_text()):
        path = pack_dir / "packs" / name
        for mode in ("exact", "fast"):
            for resident in (True, False):
                cfg = load_config(model=str(path), expert_kernels=mode)
                with torch.inference_mode(), Runtime.open(cfg, resident_experts=resident) as rt:
                    model = rt.model
                    vocab = int(model.config["vocab_size"])
                    prompt = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(1234))
                    key = f"{name}/{mode}/{'resident' if resident else 'streamed'}"
                    result[key + "/full"] = model(prompt).clone()
                    state = new_state(model)
                    chunks = [model(prompt[:, i:i + 16], state, last_logits_only=True).clone()
                              for i in range(0, prompt.shape[1], 16)]
                    result[key + "/prefill"] = torch.cat(chunks, dim=1)
                    steps, token = [], chunks[-1][0, -1].argmax()
                    for _ in range(6):
                        logits = model(token.view(1, 1), state)
                        steps.append(logits.clone())
                        token = logits[0, -1].argmax()
                    result[key + "/decode"] = torch.cat(steps, dim=1)
        print("dumped", name, flush=True)
    torch.save(result, out)


def compare(a_path: Path, b_path: Path) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        if a[key].dtype != b[key].dtype or a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
            diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].shape == b[key].shape else "shape"
            print(f"DIFFERENT {key}: max|d| {diff}")
            bad.append(key)
    print(f"{len(set(a) & set(b))} tensors compared ({len(a)} vs {len(b)}); "
          f"{'all bit-identical' if not bad else f'{len(bad)} differ or are missing'}")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd = sys.argv[1:2]
    if cmd == ["make"] and len(sys.argv) == 3:
        make(Path(sys.argv[2]))
    elif cmd == ["dump"] and len(sys.argv) == 4:
        dump(Path(sys.argv[2]), Path(sys.argv[3]))
    elif cmd == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
