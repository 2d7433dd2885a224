"""The GGUF block types of issue 19 (q4_1, q5_0, q5_1, q2_k, q3_k, iq4_nl, iq4_xs, mxfp4 and the
I-quant lattice types): our torch dequantizers equal gguf's bit for bit on random valid blocks and
on blocks llama.cpp wrote; our quantizers stay within bounds and near llama.cpp's error; the
presets, fallbacks, GPT-OSS's MXFP4 experts packed byte for byte, float experts of another dtype
at float32, and `inspect`'s tensor table."""
import ctypes
import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from lean_qwenflash.config import load_config  # noqa: E402
from lean_qwenflash.models import native  # noqa: E402
from lean_qwenflash.quant import ENCODINGS, QuantTensor, get_encoding, mxfp4  # noqa: E402
from lean_qwenflash.quant.iquants import iq_tables  # noqa: E402
from lean_qwenflash.quant.presets import (FALLBACK, PRESETS, check_preset, expert_encodings,  # noqa: E402
                                          fallback, resident_encoding)
from lean_qwenflash.runtime import Runtime  # noqa: E402
from lean_qwenflash.store import ExpertStore  # noqa: E402
from lean_qwenflash.store.packer import pack  # noqa: E402

NEW = ["q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4",
       "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m"]
QUANTIZABLE = ["q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4"]
IMPORT_ONLY = [n for n in NEW if n not in QUANTIZABLE]
NATIVE_IDS = {"q4_1": 8, "q5_0": 9, "q5_1": 10, "q2_k": 11, "q3_k": 12, "iq4_nl": 13, "iq4_xs": 14, "mxfp4": 15,
              "iq3_xxs": 16, "iq3_s": 17, "iq2_xxs": 18, "iq2_xs": 19, "iq2_s": 20, "iq1_s": 21, "iq1_m": 22}
# byte offsets of each type's f16 scale fields in a block (iq1_m's f16 is split: see _random_blocks)
F16_FIELDS = {"q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q2_k": [80, 82], "q3_k": [108], "iq4_nl": [0],
              "iq4_xs": [0], "iq3_xxs": [0], "iq3_s": [0], "iq2_xxs": [0], "iq2_xs": [0], "iq2_s": [0],
              "iq1_s": [0], "iq1_m": [], "mxfp4": []}
EDGES = torch.tensor([0.0, 6e-8, -6e-8, 6.1e-5, 65504.0, -65504.0, 1.0, -0.5, 1e-3, 3.14], dtype=torch.float16)
# quantize -> dequantize relative RMS error on Gaussian rows, with margin over what we measure
# (q4_1 .077, q5_0 .043, q5_1 .037, q2_k .275, q3_k .145, iq4_nl .073, iq4_xs .084, mxfp4 .111)
REL_RMS_BOUND = {"q4_1": 0.085, "q5_0": 0.047, "q5_1": 0.041, "q2_k": 0.29, "q3_k": 0.155, "iq4_nl": 0.08,
                 "iq4_xs": 0.09, "mxfp4": 0.12}


