"""The native per-token operations of a decode step (csrc/ops.cpp) against the torch expressions
they replace: RMS norm (fast mode), rotary embedding (bit-equal, every mode), softmax routing and
the prefetcher's ranking."""
import pytest
import torch
import torch.nn.functional as F

from lean_qwenflash.models import native
from lean_qwenflash.models.layers.norm import RMSNorm
from lean_qwenflash.models.layers.rope import Rotary, apply_rotary
from lean_qwenflash.models.moe.routers import SoftmaxRouter
from lean_qwenflash.models.policy import ExecContext, ExecPolicy
from lean_qwenflash.quant import QuantTensor, get_encoding

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def torch_rotary(x, cos, sin):
    """apply_rotary's torch expression (the reference the native call must equal bit for bit)."""
    rotary_dim, half = cos.shape[-1], cos.shape[-1] // 2
    x_rot = x[..., :rotary_dim]
    rotated = x_rot * cos + torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1) * sin
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 16, 1, 64), (3, 96)])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_rms_norm_matches_torch(shape, zero_centred):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    ref = F.rms_norm(x, (shape[-1],), None, 1e-6) * ((1 + w) if zero_centred else w)
    got = native.rms_norm(x, w, 1e-6, zero_centred)
    # float64 sum of squares vs torch's fp32 reduction: a few ulps of the scale, times |w x / rms|
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(native.rms_norm(x, None, 1e-6), F.rms_norm(x, (shape[-1],), None, 1e-6),
                               rtol=2e-6, atol=2e-6)


def test_rms_norm_module_uses_native_only_in_fast_mode():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(1, 1, 64) * 5
    exact = ExecContext(ExecPolicy(kernel_mode="exact"))
    fast = ExecContext(ExecPolicy(kernel_mode="fast"))
    norm.ctx = exact
    ref = norm.weight * F.rms_norm(x, (64,), None, 1e-6)
    assert torch.equal(norm(x), ref)                   # exact mode: torch's own arithmetic
    norm.ctx = fast
    torch.testing.assert_close(norm(x), ref, rtol=2e-6, atol=2e-6)
    prompt = torch.randn(1, 5, 64)                      # many tokens: torch's arithmetic in every mode
    assert torch.equal(norm(prompt), norm.weight * F.rms_norm(prompt, (64,), None, 1e-6))


def test_rms_norm_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        native.rms_norm(torch.randn(4, 8, dtype=torch.float64), None, 1e-6)
    with pytest.raises(ValueError, match="weight has 4 values"):
        native.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)


@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (128, 0.25), (80, 0.5)])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rope_bit_equal_to_torch(head_dim, partial, tokens):
    from lean_qwenflash.models.layers.rope import RopeConfig
    rot = Rotary(head_dim, RopeConfig(theta=1e6, partial_rotary_factor=partial))
    cos, sin = rot.tables(37, tokens, torch.float32, "cpu")
    x = torch.randn(2, 4, tokens, head_dim)
    ref = torch_rotary(x, cos, sin)
    assert torch.equal(native.rope(x, cos, sin), ref)
    assert torch.equal(apply_rotary(x, cos, sin), ref)        # the layer's function takes the native path


def test_rope_rejects_mismatched_tables():
    cos = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="does not fit"):
        native.rope(torch.zeros(1, 4, 3, 64), cos, cos)


def _router(encoding=None, norm=True, experts=64, hidden=256, top_k=6):
    r = SoftmaxRouter(hidden, experts, top_k, norm)
    with torch.no_grad():
        r.weight.normal_(0, 0.2)
    if encoding is not None:
        enc = get_encoding(encoding)
        r.set_quantized(QuantTensor(enc.quantize(r.weight.detach()), enc, (experts, hidden)))
    r.ctx = ExecContext(ExecPolicy(kernel_mode="fast"))
    return r


