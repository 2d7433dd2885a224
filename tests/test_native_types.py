"""Native kernels of the GGUF block types added for imports (csrc/quant_types.cpp,
csrc/quant_simd_types.h): q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl, iq4_xs, mxfp4, iq3_xxs, iq3_s,
iq2_xxs, iq2_xs, iq2_s, iq1_s, iq1_m.

For each: the native exact dequantizer equals gguf.quants' bit for bit (random valid blocks with
edge scales, and blocks quantized from Gaussian data where a quantizer exists); every ISA this CPU
has (scalar, AVX2, AVX-512) computes the product with int8-quantized activations within a stated
bound; the fused MoE decode and prefill calls on records of these types equal the float64 torch
reference within the fast path's bound; and the IQ kernels refuse to run before their tables are set.
"""
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

from lean_qwenflash import _kernels  # noqa: E402
from lean_qwenflash.experts.provider import ExpertWeights  # noqa: E402
from lean_qwenflash.models import kernels, native  # noqa: E402
from lean_qwenflash.models.policy import ExecContext, ExecPolicy  # noqa: E402
from lean_qwenflash.quant import ENCODINGS, QuantTensor  # noqa: E402

# the ids csrc/quant.h gives them (Encoding.native_id must agree)
NATIVE_IDS = {"q4_1": 8, "q5_0": 9, "q5_1": 10, "q2_k": 11, "q3_k": 12, "iq4_nl": 13, "iq4_xs": 14, "mxfp4": 15,
              "iq3_xxs": 16, "iq3_s": 17, "iq2_xxs": 18, "iq2_xs": 19, "iq2_s": 20, "iq1_s": 21, "iq1_m": 22}
NEW = list(NATIVE_IDS)
# byte offsets of each format's f16 scale fields (mxfp4: an e8m0 byte at 0; iq1_m: its f16 is
# spread over the top nibbles of the four u16 words at 48)
F16_FIELDS = {"q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q2_k": [80, 82], "q3_k": [108], "iq4_nl": [0],
              "iq4_xs": [0], "iq3_xxs": [0], "iq3_s": [0], "iq2_xxs": [0], "iq2_xs": [0], "iq2_s": [0], "iq1_s": [0]}
GGUF_QUANTIZES = ["q4_1", "q5_0", "q5_1", "mxfp4"]         # gguf.quants has a quantizer for these
OURS_QUANTIZES = ["q2_k", "q3_k", "iq4_nl", "iq4_xs"]       # lean_qwenflash.quant has one (pack --quant)
ALL_ISAS = ["scalar", "avx2", "avx512"]
EDGES = [0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 1e-3, 3.14]


def _ggml(name):
    return gguf.GGMLQuantizationType(ENCODINGS[name].ggml_type)


def _set_iq1_m_d(blocks: torch.Tensor, d: torch.Tensor) -> None:
    """Write f16 values d [n] into iq1_m blocks: nibble k of d is the top nibble of u16 word k."""
    b = blocks.numpy()                                   # shares the tensor's memory
    words = b[:, 48:56].copy().view(np.uint16)
    bits = d.to(torch.float16).numpy().view(np.uint16)
    for k in range(4):
        words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
    b[:, 48:56] = words.view(np.uint8)