def _ref(raw: torch.Tensor, enc) -> np.ndarray:
    return gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType(enc.ggml_type)).reshape(raw.shape[0], -1)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _random_blocks(enc, rows: int, cols: int, gen) -> torch.Tensor:
    """Random block bytes whose scales are edge values (zero, subnormals, +-max, tiny, 1): every
    code, sign and index bit random; mxfp4 exponents 0..252 (above, code 12 overflows float32)."""
    raw = torch.randint(0, 256, (rows, enc.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    b = raw.view(-1, enc.block_bytes)
    pick = lambda: EDGES[torch.randint(0, len(EDGES), (b.shape[0],), generator=gen)].view(torch.int16).to(torch.int64)
    for off in F16_FIELDS[enc.name]:
        b[:, off:off + 2] = EDGES[torch.randint(0, len(EDGES), (b.shape[0],), generator=gen)].view(torch.uint8).view(-1, 2)
    if enc.name == "mxfp4":
        b[:, 0] = torch.randint(0, 253, (b.shape[0],), dtype=torch.uint8, generator=gen)
    if enc.name == "iq1_m":        # the f16 d is the top nibble of the four u16 scale words
        d = pick() & 0xFFFF
        for i in range(4):
            hi = 49 + 2 * i        # the high byte of scale word i
            b[:, hi] = (b[:, hi] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).to(torch.uint8)
    return raw


def test_registry_ids_and_sizes():
    """Every new type is registered with the native id the kernels use and gguf's block size."""
    for name, nid in NATIVE_IDS.items():
        enc = get_encoding(name)
        assert enc.native_id == nid
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(enc.ggml_type)]
        assert (enc.block_size, enc.block_bytes) == (block, size), name
    assert len({e.native_id for e in ENCODINGS.values()}) == len(ENCODINGS)
    from lean_qwenflash.store.gguf_file import BY_GGML_TYPE
    assert {BY_GGML_TYPE[get_encoding(n).ggml_type] for n in NEW} == set(NEW)


@pytest.mark.parametrize("name", NEW)
def test_dequantize_equals_gguf_on_random_valid_blocks(name):
    enc = ENCODINGS[name]
    gen = torch.Generator().manual_seed(17)
    cols = enc.block_size * 3
    raw = _random_blocks(enc, 13, cols, gen)
    ours = enc.dequantize(raw, cols).numpy()
    ref = _ref(raw, enc)
    assert np.isfinite(ref).all()
    assert _same_bits(ours, ref)                   # -0.0 included
    # leading dimensions are kept; the native exact path (or its torch stand-in) agrees too
    assert _same_bits(enc.dequantize(raw.view(13, 1, -1), cols).numpy().reshape(13, cols), ref)
    out = torch.empty(13, cols)
    native.dequantize_into(QuantTensor(raw, enc, (13, cols)), out)
    assert _same_bits(out.numpy(), ref)


# -- llama.cpp's own quantizer: ggml_quantize_chunk from the libggml that llama-cpp-python ships ------

def _ggml():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/setup.sh")
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        pytest.skip(f"llama-cpp-python ships no {path}")
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def _llama_quantize(lib, enc, x: np.ndarray, imatrix: bool = False) -> torch.Tensor:
    """llama.cpp's blocks of x [rows, cols]; with an importance matrix of ones where asked or
    where the type needs one (iq2_xxs, iq2_xs, iq1_s)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    out = np.zeros((rows, enc.row_bytes(cols)), dtype=np.uint8)
    im = np.ones(cols, dtype=np.float32)
    need = imatrix or lib.ggml_quantize_requires_imatrix(enc.ggml_type)
    n = lib.ggml_quantize_chunk(enc.ggml_type, x.ctypes.data, out.ctypes.data, 0, rows, cols,
                                im.ctypes.data if need else None)
    assert n == out.size
    return torch.from_numpy(out)


def _gaussian(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[0] = 0.0                       # an all-zero row
    x[1, :64] *= 300.0               # outliers
    x[2] = np.abs(x[2])              # one-signed rows
    x[3] = -np.abs(x[3])
    return x


@pytest.mark.parametrize("name", NEW)
def test_dequantize_equals_gguf_on_blocks_llama_cpp_quantized(name):
    lib = _ggml()
    enc = ENCODINGS[name]
    x = _gaussian(24, 1024, 5)
    for imatrix in (False, True):
        raw = _llama_quantize(lib, enc, x, imatrix)
        ref = _ref(raw, enc)
        assert np.isfinite(ref).all()
        assert _same_bits(enc.dequantize(raw, 1024).numpy(), ref), (name, imatrix)
        out = torch.empty(24, 1024)
        native.dequantize_into(QuantTensor(raw, enc, (24, 1024)), out)
        assert _same_bits(out.numpy(), ref)
        # these are real quantizations of x (the blocks mean what we think they mean)
        rel = np.linalg.norm(ref[4:] - x[4:]) / np.linalg.norm(x[4:])
        assert rel < 0.6, (name, rel)


def test_dequantize_equals_gguf_on_files_llama_quantize_wrote(tmp_path):
    """Whole GGUF files from llama.cpp's llama_model_quantize (a tiny Qwen3-MoE with 256-wide rows,
    exported to f32 first) for each new preset it makes without an importance matrix: every tensor
    of every new type dequantizes to gguf's values bit for bit."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by scripts/setup.sh")
    hf_models = pytest.importorskip("hf_models")
    from lean_qwenflash.store.gguf_export import export_gguf
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    f32 = export_gguf(hf_models.save_checkpoint(model, str(tmp_path / "ckpt")), tmp_path / "f32.gguf", "f32")
    by_ggml = {e.ggml_type: e for e in ENCODINGS.values()}
    seen = set()
    for ftype in ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = 1
        out = tmp_path / f"{ftype}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
        for t in gguf.GGUFReader(str(out)).tensors:
            enc = by_ggml.get(int(t.tensor_type))
            if enc is None or enc.name not in NEW:
                continue
            raw = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8)
            raw = raw.reshape(-1, raw.shape[-1])
            cols = raw.shape[-1] // enc.block_bytes * enc.block_size
            ref = gguf_dequantize(raw.numpy(), t.tensor_type).reshape(raw.shape[0], cols)
            assert _same_bits(enc.dequantize(raw, cols).numpy(), ref), (ftype, t.name)
            seen.add(enc.name)
    assert seen == {"q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4"}, seen


