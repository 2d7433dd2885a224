"""Pack -> open round trips, fault injection and the packer's refusals."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lean_qwenflash import io_engine
from lean_qwenflash.io_engine import AlignedBuffer, IoError
from lean_qwenflash.store import ChecksumError, ExpertStore, StoreError, pack
from lean_qwenflash.store.checkpoint import CheckpointError, HFCheckpoint
from lean_qwenflash.families import UnsupportedArchitecture

transformers = pytest.importorskip("transformers")

ENGINES = ["uring", "pread"] if io_engine.uring_compiled() else ["pread"]
REPO = Path(__file__).resolve().parents[1]

COMMON = dict(vocab_size=96, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=56, max_position_embeddings=128)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=10,
                       mlp_only_layers=[1])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=10,
                        shared_expert_intermediate_size=24, linear_num_value_heads=4, linear_num_key_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=3)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=5, num_experts_per_tok=2)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=10,
                         shared_expert_intermediate_size=24, linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=3)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2, head_dim=10,
                      first_k_dense_replace=1, n_shared_experts=1)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2, q_lora_rank=16,
                         kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                         n_group=1, topk_group=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2, q_lora_rank=None,
                         kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=6, num_experts_per_tok=2, head_dim=10, sliding_window=8)),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM",
              dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, head_dim=10, num_dense_layers=1,
                   num_shared_experts=1, sliding_window=8, global_attn_every_n_layers=2)),
}


def test_every_registered_family_has_a_store_round_trip_config():
    from lean_qwenflash.families import FAMILIES as REGISTRY
    assert set(FAMILIES) == set(REGISTRY)


def make_checkpoint(path: Path, family: str, stacked: bool = False, dtype=torch.float32, seed: int = 0) -> Path:
    """A tiny random checkpoint: save_pretrained's per-expert layout, or the stacked 3-D layout."""
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    if stacked:
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, str(path / "model.safetensors"))
    else:
        model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return path


def expected_records(ckpt_dir: Path, dtype=None):
    ck = HFCheckpoint(ckpt_dir)
    out = {}
    for layer in ck.moe_layers():
        for e in range(ck.expert_dims()[0]):
            gu, down = ck.expert(layer, e)
            out[(layer, e)] = (gu.to(dtype) if dtype else gu, down.to(dtype) if dtype else down)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {(f, s): make_checkpoint(root / f"{f}-{'stacked' if s else 'per_expert'}", f, stacked=s)
            for f in FAMILIES for s in (False, True)}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_round_trip_bit_exact(family, stacked, ckpts, tmp_path):
    src = ckpts[(family, stacked)]
    manifest = pack(src, tmp_path / "pack", progress=False)
    assert (tmp_path / "pack" / "tokenizer_config.json").is_file()
    assert "tokenizer_config.json" in manifest.tokenizer_files
    want = expected_records(src)
    ref_model = getattr(transformers, FAMILIES[family][1]).from_pretrained(src)
    ref_state = ref_model.state_dict()
    for kind in ENGINES:
        with ExpertStore.open(tmp_path / "pack", engine=kind) as store:
            assert store.engine.kind == kind
            assert sorted(want) == sorted((l, e) for l in store.moe_layers for e in range(store.layer(l).num_experts))
            for (layer, e), (gu, down) in want.items():
                got = store.read_expert(layer, e)
                assert torch.equal(got.gate_up, gu) and torch.equal(got.down, down), (layer, e)
            resident = store.load_resident()
    # Resident tensors: everything but routed experts, under canonical names, bit-exact.
    for name, t in resident.items():
        alias = name.replace("block_sparse_moe.", "mlp.")
        assert torch.equal(t, ref_state[name] if name in ref_state else ref_state[alias]), name
    from lean_qwenflash.families import family_for
    kept = family_for(manifest.config).layout.resident_suffixes      # e.g. GPT-OSS's expert biases

    def is_record(k):
        return ".experts." in k and not k.endswith(kept)
    assert not any(is_record(k) for k in resident)
    n_ref = sum(1 for k in ref_state if not is_record(k))
    assert len(resident) == n_ref


