"""Encodings and native kernels: our dequantizers equal gguf's bit for bit, quantization error stays
within each format's bounds, and every kernel path (scalar, AVX2, AVX-512, torch) computes the
product of the dequantized weights within a stated tolerance."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from lean_qwenflash.models import kernels, native  # noqa: E402
from lean_qwenflash.models.policy import ExecContext, ExecPolicy  # noqa: E402
from lean_qwenflash.quant import ENCODINGS, QuantTensor, get_encoding  # noqa: E402
from lean_qwenflash.experts.provider import ExpertWeights  # noqa: E402

# The encodings this file's tables describe; the GGUF types added for issue 19 (q4_1 ... iq1_m, mxfp4)
# are tested in test_quant_types.py.
ALL = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
BLOCK = [n for n in ALL if not ENCODINGS[n].is_float]
# where each format keeps its f16 fields (byte offsets in a block)
F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
# quantize -> dequantize relative RMS error on Gaussian weights, with margin over what we measure
# (q8_0 .0054, q4_0 .089, q4_k .074, q5_k .037, q6_k .019)
REL_RMS_BOUND = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.008, "q4_0": 0.11, "q4_k": 0.09,
                 "q5_k": 0.045, "q6_k": 0.024}


def _gguf(raw: torch.Tensor, enc) -> np.ndarray:
    return gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType(enc.ggml_type)).reshape(raw.shape[0], -1)


def _random_blocks(enc, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random block bytes with f16 scales drawn from edge values: zero, subnormals, +-max, tiny, 1."""
    raw = torch.randint(0, 256, (rows, enc.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, enc.block_bytes)
    edges = torch.tensor([0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 1e-3, 3.14], dtype=torch.float16)
    for off in F16_FIELDS[enc.name]:
        pick = edges[torch.randint(0, len(edges), (blocks.shape[0],), generator=gen)]
        blocks[:, off:off + 2] = pick.view(torch.uint8).view(-1, 2)
    return raw


@pytest.mark.parametrize("name", BLOCK)
def test_dequantize_equals_gguf_on_random_and_edge_blocks(name):
    enc = ENCODINGS[name]
    gen = torch.Generator().manual_seed(7)
    cols = enc.block_size * 3
    raw = _random_blocks(enc, 11, cols, gen)
    ours = enc.dequantize(raw, cols).numpy()
    ref = _gguf(raw, enc)
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))     # same bits, -0.0 included
    # the native exact dequantizer too
    out = torch.empty(11, cols)
    native.dequantize_into(QuantTensor(raw, enc, (11, cols)), out)
    assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ALL)
def test_quantize_round_trip_within_bounds_and_equals_gguf(name):
    enc = ENCODINGS[name]
    gen = torch.Generator().manual_seed(3)
    cols = 512
    x = torch.randn(9, cols, generator=gen) * 0.02
    x[0] = 0.0                                  # an all-zero row: scales of zero must not give NaN
    x[1, :32] *= 1000                           # one block of outliers
    raw = enc.quantize(x)
    assert raw.dtype == torch.uint8 and raw.shape == (9, enc.row_bytes(cols))
    y = enc.dequantize(raw, cols)
    assert torch.isfinite(y).all() and torch.equal(y[0], torch.zeros(cols))
    assert np.array_equal(y.numpy(), _gguf(raw, enc))
    rel = ((y[2:] - x[2:]).norm() / x[2:].norm()).item()
    assert rel <= REL_RMS_BOUND[name], rel
    if name == "q8_0":   # exact bound: half a step of each block's scale (plus the f16 rounding of it)
        step = x.view(-1, 32).abs().amax(-1, keepdim=True) / 127
        assert ((y - x).view(-1, 32).abs() <= step * 0.5 * 1.01 + 1e-9).all()


