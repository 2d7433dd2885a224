"""The KV cache in f32 / f16 / bf16 / q8_0 / q4_0 and the blocked (online-softmax) attention.

Bounds used below (all derived, none fitted):

* Block quantization, per value x of a 32-value block with largest magnitude a (quant/legacy.py):
  q8_0 stores d = f16(a / 127) and round(x / d) clamped to +-127, so |x - x'| <= d / 2 + a * 2^-11
  (the f16 rounding of d can push the largest value one clamp step) <= a * (1/254 + 2^-10);
  q4_0 stores d = f16(-extreme / 8) and levels -8..7, so the value mapped to +8 is clamped to 7:
  |x - x'| <= d <= a * (1/8) * (1 + 2^-10).
* Scores: s_j = scale * sum_i q_i k_ji, so |s'_j - s_j| <= delta = scale * max_j sum_blocks
  ||q_block||_1 * eps(k_j block). Softmax weights then move by a factor in [e^-2delta, e^2delta]
  (a sink key has no error and a zero value, so the same holds), so each output value moves by at
  most (e^{2 delta} - 1) * max_j |v_j| + max_j eps(v_j) (the value error, weights summing to <= 1).
* Float32 arithmetic (blocked vs a float64 reference): with u = 2^-24 and gamma_n = n u / (1 - n u),
  dot products of length d give |ds_j| <= gamma_d * scale * sum_i |q_i k_ji|, and the sums over L
  keys (plus one rescale per block) add gamma_{L + 2 L / block + 4} * max |v|.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch.utils._python_dispatch import TorchDispatchMode

import hf_models
from lean_qwenflash.common import ConfigError
from lean_qwenflash.config import load_config
from lean_qwenflash.generate import new_state
from lean_qwenflash.generate.state import KVCache, SlidingKVCache
from lean_qwenflash.loader import load_hf_checkpoint
from lean_qwenflash.models import native
from lean_qwenflash.models.layers import attention as attn_mod
from lean_qwenflash.models.layers.attention import (KV_BLOCK_KEYS, KV_CODECS, Attention, SinkAttention,
                                                    blocked_attention, kv_codec)
from lean_qwenflash.models.policy import ExecContext, ExecPolicy

U = 2.0 ** -24
QUANT_EPS = {"q8_0": 1 / 254 + 2 ** -10, "q4_0": (1 / 8) * (1 + 2 ** -10)}   # x amax of the block
FLOAT_EPS = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}                             # relative, per value


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def value_error(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per-value bound of |x - decode(encode(x))| for a cache dtype (x [..., D], D padded to 32)."""
    if dtype == "f32":
        return torch.zeros_like(x)
    if dtype in FLOAT_EPS:
        return x.abs() * FLOAT_EPS[dtype] + 6e-8 * (dtype == "f16")   # f16 subnormal spacing
    pad = (-x.shape[-1]) % 32
    xb = F.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    return (amax * QUANT_EPS[dtype]).expand_as(xb).reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]


def reference(q_parts, k_parts, v, scale, *, query_start=0, key_pos=None, window=None, sinks=None):
    """Float64 attention with an explicit mask (the truth the bounds are about); GQA by repeat."""
    heads, kv_heads = q_parts[0].shape[1], k_parts[0].shape[1]
    g = heads // kv_heads
    s = sum(q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) for q, k in zip(q_parts, k_parts)) * scale
    num_q, length = s.shape[-2:]
    kp = torch.arange(length) if key_pos is None else key_pos
    qp = torch.arange(query_start, query_start + num_q)[:, None]
    vis = (kp[None, :] <= qp) & (kp[None, :] >= 0)
    if window is not None:
        vis &= kp[None, :] > qp - window
    s = s.masked_fill(~vis, float("-inf"))
    vv = v.double().repeat_interleave(g, 1)
    if sinks is not None:
        s = torch.cat((s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)), -1)
        vv = torch.cat((vv, vv.new_zeros(vv.shape[:2] + (1, vv.shape[-1]))), 2)
    return torch.softmax(s, -1) @ vv


def quant_bound(q_parts, k_parts, v, scale, dtype):
    """The derived bound (module docstring) of |out(dtype cache) - out(exact)| per head [B, H, 1, 1]."""
    heads, kv_heads = q_parts[0].shape[1], k_parts[0].shape[1]
    g = heads // kv_heads
    delta = 0
    for q, k in zip(q_parts, k_parts):
        eps = value_error(k.float(), dtype).repeat_interleave(g, 1)            # [B, H, L, d]
        delta = delta + q.abs() @ eps.transpose(-1, -2)                         # [B, H, T, L]
    delta = scale * delta.amax(-1, keepdim=True)
    vmax = v.abs().amax(2, keepdim=True).repeat_interleave(g, 1)                # [B, H, 1, Dv]
    veps = value_error(v.float(), dtype).amax(2, keepdim=True).repeat_interleave(g, 1)
    return (torch.exp(2 * delta) - 1) * vmax + veps