def test_layouts_pack_identically(ckpts, tmp_path):
    for family in FAMILIES:
        a = pack(ckpts[(family, False)], tmp_path / f"{family}-a", progress=False)
        b = pack(ckpts[(family, True)], tmp_path / f"{family}-b", progress=False)
        assert (tmp_path / f"{family}-a" / "experts.bin").read_bytes() == (tmp_path / f"{family}-b" / "experts.bin").read_bytes()
        assert a.to_json()["layers"] == b.to_json()["layers"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_dtype_conversion(dtype, tmp_path):
    src = make_checkpoint(tmp_path / "ck", "qwen3_moe", dtype=dtype)
    pack(src, tmp_path / "keep", progress=False)
    pack(src, tmp_path / "f32", dtype="float32", progress=False)
    keep, f32 = ExpertStore.open(tmp_path / "keep"), ExpertStore.open(tmp_path / "f32")
    for (layer, e), (gu, down) in expected_records(src).items():
        k = keep.read_expert(layer, e)
        assert k.gate_up.dtype == dtype and torch.equal(k.gate_up, gu) and torch.equal(k.down, down)
        assert torch.equal(f32.read_expert(layer, e).gate_up, gu.float())
    assert keep.load_resident()["model.norm.weight"].dtype == dtype


@pytest.mark.parametrize("kind", ENGINES)
def test_ten_thousand_random_reads_at_depth_32(kind, ckpts, tmp_path):
    src = ckpts[("qwen3_next", True)]
    pack(src, tmp_path / "pack", progress=False)
    want = expected_records(src)
    keys = sorted(want)
    store = ExpertStore.open(tmp_path / "pack", engine=kind, queue_depth=32)
    rec_bytes = store.max_record_bytes
    slots = AlignedBuffer(32 * rec_bytes)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(keys), size=10_000)
    for start in range(0, len(picks), 32):
        batch = [(keys[i][0], keys[i][1], slots, j * rec_bytes) for j, i in enumerate(picks[start:start + 32])]
        store.read(batch, urgent=bool(start % 64))
        for layer, e, _, off in batch:
            got = store.expert_views(layer, slots, off)
            assert torch.equal(got.gate_up, want[(layer, e)][0]) and torch.equal(got.down, want[(layer, e)][1])
    assert store.engine.num_reads == 10_000
    store.close()


def _pack_copy(ckpts, tmp_path, name="pack"):
    pack(ckpts[("qwen3_moe", False)], tmp_path / name, progress=False)
    return tmp_path / name


def test_flipped_byte_is_caught_naming_layer_and_expert(ckpts, tmp_path):
    p = _pack_copy(ckpts, tmp_path)
    store = ExpertStore.open(p)
    rec = store.layer(2)
    with open(p / "experts.bin", "r+b") as f:
        f.seek(rec.offset(3) + 17)
        b = f.read(1)
        f.seek(rec.offset(3) + 17)
        f.write(bytes([b[0] ^ 0x40]))
    store = ExpertStore.open(p)
    store.read_expert(2, 2)  # neighbours are fine
    with pytest.raises(ChecksumError, match="layer 2 expert 3") as ei:
        store.read_expert(2, 3)
    assert (ei.value.layer_idx, ei.value.expert_id) == (2, 3)
    # Verification can be switched off; then the corrupted bytes come through as they are.
    ExpertStore.open(p, verify_checksums=False).read_expert(2, 3)


def test_truncated_experts_refused_at_open(ckpts, tmp_path):
    p = _pack_copy(ckpts, tmp_path)
    size = (p / "experts.bin").stat().st_size
    os.truncate(p / "experts.bin", size - 4096)
    with pytest.raises(StoreError, match="truncated.*re-pack"):
        ExpertStore.open(p)


@pytest.mark.parametrize("field,value,words", [
    ("format", "gguf", "not a lean-qwenflash pack"),
    ("version", 99, "newer than this lean-qwenflash"),
    ("version", 0, "no longer supported"),
])
def test_wrong_magic_or_version_refused_with_hint(ckpts, tmp_path, field, value, words):
    p = _pack_copy(ckpts, tmp_path)
    doc = json.loads((p / "manifest.json").read_text())
    doc[field] = value
    (p / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=words) as ei:
        ExpertStore.open(p)
    assert "lean-qwenflash pack" in str(ei.value)