def test_encoding_errors_name_the_problem():
    enc = get_encoding("q4_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        enc.row_bytes(100)
    with pytest.raises(ValueError, match="unknown encoding 'q3_x'"):
        get_encoding("q3_x")
    with pytest.raises(ValueError, match="uint8 rows of 144 bytes"):
        enc.dequantize(torch.zeros(2, 100, dtype=torch.uint8), 256)


def _quantized_act(x: torch.Tensor) -> torch.Tensor:
    """What the native kernels multiply with for block encodings: x in int8 blocks of 32."""
    xb = x.float().view(-1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return (torch.round(xb * inv).clamp(-127, 127) * d).view(-1)


def _weight(name: str, rows: int, cols: int, gen) -> tuple:
    enc = ENCODINGS[name]
    w = torch.randn(rows, cols, generator=gen) * 0.05
    if enc.is_float:
        t = w.to(enc.torch_dtype)
        return t, t.float()
    raw = enc.quantize(w)
    return QuantTensor(raw, enc, (rows, cols)), enc.dequantize(raw, cols)


def _shapes(name):
    block = ENCODINGS[name].block_size
    if block == 1:
        return [(1, 1), (7, 33), (67, 100), (33, 515)]
    return [(1, block), (2, 3 * block), (33, 2 * block), (67, 5 * block if block == 32 else block)]


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("name", ALL)
def test_gemv_every_isa_matches_dequantized_product(isa, name):
    """Tolerances: float rows multiply fp32 activations (fp32 rounding only: 1e-5 of the row's
    |w|.|x|); block rows multiply int8-quantized activations, compared to that exact product (1e-5),
    and to the fp32 product within the activations' quantization error (2% of |w|.|x|)."""
    gen = torch.Generator().manual_seed(11)
    for rows, cols in _shapes(name):
        weight, deq = _weight(name, rows, cols, gen)
        x = torch.randn(cols, generator=gen)
        out = native.gemv(weight, x, isa=isa, threads=2).double()
        scale = (deq.double().abs() @ x.double().abs()) + 1e-12
        exact = deq.double() @ x.double()
        if ENCODINGS[name].is_float:
            assert ((out - exact).abs() / scale).max() < 1e-5
        else:
            with_qact = deq.double() @ _quantized_act(x).double()
            assert ((out - with_qact).abs() / scale).max() < 1e-5, (rows, cols)
            assert ((out - exact).abs() / scale).max() < 2e-2, (rows, cols)


@pytest.mark.parametrize("name", BLOCK + ["bf16"])
def test_simd_paths_agree_with_scalar(name):
    gen = torch.Generator().manual_seed(5)
    weight, deq = _weight(name, 40, 2 * ENCODINGS[name].block_size * 4 if name != "bf16" else 1000, gen)
    x = torch.randn(weight.shape[1], generator=gen)
    ref = native.gemv(weight, x, isa="scalar", threads=1)
    scale = deq.abs() @ x.abs()
    for isa in native.ISAS:
        assert ((native.gemv(weight, x, isa=isa, threads=2) - ref).abs() / scale).max() < 1e-5, isa


def _gemm(weight, x: torch.Tensor, isa: str, threads: int = 2) -> torch.Tensor:
    from lean_qwenflash import _kernels
    rows, cols = weight.shape
    raw = weight.raw if isinstance(weight, QuantTensor) else weight
    out = torch.empty(x.shape[0], rows)
    _kernels.gemm(raw.data_ptr(), native.encoding_id(weight), rows, cols, x.data_ptr(), x.shape[0], out.data_ptr(),
                  threads, isa)
    return out


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("name", ALL)
def test_multi_column_kernels_equal_the_single_column_ones(isa, name):
    """The many-token product (one row decoded once for several tokens: moe_prefill's inner loop)
    gives every token exactly gemv's bits, for token counts off the kernels' group of four, with
    rows in more than one thread task and more columns than one pass over a row block takes."""
    gen = torch.Generator().manual_seed(21)
    block = ENCODINGS[name].block_size
    cols = 3 * 256 if block > 1 else 100
    weight, _ = _weight(name, 37, cols, gen)
    for n in (1, 2, 3, 4, 5, 7, 8, 70):
        x = torch.randn(n, cols, generator=gen)
        x[0, :32] *= 50                                       # a block with outliers
        got = _gemm(weight, x, isa)
        want = torch.stack([native.gemv(weight, x[t], isa=isa, threads=1) for t in range(n)])
        assert torch.equal(got, want), (name, isa, n, (got - want).abs().max().item())
    assert torch.equal(_gemm(weight, x, isa, threads=1), _gemm(weight, x, isa, threads=3))


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quants_have_one_order_on_every_simd_isa(name):
    """q4_k, q5_k and q6_k on AVX2 and AVX-512 add a block's sub-block sums in one fixed tree, one row or
    eight / sixteen rows a lane each: the same bits on both ISAs, for one token and for many (the
    grouped-rows prefill kernels take >= 4 tokens and full groups of rows; 37 rows leave a tail)."""
    simd = [isa for isa in native.ISAS if isa != "scalar"]
    if len(simd) < 2:
        pytest.skip(f"this CPU runs only {simd}: the cross-ISA comparison needs AVX2 and AVX-512")
    gen = torch.Generator().manual_seed(5)
    weight, _ = _weight(name, 37, 4 * 256, gen)
    for n in (1, 3, 4, 9, 33):
        x = torch.randn(n, 4 * 256, generator=gen)
        x[0, :32] *= 50                                       # a block with outliers
        got = {isa: _gemm(weight, x, isa) for isa in simd}
        assert torch.equal(got["avx2"], got["avx512"]), (name, n)
        assert torch.equal(got["avx2"][0], native.gemv(weight, x[0], isa="avx512", threads=1))


def test_resident_k_quants_stay_native_for_long_prompts():
    """A resident matrix in fast mode: the K-quants with grouped-rows kernels (AVX2 / AVX-512) take the
    native GEMM up to GROUPED_GEMM_MAX_TOKENS tokens, with its bits; other encodings, the scalar
    path and longer inputs dequantize and use torch beyond NATIVE_GEMM_MAX_TOKENS."""
    gen = torch.Generator().manual_seed(8)
    n = kernels.NATIVE_GEMM_MAX_TOKENS + 72
    assert n <= kernels.GROUPED_GEMM_MAX_TOKENS
    x = torch.randn(n, 512, generator=gen)
    for name in ("q4_k", "q6_k", "q8_0"):
        weight, deq = _weight(name, 48, 512, gen)
        for isa in native.ISAS:
            ctx = ExecContext(ExecPolicy(kernel_mode="fast", isa=isa))
            got = kernels.quant_linear(x, weight, ctx=ctx)
            if name != "q8_0" and isa != "scalar":
                assert torch.equal(got, native.gemm(weight, x, isa=isa)), (name, isa)
            else:   # the exact product (BLAS may round differently at another buffer alignment)
                torch.testing.assert_close(got, torch.nn.functional.linear(x, deq), rtol=1e-5, atol=1e-5)
        long = torch.randn(kernels.GROUPED_GEMM_MAX_TOKENS + 1, 512, generator=gen)
        torch.testing.assert_close(kernels.quant_linear(long, weight, ctx=ExecContext(ExecPolicy(kernel_mode="fast"))),
                                   torch.nn.functional.linear(long, deq), rtol=1e-5, atol=1e-5)


def test_isa_refusal_and_bad_shapes_are_clear():
    weight, _ = _weight("q4_k", 4, 256, torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="unknown isa 'sse9'"):
        native.gemv(weight, torch.zeros(256), isa="sse9")
    with pytest.raises(ValueError, match="x has 100 values"):
        native.gemv(weight, torch.zeros(100))
    for isa in ("avx2", "avx512"):
        if isa not in native.ISAS:
            with pytest.raises(Exception, match="this CPU lacks"):
                native.gemv(weight, torch.zeros(256), isa=isa)


def _experts(gate_up: str, down: str, num: int, hidden: int, inter: int, gen):
    out, ref = [], []
    for _ in range(num):
        gu, gu_f = _weight(gate_up, 2 * inter, hidden, gen)
        dn, dn_f = _weight(down, hidden, inter, gen)
        out.append(ExpertWeights(gu, dn))
        ref.append((gu_f, dn_f))
    return out, ref


def _torch_moe(x, ref, weights):
    out = torch.zeros(x.shape[-1], dtype=torch.float64)
    for (gu, dn), w in zip(ref, weights):
        h = gu.double() @ x.double().view(-1)
        inter = dn.shape[1]
        out += w * (dn.double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("gate_up,down,num", [("q4_k", "q6_k", 8), ("q8_0", "q8_0", 3), ("q5_k", "q4_k", 1),
                                              ("q4_0", "q8_0", 2), ("bf16", "bf16", 4), ("f32", "f16", 2)])
def test_moe_decode_matches_torch_reference(isa, gate_up, down, num):
    gen = torch.Generator().manual_seed(num)
    hidden, inter = 256, 256 if "k" in gate_up + down else 96
    experts, ref = _experts(gate_up, down, num, hidden, inter, gen)
    weights = torch.rand(num, generator=gen).tolist()
    x = torch.randn(1, hidden, generator=gen)
    out = native.moe_decode(x, experts, weights, isa=isa, threads=2)[0].double()
    want = _torch_moe(x, ref, weights)
    tol = 1e-5 if ENCODINGS[gate_up].is_float and ENCODINGS[down].is_float else 3e-2
    assert ((out - want).norm() / want.norm()).item() < tol
    # the torch exact path computes the same product from the dequantized weights
    exact = kernels.experts_decode(x, experts, weights, ExecContext(ExecPolicy(kernel_mode="exact")))[0].double()
    assert ((exact - want).norm() / want.norm()).item() < 1e-5


def test_moe_decode_is_independent_of_thread_count():
    gen = torch.Generator().manual_seed(1)
    experts, _ = _experts("q4_k", "q6_k", 8, 512, 256, gen)
    x = torch.randn(1, 512, generator=gen)
    runs = [native.moe_decode(x, experts, [0.3] * 8, threads=t) for t in (1, 2, 3, 2)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("gate_up,down", [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("bf16", "bf16")])
def test_moe_decode_in_pieces_has_its_bits(isa, gate_up, down):
    """A streamed decode step computes the cached experts first and the rest once read, then sums:
    for any split, the bits of one moe_decode call (and of the torch path in exact mode)."""
    gen = torch.Generator().manual_seed(7)
    hidden, inter = 256, 256
    experts, _ = _experts(gate_up, down, 8, hidden, inter, gen)
    weights = torch.rand(8, generator=gen).tolist()
    x = torch.randn(1, hidden, generator=gen)
    for mode in ("fast", "exact"):
        ctx = ExecContext(ExecPolicy(kernel_mode=mode, isa=isa))
        whole = kernels.experts_decode(x, experts, weights, ctx)
        for ready in ([0, 3, 4, 7], [5], list(range(8)), []):
            parts = [None] * 8
            for batch in (ready, [i for i in range(8) if i not in ready]):
                if batch:
                    for i, y in zip(batch, kernels.experts_decode_parts(x, [experts[i] for i in batch], ctx)):
                        parts[i] = y
            assert torch.equal(kernels.experts_combine(x, experts, parts, weights, ctx), whole), (mode, ready)
    with pytest.raises(ValueError, match="one contiguous fp32 row"):
        native.moe_combine([torch.zeros(hidden)], [1.0, 2.0])


def _prefill_case(gate_up, down, num, seed, tokens=7, top_k=3, hidden=256, inter=256):
    gen = torch.Generator().manual_seed(seed)
    experts, ref = _experts(gate_up, down, num, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    picks = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])   # [T, k]
    weights = torch.rand(tokens, top_k, generator=gen)
    order = torch.argsort(picks.reshape(-1), stable=True)
    ids, counts = torch.unique(picks.reshape(-1), return_counts=True)
    return x, [experts[i] for i in ids.tolist()], experts, counts, order // top_k, \
        weights.reshape(-1)[order], picks, weights, ref


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("gate_up,down", [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("q5_k", "q4_k"), ("q4_0", "q8_0")])
def test_moe_prefill_matches_torch_reference(isa, gate_up, down):
    """Many tokens through their experts in one call: each token's output is its own experts'
    weighted sum (int8 activations: within the fast path's bound), and it equals running each
    token alone through moe_decode up to the order of the sum."""
    x, experts, all_experts, counts, tokens, weights, picks, pick_w, ref = _prefill_case(gate_up, down, 6, 3)
    out = native.moe_prefill(x, experts, counts, tokens, weights, torch.zeros_like(x), isa=isa, threads=2)
    for t in range(x.shape[0]):
        chosen = [ref[e] for e in picks[t].tolist()]
        want = _torch_moe(x[t:t + 1], chosen, pick_w[t].tolist())
        assert ((out[t].double() - want).norm() / want.norm()).item() < 3e-2, t
        alone = native.moe_decode(x[t:t + 1], [all_experts[e] for e in picks[t].tolist()], pick_w[t].tolist(),
                                  isa=isa)[0]
        torch.testing.assert_close(out[t], alone, rtol=1e-5, atol=1e-5)


def test_moe_prefill_is_deterministic_and_splits_like_the_torch_path():
    """Bit-equal across thread counts; and a call over all experts equals two calls over two groups
    of them (a streaming provider's acquire limit), since outputs are added expert by expert."""
    x, experts, _, counts, tokens, weights, *_ = _prefill_case("q4_k", "q6_k", 8, 5, tokens=9)
    runs = [native.moe_prefill(x, experts, counts, tokens, weights, torch.zeros_like(x), threads=t) for t in (1, 2, 3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    half = len(experts) // 2
    n = int(counts[:half].sum())
    split = torch.zeros_like(x)
    native.moe_prefill(x, experts[:half], counts[:half], tokens[:n], weights[:n], split)
    native.moe_prefill(x, experts[half:], counts[half:], tokens[n:], weights[n:], split)
    assert torch.equal(split, runs[0])
    scalar = native.moe_prefill(x, experts, counts, tokens, weights, torch.zeros_like(x), isa="scalar")
    for isa in native.ISAS:       # every ISA within the fast path's bound of the scalar one
        other = native.moe_prefill(x, experts, counts, tokens, weights, torch.zeros_like(x), isa=isa)
        assert ((other - scalar).norm() / scalar.norm()).item() < 1e-4, isa
    with pytest.raises(ValueError, match="sum to the number"):
        native.moe_prefill(x, experts, counts + 1, tokens, weights, torch.zeros_like(x))
    with pytest.raises(ValueError, match="rows of x"):
        native.moe_prefill(x, experts, counts, tokens + 100, weights, torch.zeros_like(x))
    with pytest.raises(ValueError, match="contiguous fp32"):
        native.moe_prefill(x.double(), experts, counts, tokens, weights, torch.zeros_like(x))


def test_dequantize_equals_gguf_on_blocks_quantized_by_llama_cpp(tmp_path):
    """Real blocks from llama.cpp's own quantizer (a tiny Qwen3-MoE exported to GGUF f32, then
    quantized to each type): our torch and native dequantizers give gguf's values bit for bit."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/setup.sh")
    hf_models = pytest.importorskip("hf_models")
    from lean_qwenflash.store.gguf_export import export_gguf
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    f32 = export_gguf(hf_models.save_checkpoint(model, str(tmp_path / "ckpt")), tmp_path / "f32.gguf", "f32")
    by_ggml = {e.ggml_type: e for e in ENCODINGS.values()}
    seen = set()
    for ftype in ("LLAMA_FTYPE_MOSTLY_Q8_0", "LLAMA_FTYPE_MOSTLY_Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                  "LLAMA_FTYPE_MOSTLY_Q5_K_M", "LLAMA_FTYPE_MOSTLY_Q6_K"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.nthread = 1
        out = tmp_path / f"{ftype}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
        for t in gguf.GGUFReader(str(out)).tensors:
            enc = by_ggml.get(int(t.tensor_type))
            if enc is None or enc.is_float or enc.name not in BLOCK:
                continue
            raw = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8)   # (the reader maps the file read-only)
            raw = raw.reshape(-1, raw.shape[-1])
            cols = raw.shape[-1] // enc.block_bytes * enc.block_size
            ref = gguf_dequantize(raw.numpy(), t.tensor_type).reshape(raw.shape[0], cols)
            ours = enc.dequantize(raw, cols).numpy()
            assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), (ftype, t.name)
            out_native = torch.empty(raw.shape[0], cols)
            native.dequantize_into(QuantTensor(raw, enc, (raw.shape[0], cols)), out_native)
            assert np.array_equal(out_native.numpy().view(np.uint32), ref.view(np.uint32)), (ftype, t.name)
            seen.add(enc.name)
    assert seen == {"q8_0", "q4_0", "q4_k", "q5_k", "q6_k"}, seen


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("above", [False, True])
def test_float_expert_prefill_runs_natively_when_experts_get_few_tokens_each(monkeypatch, isa, dtype, above):
    """Float records: a prompt whose selected experts get at most ``float_native_max_tokens`` tokens
    each on average (top-3 over 8 experts) is one native call for the layer, no per-expert
    conversion of the records; with more, torch's GEMM runs. The limit is FLOAT_NATIVE_MAX_TOKENS
    (16) for fp32 records and on the scalar path, HALF_FLOAT_NATIVE_MAX_TOKENS for bf16 / f16 records
    on AVX2 / AVX-512. Both paths equal the exact path's sum to fp32 rounding."""
    from lean_qwenflash.experts.provider import ResidentExperts
    from lean_qwenflash.models.moe.block import routed_experts
    limit = kernels.HALF_FLOAT_NATIVE_MAX_TOKENS.get(isa, 16) if dtype != "f32" else 16
    record = torch.zeros(1, dtype=ENCODINGS[dtype].torch_dtype)
    assert kernels.float_native_max_tokens(record, ExecPolicy(isa=isa)) == limit
    tokens = limit * 8 // 3 + (8 if above else 0)       # per expert: <= limit, or 3 more
    gen = torch.Generator().manual_seed(tokens)
    experts, _ = _experts(dtype, dtype, 8, 256, 96, gen)
    x = torch.randn(tokens, 256, generator=gen)
    picks = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(tokens)])
    weights = torch.rand(tokens, 3, generator=gen)
    calls = []
    real = native.moe_prefill
    monkeypatch.setattr(native, "moe_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    provider = ResidentExperts({0: experts})
    fast = routed_experts(x, weights, picks, provider, 0, ExecContext(ExecPolicy(kernel_mode="fast", isa=isa)))
    assert len(calls) == (0 if above else 1)
    exact = routed_experts(x, weights, picks, provider, 0, ExecContext(ExecPolicy(kernel_mode="exact")))
    assert len(calls) == (0 if above else 1)
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