# -- our quantizers --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_round_trip_within_bounds_and_near_llama_cpp(name):
    enc = ENCODINGS[name]
    x = torch.from_numpy(_gaussian(40, 1024, 9))
    raw = enc.quantize(x)
    assert raw.dtype == torch.uint8 and raw.shape == (40, enc.row_bytes(1024))
    y = enc.dequantize(raw, 1024)
    assert torch.isfinite(y).all() and torch.equal(y[0], torch.zeros(1024))
    assert _same_bits(y.numpy(), _ref(raw, enc))          # gguf reads our blocks as we do
    # the outlier block is represented, not clipped to nothing
    assert (y[1, :64] - x[1, :64]).norm() / x[1, :64].norm() < 2 * REL_RMS_BOUND[name]
    rel = ((y[4:] - x[4:]).norm() / x[4:].norm()).item()
    assert rel <= REL_RMS_BOUND[name], rel
    # against llama.cpp's reference quantizer (no importance matrix) on the same rows
    lib = _ggml()
    theirs = _ref(_llama_quantize(lib, enc, x.numpy()), enc)
    their_rel = float(np.linalg.norm(theirs[4:] - x.numpy()[4:]) / np.linalg.norm(x.numpy()[4:]))
    assert rel <= their_rel * 1.15, (rel, their_rel)
    # and gguf-py's quantizer where it has one
    qtype = gguf.GGMLQuantizationType(enc.ggml_type)
    try:
        g = gguf_dequantize(gguf.quants.quantize(x.numpy(), qtype), qtype).reshape(40, -1)
    except NotImplementedError:
        return
    g_rel = float(np.linalg.norm(g[4:] - x.numpy()[4:]) / np.linalg.norm(x.numpy()[4:]))
    assert rel <= g_rel * 1.02, (rel, g_rel)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_keeps_leading_dims_and_rejects_bad_rows(name):
    enc = ENCODINGS[name]
    x = torch.randn(2, 3, 2 * enc.block_size) * 0.1
    raw = enc.quantize(x)
    assert raw.shape == (2, 3, enc.row_bytes(2 * enc.block_size))
    assert torch.equal(enc.dequantize(raw, 2 * enc.block_size), enc.dequantize(raw.reshape(6, -1), 2 * enc.block_size)
                       .reshape(2, 3, -1))
    with pytest.raises(ValueError, match=f"multiple of {enc.block_size}"):
        enc.row_bytes(enc.block_size + 16)