def test_broken_manifest_and_index_refused(ckpts, tmp_path):
    p = _pack_copy(ckpts, tmp_path)
    (p / "experts.idx").write_bytes((p / "experts.idx").read_bytes()[:-4])
    with pytest.raises(StoreError, match="checksum index"):
        ExpertStore.open(p)
    (p / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        ExpertStore.open(p)
    with pytest.raises(StoreError, match="no manifest.json"):
        ExpertStore.open(tmp_path)


def test_misaligned_destination_rejected_before_io(ckpts, tmp_path):
    store = ExpertStore.open(_pack_copy(ckpts, tmp_path))
    buf = AlignedBuffer(store.max_record_bytes + 4096)
    with pytest.raises(IoError, match="misaligned") as ei:
        store.submit(0, 1, buf, dest_offset=8)
    assert ei.value.tag == store.tag(0, 1)
    assert store.engine.num_reads == 0 and not np.frombuffer(buf, dtype=np.uint8).any()


def test_engine_never_writes_the_store(ckpts, tmp_path):
    p = _pack_copy(ckpts, tmp_path)
    before = {f.name: (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest()) for f in p.iterdir()}
    for kind in ENGINES:
        store = ExpertStore.open(p, engine=kind)
        buf = AlignedBuffer(store.max_record_bytes)
        for i in range(2000):
            layer = store.moe_layers[i % len(store.moe_layers)]
            store.read([(layer, i % store.layer(layer).num_experts, buf, 0)])
        store.close()
    after = {f.name: (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest()) for f in p.iterdir()}
    assert before == after


def test_killed_pack_leaves_nothing_openable(ckpts, tmp_path):
    """SIGKILL mid-pack: OUT_DIR must not exist and the leftover .tmp must not open."""
    out = tmp_path / "out"
    # Slow every record down so the kill lands mid-pack deterministically.
    code = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "import lean_qwenflash.store.packer as p\n"
        "real = p.crc32c\n"
        "def slow(b):\n    time.sleep(0.05); return real(b)\n"
        "p.crc32c = slow\n"
        "p.pack(%r, %r, progress=False)\n" % (str(REPO), str(ckpts[("qwen3_next", False)]), str(out))
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    tmp = out.with_name("out.tmp")
    deadline = time.time() + 60
    while not ((tmp / "experts.bin").exists() and (tmp / "experts.bin").stat().st_size > 0):
        assert time.time() < deadline and proc.poll() is None, "pack finished or died before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    with pytest.raises(StoreError, match="interrupted pack"):
        ExpertStore.open(tmp)
    # Packing again cleans up the leftover and succeeds.
    pack(ckpts[("qwen3_next", False)], out, progress=False)
    assert not tmp.exists()
    ExpertStore.open(out).read_expert(0, 0)


def test_pack_refusals_name_the_problem(ckpts, tmp_path):
    src = ckpts[("qwen3_moe", False)]
    out = tmp_path / "exists"
    out.mkdir()
    with pytest.raises(FileExistsError, match="--force"):
        pack(src, out, progress=False)
    pack(src, out, force=True, progress=False)
    ExpertStore.open(out)

    bad = tmp_path / "unsupported"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="LlamaForCausalLM.*supported: "):
        pack(bad, tmp_path / "o1", progress=False)

    # Drop one expert tensor / give one a wrong shape: the error names it.
    from safetensors.torch import load_file
    sd = load_file(str(src / "model.safetensors"))
    for what in ("missing", "shape"):
        broken = tmp_path / what
        shutil.copytree(src, broken)
        sd2 = dict(sd)
        key = "model.layers.2.mlp.experts.4.up_proj.weight"
        if what == "missing":
            del sd2[key]
        else:
            sd2[key] = torch.zeros(3, 3)
        save_file(sd2, str(broken / "model.safetensors"))
        with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
            pack(broken, tmp_path / f"o-{what}", progress=False)
        assert not (tmp_path / f"o-{what}").exists() and not (tmp_path / f"o-{what}.tmp").exists()


def test_cli_pack_and_inspect(ckpts, tmp_path):
    src = ckpts[("mixtral", False)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "lean_qwenflash", "pack", str(src), str(tmp_path / "p"), "--quiet"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "MixtralForCausalLM" in r.stdout
    r = subprocess.run([sys.executable, "-m", "lean_qwenflash", "inspect", str(tmp_path / "p"), "--verify-all"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "match their checksums" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "lean_qwenflash", "inspect", str(tmp_path / "nope")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = subprocess.run([sys.executable, "-m", "lean_qwenflash", "pack"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "SOURCE" in r.stderr
