"""The fused one-token mixer sub-blocks: attention (``AttentionStep``, csrc/decode_step.cpp), one
native call that must give the bits of the separate fast-mode calls it replaces, where it runs and
where it must not; Gated DeltaNet (``DeltaNetStep``, csrc/deltanet.cpp), which must follow the
separate calls to fp32 rounding, output and recurrent state, step after step."""
import pytest
import torch

from lean_qwenflash.config import load_config
from lean_qwenflash.generate.state import new_state
from lean_qwenflash.models import base, native
from lean_qwenflash.generate.state import DeltaNetState
from lean_qwenflash.models.layers import attention, deltanet
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.store import pack

hf_models = pytest.importorskip("hf_models")
pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")

# Families whose full-attention layers the fused step covers; the others keep the separate calls
# (OLMoE: norms over the whole projection and clipping; AfMoE: a gate projection; DeepSeek: MLA).
FUSED = ["qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "glm4_moe", "gpt_oss"]
SEPARATE = ["olmoe", "afmoe", "deepseek_v3"]
# Qwen3-Next's output gate: sigmoid in C++ vs torch's vectorised one may differ in the last bit.
GATED = {"qwen3_next", "qwen3_5_moe"}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_step")
    made = {}

    def get(family, quant="q4_k_m"):
        if (family, quant) not in made:
            model, _ = hf_models.make_hf_model(family, "quant")
            ckpt = root / f"ckpt-{family}"
            if not ckpt.is_dir():
                hf_models.save_checkpoint(model, str(ckpt))
            made[family, quant] = root / f"pack-{family}-{quant}"
            pack(ckpt, made[family, quant], quant=quant, progress=False)
        return made[family, quant]
    return get


def _decode(model, prompt_len: int, steps: int, fused: bool, monkeypatch, calls: list):
    vocab = int(model.config["vocab_size"])
    real = attention.AttentionStep.__call__

    def counted(self, *a):
        out = real(self, *a)
        calls.append(out is not None)
        return out
    with monkeypatch.context() as m:
        m.setattr(attention.AttentionStep, "__call__", counted)
        # (the DeltaNet step is not bit-equal, and a last-bit change can flip a routing choice:
        # it has its own test below)
        m.setattr(deltanet.DeltaNetStep, "build", classmethod(lambda cls, net, norm: None))
        if not fused:
            m.setattr(base.DecoderLayer, "mixer_step", lambda self: None)
        state = new_state(model)
        model(torch.arange(prompt_len).view(1, -1) * 7 % vocab, state, last_logits_only=True)
        return torch.stack([model(torch.tensor([[(5 * i + 3) % vocab]]), state)[0, -1] for i in range(steps)])


@pytest.mark.parametrize("family", FUSED + SEPARATE)
def test_fused_attention_step_gives_the_separate_calls_bits(family, packs, monkeypatch):
    """60 prompt tokens, then 10 decode steps: past the cache's first capacity (64 rows), so the
    fused step also writes into a cache that has just grown."""
    with Runtime.open(load_config(model=str(packs(family)), dtype="float32", expert_kernels="fast"),
                      resident_experts=True) as rt, torch.inference_mode():
        calls = []
        fused = _decode(rt.model, 60, 10, True, monkeypatch, calls)
        separate = _decode(rt.model, 60, 10, False, monkeypatch, [])
    if family in SEPARATE:
        assert not any(calls)
        assert torch.equal(fused, separate)
        return
    full = sum(t != "linear_attention" for t in rt.model.layer_types)
    assert sum(calls) >= 10 * (full if family != "gpt_oss" else 1), calls    # (GPT-OSS: its full layers only)
    if family in GATED:
        torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(fused, separate)


def test_exact_mode_and_other_caches_keep_the_separate_calls(packs, monkeypatch):
    path = str(packs("qwen3_moe"))
    for cfg in (load_config(model=path, dtype="float32", expert_kernels="exact"),
                load_config(model=path, dtype="float32", expert_kernels="fast", kv_cache_dtype="q8_0")):
        with Runtime.open(cfg, resident_experts=True) as rt, torch.inference_mode():
            calls = []
            _decode(rt.model, 8, 3, True, monkeypatch, calls)
            assert not any(calls)
            assert all(layer.mixer_step() is None for layer in rt.model._layers)


def test_a_policy_change_rebuilds_the_step(packs):
    with Runtime.open(load_config(model=str(packs("qwen3_moe")), dtype="float32", expert_kernels="fast"),
                      resident_experts=True) as rt:
        layer = rt.model._layers[0]
        step = layer.mixer_step()
        assert step is not None and layer.mixer_step() is step
        rt.model.set_policy(rt.model.policy.with_kernels("exact"))
        assert layer.mixer_step() is None
        rt.model.set_policy(rt.model.policy.with_kernels("fast"))
        assert layer.mixer_step() not in (None, step)


def test_native_step_refuses_shapes_that_do_not_fit():
    w = torch.zeros(64, 64)
    norm = torch.ones(64)
    args = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, gated=False, in_norm=norm.data_ptr(), in_norm_mode=1,
                in_eps=1e-6, w=[w.data_ptr()] * 4, enc=[0] * 4, rows=[64, 32, 32, 64], bias=[0] * 4,
                q_norm=0, k_norm=0, qk_mode=1, qk_eps=1e-6, scale=0.25, sinks=0)
    step = native._K.AttentionStep(**args)
    x, out = torch.randn(64), torch.empty(64)
    cache = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="row counts do not fit"):
        native._K.AttentionStep(**dict(args, rows=[64, 64, 32, 64])).run(
            x.data_ptr(), 0, 0, 0, cache.data_ptr(), cache.data_ptr(), 128, 16, 0, out.data_ptr(), 1)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        step.run(x.data_ptr(), 3, x.data_ptr(), x.data_ptr(), cache.data_ptr(), cache.data_ptr(), 128, 16, 0,
                 out.data_ptr(), 1)
    with pytest.raises(ValueError, match="q and k norms come together"):
        native._K.AttentionStep(**dict(args, q_norm=norm.data_ptr()))