@pytest.mark.parametrize("name", IMPORT_ONLY)
def test_lattice_types_are_import_only(name):
    with pytest.raises(ValueError, match="importance matrix.*GGUF"):
        ENCODINGS[name].quantize(torch.zeros(1, 256))


def test_iq_tables_are_the_documented_arrays():
    t = iq_tables()
    shapes = {"iq2xxs_grid": (256, 8), "iq2xs_grid": (512, 8), "iq2s_grid": (1024, 8), "iq3xxs_grid": (256, 4),
              "iq3s_grid": (512, 4), "iq1s_grid": (2048, 8), "ksigns": (128,), "kvalues_iq4nl": (16,),
              "kvalues_mxfp4": (16,)}
    assert {k: v.shape for k, v in t.items()} == shapes
    for k in ("iq2xxs_grid", "iq2xs_grid", "iq2s_grid"):
        assert t[k].dtype == np.uint8 and set(np.unique(t[k])) == {8, 25, 43}
    assert set(np.unique(t["iq3xxs_grid"])) <= {4, 12, 20, 28, 36, 44, 52, 62}
    assert set(np.unique(t["iq3s_grid"])) <= set(range(1, 16, 2))
    assert t["iq1s_grid"].dtype == np.int8 and set(np.unique(t["iq1s_grid"])) == {-1, 0, 1}
    # ksigns: index i's low 7 bits are i, bit 7 makes the count of set bits even
    assert all(int(s) & 127 == i and bin(int(s)).count("1") % 2 == 0 for i, s in enumerate(t["ksigns"]))
    assert list(t["kvalues_mxfp4"][:8]) == [0, 1, 2, 3, 4, 6, 8, 12]
    assert not t["iq2s_grid"].flags.writeable


# -- MXFP4: the block layout vs the checkpoint layout ----------------------------------------------

def test_mxfp4_from_hf_is_a_rearrangement():
    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=gen)
    rows = mxfp4.from_hf(blocks, scales)
    assert rows.shape == (3, 5, 4 * 17)
    enc = get_encoding("mxfp4")
    assert torch.equal(enc.dequantize(rows, 128), mxfp4.dequantize(blocks, scales))
    # same multiset of nibbles per block, same scale byte
    b = rows.reshape(-1, 17)
    assert torch.equal(b[:, 0], scales.reshape(-1))
    nib = lambda t: torch.sort(torch.cat((t & 15, t >> 4), dim=-1), dim=-1).values
    assert torch.equal(nib(b[:, 1:]), nib(blocks.reshape(-1, 16)))


# -- presets and fallbacks ------------------------------------------------------------------------

def test_presets_and_what_is_not_offered():
    for p in ("q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs", "mxfp4"):
        assert p in PRESETS
    for p in ("iq2_xxs", "IQ3_XXS", "iq1_s", "iq2_m"):
        with pytest.raises(ValueError, match="importance matrix.*llama-quantize"):
            check_preset(p)
    with pytest.raises(ValueError, match="--quant must be one of"):
        check_preset("q7_z")
    # q3_k_m: gate/up q3_k; down q5_k in the first sixteenth of the layers, q4_k after
    downs = [expert_encodings("q3_k_m", i, 32)["down"] for i in range(32)]
    assert downs == ["q5_k"] * 2 + ["q4_k"] * 30
    assert {expert_encodings("q3_k_m", i, 32)["gate_up"] for i in range(32)} == {"q3_k"}
    assert resident_encoding("q3_k_m", "model.layers.3.self_attn.v_proj.weight") == "q4_k"
    assert resident_encoding("q3_k_m", "model.layers.3.self_attn.q_proj.weight") == "q3_k"
    assert resident_encoding("iq4_xs", "lm_head.weight") == "q6_k"
    assert resident_encoding("mxfp4", "model.layers.0.self_attn.q_proj.weight") == "q8_0"
    assert expert_encodings("mxfp4", 0, 4) == {"gate_up": "mxfp4", "down": "mxfp4"}
    assert resident_encoding("iq4_nl", "model.embed_tokens.weight") is None