@pytest.mark.parametrize("encoding", [None, "q8_0"])
@pytest.mark.parametrize("norm", [True, False])
def test_route_lists_matches_torch_route(encoding, norm):
    r = _router(encoding, norm)
    for seed in range(20):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(seed))
        ids, weights = r.route_lists(x)
        ref_w, ref_i = r.route(x)
        pairs = sorted(zip(ref_i[0].tolist(), ref_w[0].tolist()))
        assert ids == [e for e, _ in pairs] and ids == sorted(ids)
        torch.testing.assert_close(torch.tensor(weights), torch.tensor([w for _, w in pairs]),
                                   rtol=1e-4 if encoding else 1e-5, atol=1e-6)


def test_predict_ranks_like_torch_topk():
    r = _router()
    for seed in range(10):
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(100 + seed))
        ref = torch.topk(r(x).float(), 10, dim=-1).indices
        assert r.predict(x, 10).tolist() == ref.tolist()


def test_router_falls_back_outside_fast_mode():
    r = _router()
    r.ctx = ExecContext(ExecPolicy(kernel_mode="exact"))
    assert r.route_lists(torch.randn(1, 256)) is None
    assert _router().route_lists(torch.randn(1, 256, dtype=torch.float64)) is None


@pytest.mark.parametrize("isa", native.ISAS)
def test_gemv_multi_equals_one_gemv_per_matrix(isa):
    """A layer's q, k, v (mixed encodings, a float one too) in one call: each output bit-equal to
    its own gemv (x is quantized once, the same way)."""
    g = torch.Generator().manual_seed(3)
    weights = []
    for rows, enc in ((96, "q4_k"), (32, "q4_k"), (32, "q6_k"), (16, "q8_0")):
        e = get_encoding(enc)
        weights.append(QuantTensor(e.quantize(torch.randn(rows, 256, generator=g)), e, (rows, 256)))
    weights.append(torch.randn(8, 256, generator=g))
    x = torch.randn(1, 256, generator=g)
    outs = native.gemv_multi(weights, x, isa=isa)
    for w, out in zip(weights, outs):
        assert torch.equal(out, native.gemv(w, x, isa=isa))
    with pytest.raises(ValueError, match="gemv_multi"):
        native.gemv_multi([weights[0], torch.randn(4, 128)], x)


def test_linears_fuse_or_fall_back():
    from lean_qwenflash.models import kernels
    from lean_qwenflash.models.layers.linear import Linear
    mods = [Linear(256, n, bias=b) for n, b in ((64, True), (32, False))]
    e = get_encoding("q8_0")
    for m in mods:
        m.set_quantized(QuantTensor(e.quantize(torch.randn(m.out_features, 256)), e, (m.out_features, 256)))
        if m.bias is not None:
            with torch.no_grad():
                m.bias.normal_()
    fast = ExecContext(ExecPolicy(kernel_mode="fast"))
    for m in mods:
        m.ctx = fast
    x = torch.randn(1, 1, 256)
    fused = kernels.linears(x, mods, fast)
    assert [tuple(o.shape) for o in fused] == [(1, 1, 64), (1, 1, 32)]
    for o, m in zip(fused, mods):
        assert torch.equal(o, m(x))          # the same native product and bias add as one module
    assert kernels.linears(x, mods, ExecContext(ExecPolicy(kernel_mode="exact"))) is None
    assert kernels.linears(torch.randn(1, 3, 256), mods, fast) is None      # many tokens: the modules


@pytest.mark.parametrize("encoding", ["q4_k", "q6_k", "q8_0", "q4_0", "q5_k"])
def test_quantized_embedding_lookup_is_exact(encoding):
    """Token lookups dequantize natively, bit-equal to the encoding's torch dequantizer."""
    from lean_qwenflash.models.layers.linear import Embedding
    e = get_encoding(encoding)
    table = QuantTensor(e.quantize(torch.randn(50, 256)), e, (50, 256))
    emb = Embedding(50, 256)
    emb.set_quantized(table, torch.float32)
    ids = torch.tensor([[3, 49, 0, 3]])
    assert torch.equal(emb(ids), e.dequantize(table.raw[ids.reshape(-1)], 256).view(1, 4, 256))
