"""Model runtime against transformers on tiny random checkpoints (fp32)."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_models
from lean_qwenflash.experts.provider import ExpertProvider, ExpertWeights, ResidentExperts
from lean_qwenflash.generate import Generator, SamplingParams, new_state
from lean_qwenflash.families import supported_architectures
from lean_qwenflash.loader import CheckpointError, build_model, load_hf_checkpoint
from lean_qwenflash.models import kernels
from lean_qwenflash.families import family_for, moe_facts
from lean_qwenflash.store import naming

RTOL, ATOL = 1e-4, 1e-5
CASE_IDS = [f"{f}-{v}" for f, v in hf_models.ALL_CASES]


@pytest.fixture(params=hf_models.ALL_CASES, ids=CASE_IDS)
def loaded(request):
    c = hf_models.case(*request.param)
    model, provider = load_hf_checkpoint(c.path)
    return c, model, provider


def test_logits_match_transformers(loaded):
    c, model, _ = loaded
    torch.testing.assert_close(model(c.prompt), c.hf_logits, rtol=RTOL, atol=ATOL)


# Gated-DeltaNet layers compute a prompt with the chunked delta rule and a step with the recurrent
# one: the same sums in another fp32 order, which reads up to ~1.3e-5 apart on logits of scale ~4
# on some CPUs (oneDNN's kernels differ by ISA); attention-only families stay within ATOL.
RECURRENT_ATOL = 3e-5


def test_full_equals_chunked_prefill_equals_decode(loaded):
    from lean_qwenflash.models.layers.deltanet import GatedDeltaNet
    c, model, _ = loaded
    atol = RECURRENT_ATOL if any(isinstance(m, GatedDeltaNet) for m in model.modules()) else ATOL
    full = model(c.prompt)
    state = new_state(model)
    chunks = [model(c.prompt[:, a:b], state) for a, b in ((0, 13), (13, 30), (30, 40))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=RTOL, atol=atol)
    state = new_state(model)
    steps = [model(c.prompt[:, i:i + 1], state) for i in range(c.prompt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=RTOL, atol=atol)
    assert state.num_tokens == c.prompt.shape[1]


def test_greedy_matches_transformers_generate(loaded):
    c, model, _ = loaded
    ours = list(Generator(model, prefill_chunk_tokens=16).generate(
        c.prompt[0].tolist(), SamplingParams(temperature=0), max_new_tokens=32))
    assert ours == c.hf_greedy(32)


def test_stacked_layout_loads_identically(loaded):
    c, model, provider = loaded
    stacked_model, stacked_provider = load_hf_checkpoint(c.stacked_path)
    assert torch.equal(stacked_model(c.prompt), model(c.prompt))
    for layer, experts in provider.layers.items():
        for a, b in zip(experts, stacked_provider.layers[layer]):
            assert torch.equal(a.gate_up, b.gate_up) and torch.equal(a.down, b.down)


def test_resident_keys_equal_checkpoint_keys(loaded):
    c, model, _ = loaded
    names = family_for(c.config).layout
    with safe_open(os.path.join(c.path, "model.safetensors"), "pt") as f:
        on_disk = {k for k in f.keys() if naming.parse_expert_key(names, k) is None}
    assert set(model.state_dict()) == on_disk


def test_build_model_from_resident_tensors(loaded):
    c, model, provider = loaded
    rebuilt = build_model(c.config, dict(model.state_dict()), provider)
    assert torch.equal(rebuilt(c.prompt), model(c.prompt))


class SlotProvider(ExpertProvider):
    """Stands in for a streaming provider: copies each acquired expert into a slot of one shared
    buffer (4096-byte aligned records, down right after gate_up) and records the calls."""

    def __init__(self, resident: ResidentExperts):
        self.resident = resident
        self.calls = []
        self.inputs = []
        self.buffer = torch.empty(1 << 20)

    def acquire(self, layer_idx, expert_ids):
        self.calls.append(("acquire", layer_idx, list(expert_ids)))
        out, offset = [], (-self.buffer.data_ptr() % 4096) // 4
        for w in self.resident.acquire(layer_idx, expert_ids):
            views = []
            for t in (w.gate_up, w.down):
                view = self.buffer[offset:offset + t.numel()].view(t.shape)
                view.copy_(t)
                views.append(view)
                offset += t.numel()
            out.append(ExpertWeights(*views))
            offset = (offset + 1023) // 1024 * 1024
        return out

    def release(self, layer_idx, expert_ids):
        self.calls.append(("release", layer_idx, list(expert_ids)))

    def layer_input(self, layer_idx, hidden_states):
        self.inputs.append(layer_idx)


@pytest.mark.parametrize("family", ["qwen3_next", "mixtral"])
def test_slot_provider_bit_identical_and_protocol(family):
    c = hf_models.case(family)
    model, resident = load_hf_checkpoint(c.path)
    moe_layers = list(moe_facts(c.config).moe_layers)
    for ids in (c.prompt, c.prompt[:, :1]):
        expected = model(ids)
        slots = SlotProvider(resident)
        model.set_expert_provider(slots)
        got = model(ids)
        model.set_expert_provider(resident)
        assert torch.equal(got, expected)
        assert slots.inputs == moe_layers
        acquires = [call for call in slots.calls if call[0] == "acquire"]
        assert [layer for _, layer, _ in acquires] == moe_layers
        for kind, layer, expert_ids in acquires:
            assert expert_ids == sorted(set(expert_ids))
            assert ("release", layer, expert_ids) in slots.calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_linear_equals_f_linear(two_threads_split_everything, dtype):
    torch.manual_seed(0)
    for rows, cols, bias, batch in ((64, 48, False, (1,)), (64, 48, True, (1, 1)), (63, 48, False, (1,)),
                                    (64, 48, False, (3,))):
        w = torch.randn(rows, cols, dtype=dtype)
        b = torch.randn(rows, dtype=dtype) if bias else None
        x = torch.randn(*batch, cols, dtype=dtype)
        got = kernels.linear(x, w, b)
        assert got.shape == batch + (rows,)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, F.linear(x, w, b), **tol)
    # A transposed (non-contiguous) weight takes the plain path and still gives the right answer.
    w = torch.randn(48, 64, dtype=dtype).t()
    torch.testing.assert_close(kernels.linear(torch.ones(1, 48, dtype=dtype), w), w.sum(dim=1)[None].to(dtype),
                               **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_moe", "mixtral", "olmoe"])
def test_two_thread_split_decode_matches_transformers(two_threads_split_everything, family):
    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    state = new_state(model)
    steps = [model(c.prompt[:, i:i + 1], state) for i in range(c.prompt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), c.hf_logits, rtol=RTOL, atol=ATOL)
    ours = list(Generator(model, prefill_chunk_tokens=16).generate(
        c.prompt[0].tolist(), SamplingParams(temperature=0), max_new_tokens=32))
    assert ours == c.hf_greedy(32)


def test_state_clone_is_an_independent_snapshot():
    c = hf_models.case("qwen3_next")
    model, _ = load_hf_checkpoint(c.path)
    state = new_state(model)
    model(c.prompt[:, :20], state)
    snapshot = state.clone()
    assert snapshot.num_tokens == 20
    a = model(c.prompt[:, 20:], state)
    b = model(c.prompt[:, 20:], snapshot)
    assert torch.equal(a, b)
    assert snapshot.num_tokens == state.num_tokens == 40


def _copy_checkpoint(c, tmp_path, edit_tensors=None, edit_config=None):
    dst = tmp_path / "ckpt"
    shutil.copytree(c.path, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _copy_checkpoint(hf_models.case("mixtral"), tmp_path,
                            edit_config=lambda cfg: cfg.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(path)
    assert "LlamaForCausalLM" in str(err.value)
    for arch in supported_architectures():
        assert arch in str(err.value)


def test_missing_resident_tensor_is_named(tmp_path):
    key = "model.layers.1.self_attn.k_proj.weight"
    path = _copy_checkpoint(hf_models.case("mixtral"), tmp_path, edit_tensors=lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing tensors: " + key.replace(".", r"\.")):
        load_hf_checkpoint(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = _copy_checkpoint(hf_models.case("mixtral"), tmp_path,
                            edit_tensors=lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.extra\.weight"):
        load_hf_checkpoint(path)


def test_missing_expert_is_named(tmp_path):
    key = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    path = _copy_checkpoint(hf_models.case("mixtral"), tmp_path, edit_tensors=lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        load_hf_checkpoint(path)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    key = "model.layers.0.linear_attn.A_log"
    path = _copy_checkpoint(hf_models.case("qwen3_next"), tmp_path,
                            edit_tensors=lambda t: t.update({key: torch.zeros(7)}))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(path)
    assert key in str(err.value) and "(7,)" in str(err.value) and "(4,)" in str(err.value)


def test_wrong_expert_shape_names_tensor_and_shapes(tmp_path):
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    path = _copy_checkpoint(hf_models.case("mixtral"), tmp_path,
                            edit_tensors=lambda t: t.update({key: torch.zeros(5, 48)}))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(path)
    assert key in str(err.value) and "(5, 48)" in str(err.value) and "(32, 48)" in str(err.value)


def test_qwen3_next_ignores_mtp_weights(tmp_path):
    c = hf_models.case("qwen3_next")
    path = _copy_checkpoint(c, tmp_path, edit_tensors=lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)}))
    model, _ = load_hf_checkpoint(path)
    torch.testing.assert_close(model(c.prompt), c.hf_logits, rtol=RTOL, atol=ATOL)


def test_qwen3_next_layer_types_from_interval_when_absent():
    from lean_qwenflash.families.qwen3_next import layer_types

    assert layer_types({"num_hidden_layers": 6, "full_attention_interval": 3}) == [
        "linear_attention", "linear_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        layer_types({"num_hidden_layers": 2, "layer_types": ["full_attention"]})


def test_every_registered_family_has_tiny_test_configs():
    from lean_qwenflash.families import FAMILIES

    for name, family in FAMILIES.items():
        assert name in hf_models.BASE and name in hf_models.VARIANTS, f"family {name} has no tiny test config"
        assert hf_models.BASE[name]["architectures"][0] in family.architectures
        assert {"base", "quant"} <= set(hf_models.VARIANTS[name])