def _blocks(name: str, rows: int, cols: int, gen: torch.Generator, edges: bool) -> torch.Tensor:
    """Random block bytes of `name` [rows, row bytes] with valid scales: drawn from EDGES (zero,
    subnormal, +-max, ...) when `edges`, else of magnitude 0.001-0.01 (products of sane size)."""
    enc = ENCODINGS[name]
    raw = torch.randint(0, 256, (rows, enc.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, enc.block_bytes)
    n = blocks.shape[0]
    if edges:
        pick = lambda: torch.tensor(EDGES)[torch.randint(0, len(EDGES), (n,), generator=gen)]  # noqa: E731
    else:
        pick = lambda: (torch.rand(n, generator=gen) * 0.009 + 0.001) * torch.sign(torch.randn(n, generator=gen))  # noqa: E731
    if name == "mxfp4":      # e8m0: 2^(e - 128); edges: the subnormal scales, 1, and near the top
        if edges:
            choice = torch.tensor([0, 1, 2, 3, 100, 127, 128, 129, 200, 250], dtype=torch.uint8)
            blocks[:, 0] = choice[torch.randint(0, len(choice), (n,), generator=gen)]
        else:
            blocks[:, 0] = torch.randint(118, 124, (n,), dtype=torch.uint8, generator=gen)
    elif name == "iq1_m":
        _set_iq1_m_d(blocks, pick())
    else:
        for off in F16_FIELDS[name]:
            blocks[:, off:off + 2] = pick().to(torch.float16).view(torch.uint8).view(-1, 2)
    return raw


def _native_deq(raw: torch.Tensor, name: str, cols: int) -> np.ndarray:
    out = torch.empty(raw.shape[0], cols)
    _kernels.dequantize(raw.data_ptr(), NATIVE_IDS[name], raw.shape[0], cols, out.data_ptr(), 2)
    return out.numpy()


def _gguf(raw: torch.Tensor, name: str) -> np.ndarray:
    return gguf_dequantize(raw.numpy(), _ggml(name)).reshape(raw.shape[0], -1)


def test_ids_and_block_sizes_agree_with_the_encodings():
    for name, nid in NATIVE_IDS.items():
        enc = ENCODINGS[name]
        assert enc.native_id == nid, name
        assert _kernels.block_bytes(nid) == enc.block_bytes, name
        assert _kernels.block_values(nid) == enc.block_size, name
        block, nbytes = gguf.GGML_QUANT_SIZES[_ggml(name)]
        assert (block, nbytes) == (enc.block_size, enc.block_bytes), name


@pytest.mark.parametrize("name", NEW)
def test_dequantize_bit_equal_to_gguf_on_random_and_edge_blocks(name):
    gen = torch.Generator().manual_seed(NATIVE_IDS[name])
    cols = ENCODINGS[name].block_size * 3
    for edges in (True, False):
        raw = _blocks(name, 13, cols, gen, edges)
        ref = _gguf(raw, name)
        assert np.isfinite(ref).all()
        ours = _native_deq(raw, name, cols)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), name    # same bits, -0.0 included


@pytest.mark.parametrize("name", GGUF_QUANTIZES + OURS_QUANTIZES)
def test_dequantize_bit_equal_to_gguf_on_quantized_data(name):
    """Blocks a quantizer made from Gaussian data (with an all-zero row and a block of outliers):
    gguf's own quantizer where it has one, else ours. (The lattice types have no quantizer without
    an importance matrix: the random-block test covers them.)"""
    enc = ENCODINGS[name]
    gen = torch.Generator().manual_seed(100 + NATIVE_IDS[name])
    cols = 512
    x = torch.randn(6, cols, generator=gen) * 0.02
    x[0] = 0.0
    x[1, :32] *= 1000
    raw = torch.from_numpy(gguf_quantize(x.numpy(), _ggml(name))) if name in GGUF_QUANTIZES else enc.quantize(x)
    ref = _gguf(raw, name)
    ours = _native_deq(raw.contiguous(), name, cols)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(ours[0], np.zeros(cols, np.float32))


def _quantized_act(x: torch.Tensor) -> torch.Tensor:
    """The int8 activations the kernels multiply with: blocks of 32, scale amax / 127."""
    xb = x.double().view(-1, 32)
    d = (x.float().view(-1, 32).abs().amax(-1, keepdim=True) / 127).double()
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d)).float()
    return (torch.round(x.float().view(-1, 32) * inv).clamp(-127, 127).double() * d).view(-1), xb


def _gemv(raw: torch.Tensor, name: str, rows: int, cols: int, x: torch.Tensor, isa: str) -> torch.Tensor:
    out = torch.empty(rows)
    _kernels.gemv(raw.data_ptr(), NATIVE_IDS[name], rows, cols, x.data_ptr(), out.data_ptr(), 2, isa)
    return out.double()


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("name", NEW)
def test_dot_products_every_isa_within_the_activation_quantization_bound(isa, name):
    """Bounds, per output row r with dequantized weights w (gguf's, float64) and activations x:
    * against w . q(x) (q = the kernels' int8 activations, dequantized in float64): the integer
      products are exact, so only fp32 rounding of the block sums remains: <= 1e-5 * |w| . |x|;
    * against the float product w . x: each activation moves by at most half its block's step,
      |x_i - q(x)_i| <= amax_b / 254, so |w . x - w . q(x)| <= sum_b amax_b / 254 * sum_{i in b} |w_i|
      (plus the same fp32 term)."""
    if isa not in native.ISAS:
        pytest.skip(f"this CPU lacks {isa} (it has {', '.join(native.ISAS)}); the {isa} kernels are "
                    f"compiled but only reachable on a CPU that has it")
    gen = torch.Generator().manual_seed(7 * NATIVE_IDS[name])
    block = ENCODINGS[name].block_size
    for rows, cols in [(1, block), (5, 3 * block), (37, 8 * block if block == 32 else 2 * block)]:
        raw = _blocks(name, rows, cols, gen, edges=False)
        w = torch.from_numpy(_gguf(raw, name)).double()
        x = torch.randn(cols, generator=gen)
        x[:32] *= 20                                            # a block with outliers
        out = _gemv(raw, name, rows, cols, x, isa)
        qx, xb = _quantized_act(x)
        fp32_term = 1e-5 * (w.abs() @ x.double().abs()) + 1e-30
        assert ((out - w @ qx).abs() <= fp32_term).all(), (isa, name, rows, cols, ((out - w @ qx).abs() / fp32_term).max())
        act_bound = (w.abs().view(rows, -1, 32).sum(-1) * (xb.abs().amax(-1) / 254)).sum(-1)
        assert ((out - w @ x.double()).abs() <= act_bound * 1.001 + fp32_term).all(), (isa, name, rows, cols)


