"""Family-specific checkpoint shapes beyond the shared per-family tests (tests/test_models.py)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models  # noqa: E402
from lean_qwenflash.config import load_config  # noqa: E402
from lean_qwenflash.families import FamilyConfigError, family_for, moe_facts  # noqa: E402
from lean_qwenflash.generate import Generator, SamplingParams  # noqa: E402
from lean_qwenflash.runtime import Runtime  # noqa: E402
from lean_qwenflash.store import pack  # noqa: E402


def test_qwen3_5_multimodal_checkpoint_runs_its_text_model_and_says_it_skips_the_vision_tower(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (text under model.language_model., a vision
    tower, the config nested in text_config) packs to the text model: same logits and greedy
    tokens as transformers' multimodal model on text input; the pack's notes say what was skipped."""
    import transformers

    text_model = hf_models.case("qwen3_5_moe").hf_model
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text_model.config.to_dict(), vision_config=vision)
    cfg._attn_implementation = "eager"
    mm = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    # The same text weights as the CausalLM case (its router margins hold), under the nested names.
    missing, unexpected = mm.model.language_model.load_state_dict(
        {k[len("model."):]: v for k, v in text_model.state_dict().items() if k.startswith("model.")}, strict=False)
    assert not missing and not unexpected
    mm.lm_head.load_state_dict(text_model.lm_head.state_dict())
    src = tmp_path / "mm"
    mm.save_pretrained(src)
    assert "text_config" in json.loads((src / "config.json").read_text())
    out = tmp_path / "pack"
    manifest = pack(src, out, progress=False)
    assert any("model.visual." in n and "skipped" in n for n in manifest.notes), manifest.notes
    assert any("vision tower" in n for n in manifest.notes)
    prompt = hf_models.prompt_ids(96)
    with torch.no_grad():
        ref = mm(prompt).logits
        ref_tokens = mm.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, prompt.shape[1]:]
    with Runtime.open(load_config(model=str(out), host_cache_bytes="1MiB")) as rt:
        torch.testing.assert_close(rt.model(prompt), ref, rtol=1e-4, atol=1e-5)
        tokens = list(Generator(rt.model).generate(prompt[0].tolist(), SamplingParams(temperature=0), 16))
    assert tokens == ref_tokens.tolist()


def test_typed_config_errors_name_the_key():
    config = dict(hf_models.read_config(hf_models.case("qwen3_moe").path))
    assert moe_facts(config).top_k == 2
    for key, value, words in [("num_experts_per_tok", "two", "must be an integer"),
                              ("num_hidden_layers", 0, "must be >= 1"),
                              ("moe_intermediate_size", None, "missing")]:
        bad = dict(config, **{key: value})
        with pytest.raises(FamilyConfigError, match=f"'{key}'.*{words}"):
            moe_facts(bad)
    assert family_for({"model_type": "mixtral"}).name == "mixtral"


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_caches_the_latent_not_expanded_keys_and_values(family):
    from lean_qwenflash.generate import new_state
    from lean_qwenflash.loader import load_hf_checkpoint

    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    state = new_state(model)
    model(c.prompt, state)
    cfg = c.config
    r, dr = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    for layer in state.layers:
        assert layer.keys.shape[1] == 1 and layer.keys.shape[-1] == r        # one latent per token
        assert layer.values.shape[1] == 1 and layer.values.shape[-1] == dr   # one shared rope key per token
    per_token = sum((l.keys.shape[-1] + l.values.shape[-1]) * l.keys.element_size() for l in state.layers)
    expanded = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 4
    assert per_token == cfg["num_hidden_layers"] * (r + dr) * 4 < expanded
    # what the cache holds for these tokens, in bytes (its capacity grows by doubling)
    assert sum(l.keys[:, :, :l.num_tokens].nbytes + l.values[:, :, :l.num_tokens].nbytes
               for l in state.layers) == per_token * c.prompt.shape[1]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_long_prompt_matches_transformers(family):
    """1100 tokens (past the YaRN original context of 64 and the configured 256), prefilled in
    chunks through the latent cache, then decoded: transformers' logits."""
    from lean_qwenflash.generate import new_state
    from lean_qwenflash.loader import load_hf_checkpoint

    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    prompt = hf_models.prompt_ids(96, 1100, seed=7)
    with torch.no_grad():
        ref = c.hf_model(prompt).logits
    state = new_state(model)
    chunks = [model(prompt[:, a:min(a + 300, 1098)], state) for a in range(0, 1098, 300)]
    steps = [model(prompt[:, i:i + 1], state) for i in (1098, 1099)]
    ours = torch.cat(chunks + steps, dim=1)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_gpt_oss_sliding_window_cache_stays_bounded_and_long_prompts_match():
    """300 tokens through window-8 layers: transformers' logits, chunked and token by token, while
    the window layers never hold more than 8 tokens' keys (the full layers hold all of them)."""
    from lean_qwenflash.generate import KVCache, SlidingKVCache, new_state
    from lean_qwenflash.loader import load_hf_checkpoint

    c = hf_models.case("gpt_oss")
    model, _ = load_hf_checkpoint(c.path)
    prompt = hf_models.prompt_ids(96, 300, seed=11)
    with torch.no_grad():
        ref = c.hf_model(prompt).logits
    state = new_state(model)
    pieces = [model(prompt[:, a:a + 37], state) for a in range(0, 259, 37)]
    pieces += [model(prompt[:, i:i + 1], state) for i in range(259, 300)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), ref, rtol=1e-4, atol=1e-5)
    window = c.config["sliding_window"]
    kinds = [type(l) for l in state.layers]
    assert kinds == [SlidingKVCache, KVCache, SlidingKVCache, KVCache]
    for layer in state.layers:
        if isinstance(layer, SlidingKVCache):
            assert layer.keys.shape[2] == window and layer.num_tokens == 300
        else:
            assert layer.num_tokens == 300 and layer.keys.shape[2] >= 300
    snapshot = state.clone()            # prefix snapshots of a window layer stay bounded too
    assert snapshot.layers[0].nbytes() == state.layers[0].nbytes() < state.layers[1].nbytes() / 30


