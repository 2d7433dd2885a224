"""Quantized packs end to end: `pack --quant`, streamed == resident bit for bit (both kernel modes),
quantized logits vs the same model with the dequantized experts in fp32, mixed encodings, the
float fallback, v1 packs, and corrupt quantized records."""
import json
import shutil

import pytest
import torch

from lean_qwenflash import io_engine
from lean_qwenflash.config import load_config
from lean_qwenflash.experts.provider import ResidentExperts, aligned_record
from lean_qwenflash.generate.generator import Generator
from lean_qwenflash.generate.sampling import SamplingParams
from lean_qwenflash.loader import build_model
from lean_qwenflash.quant import QuantTensor
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.store import ExpertStore, pack
from lean_qwenflash.store.format import StoreError
from lean_qwenflash.store.reader import ChecksumError

hf_models = pytest.importorskip("hf_models")

FAMILIES = list(hf_models.FAMILIES)     # every registered family
PRESETS = ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m"]
ENGINES = ["uring", "pread"] if io_engine.uring_compiled() else ["pread"]
GREEDY = SamplingParams(temperature=0.0)
PROMPT = hf_models.prompt_ids(96, 24)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_ckpts")
    out = {}
    for family in FAMILIES:
        model, _ = hf_models.make_hf_model(family, "quant")
        out[family] = hf_models.save_checkpoint(model, str(root / family))
    return out


@pytest.fixture(scope="module")
def packs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_packs")
    made = {}

    def get(family, preset):
        if (family, preset) not in made:
            made[family, preset] = root / f"{family}-{preset}"
            pack(checkpoints[family], made[family, preset], quant=preset, progress=False)
        return made[family, preset]
    return get