def test_fallback_takes_the_nearest_block_type_then_the_float():
    assert fallback("q4_k", 512, "bf16") == ("q4_k", "")
    for big, small in FALLBACK.items():
        got, why = fallback(big, 1408, "bf16")        # GLM-4.5-Air's expert width: 44 x 32, not 256-aligned
        assert got == small and "not a multiple" in why
        assert get_encoding(small).block_size == 32
    assert fallback("q4_k", 48, "bf16")[0] == "bf16"     # no block type holds 48
    assert fallback("q8_0", 40, "f16")[0] == "f16"


def test_pack_falls_back_to_bf16_not_f32(tmp_path):
    hf_models = pytest.importorskip("hf_models")
    c = hf_models.case("qwen3_moe")            # f32 checkpoint; hidden 48, expert width 24: no block fits
    m = pack(c.path, tmp_path / "p", quant="q4_k", progress=False)
    assert {t.encoding for l in m.layers for t in l.tensors} == {"bf16"}
    assert any("not a multiple of q4_k's block of 256; stored as bf16" in n for n in m.notes), m.notes
    # residents that fell back are bf16 too, and say so
    doc = json.loads((tmp_path / "p" / "manifest.json").read_text())
    res = {t["name"]: t["encoding"] for t in doc["resident"]}
    assert res["model.layers.0.self_attn.q_proj.weight"] == "bf16"
    assert any(n.startswith("resident") and "stored as bf16" in n for n in m.notes)
    # an f32 pack asked for explicitly stays f32
    m = pack(c.path, tmp_path / "q", quant="q4_k", dtype="float32", progress=False)
    assert {t.encoding for l in m.layers for t in l.tensors} == {"f32"}
    with pytest.raises(ValueError, match="importance matrix"):
        pack(c.path, tmp_path / "r", quant="iq2_xxs", progress=False)
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.tmp").exists()


def test_pack_falls_back_to_32_value_blocks(tmp_path):
    """Rows of 96 (a multiple of 32, not of 256): q4_k -> q5_0, q6_k -> q8_0, q3_k -> iq4_nl."""
    hf_models = pytest.importorskip("hf_models")
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    cfg = dict(model.config.to_dict())
    import transformers
    cfg.update(hidden_size=256, moe_intermediate_size=96)
    small = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).eval()
    path = hf_models.save_checkpoint(small, str(tmp_path / "ckpt"))
    m = pack(path, tmp_path / "p", quant="q4_k_m", progress=False)
    for l in m.layers:
        enc = {t.name: t.encoding for t in l.tensors}
        assert enc["gate_up"] == "q4_k"                  # rows of 256
        assert enc["down"] in ("q5_0", "q8_0")           # rows of 96: q4_k -> q5_0, q6_k -> q8_0
    assert any("down" in n and "stored as q5_0" in n for n in m.notes)
    m = pack(path, tmp_path / "q", quant="q3_k_m", progress=False)
    assert {t.encoding for l in m.layers for t in l.tensors if t.name == "down"} == {"q5_0"}   # q4_k's fallback
    with Runtime.open(load_config(model=str(tmp_path / "q"), expert_kernels="exact")) as rt:
        assert torch.isfinite(rt.model(hf_models.prompt_ids(cfg["vocab_size"], 12))).all()


# -- packs of the new presets run, streamed == resident ----------------------------------------------