def test_gpt_oss_mxfp4_checkpoint_packs_exactly(tmp_path):
    """GPT-OSS checkpoints ship MXFP4 experts (``*_blocks`` / ``*_scales``): the packer keeps them
    as the mxfp4 encoding (byte for byte; tests/test_quant_types.py checks the bytes) and says so;
    widened to fp32 on request, the model computes what transformers computes with the dequantized
    weights."""
    import json as _json

    from safetensors.torch import save_file

    from lean_qwenflash.quant import mxfp4
    from lean_qwenflash.store import ExpertStore

    import copy

    c = hf_models.case("gpt_oss", "quant")
    model = copy.deepcopy(c.hf_model)           # the shared case stays as it was
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            linear = state.pop(key).transpose(1, 2).contiguous()          # [E, rows, cols], as the products
            blocks, scales = mxfp4.quantize(linear)
            state[key + "_blocks"], state[key + "_scales"] = blocks, scales
            # the reference: transformers with the dequantized weights
            model.get_parameter(key).copy_(mxfp4.dequantize(blocks, scales).transpose(1, 2))
    src = tmp_path / "mxfp4"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = dict(c.config, quantization_config={"quant_method": "mxfp4"})
    (src / "config.json").write_text(_json.dumps(config))
    out = tmp_path / "pack"
    manifest = pack(src, out, progress=False)
    assert any("mxfp4" in n and "byte for byte" in n for n in manifest.notes), manifest.notes
    with ExpertStore.open(out) as store:
        rec = store.read_expert(store.moe_layers[0], 1)
        blocks = state[f"model.layers.{store.moe_layers[0]}.mlp.experts.gate_up_proj_blocks"][1]
        scales = state[f"model.layers.{store.moe_layers[0]}.mlp.experts.gate_up_proj_scales"][1]
        want = mxfp4.dequantize(blocks, scales)
        assert rec.gate_up.encoding.name == "mxfp4"
        assert torch.equal(rec.gate_up.dequantize(), torch.cat((want[0::2], want[1::2])))
    # The same experts widened to fp32 (exact), run in fp32: transformers' logits.
    pack(src, tmp_path / "pack32", dtype="float32", progress=False)
    prompt = hf_models.prompt_ids(96)
    with torch.no_grad():
        ref = model(prompt).logits
    with Runtime.open(load_config(model=str(tmp_path / "pack32"), host_cache_bytes="8MiB")) as rt:
        torch.testing.assert_close(rt.model(prompt), ref, rtol=1e-4, atol=1e-5)
