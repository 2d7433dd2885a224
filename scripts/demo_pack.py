#!/usr/bin/env python3
"""Main job until the default model ships: make a small random Qwen3-Next checkpoint, pack it,
open the pack and read every expert back, checking it against the checkpoint."""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lean_qwenflash.store import ExpertStore, pack  # noqa: E402
from lean_qwenflash.store.checkpoint import HFCheckpoint  # noqa: E402


def main() -> int:
    import transformers
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        torch.manual_seed(0)
        cfg = transformers.Qwen3NextConfig(
            vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
            shared_expert_intermediate_size=256, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4)
        transformers.Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d / "hf")
        print(f"made a random Qwen3-Next checkpoint in {d / 'hf'}")
        m = pack(d / "hf", d / "pack")
        print(f"packed: {len(m.layers)} MoE layers x {m.layers[0].num_experts} experts, "
              f"{m.experts_bytes / 2**20:.1f} MiB of expert records")
        ck = HFCheckpoint(d / "hf")
        with ExpertStore.open(d / "pack") as store:
            t0 = time.perf_counter()
            n = 0
            for layer in store.moe_layers:
                for e in range(store.layer(layer).num_experts):
                    got = store.read_expert(layer, e)
                    gu, down = ck.expert(layer, e)
                    assert torch.equal(got.gate_up, gu) and torch.equal(got.down, down), (layer, e)
                    n += 1
            dt = time.perf_counter() - t0
            print(f"read back {n} expert records with the {store.engine.kind} engine (O_DIRECT: {store.engine.direct}) "
                  f"in {dt * 1e3:.0f} ms: all bit-identical to the checkpoint, all checksums good")
    return 0


if __name__ == "__main__":
    sys.exit(main())