@pytest.fixture(scope="module")
def quant_checkpoint(tmp_path_factory):
    hf_models = pytest.importorskip("hf_models")
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    return hf_models.save_checkpoint(model, str(tmp_path_factory.mktemp("qt") / "ckpt")), model


@pytest.mark.parametrize("preset", ["q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs", "mxfp4"])
def test_new_presets_pack_and_stream_bit_identically(preset, quant_checkpoint, tmp_path):
    hf_models = pytest.importorskip("hf_models")
    path, model = quant_checkpoint
    m = pack(path, tmp_path / "p", quant=preset, progress=False)
    encs = {t.encoding for l in m.layers for t in l.tensors}
    assert encs == ({"q3_k", "q4_k"} if preset == "q3_k_m" else {preset}), encs
    prompt = hf_models.prompt_ids(model.config.vocab_size, 24)
    with torch.no_grad():
        ref = model(prompt).logits
    with ExpertStore.open(tmp_path / "p") as store:
        slot, top_k = store.max_record_bytes, int(store.config["num_experts_per_tok"])
    for mode in ("exact", "fast"):
        with Runtime.open(load_config(model=str(tmp_path / "p"), expert_kernels=mode), resident_experts=True) as rt:
            resident = rt.model(prompt)
        with Runtime.open(load_config(model=str(tmp_path / "p"), expert_kernels=mode,
                                      host_cache_bytes=top_k * slot)) as rt:
            streamed = rt.model(prompt)
            assert rt.stats()["total"]["misses"] > 0
        assert torch.equal(streamed, resident), mode
        # quantization moves the logits, but stays the same model (bounded by the type's error)
        p, q = ref.log_softmax(-1), resident.log_softmax(-1)
        kl = (p.exp() * (p - q)).sum(-1).mean().item()
        assert kl < (0.2 if preset == "q2_k" else 0.05), (preset, mode, kl)


# -- GPT-OSS: MXFP4 experts packed byte for byte ---------------------------------------------------

def _mxfp4_gpt_oss(tmp_path):
    """A tiny GPT-OSS checkpoint with its experts stored as MXFP4 (blocks/scales), and transformers'
    model holding exactly the dequantized experts."""
    import copy

    from safetensors.torch import save_file
    hf_models = pytest.importorskip("hf_models")
    c = hf_models.case("gpt_oss", "quant")
    model = copy.deepcopy(c.hf_model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            linear = state.pop(key).transpose(1, 2).contiguous()
            blocks, scales = mxfp4.quantize(linear)
            state[key + "_blocks"], state[key + "_scales"] = blocks, scales
            model.get_parameter(key).copy_(mxfp4.dequantize(blocks, scales).transpose(1, 2))
    src = tmp_path / "mxfp4"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(dict(c.config, quantization_config={"quant_method": "mxfp4"})))
    return src, state, model, c