def _deltanet_layers(model):
    return [layer for layer in model._layers if isinstance(layer._blocks[0], deltanet.GatedDeltaNet)]


@pytest.mark.parametrize("quant", ["q4_k_m", None])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_fused_deltanet_step_follows_the_separate_calls(family, quant, packs, monkeypatch):
    """Every DeltaNet layer (Qwen3-Next's grouped projections, Qwen3.5's flat ones; q4_k_m and fp32
    weights): from a fresh state and after a prompt, four steps of the native sub-block give the
    output, conv window and recurrent state of the separate calls to fp32 rounding; and a model's
    decode takes it in every DeltaNet layer."""
    torch.manual_seed(0)
    with Runtime.open(load_config(model=str(packs(family, quant)), dtype="float32", expert_kernels="fast"),
                      resident_experts=True) as rt, torch.inference_mode():
        layers = _deltanet_layers(rt.model)
        assert layers
        for layer in layers:
            step, net, norm = layer.mixer_step(), layer._blocks[0], layer.input_layernorm
            assert isinstance(step, deltanet.DeltaNetStep)
            hidden = net.out_proj.out_features
            for prompt in (0, 5):
                fused, separate = DeltaNetState(), DeltaNetState()
                if prompt:
                    x = torch.randn(1, prompt, hidden)
                    net(norm(x), None, fused)
                    net(norm(x), None, separate)
                for _ in range(4):
                    x = torch.randn(1, 1, hidden)
                    want = x + net(norm(x), None, separate)
                    got = step(x, None, fused)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(fused.recurrent, separate.recurrent, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(fused.conv, separate.conv, rtol=1e-5, atol=1e-5)
        calls = []
        real = deltanet.DeltaNetStep.__call__

        def counted(self, *a):
            out = real(self, *a)
            calls.append(out is not None)
            return out
        monkeypatch.setattr(deltanet.DeltaNetStep, "__call__", counted)
        state = new_state(rt.model)
        rt.model(torch.tensor([[1, 2, 3]]), state, last_logits_only=True)
        for tok in (4, 5, 6):
            rt.model(torch.tensor([[tok]]), state)
        assert calls == [True] * (3 * len(layers))
        rt.model.set_policy(rt.model.policy.with_kernels("exact"))
        assert all(layer.mixer_step() is None for layer in layers)


@pytest.mark.parametrize("decay", ["mild", "strong"])
@pytest.mark.parametrize("tokens", [1, 37, 64, 100, 256])
def test_chunked_delta_rule_is_the_token_by_token_rule(tokens, decay):
    """The prefill rule (all chunks' intra-chunk parts at once, the last chunk padded; decays
    below e^DECAY_FLOOR dropped) against the one-token rule applied token by token, in fp64: within
    1e-10; in fp32 against that fp64 reference, within 1e-5. "strong": per-token log-decays down to
    -20, so a chunk's cumulative decay passes the floor many times over (as a random Qwen3.5-shaped
    model's do)."""
    torch.manual_seed(tokens)
    heads, dk, dv = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(1, heads, tokens, dk, dtype=torch.float64), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, heads, tokens, dk, dtype=torch.float64), dim=-1)
    v = torch.randn(1, heads, tokens, dv, dtype=torch.float64)
    g = -torch.rand(1, heads, tokens, dtype=torch.float64) * (20.0 if decay == "strong" else 0.3)
    beta = torch.rand(1, heads, tokens, dtype=torch.float64)
    start = torch.randn(1, heads, dk, dv, dtype=torch.float64)
    want, state = [], start.clone()
    for t in range(tokens):
        want.append(deltanet.recurrent_gated_delta_rule(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                                         beta[:, :, t], state))
    want = torch.stack(want, dim=2)
    out, final = deltanet.chunked_gated_delta_rule(q, k, v, g, beta, start.clone())
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, state, rtol=0, atol=1e-10)
    out, final = deltanet.chunked_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta, start)))
    torch.testing.assert_close(out, want.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(final, state.float(), rtol=0, atol=1e-5)


def test_native_deltanet_step_refuses_shapes_that_do_not_fit():
    w, ones = torch.zeros(256, 64), torch.ones(1024)
    args = dict(hidden=64, k_heads=2, v_heads=4, k_dim=16, v_dim=12, conv_kernel=4, split=True,
                in_norm=ones.data_ptr(), in_norm_mode=1, in_eps=1e-6, w=[w.data_ptr()] * 5, enc=[0] * 5,
                rows=[112, 48, 4, 4, 64], conv=ones.data_ptr(), a_log=ones.data_ptr(), dt_bias=ones.data_ptr(),
                out_norm=ones.data_ptr(), out_eps=1e-6)
    x, out, conv, rec = torch.randn(64), torch.empty(64), torch.zeros(112 * 3), torch.zeros(4 * 16 * 12)
    native._K.DeltaNetStep(**args).run(x.data_ptr(), conv.data_ptr(), rec.data_ptr(), out.data_ptr(), 1)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="projection row counts do not fit"):
        native._K.DeltaNetStep(**dict(args, rows=[112, 48, 4, 8, 64])).run(
            x.data_ptr(), conv.data_ptr(), rec.data_ptr(), out.data_ptr(), 1)
    with pytest.raises(ValueError, match="value heads a multiple of key heads"):
        native._K.DeltaNetStep(**dict(args, v_heads=3)).run(x.data_ptr(), conv.data_ptr(), rec.data_ptr(),
                                                            out.data_ptr(), 1)
    with pytest.raises(ValueError, match="a null weight"):
        native._K.DeltaNetStep(**dict(args, w=[0] * 5))