def float_bound(q_parts, k_parts, v, scale, length):
    heads, kv_heads = q_parts[0].shape[1], k_parts[0].shape[1]
    g = heads // kv_heads
    ds = sum(gamma(q.shape[-1]) * (q.abs() @ k.abs().repeat_interleave(g, 1).transpose(-1, -2))
             for q, k in zip(q_parts, k_parts))
    delta = scale * ds.amax(-1, keepdim=True) + 4 * U
    vmax = v.abs().amax(2, keepdim=True).repeat_interleave(g, 1)
    return ((torch.exp(2 * delta) - 1) + gamma(length + 2 * length // KV_BLOCK_KEYS + 4)) * vmax


# ---- the storage is GGUF's block layout ----

@pytest.mark.parametrize("dtype,ggml", [("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)])
def test_cache_rows_are_gguf_blocks(dtype, ggml):
    codec = KV_CODECS[dtype]
    x = torch.randn(2, 3, 5, 64) * torch.logspace(-3, 2, 64)
    raw = codec.encode(x)
    assert raw.dtype == torch.uint8 and raw.shape == (2, 3, 5, 64 // 32 * codec.encoding.block_bytes)
    ref = gguf_dequantize(raw.reshape(-1, raw.shape[-1]).numpy(), ggml).reshape(x.shape)
    assert np.array_equal(codec.decode(raw, 64).numpy(), ref)
    assert torch.all((codec.decode(raw, 64) - x).abs() <= value_error(x, dtype))
    # A row narrower than a block is padded with zeros to one block and cut back on decode.
    small = torch.randn(4, 16)
    assert codec.encode(small).shape == (4, codec.encoding.block_bytes)
    assert torch.all((codec.decode(codec.encode(small), 16) - small).abs() <= value_error(small, dtype))


def test_bytes_per_row():
    assert [KV_CODECS[n].bytes_per_value_row(128) for n in ("f32", "f16", "bf16", "q8_0", "q4_0")] == [512, 256, 256, 136, 72]


# ---- quantized caches within the derived bound: plain, GQA, window, sinks, MLA; torch and native ----

def _case(kind, length, num_q, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    if kind == "mla":            # one kv head: scores from the latent and the rope key; values = the latent
        q = [rnd(1, 4, num_q, 64), rnd(1, 4, num_q, 16)]
        k = [rnd(1, 1, length, 64), rnd(1, 1, length, 16)]
        return q, k, None, 64 ** -0.5
    heads, kv_heads = (8, 2) if kind != "mha" else (4, 4)
    q = [rnd(1, heads, num_q, 64) * 1.5]
    k = [rnd(1, kv_heads, length, 64)]
    v = rnd(1, kv_heads, length, 64)
    return q, k, v, 64 ** -0.5


KINDS = [("gqa", None, False), ("mha", None, False), ("gqa", 37, False), ("gqa", None, True), ("gqa", 50, True), ("mla", None, False)]


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("kind,window,with_sinks", KINDS)
@pytest.mark.parametrize("num_q", [1, 24])
def test_quantized_cache_within_derived_bound(dtype, kind, window, with_sinks, num_q):
    length = 700
    q, k, v, scale = _case(kind, length, num_q)
    sinks = torch.randn(q[0].shape[1]) if with_sinks else None
    values = k[0] if v is None else v
    codec = kv_codec(dtype)
    start = length - num_q
    ref = reference(q, k, values, scale, query_start=start, window=window, sinks=sinks)
    stored = [codec.encode(t) for t in k]
    vstore = 0 if v is None else (codec.encode(v), v.shape[-1])
    got = blocked_attention(q, [(s, t.shape[-1]) for s, t in zip(stored, k)], vstore, codec, scale=scale,
                            query_start=start, window=window, sinks=sinks)
    bound = quant_bound(q, k, values, scale, dtype) + float_bound(q, k, values, scale, length)
    err = (got.double() - ref).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    assert float(err.max()) > 0                # the cache really is quantized
    if num_q == 1 and window is None and native.available():
        for isa in native.ISAS:                # the native decode kernel, every path this CPU has
            q1 = torch.cat([p[0, :, 0] for p in q], -1).contiguous()
            keys = [(s[0], codec.native_id(s), t.shape[-1]) for s, t in zip(stored, k)]
            vals = keys[0] if v is None else (vstore[0][0], codec.native_id(vstore[0]), v.shape[-1])
            out = native.attention_decode(q1, keys, vals, length, scale, sinks, isa=isa, threads=2)
            err = (out.double()[None, :, None] - ref).abs()
            assert torch.all(err <= bound), (isa, float((err - bound).max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_0"])
def test_cuda_blocked_attention_within_bound(dtype):
    """The torch path on CUDA: the cache encoded and read block by block on the device."""
    q, k, v, scale = _case("gqa", 900, 8)
    codec = kv_codec(dtype)
    ref = reference(q, k, v, scale, query_start=892, window=300, sinks=None)
    got = blocked_attention([q[0].cuda()], [(codec.encode(k[0].cuda()), 64)], (codec.encode(v.cuda()), 64), codec,
                            scale=scale, query_start=892, window=300)
    assert got.is_cuda
    bound = quant_bound(q, k, v, scale, dtype) + float_bound(q, k, v, scale, 900) * 4   # TF32 off; margin for CUDA sums
    assert torch.all((got.cpu().double() - ref).abs() <= bound)


# ---- blocked == full attention (f32) within the float32 bound, at several lengths ----

@pytest.mark.parametrize("length", [1, 255, 256, 257, 1000, 3000])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (100, False)])
def test_blocked_matches_full_attention(length, window, with_sinks):
    num_q = min(length, 17)
    q, k, v, scale = _case("gqa", length, num_q, seed=length)
    sinks = torch.randn(8) if with_sinks else None
    start = length - num_q
    ref = reference(q, k, v, scale, query_start=start, window=window, sinks=sinks)
    got = blocked_attention(q, [(k[0], 64)], (v, 64), KV_CODECS["f32"], scale=scale, query_start=start,
                            window=window, sinks=sinks)
    bound = float_bound(q, k, v, scale, length)
    assert torch.all((got.double() - ref).abs() <= bound)
    sdpa = F.scaled_dot_product_attention(q[0], k[0].repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                          attn_mask=torch.arange(length)[None] <= torch.arange(start, length)[:, None]
                                          if window is None and sinks is None else None, scale=scale)
    if window is None and sinks is None:      # and SDPA (today's exact path) is within the same bound
        assert torch.all((sdpa.double() - ref).abs() <= bound)


@pytest.mark.parametrize("length", [1, 255, 256, 257, 1025, 2600])   # (spans of 256 keys)
def test_native_decode_matches_blocked_torch(length):
    if not native.available():
        pytest.skip("the native extension is not built")
    q, k, v, scale = _case("gqa", length, 1, seed=3)
    if length == 2600:          # 8 kv heads x 2600 keys: many spans on several threads
        q, k, v = [q[0].repeat(1, 4, 1, 1)], [k[0].repeat(1, 4, 1, 1)], v.repeat(1, 4, 1, 1)
    ref = reference(q, k, v, scale, query_start=length - 1)
    bound = float_bound(q, k, v, scale, length)
    for isa in native.ISAS:
        for threads in (1, 2):
            out = native.attention_decode(q[0][0, :, 0].contiguous(), [(k[0][0], 0, 64)], (v[0], 0, 64), length, scale,
                                          isa=isa, threads=threads)
            assert torch.all((out.double()[None, :, None] - ref).abs() <= bound), (isa, threads)
            if threads == 2:
                assert torch.equal(out, previous), "the result must not depend on the thread count"
            previous = out


def test_native_decode_rejects_bad_rows():
    if not native.available():
        pytest.skip("the native extension is not built")
    q = torch.zeros(4, 64)
    k = torch.zeros(2, 10, 64)
    with pytest.raises(ValueError, match="rows are 256 bytes"):
        native.attention_decode(q, [(k, 3, 64)], (k, 0, 64), 10, 1.0)
    with pytest.raises(ValueError, match="do not hold"):
        native.attention_decode(q, [(k, 0, 64)], (k, 0, 64), 11, 1.0)


# ---- the layers: exact mode keeps SDPA's bits below the threshold; bounded memory beyond ----

def _layer(cls=Attention, **kw):
    torch.manual_seed(0)
    layer = cls(64, 8, 2, 32, **kw)
    with torch.no_grad():
        if hasattr(layer, "sinks"):
            layer.sinks.normal_()
    return layer


def _rope(n, dim=32, offset=0):
    t = torch.arange(offset, offset + n, dtype=torch.float32)[:, None] * torch.logspace(0, -3, dim // 2)[None]
    t = torch.cat((t, t), -1)
    return t.cos(), t.sin()                     # [T, D], as the models' Rotary gives


def _run(layer, policy, x, chunks, state):
    layer.ctx = ExecContext(policy)
    outs, at = [], 0
    for c in chunks:
        outs.append(layer(x[:, at:at + c], _rope(c, offset=at), state))
        at += c
    return torch.cat(outs, 1)


@pytest.mark.parametrize("cls,window", [(Attention, None), (Attention, 6), (SinkAttention, None), (SinkAttention, 6)])
def test_exact_mode_short_context_keeps_sdpa_bits(cls, window, monkeypatch):
    layer = _layer(cls, sliding_window=window)
    x = torch.randn(1, 30, 64)
    make = (lambda: SlidingKVCache(window)) if window else KVCache
    exact = ExecPolicy(kernel_mode="exact")
    with torch.no_grad():
        got = _run(layer, exact, x, [10, 1, 19], make())
        calls = []
        real = attn_mod.blocked_attention
        monkeypatch.setattr(attn_mod, "blocked_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        monkeypatch.setattr(attn_mod.native, "available", lambda: False)
        again = _run(layer, exact, x, [10, 1, 19], make())
        assert torch.equal(got, again) and not calls          # SDPA, not the blocked path
        monkeypatch.setattr(attn_mod, "EXACT_MAX_KEYS", 12)    # past the threshold: the blocked path
        blocked = _run(layer, exact, x, [10, 1, 19], make())
        assert calls
        torch.testing.assert_close(blocked, got, rtol=0, atol=1e-5)


class _Allocations(TorchDispatchMode):
    """The bytes of every new tensor storage an op creates (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append((t.dtype, t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()))
        return out


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_prefill_step_memory_does_not_grow_with_context(dtype):
    """A 64-token chunk after 512, 2048 and 8192 cached tokens: the largest float tensor the step
    makes (scores, dequantized blocks) is the same and O(chunk x heads x KV_BLOCK_KEYS)."""
    chunk, heads, dim = 64, 8, 32
    layer = _layer()
    policy = ExecPolicy(kernel_mode="fast", kv_cache_dtype=dtype)
    largest = []
    with torch.no_grad():
        for context in (512, 2048, 8192):
            state = KVCache()
            _run(layer, policy, torch.randn(1, context, 64), [context], state)
            assert state.keys.dtype == (torch.uint8 if dtype == "q8_0" else torch.float32)
            mode = _Allocations()
            x = torch.randn(1, chunk, 64)
            with mode:
                layer.ctx = ExecContext(policy)
                layer(x, _rope(chunk, offset=context), state)
            floats = [(n, ptr) for dt, n, ptr in mode.sizes if dt.is_floating_point]
            if dtype == "f32":        # the f32 cache regrows by doubling: that is the cache, not the step
                cache = {state.keys.untyped_storage().data_ptr(), state.values.untyped_storage().data_ptr()}
                floats = [(n, ptr) for n, ptr in floats if ptr not in cache]
            else:                     # the cache is uint8; no float tensor as large as a copy of it
                assert max(n for n, _ in floats) < context * 2 * dim * 4 or context < 8192
            largest.append(max(n for n, _ in floats))
    assert largest[0] == largest[1] == largest[2], largest
    assert largest[0] <= 4 * chunk * heads * KV_BLOCK_KEYS


# ---- whole models: greedy agreement, sinks + sliding window (gpt_oss), MLA (deepseek) ----

def _teacher_forced(model, tokens, chunk=16):
    state = new_state(model)
    logits = [model(tokens[:, a:a + chunk], state) for a in range(0, 64, chunk)]
    logits += [model(tokens[:, i:i + 1], state) for i in range(64, tokens.shape[1])]
    return torch.cat(logits, 1)[0], state


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_greedy_agreement_and_snapshots(family):
    """300 random tokens, teacher-forced (64 prefilled in chunks, then one at a time): every position whose f32 top-2 margin
    exceeds twice the largest logit change still picks the same token, most positions do, and the
    quantized state snapshots (clone) are smaller and continue identically."""
    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    model.set_policy(ExecPolicy(kv_cache_dtype="f32"))
    tokens = hf_models.prompt_ids(c.hf_model.config.vocab_size, 300, seed=7)
    ref, ref_state = _teacher_forced(model, tokens)
    # Measured on these tiny random models (perturbed weights: peaked scores): q8_0 0.98-1.0, q4_0 0.81-1.0.
    for dtype, min_agree in (("q8_0", 0.97), ("q4_0", 0.75)):
        model.set_policy(ExecPolicy(kv_cache_dtype=dtype))
        got, state = _teacher_forced(model, tokens)
        diff = (got - ref).abs().amax(-1)
        top2 = ref.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        same = got.argmax(-1) == ref.argmax(-1)
        assert torch.all(same[margin > 2 * diff])
        assert float(same.float().mean()) >= min_agree, (dtype, float(same.float().mean()))
        assert float(diff.max()) > 0
        # Snapshots keep the cache as stored: each KV layer's bytes are the codec's row bytes.
        snap, ref_snap = state.clone(), ref_state.clone()
        codec = KV_CODECS[dtype]
        for layer, ref_layer in zip(snap.layers, ref_snap.layers):
            if isinstance(layer, (KVCache, SlidingKVCache)):
                for t, r in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
                    assert t.dtype == torch.uint8
                    assert t.nbytes == r.numel() // r.shape[-1] * codec.bytes_per_value_row(r.shape[-1])
        assert snap.nbytes() < ref_snap.nbytes()
        nxt = tokens[:, :1]
        assert torch.equal(model(nxt, state), model(nxt, snap))


# ---- config and policy ----

def test_config_key_validated_and_passed_to_the_policy(tmp_path):
    cfg = load_config(kv_cache_dtype="q4_0")
    assert ExecPolicy.from_config(cfg).kv_cache_dtype == "q4_0"
    assert ExecPolicy.from_config(load_config()).kv_cache_dtype == "f32"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: must be one of f32, f16, bf16, q8_0, q4_0, got 'q5'"):
        load_config(kv_cache_dtype="q5")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ExecPolicy(kv_cache_dtype="int8")
    assert math.isclose(KV_CODECS["q8_0"].bytes_per_value_row(128) / 512, 34 / 128)


def test_kv_cache_dtype_from_the_command_line():
    """serve --kv-cache-dtype and generate's runtime flag reach the config (and so ExecPolicy)."""
    from lean_qwenflash.cli import _runtime_config, build_parser
    from lean_qwenflash.server.main import serve_config
    assert serve_config(kv_cache_dtype="q8_0").kv_cache_dtype == "q8_0"
    assert serve_config().kv_cache_dtype == "f32"
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--kv-cache-dtype", "q4_0"])
    assert _runtime_config(args).kv_cache_dtype == "q4_0"
    assert ExecPolicy.from_config(_runtime_config(args)).kv_cache_dtype == "q4_0"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "q2_k"])


@pytest.mark.parametrize("past", [1, 300, 3000])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_fast_chunk_over_f32_cache_takes_flash_calls_within_bound(past, heads, kv_heads, monkeypatch):
    """Fast mode, a prompt chunk after the first over an f32 cache: two flash calls merged by
    their log-sum-exps (``chunk_over_cache``), within the float bound of the float64 truth; exact
    mode and a quantized cache keep their paths."""
    num_q, dim = 37, 64
    layer = Attention(64, heads, kv_heads, dim)
    g = torch.Generator().manual_seed(past)
    k_past, v_past = torch.randn(1, kv_heads, past, dim, generator=g), torch.randn(1, kv_heads, past, dim, generator=g)
    q = torch.randn(1, heads, num_q, dim, generator=g) * 1.5
    k, v = torch.randn(1, kv_heads, num_q, dim, generator=g), torch.randn(1, kv_heads, num_q, dim, generator=g)
    calls = []
    real = Attention.chunk_over_cache
    monkeypatch.setattr(Attention, "chunk_over_cache", lambda self, *a: calls.append(1) or real(self, *a))
    for policy, taken in ((ExecPolicy(kernel_mode="fast"), True), (ExecPolicy(kernel_mode="exact"), False),
                          (ExecPolicy(kernel_mode="fast", kv_cache_dtype="q8_0"), False)):
        layer.ctx = ExecContext(policy)
        state = KVCache()
        codec = KV_CODECS[policy.kv_cache_dtype]
        state.append(codec.encode(k_past), codec.encode(v_past))
        calls.clear()
        with torch.no_grad():
            got = layer.attention(q, k, v, state)
        assert bool(calls) == taken and state.num_tokens == past + num_q
        if taken:
            keys, values = torch.cat((k_past, k), 2), torch.cat((v_past, v), 2)
            ref = reference([q], [keys], values, dim ** -0.5, query_start=past)
            assert torch.all((got.double() - ref).abs() <= float_bound([q], [keys], values, dim ** -0.5, past + num_q))