def _run(cfg, resident=False):
    with Runtime.open(cfg, resident_experts=resident) as rt:
        logits = rt.model(PROMPT)
        tokens = list(Generator(rt.model).generate(PROMPT[0].tolist(), GREEDY, 12))
        stats = rt.stats()
    return logits, tokens, stats


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", PRESETS)
def test_streamed_equals_resident_bit_for_bit(family, preset, packs):
    path = packs(family, preset)
    with ExpertStore.open(path) as store:
        encodings = {t.encoding for l in store.manifest.layers for t in l.tensors}
        assert encodings <= {"q4_k", "q6_k"} if preset == "q4_k_m" else encodings == {preset}
        slot = store.max_record_bytes
        total = store.manifest.num_records
    with ExpertStore.open(path) as store:
        top_k = int(store.config["num_experts_per_tok"])
    budgets = [top_k * slot, max(top_k, total // 4) * slot, total * slot]
    every = [(b, pf, eng) for b in budgets for pf in (False, True) for eng in ENGINES]
    some = [(budgets[0], True, ENGINES[0]), (budgets[1], False, ENGINES[-1])]
    for mode in ("exact", "fast"):
        ref_logits, ref_tokens, _ = _run(load_config(model=str(path), expert_kernels=mode), resident=True)
        # every budget x prefetch x engine for the mixed-encoding preset in exact mode; a spread otherwise
        for budget, prefetch, engine in (every if (preset, mode) == ("q4_k_m", "exact") else some):
            logits, tokens, stats = _run(load_config(model=str(path), expert_kernels=mode, host_cache_bytes=budget,
                                                     prefetch=prefetch, io_engine=engine))
            assert torch.equal(logits, ref_logits), (mode, budget, prefetch, engine)
            assert tokens == ref_tokens
            assert stats["total"]["misses"] > 0      # it really streamed (the "all" budget misses once each)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss", "deepseek_v3"])
def test_streamed_prefill_in_runs_equals_resident_bit_for_bit(family, packs, monkeypatch):
    """A streamed prefill computes a group's experts in runs as their reads land
    (``TieredExperts.acquire_runs``): runs of 1 and 3 experts, cold and small caches, give the
    resident bits in both kernel modes, and the runs really were that short."""
    from lean_qwenflash.experts.tiered import TieredExperts
    from lean_qwenflash.models.moe import block
    path = packs(family, "q4_k_m")
    with ExpertStore.open(path) as store:
        slot, total = store.max_record_bytes, store.manifest.num_records
        top_k = int(store.config["num_experts_per_tok"])
    real, sizes = TieredExperts.acquire_runs, []

    def recorded(self, layer, ids, run):
        for part in real(self, layer, ids, run):
            sizes.append(len(part[0]))
            yield part
    monkeypatch.setattr(TieredExperts, "acquire_runs", recorded)
    for mode in ("exact", "fast"):
        ref_logits, ref_tokens, _ = _run(load_config(model=str(path), expert_kernels=mode), resident=True)
        for run, budget in ((1, top_k * slot), (3, max(top_k, total // 4) * slot), (3, total * slot)):
            monkeypatch.setattr(block, "STREAM_RUN_EXPERTS", run)
            sizes.clear()
            logits, tokens, stats = _run(load_config(model=str(path), expert_kernels=mode, host_cache_bytes=budget))
            assert torch.equal(logits, ref_logits), (mode, run, budget)
            assert tokens == ref_tokens
            assert stats["total"]["misses"] > 0
            assert sizes.count(run) >= 2, sizes      # (groups with misses came in runs; cached ones whole)


def _dequantized_reference(path):
    """The pack's model with every expert dequantized to fp32 and held as float tensors."""
    with ExpertStore.open(path) as store:
        experts = ResidentExperts.from_store(store)
        layers = {l: [aligned_record(*(t.dequantize() if isinstance(t, QuantTensor) else t.float() for t in w))
                      for w in ws] for l, ws in experts.layers.items()}
        resident = {k: v.dequantize() if isinstance(v, QuantTensor) else v for k, v in store.load_resident().items()}
        return build_model(store.config, resident, ResidentExperts(layers))


def _token_by_token(model):
    from lean_qwenflash.generate.state import new_state
    state = new_state(model)
    return torch.cat([model(PROMPT[:, i:i + 1], state) for i in range(PROMPT.shape[1])], dim=1)


def _kl(ref, other) -> float:
    p, q = ref.log_softmax(-1), other.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_logits_match_the_dequantized_fp32_model(family, packs):
    """Exact kernels on a quantized pack compute what the fp32 model with the dequantized experts
    computes; fast kernels (int8 activations) cost far less than the weight quantization itself."""
    float_logits = {}
    with Runtime.open(load_config(model=str(packs(family, None)), expert_kernels="exact"), resident_experts=True) as rt:
        float_logits = _token_by_token(rt.model)
    for preset in ("q4_k_m", "q8_0"):
        path = packs(family, preset)
        ref = _dequantized_reference(path)
        ref.set_policy(ref.policy.with_kernels("exact"))
        with Runtime.open(load_config(model=str(path), expert_kernels="exact"), resident_experts=True) as rt:
            torch.testing.assert_close(rt.model(PROMPT), ref(PROMPT), rtol=1e-4, atol=1e-5)
            exact = _token_by_token(rt.model)
            rt.model.set_policy(rt.model.policy.with_kernels("fast"))
            fast = _token_by_token(rt.model)
        weight_cost, act_cost = _kl(float_logits, exact), _kl(exact, fast)
        if preset == "q4_k_m":
            # measured: 20x to 300x below (KL 2e-5..4e-4 against 3e-3..2e-2)
            assert act_cost < weight_cost / 4, (act_cost, weight_cost)
        # q8_0 weights cost so little that a router flip between the modes dominates (qwen3_next:
        # KL 1.6e-3, 21/24 argmax agree; qwen3_5_moe 5.7e-3; glm4_moe 2.0e-2: sigmoid routing scaled
        # by 2.5 on random weights flips more); bound it absolutely
        assert act_cost < 3e-2, act_cost


def test_mixed_records_and_summary(packs, checkpoints):
    path = packs("qwen3_moe", "q4_k_m")
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["version"] == 2
    downs = [next(t for t in l["tensors"] if t["name"] == "down")["encoding"] for l in doc["layers"]]
    gate_ups = {next(t for t in l["tensors"] if t["name"] == "gate_up")["encoding"] for l in doc["layers"]}
    assert gate_ups == {"q4_k"} and "q6_k" in downs
    for l in doc["layers"]:
        for t in l["tensors"]:
            assert t["nbytes"] == {"q4_k": 144, "q6_k": 210}[t["encoding"]] * t["shape"][0] * t["shape"][1] // 256
    resident = {t["name"]: t for t in doc["resident"]}
    assert resident["lm_head.weight"]["encoding"] == "q6_k"
    assert resident["model.layers.0.self_attn.q_proj.weight"]["encoding"] == "q4_k"          # rows of 256
    assert resident["model.layers.0.self_attn.o_proj.weight"]["encoding"] == "q5_0"          # rows of 64: q4_k's fallback
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert resident[name]["encoding"] == "f32"
    assert any("resident" in n and "o_proj" in n for n in doc["notes"])
    bf16 = ExpertStore.open(packs("qwen3_moe", "q8_0"))
    q4 = ExpertStore.open(path)
    assert q4.manifest.experts_bytes < bf16.manifest.experts_bytes
    bf16.close(), q4.close()


def test_rows_a_block_cannot_hold_fall_back_to_float(tmp_path):
    c = hf_models.case("qwen3_moe")            # hidden 48, expert width 24: not multiples of 256 (nor 32)
    m = pack(c.path, tmp_path / "p", quant="q4_k", progress=False)
    assert {t.encoding for l in m.layers for t in l.tensors} == {"bf16"}      # the compute dtype, never f32
    assert any("not a multiple of q4_k's block of 256; stored as bf16" in n for n in m.notes)
    m = pack(c.path, tmp_path / "q", quant="q8_0", progress=False)   # 48 = 32 + 16: still float
    assert any("q8_0" in n for n in m.notes)
    with pytest.raises(ValueError, match="--quant must be one of"):
        pack(c.path, tmp_path / "r", quant="q3_k", progress=False)
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.tmp").exists()


def test_v1_pack_still_opens_with_identical_output(tmp_path):
    c = hf_models.case("mixtral")
    new = tmp_path / "v2"
    pack(c.path, new, progress=False)
    old = tmp_path / "v1"
    shutil.copytree(new, old)
    doc = json.loads((old / "manifest.json").read_text())
    doc["version"] = 1
    doc.pop("resident"), doc.pop("notes")
    for l in doc["layers"]:
        for t in l["tensors"]:
            t["dtype"] = {"f32": "float32"}[t.pop("encoding")]
            t.pop("nbytes")
    (old / "manifest.json").write_text(json.dumps(doc))
    outs = []
    for p in (new, old):
        with Runtime.open(load_config(model=str(p))) as rt:
            outs.append(rt.model(c.prompt))
            assert rt.store.manifest.version == (1 if p == old else 2)
    assert torch.equal(*outs)


def test_v2_manifest_with_unknown_encoding_or_wrong_size_is_refused(packs, tmp_path):
    src = packs("olmoe", "q6_k")
    for change, words in [(("encoding", "q9_z"), "encoding 'q9_z', which this lean-qwenflash does not know"),
                          (("nbytes", 12), "says 12 bytes but q6_k")]:
        p = tmp_path / change[0]
        shutil.copytree(src, p)
        doc = json.loads((p / "manifest.json").read_text())
        doc["layers"][0]["tensors"][1][change[0]] = change[1]
        (p / "manifest.json").write_text(json.dumps(doc))
        with pytest.raises(StoreError, match=words):
            ExpertStore.open(p)


def test_corrupt_quantized_record_fails_its_checksum(packs, tmp_path):
    p = tmp_path / "corrupt"
    shutil.copytree(packs("qwen3_next", "q4_k_m"), p)
    with ExpertStore.open(p) as store:
        rec = store.manifest.layers[1]
        at = rec.offset(5) + rec.tensors[1].offset + 7
    with open(p / "experts.bin", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with ExpertStore.open(p) as store:
        with pytest.raises(ChecksumError, match=f"layer {rec.layer_idx} expert 5 failed its checksum"):
            store.read_expert(rec.layer_idx, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("preset", ["q4_k_m", "q8_0"])
def test_cuda_quantized_experts_match_cpu_exact(preset, packs):
    """On CUDA quantized records move to the device tier as bytes and are dequantized there with
    torch (the reference dequantizer): logits match the CPU exact path, resident and streamed."""
    path = packs("qwen3_moe", preset)
    with Runtime.open(load_config(model=str(path), expert_kernels="exact"), resident_experts=True) as rt:
        want = rt.model(PROMPT)
    with ExpertStore.open(path) as store:
        slot = store.max_record_bytes
        top_k = int(store.config["num_experts_per_tok"])
    for resident in (True, False):
        cfg = load_config(model=str(path), device="cuda", host_cache_bytes=4 * top_k * slot,
                          device_cache_bytes=top_k * slot)
        with Runtime.open(cfg, resident_experts=resident) as rt:
            torch.testing.assert_close(rt.model(PROMPT.cuda()).cpu(), want, rtol=1e-4, atol=1e-4)


def test_decode_steps_run_torch_on_one_thread_and_restore_it(packs, monkeypatch):
    """...and keep the kernel threads spinning (the policy's decode_spin) only while a step runs."""
    seen = []
    from lean_qwenflash.models import kernels, native
    from lean_qwenflash.models.policy import DECODE_SPIN
    real = kernels.experts_decode

    def spy(*a, **k):
        spin = native.set_spin(0)
        native.set_spin(spin)
        seen.append((torch.get_num_threads(), spin))
        return real(*a, **k)
    monkeypatch.setattr(kernels, "experts_decode", spy)
    torch.set_num_threads(2)
    default_spin = native.set_spin(0)
    native.set_spin(default_spin)
    try:
        with Runtime.open(load_config(model=str(packs("mixtral", "q4_k")), cpu_threads=2), resident_experts=True) as rt:
            assert rt.model.policy.decode_torch_threads == 1 and rt.model.policy.native_threads == 2
            list(Generator(rt.model).generate(PROMPT[0].tolist(), GREEDY, 3))
            assert torch.get_num_threads() == 2
        decode = [s for s in seen if s[0] == 1]
        assert decode and set(decode) == {(1, DECODE_SPIN)}       # one-token steps
        assert {s for s in seen if s[0] != 1} <= {(2, default_spin)}     # the prefill
        assert native.set_spin(default_spin) == default_spin != DECODE_SPIN
    finally:
        torch.set_num_threads(1)
    with pytest.raises(Exception, match="cpu_threads: must be >= 0"):
        load_config(cpu_threads=-1)


def test_short_prompts_of_encoded_models_run_torch_on_one_thread(packs, monkeypatch):
    """A step of at most NATIVE_GEMM_MAX_TOKENS tokens of a model whose projections are encoded (a
    few float exceptions aside) runs torch on one thread with the native pool spinning, as decode
    does; a longer chunk, and a model of float projections, keep torch on the budget."""
    from lean_qwenflash.models import kernels, native
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.policy import DECODE_SPIN
    seen = []
    real = RMSNorm.forward

    def spy(self, x):
        spin = native.set_spin(0)
        native.set_spin(spin)
        seen.append((x.shape[1], torch.get_num_threads(), spin))
        return real(self, x)
    monkeypatch.setattr(RMSNorm, "forward", spy)
    torch.set_num_threads(2)
    default_spin = native.set_spin(0)
    native.set_spin(default_spin)
    long = torch.arange(kernels.NATIVE_GEMM_MAX_TOKENS + 8).view(1, -1) % 96
    try:
        # qwen3_next's and qwen3_5_moe's q4_k packs keep a few float matrices (the shared-expert
        # gate [1, H], DeltaNet projections; a llama.cpp Qwen3.5 file has a float gate and a
        # dequantized out_proj): still an encoded model, its short steps native ones
        for family, preset, encoded in (("mixtral", "q4_k", True), ("mixtral", None, False),
                                        ("qwen3_next", "q4_k", True), ("qwen3_5_moe", "q4_k", True)):
            with Runtime.open(load_config(model=str(packs(family, preset)), cpu_threads=2),
                              resident_experts=True) as rt:
                assert rt.model._matrices_encoded() is encoded
                for ids in (PROMPT, long):
                    seen.clear()
                    rt.model(ids)
                    short = ids.shape[1] <= kernels.NATIVE_GEMM_MAX_TOKENS and encoded
                    assert seen and set(seen) == ({(ids.shape[1], 1, DECODE_SPIN)} if short else
                                                  {(ids.shape[1], 2, default_spin)}), (family, preset, ids.shape)
                assert torch.get_num_threads() == 2 and native.set_spin(default_spin) == default_spin
    finally:
        torch.set_num_threads(1)


def test_float_linears_take_the_native_kernel_in_fast_mode_only(packs):
    """Routers and other float linears: one-row products run the native kernel in fast mode (close
    to torch), and exactly torch's F.linear in exact mode."""
    import torch.nn.functional as F
    with Runtime.open(load_config(model=str(packs("qwen3_moe", "q4_k_m"))), resident_experts=True) as rt:
        router = rt.model.moe_blocks()[0].gate
        x = torch.randn(1, 1, router.in_features, generator=torch.Generator().manual_seed(0))
        rt.model.set_policy(rt.model.policy.with_kernels("fast"))
        assert router.ctx.policy.float_native
        fast = router(x)
        torch.testing.assert_close(fast, F.linear(x, router.weight), rtol=1e-5, atol=1e-6)
        rt.model.set_policy(rt.model.policy.with_kernels("exact"))
        assert torch.equal(router(x), F.linear(x, router.weight))
