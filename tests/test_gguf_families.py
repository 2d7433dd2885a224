"""GGUF import of the families beyond test_gguf.py's four: qwen35moe (Qwen3.5-MoE's text model),
gpt-oss, glm4moe, deepseek2 (DeepSeek-V2 and V3) and afmoe.

Per family: a tiny random transformers checkpoint (``hf_models.GGUF_VARIANT``: expert rows of 256
values, and the settings llama.cpp's graph for the architecture fixes), written as an f32 GGUF by
our exporter with the names and metadata llama.cpp's converter writes, quantized by llama.cpp
itself (Q8_0, Q4_K_M) and dequantized back to f32 by llama.cpp. The oracle is llama-cpp-python
(its bundled llama.cpp loads all five architectures) with an f32 KV cache: our exact kernels on
the pack of a file vs llama.cpp on the f32 file (or on its f32 copy of the quantized one).

Also: a pack of the f32 GGUF is the pack of the HF checkpoint, bit for bit (names, transforms and
config read back exactly); DeepSeek's older attn_kv_b layout and a rotate-half DeepSeek checkpoint
(rope_interleave false, whose rope rows the exporter interleaves); V2 and V3 files told apart by
their gating function; GLM's multi-token-prediction layer skipped with a note; configs llama.cpp
cannot compute refused on export by name.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import llama_cpp  # the oracle; installed by setup.sh (never skipped)

from lean_qwenflash.config import load_config
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.store import ExpertStore, pack
from lean_qwenflash.store.gguf_export import export_gguf
from lean_qwenflash.store.gguf_file import GGUFCheckpoint

import hf_models

FAMILIES = ["afmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_5_moe"]
QUANTS = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
POSITIONS = 64
TEACHER = hf_models.prompt_ids(96, POSITIONS, seed=77)


def llama_quantize(src, dst, ftype) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def llama_logits(path, ids=TEACHER) -> torch.Tensor:
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, type_k=0, type_v=0, verbose=False)
    llm.eval(ids[0].tolist())
    return torch.tensor(np.array(llm.scores[:ids.shape[1]]))


def ours(pack_dir, ids=TEACHER) -> torch.Tensor:
    with Runtime.open(load_config(model=str(pack_dir), expert_kernels="exact"), resident_experts=True) as rt:
        return rt.model(ids)[0]


class Files:
    """Per family (and variant): the HF checkpoint, the f32 GGUF, llama.cpp's quantized copies and
    their f32 copies, and packs, made once."""

    def __init__(self, root):
        self.root = root
        self._made = {}

    def _once(self, key, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def hf(self, family, variant=hf_models.GGUF_VARIANT):
        def make():
            model, _ = hf_models.make_hf_model(family, variant)
            return hf_models.save_checkpoint(model, str(self.root / family / variant / "hf"))
        return self._once(("hf", family, variant), make)

    def gguf(self, family, kind="f32"):
        def make():
            path = self.root / family / f"model-{kind}.gguf"
            if kind == "f32":
                export_gguf(self.hf(family), path, "f32")
            elif kind.endswith("-f32"):
                llama_quantize(self.gguf(family, kind[:-4]), path, llama_cpp.LLAMA_FTYPE_ALL_F32)
            else:
                llama_quantize(self.gguf(family), path, QUANTS[kind])
            return path
        return self._once(("gguf", family, kind), make)

    def pack(self, src, name):
        def make():
            out = self.root / "packs" / name
            pack(src, out, progress=False)
            return out
        return self._once(("pack", name), make)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return Files(tmp_path_factory.mktemp("gguf_families"))


def _same_math(theirs: torch.Tensor, mine: torch.Tensor, what: str) -> float:
    top2 = torch.topk(theirs, 2, dim=-1).values
    close = (top2[:, 0] - top2[:, 1]) < 1e-3
    agree = theirs.argmax(-1) == mine.argmax(-1)
    diff = (mine - theirs).abs().max().item()
    print(f"{what}: max |dlogit| {diff:.2e}, argmax {agree.float().mean().item():.4f}")
    assert bool((agree | close).all()), f"{what}: argmax differs at {torch.nonzero(~agree & ~close).flatten().tolist()}"
    assert diff <= 1e-3, f"{what}: max |dlogit| {diff:.2e}"
    return diff


# -- same weights, same math as llama.cpp ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_weights_same_math_as_llama_cpp(family, kind, files):
    """Our exact kernels on the pack of the file vs llama.cpp on the f32 file (or on its own f32
    copy of the quantized file), teacher-forced on 64 positions."""
    ref = llama_logits(files.gguf(family, "f32" if kind == "f32" else f"{kind}-f32"))
    path = files.pack(files.gguf(family, kind), f"{family}-{kind}")
    _same_math(ref, ours(path), f"{family} {kind}")
    with ExpertStore.open(path) as store:
        got = {e for per in store.manifest.encodings().values() for e in per}
    assert got == {"f32": {"f32"}, "q8_0": {"q8_0"}, "q4_k_m": {"q4_k", "q6_k"}}[kind], got


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_pack_is_the_hf_pack(family, files):
    """HF -> f32 GGUF -> pack holds what HF -> pack holds, bit for bit: every resident tensor (names,
    transforms undone), every expert record, and the config the model is built from."""
    from lean_qwenflash.store.gguf_names import Split, Values, gguf_arch, transform_for
    arch = gguf_arch(family)
    from_gguf = files.pack(files.gguf(family), f"{family}-f32")
    from_hf = files.pack(files.hf(family), f"{family}-hf")
    rounded = []
    with ExpertStore.open(from_gguf) as g, ExpertStore.open(from_hf) as h:
        mine, theirs = g.load_resident(), h.load_resident()
        assert sorted(mine) == sorted(theirs)
        for name, t in theirs.items():
            tr = transform_for(arch, name)
            assert mine[name].dtype == t.dtype, name
            if isinstance(tr, Values) and not isinstance(tr, Split) and not torch.equal(mine[name], t):
                # float transforms and their inverse (1 + w, -exp(A_log)) round: within an ulp or two
                torch.testing.assert_close(mine[name], t, rtol=1e-6, atol=1e-7)
                rounded.append(name)
            else:
                assert torch.equal(mine[name], t), name
        assert g.manifest.family == h.manifest.family == family
        if family == "gpt_oss":
            # llama.cpp rounds YaRN's correction range (transformers' truncate=True); the released
            # gpt-oss configs say truncate false, so llama.cpp (and a GGUF-born pack) differ from
            # transformers there by design
            assert g.config["rope_parameters"]["truncate"] is True
    assert (from_gguf / "experts.bin").read_bytes() == (from_hf / "experts.bin").read_bytes()
    if rounded:
        print(f"{family}: {len(rounded)} value-transformed tensors round (e.g. {rounded[0]})")
        torch.testing.assert_close(ours(from_gguf), ours(from_hf), rtol=0, atol=1e-5)
    else:
        assert torch.equal(ours(from_gguf), ours(from_hf))


def test_quantized_records_are_the_gguf_bytes(files):
    import gguf
    for family in ("gpt_oss", "deepseek_v3", "qwen3_5_moe"):
        src = files.gguf(family, "q4_k_m")
        tensors = {t.name: np.asarray(t.data).reshape(-1).view(np.uint8) for t in gguf.GGUFReader(str(src)).tensors}
        path = files.pack(src, f"{family}-q4_k_m")
        blob = np.fromfile(path / "experts.bin", dtype=np.uint8)
        with ExpertStore.open(path) as store:
            for rec in store.manifest.layers:
                parts = [tensors[f"blk.{rec.layer_idx}.ffn_{r}_exps.weight"] for r in ("gate", "up", "down")]
                for e in range(rec.num_experts):
                    g, u, d = (t[e * (t.size // rec.num_experts):(e + 1) * (t.size // rec.num_experts)] for t in parts)
                    base, (gu, dn) = rec.offset(e), rec.tensors
                    assert np.array_equal(blob[base + gu.offset:base + gu.offset + gu.nbytes], np.concatenate([g, u]))
                    assert np.array_equal(blob[base + dn.offset:base + dn.offset + dn.nbytes], d)


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_reordered_columns_stay_encoded(kind, files, tmp_path):
    """Qwen3.5's out_proj, whose columns llama.cpp's converter reorders by value head: the pack keeps
    the file's block rows and the column order (a v3 pack; ``col_order``), not an f32 copy; it reads
    back as the HF matrix exactly; the fused decode step of every DeltaNet layer follows the separate
    calls (both permute the input); a pack that lost the order, or a v2 manifest claiming one, is
    refused by name."""
    import json
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    from lean_qwenflash.generate.state import DeltaNetState
    from lean_qwenflash.models.layers import deltanet
    from lean_qwenflash.quant import QuantCols
    from lean_qwenflash.store import StoreError

    src = files.gguf("qwen3_5_moe", kind)
    path = files.pack(src, f"qwen3_5_moe-{kind}")
    stored = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    ckpt = GGUFCheckpoint(src)
    doc = json.loads((path / "manifest.json").read_text())
    outs = [t for t in doc["resident"] if t["name"].endswith("linear_attn.out_proj.weight")]
    assert doc["version"] == 3 and outs and all(t.get("col_order") is True for t in outs)
    assert not any("out_proj" in n for n in doc["notes"]), doc["notes"]
    with ExpertStore.open(path) as store:
        resident = store.load_resident()
    for t in outs:
        q, layer = resident[t["name"]], int(t["name"].split(".")[2])
        theirs = stored[f"blk.{layer}.ssm_out.weight"]
        assert isinstance(q, QuantCols) and q.encoding.ggml_type == int(theirs.tensor_type)
        assert np.array_equal(q.inner.raw.numpy().reshape(-1), np.asarray(theirs.data).reshape(-1).view(np.uint8))
        assert not torch.equal(q.order, torch.arange(q.shape[1]))      # the test model has 2 value heads per key head
        assert torch.equal(q.dequantize(), ckpt.get(ckpt.resident_keys[t["name"]]))

    torch.manual_seed(0)
    with Runtime.open(load_config(model=str(path), dtype="float32", expert_kernels="fast"),
                      resident_experts=True) as rt, torch.inference_mode():
        layers = [layer for layer in rt.model._layers if isinstance(layer._blocks[0], deltanet.GatedDeltaNet)]
        assert layers
        for layer in layers:
            step, net, norm = layer.mixer_step(), layer._blocks[0], layer.input_layernorm
            assert isinstance(step, deltanet.DeltaNetStep) and isinstance(net.out_proj.qweight, QuantCols)
            fused, separate = DeltaNetState(), DeltaNetState()
            for _ in range(3):
                x = torch.randn(1, 1, net.out_proj.out_features)
                torch.testing.assert_close(step(x, None, fused), x + net(norm(x), None, separate), rtol=1e-5, atol=1e-5)

    name = outs[0]["name"]
    lost = tmp_path / "lost"
    shutil.copytree(path, lost)
    tensors = load_file(str(lost / "resident.safetensors"))
    tensors[name + ".col_order"] = torch.zeros_like(tensors[name + ".col_order"])
    save_file(tensors, str(lost / "resident.safetensors"))
    with ExpertStore.open(lost) as store, pytest.raises(StoreError, match=f"{name}.*col_order.*not a permutation"):
        store.load_resident()
    old = tmp_path / "v2"
    shutil.copytree(path, old)
    (old / "manifest.json").write_text(json.dumps(dict(doc, version=2)))
    with pytest.raises(StoreError, match=f"{name}: col_order True is not a v3"):
        ExpertStore.open(old)


# -- DeepSeek: both MLA layouts, rotate-half checkpoints, V2 / V3 ---------------------------------

def test_deepseek_older_kv_b_layout(files):
    """A file with one attn_kv_b per layer (older converters; per-head key/value sizes) loads in
    llama.cpp with the same logits as the split attn_k_b / attn_v_b file, and packs to the same pack."""
    old = export_gguf(files.hf("deepseek_v3"), files.root / "deepseek_v3" / "model-kv_b.gguf", "f32", alternatives=True)
    names = {t.name for t in GGUFCheckpoint(old).tensors.values()}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    new = files.gguf("deepseek_v3")
    assert "blk.0.attn_k_b.weight" in GGUFCheckpoint(new).tensors
    theirs_old, theirs_new = llama_logits(old), llama_logits(new)
    assert (theirs_old - theirs_new).abs().max().item() <= 1e-4
    path = files.pack(old, "deepseek_v3-kv_b")
    assert (path / "experts.bin").read_bytes() == (files.pack(new, "deepseek_v3-f32") / "experts.bin").read_bytes()
    with ExpertStore.open(path) as a, ExpertStore.open(files.pack(new, "deepseek_v3-f32")) as b:
        mine, theirs = a.load_resident(), b.load_resident()
        assert all(torch.equal(mine[n], t) for n, t in theirs.items()) and sorted(mine) == sorted(theirs)
    _same_math(theirs_old, ours(path), "deepseek_v3 attn_kv_b")


def test_deepseek_rotate_half_checkpoint(files):
    """DeepSeek-V3 "lite": no query compression and rope dims in rotate-half order
    (rope_interleave false). The exporter interleaves the rope rows (llama.cpp's rope pairs
    neighbours); the GGUF-born config says rope_interleave true and computes the same."""
    hf = files.hf("deepseek_v3", "lite")
    path = export_gguf(hf, files.root / "deepseek_v3" / "model-lite.gguf", "f32")
    cfg = GGUFCheckpoint(path).config
    assert cfg["rope_interleave"] is True and cfg["q_lora_rank"] is None
    from_gguf = files.pack(path, "deepseek_v3-lite")
    mine = ours(from_gguf)
    _same_math(llama_logits(path), mine, "deepseek_v3 lite")
    torch.testing.assert_close(mine, ours(files.pack(hf, "deepseek_v3-lite-hf")), rtol=0, atol=1e-5)


def test_deepseek2_files_are_v2_or_v3_by_gating(files):
    assert GGUFCheckpoint(files.gguf("deepseek_v3")).family.name == "deepseek_v3"
    ckpt = GGUFCheckpoint(files.gguf("deepseek_v2"))
    assert ckpt.family.name == "deepseek_v2" and ckpt.config["topk_method"] == "greedy"
    assert ckpt.config["architectures"] == ["DeepseekV2ForCausalLM"]


# -- GLM: the multi-token-prediction layer ---------------------------------------------------------

def _with_nextn_layer(src, dst):
    """A copy of the GLM file ``src`` with one more block holding an MTP layer (its decoder tensors
    copied from the last layer, plus the nextn.* tensors), as llama.cpp's converter writes them."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    blocks = r.fields[f"{arch}.block_count"].contents()
    for key, fld in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", f"{arch}.block_count"):
            continue
        sub = fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, fld.contents(), fld.types[0], sub_type=sub)
    w.add_uint32(f"{arch}.block_count", blocks + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    hidden = r.fields[f"{arch}.embedding_length"].contents()
    last = f"blk.{blocks - 1}."
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for t in r.tensors:
        if t.name.startswith(last):
            w.add_tensor(f"blk.{blocks}." + t.name[len(last):], np.asarray(t.data), raw_dtype=t.tensor_type)
    rng = np.random.default_rng(0)
    for name, shape in (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)),
                        ("hnorm.weight", (hidden,)), ("shared_head_norm.weight", (hidden,))):
        w.add_tensor(f"blk.{blocks}.nextn.{name}", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_glm_mtp_layer_is_skipped_with_a_note(files):
    src = files.gguf("glm4_moe")
    mtp = _with_nextn_layer(src, files.root / "glm4_moe" / "model-mtp.gguf")
    out = files.root / "packs" / "glm4_moe-mtp"
    manifest = pack(mtp, out, progress=False)
    assert any("multi-token prediction" in n for n in manifest.notes), manifest.notes
    assert manifest.config["num_hidden_layers"] == GGUFCheckpoint(src).config["num_hidden_layers"]
    assert (out / "experts.bin").read_bytes() == (files.pack(src, "glm4_moe-f32") / "experts.bin").read_bytes()
    theirs = llama_logits(mtp)          # llama.cpp loads the MTP layer and does not run it
    assert (theirs - llama_logits(src)).abs().max().item() <= 1e-5
    _same_math(theirs, ours(out), "glm4_moe with an MTP layer")


# -- configs llama.cpp's graph cannot compute --------------------------------------------------------

@pytest.mark.parametrize("family, overrides, match", [
    ("afmoe", dict(global_attn_every_n_layers=2), "full attention .*every 4th layer"),
    ("afmoe", dict(global_attn_every_n_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                   mup_enabled=False), "mup_enabled false"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"] * 2), "even layers"),
    ("gpt_oss", dict(swiglu_limit=1.5), "swiglu_limit 7.0"),
    ("glm4_moe", dict(n_group=4, topk_group=2), "no expert groups"),
    ("deepseek_v2", dict(), "group_limited_greedy"),
    ("deepseek_v3", dict(), "one mscale"),
])
def test_export_refuses_what_llama_cpp_cannot_compute(family, overrides, match, tmp_path):
    config = hf_models.hf_config(family, "base")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    hf = hf_models.save_checkpoint(hf_models.hf_model_class(family)(config).eval(), str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=match):
        export_gguf(hf, tmp_path / "model.gguf", "f32")
    assert not (tmp_path / "model.gguf").exists()