def test_gpt_oss_mxfp4_experts_pack_byte_for_byte(tmp_path):
    src, state, model, c = _mxfp4_gpt_oss(tmp_path)
    m = pack(src, tmp_path / "mx", progress=False)
    assert {t.encoding for l in m.layers for t in l.tensors} == {"mxfp4"}
    assert any("mxfp4" in n and "byte for byte" in n for n in m.notes), m.notes
    old = pack(src, tmp_path / "bf16", dtype="bfloat16", progress=False)       # the former path: bf16
    assert {t.encoding for l in old.layers for t in l.tensors} == {"bf16"}
    assert any("dequantized" in n for n in old.notes)
    ratio = old.experts_bytes / m.experts_bytes
    bf16_bytes = sum(t.nbytes for t in old.layers[0].tensors)
    mx_bytes = sum(t.nbytes for t in m.layers[0].tensors)
    assert bf16_bytes / mx_bytes == pytest.approx(64 / 17)                     # 2 bytes vs 17/32 a value
    assert ratio > 3                                                           # (records are padded to 4 KiB)
    with ExpertStore.open(tmp_path / "mx") as mx_store, ExpertStore.open(tmp_path / "bf16") as bf_store:
        for layer in mx_store.moe_layers:
            for e in (0, 5):
                rec, ref = mx_store.read_expert(layer, e), bf_store.read_expert(layer, e)
                for ours, theirs in zip(rec, ref):
                    assert isinstance(ours, QuantTensor) and ours.encoding.name == "mxfp4"
                    assert theirs.dtype == torch.bfloat16
                    assert torch.equal(ours.dequantize(), theirs.float())
                # the bytes are the checkpoint's: scale bytes of gate_up are its scales, rows de-interleaved
                s = state[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"][e]
                s = torch.cat((s[0::2], s[1::2]))
                assert torch.equal(rec.gate_up.raw.view(-1, 17)[:, 0], s.reshape(-1))
    # the pack runs and computes what transformers computes with the same (dequantized) experts
    prompt = c.prompt
    with torch.no_grad():
        want = model(prompt).logits
    with Runtime.open(load_config(model=str(tmp_path / "mx"), expert_kernels="exact", host_cache_bytes="8MiB")) as rt:
        torch.testing.assert_close(rt.model(prompt), want, rtol=1e-4, atol=1e-5)
    # fast mode (native kernels where the build has mxfp4: int8 activations) stays close
    with Runtime.open(load_config(model=str(tmp_path / "mx"), expert_kernels="fast", host_cache_bytes="8MiB")) as rt:
        got = rt.model(prompt)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()
    p, q = want.log_softmax(-1), got.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 1e-3
    # --quant mxfp4 of an MXFP4 checkpoint keeps the experts' bytes too (residents in q8_0)
    q = pack(src, tmp_path / "mxq", quant="mxfp4", progress=False)
    assert any("byte for byte" in n for n in q.notes)
    with ExpertStore.open(tmp_path / "mx") as a, ExpertStore.open(tmp_path / "mxq") as b:
        layer = a.moe_layers[-1]
        assert torch.equal(a.read_expert(layer, 3).down.raw, b.read_expert(layer, 3).down.raw)


# -- float experts of another dtype at float32 -----------------------------------------------------

def test_bf16_experts_run_at_float32(tmp_path):
    """A pack whose experts are bf16 runs at dtype float32 (converted per call): the same logits as
    an f32 pack of the bf16-rounded experts, streamed == resident, both kernel modes."""
    hf_models = pytest.importorskip("hf_models")
    c = hf_models.case("qwen3_moe")
    pack(c.path, tmp_path / "bf16", dtype="bfloat16", progress=False)
    prompt = c.prompt
    outs = {}
    for mode in ("exact", "fast"):
        cfg = load_config(model=str(tmp_path / "bf16"), dtype="float32", expert_kernels=mode)
        with Runtime.open(cfg, resident_experts=True) as rt:
            outs[mode] = rt.model(prompt)
            assert outs[mode].dtype == torch.float32
        with ExpertStore.open(tmp_path / "bf16") as store:
            slot = store.max_record_bytes
        cfg = load_config(model=str(tmp_path / "bf16"), dtype="float32", expert_kernels=mode,
                          host_cache_bytes=2 * slot)
        with Runtime.open(cfg) as rt:
            assert torch.equal(rt.model(prompt), outs[mode]), mode
    # the reference: transformers in fp32 with the experts rounded to bf16
    import copy
    model = copy.deepcopy(c.hf_model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(torch.bfloat16).float())
        want = model(prompt).logits
    torch.testing.assert_close(outs["exact"], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["fast"], want, rtol=1e-4, atol=1e-5)


def test_bf16_resident_matrices_stay_bf16_in_fast_mode(tmp_path):
    """A checkpoint stored in bf16 (as most releases are) run at dtype float32: in fast mode on CPU
    its attention / shared / head matrices keep their bf16 bytes (ExecPolicy.stored_floats: half an
    fp32 copy) and run through the native kernels, within fast mode's bound of the exact logits;
    exact mode converts them and matches transformers on the same bf16 weights; streamed ==
    resident in both."""
    import copy
    from lean_qwenflash.models.layers.linear import Linear
    from lean_qwenflash.models.moe.routers import Router
    hf_models = pytest.importorskip("hf_models")
    c = hf_models.case("qwen3_moe")
    ref = copy.deepcopy(c.hf_model)          # fp32 with every parameter rounded to bf16
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf_models.save_checkpoint(copy.deepcopy(ref).to(torch.bfloat16), tmp_path / "ckpt")
    pack(tmp_path / "ckpt", tmp_path / "p", progress=False)
    with ExpertStore.open(tmp_path / "p") as store:
        slot = store.max_record_bytes
    outs = {}
    for mode in ("exact", "fast"):
        cfg = load_config(model=str(tmp_path / "p"), dtype="float32", expert_kernels=mode)
        with Runtime.open(cfg, resident_experts=True) as rt:
            linears = [m for m in rt.model.modules() if isinstance(m, Linear) and not isinstance(m, Router)]
            kept = [m for m in linears if m.qweight is not None]
            if mode == "fast":
                assert kept == linears and all(m.qweight.encoding.name == "bf16" for m in kept)
                assert all(m.weight.dtype == torch.float32 for m in rt.model.modules() if isinstance(m, Router))
            else:
                assert not kept and all(m.weight.dtype == torch.float32 for m in linears)
            outs[mode] = rt.model(c.prompt)
        cfg = load_config(model=str(tmp_path / "p"), dtype="float32", expert_kernels=mode,
                          host_cache_bytes=2 * slot)
        with Runtime.open(cfg) as rt:
            assert torch.equal(rt.model(c.prompt), outs[mode]), mode
    with torch.no_grad():
        want = ref(c.prompt).logits
    torch.testing.assert_close(outs["exact"], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["fast"], want, rtol=1e-3, atol=1e-4)
    assert not torch.equal(outs["fast"], outs["exact"])     # the native products did run


# -- inspect ---------------------------------------------------------------------------------------

def test_inspect_lists_every_tensor_with_encoding_and_bytes(tmp_path, capsys, quant_checkpoint):
    from lean_qwenflash.cli import main
    path, _ = quant_checkpoint
    m = pack(path, tmp_path / "p", quant="q3_k_m", progress=False)
    assert main(["inspect", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    table = out.split("tensors:\n", 1)[1]
    for l in m.layers:
        for t in l.tensors:
            line = next(s for s in table.splitlines() if s.strip().startswith(f"layers.{l.layer_idx}.experts.{t.name} "))
            assert t.encoding in line and str(list(t.shape)) in line
    for t in m.resident:
        line = next(s for s in table.splitlines() if s.strip().startswith(t.name + " "))
        assert t.encoding in line
    assert "q3_k" in table and "q4_k" in table and "q6_k" in table      # head q6_k, attention v/o q4_k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("name", NEW)
def test_cuda_dequantize_and_quantize_equal_cpu(name):
    """The torch code is the reference on CUDA too: the same bits from the same blocks."""
    enc = ENCODINGS[name]
    gen = torch.Generator().manual_seed(23)
    cols = enc.block_size * 4
    raw = _random_blocks(enc, 9, cols, gen)
    assert torch.equal(enc.dequantize(raw.cuda(), cols).cpu(), enc.dequantize(raw, cols))
    if name in QUANTIZABLE:
        x = torch.from_numpy(_gaussian(8, 1024, 3))
        got = enc.dequantize(enc.quantize(x.cuda()), 1024).cpu()
        rel = ((got[4:] - x[4:]).norm() / x[4:].norm()).item()
        assert rel <= REL_RMS_BOUND[name], rel