@pytest.mark.parametrize("name", NEW)
def test_simd_paths_agree_with_scalar(name):
    gen = torch.Generator().manual_seed(3 + NATIVE_IDS[name])
    cols = ENCODINGS[name].block_size * 8
    raw = _blocks(name, 24, cols, gen, edges=False)
    w = torch.from_numpy(_gguf(raw, name)).double()
    x = torch.randn(cols, generator=gen)
    ref = _gemv(raw, name, 24, cols, x, "scalar")
    scale = w.abs() @ x.double().abs()
    for isa in native.ISAS:
        assert ((_gemv(raw, name, 24, cols, x, isa) - ref).abs() / scale).max() < 1e-5, isa


def test_iq_kernels_refuse_before_their_tables_are_set():
    """In a process that loads the extension without lean_qwenflash.models.native (which hands the
    tables over), an IQ dequantization or product fails by name instead of reading unset tables."""
    code = (
        "import torch\n"
        "from lean_qwenflash import _kernels as K\n"
        "raw = torch.zeros(1, 66, dtype=torch.uint8); out = torch.empty(1, 256)\n"
        "for call in (lambda: K.dequantize(raw.data_ptr(), 18, 1, 256, out.data_ptr(), 1),\n"
        "             lambda: K.gemv(raw.data_ptr(), 18, 1, 256, out.data_ptr(), out.data_ptr(), 1, 'scalar')):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print('refused:', e)\n"
        "    else:\n"
        "        print('ran')\n"
        "try:\n"
        "    K.set_iq_table('iq2xxs', b'123')\n"
        "except ValueError as e:\n"
        "    print('bad size:', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("refused: iq2_xxs kernels need the 'iq2xxs' table") for line in lines[:2])
    assert "gguf" in lines[0]
    assert lines[2].startswith("bad size: set_iq_table iq2xxs: expected 2048 bytes, got 3")
    with pytest.raises(ValueError, match="unknown table 'iq9'"):
        _kernels.set_iq_table("iq9", b"")


# ---- end to end: fused MoE decode and prefill on records of the new types ----

def _experts(gate_up: str, down: str, num: int, hidden: int, inter: int, gen):
    out, ref = [], []
    for _ in range(num):
        parts = []
        for name, rows, cols in ((gate_up, 2 * inter, hidden), (down, hidden, inter)):
            raw = _blocks(name, rows, cols, gen, edges=False)
            parts.append((QuantTensor(raw, ENCODINGS[name], (rows, cols)), torch.from_numpy(_gguf(raw, name))))
        out.append(ExpertWeights(parts[0][0], parts[1][0]))
        ref.append((parts[0][1], parts[1][1]))
    return out, ref


def _torch_moe(x, ref, weights):
    out = torch.zeros(x.shape[-1], dtype=torch.float64)
    for (gu, dn), w in zip(ref, weights):
        h = gu.double() @ x.double().view(-1)
        inter = dn.shape[1]
        out += w * (dn.double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


PAIRS = [("mxfp4", "mxfp4"), ("q2_k", "q3_k"), ("iq4_nl", "q5_0"), ("q4_1", "q5_1"), ("iq4_xs", "iq2_s"),
         ("iq2_xxs", "iq3_s"), ("iq3_xxs", "iq2_xs"), ("iq1_s", "iq1_m")]


@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize("gate_up,down", PAIRS)
def test_moe_decode_and_prefill_match_torch_reference(isa, gate_up, down):
    """Fast path (int8 activations): relative error <= 3e-2 of the float64 product of the
    dequantized weights, as for the other block types (tests/test_quant.py); the exact path
    (native dequantization + torch) within 1e-5; prefill equals each token's decode up to the order
    of the sum."""
    gen = torch.Generator().manual_seed(NATIVE_IDS[gate_up] * 31 + NATIVE_IDS[down])
    hidden, inter, num = 256, 256, 4
    experts, ref = _experts(gate_up, down, num, hidden, inter, gen)
    weights = torch.rand(num, generator=gen).tolist()
    x = torch.randn(1, hidden, generator=gen)
    want = _torch_moe(x, ref, weights)
    out = native.moe_decode(x, experts, weights, isa=isa, threads=2)[0].double()
    assert ((out - want).norm() / want.norm()).item() < 3e-2
    exact = kernels.experts_decode(x, experts, weights, ExecContext(ExecPolicy(kernel_mode="exact")))[0].double()
    assert ((exact - want).norm() / want.norm()).item() < 1e-5
    # the model's fast path takes the native kernel for these types (the same bits as the direct call)
    assert native.knows(ENCODINGS[gate_up]) and native.knows(ENCODINGS[down])
    fast = kernels.experts_decode(x, experts, weights, ExecContext(ExecPolicy(kernel_mode="fast", isa=isa, native_threads=2)))
    assert torch.equal(fast[0].double(), out)

    tokens, top_k = 5, 2
    xs = torch.randn(tokens, hidden, generator=gen)
    picks = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    pick_w = torch.rand(tokens, top_k, generator=gen)
    order = torch.argsort(picks.reshape(-1), stable=True)
    ids, counts = torch.unique(picks.reshape(-1), return_counts=True)
    got = native.moe_prefill(xs, [experts[i] for i in ids.tolist()], counts, order // top_k, pick_w.reshape(-1)[order],
                             torch.zeros_like(xs), isa=isa, threads=2)
    for t in range(tokens):
        chosen = picks[t].tolist()
        want_t = _torch_moe(xs[t:t + 1], [ref[e] for e in chosen], pick_w[t].tolist())
        assert ((got[t].double() - want_t).norm() / want_t.norm()).item() < 3e-2, t
        alone = native.moe_decode(xs[t:t + 1], [experts[e] for e in chosen], pick_w[t].tolist(), isa=isa)[0]
        torch.testing.assert_close(got[t], alone, rtol=1e-5, atol=1e-5)


# ---- real blocks from llama.cpp's own quantizer ----

# file types llama.cpp quantizes without an importance matrix (its IQ3 file types put some tensors
# in iq2_s, which needs one), and the new block types they hold
LLAMA_FTYPES = ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"]
LLAMA_MAKES = {"q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4"}


@pytest.fixture(scope="module")
def llama_quantized(tmp_path_factory):
    """{encoding name: [raw block rows]} from a tiny Qwen3-MoE exported to GGUF f32 and quantized by
    llama.cpp to each file type of LLAMA_FTYPES."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/setup.sh")
    hf_models = pytest.importorskip("hf_models")
    from lean_qwenflash.store.gguf_export import export_gguf
    tmp = tmp_path_factory.mktemp("llama_q")
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    f32 = export_gguf(hf_models.save_checkpoint(model, str(tmp / "ckpt")), tmp / "f32.gguf", "f32")
    by_ggml = {ENCODINGS[n].ggml_type: n for n in NEW}
    found: dict = {}
    for ftype in LLAMA_FTYPES:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = 1
        out = tmp / f"{ftype}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0, ftype
        for t in gguf.GGUFReader(str(out)).tensors:
            name = by_ggml.get(int(t.tensor_type))
            if name is not None:
                raw = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8)
                found.setdefault(name, []).append(raw.reshape(-1, raw.shape[-1]))
    return found


def test_llama_cpp_blocks_dequantize_bit_equal_and_multiply_within_bounds(llama_quantized):
    """Every new type llama.cpp makes without an importance matrix: native dequantization equals
    gguf's bit for bit, and each ISA's product is within the fp32 bound of w . q(x) (as above)."""
    assert set(llama_quantized) == LLAMA_MAKES, set(llama_quantized)
    gen = torch.Generator().manual_seed(0)
    for name, tensors in llama_quantized.items():
        enc = ENCODINGS[name]
        for raw in tensors:
            rows, cols = raw.shape[0], raw.shape[1] // enc.block_bytes * enc.block_size
            ref = _gguf(raw, name)
            assert np.array_equal(_native_deq(raw, name, cols).view(np.uint32), ref.view(np.uint32)), name
            w = torch.from_numpy(ref).double()
            x = torch.randn(cols, generator=gen)
            qx, _ = _quantized_act(x)
            fp32_term = 1e-5 * (w.abs() @ x.double().abs()) + 1e-30
            for isa in native.ISAS:
                assert ((_gemv(raw, name, rows, cols, x, isa) - w @ qx).abs() <= fp32_term).all(), (name, isa)
