"""The model runtime on a CUDA device against transformers on the CPU, and flash-linear-attention's
chunked gated delta rule against our torch implementation.

Every test skips without CUDA. Qwen3-Next's prefill delta rule can run two ways on CUDA: our torch
code ("torch": the CPU math, so transformers' tight tolerance applies) or fla's Triton kernel when it
is installed ("fla": what a GPU run uses; its fp32 dots run at TF32 precision, so looser bounds).
"""
import importlib.util

import hf_models
import pytest
import torch
import torch.nn.functional as F

from lean_qwenflash.generate import Generator, SamplingParams, new_state
from lean_qwenflash.loader import load_hf_checkpoint
from lean_qwenflash.models import kernels
from lean_qwenflash.models.layers import deltanet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")

CASE_IDS = [f"{f}-{v}" for f, v in hf_models.ALL_CASES]
GREEDY = SamplingParams(temperature=0)
# fp32 on the GPU against the CPU is the same math summed in other orders (cuBLAS, SDPA's blocked
# softmax), carried through up to four layers onto logits of magnitude ~4: ~1e-5 apart, which is the
# CPU tests' atol. 1e-4 leaves room for that noise and still catches any wrong term.
EXACT = {"rtol": 1e-4, "atol": 1e-4}
# Rounding the operands of our torch delta rule's dots and triangular solve to TF32 on the CPU moves
# these logits by up to 6e-3 (relative norm 7e-4); a wrong layout, scale or state moves them by O(1).
FLA_REL, FLA_ABS = 5e-3, 5e-2


def fla_missing() -> str:
    reason = "flash-linear-attention not installed"
    if importlib.util.find_spec("fla") is not None:
        reason += " (an `fla` package is on the path but `import fla.ops.gated_delta_rule` failed)"
    return reason


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 in cuBLAS and cuDNN: TF32 would add ~1e-3 relative error to every product."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):   # torch >= 2.9, which deprecates allow_tf32 (no mixing the two)
        saved = matmul.fp32_precision, cudnn.conv.fp32_precision
        matmul.fp32_precision = cudnn.conv.fp32_precision = "ieee"
        yield
        matmul.fp32_precision, cudnn.conv.fp32_precision = saved
    else:
        saved = matmul.allow_tf32, cudnn.allow_tf32
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        yield
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def load_cuda(c, dtype=torch.float32):
    """Our model straight onto the GPU: load_hf_checkpoint places the resident tensors and, in the
    provider (the model does not own them), every routed expert."""
    model, provider = load_hf_checkpoint(c.path, dtype=dtype, device="cuda")
    assert all(t.is_cuda and t.dtype == dtype for t in model.state_dict().values())
    assert all(w.gate_up.is_cuda and w.down.is_cuda for ws in provider.layers.values() for w in ws)
    return model


def use_delta_rule(path: str, monkeypatch) -> list:
    """Run Qwen3-Next prefill through our torch delta rule or fla's kernel; returns the list in which
    each fla call records the shape of its q."""
    calls = []
    if path == "torch":
        monkeypatch.setattr(kernels, "_fla_chunk", None)
    elif kernels._fla_chunk is None:
        pytest.skip(fla_missing())
    else:
        fla = kernels._fla_chunk

        def counted(q, *args, **kwargs):
            calls.append(tuple(q.shape))
            return fla(q, *args, **kwargs)

        monkeypatch.setattr(kernels, "_fla_chunk", counted)
    return calls


def assert_logits(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    if path == "torch":
        torch.testing.assert_close(got, want, **EXACT)
        return
    rel = ((got - want).norm() / want.norm()).item()
    err = (got - want).abs().max().item()
    assert rel <= FLA_REL and err <= FLA_ABS, f"relative norm error {rel:.2e}, max abs error {err:.2e}"


@pytest.mark.parametrize("case_key", hf_models.ALL_CASES, ids=CASE_IDS)
def test_logits_match_transformers(case_key, monkeypatch):
    use_delta_rule("torch", monkeypatch)   # the fla path: test_qwen3_next_full_equals_chunked_equals_decode
    c = hf_models.case(*case_key)
    logits = load_cuda(c)(c.prompt.cuda())
    assert logits.is_cuda
    assert_logits(logits, c.hf_logits, "torch")


def test_model_moved_to_cuda_with_its_experts(monkeypatch):
    """Loaded on the CPU and used there (rotary tables built on the CPU), then moved: parameters with
    .to(), the routed experts with ResidentExperts.to() as Runtime.open does, which the model uses
    once set_expert_provider hands them over."""
    use_delta_rule("torch", monkeypatch)
    c = hf_models.case("qwen3_next")
    model, provider = load_hf_checkpoint(c.path)
    model(c.prompt)
    model.to("cuda")
    model.set_expert_provider(provider.to(device="cuda"))
    assert_logits(model(c.prompt.cuda()), c.hf_logits, "torch")


@pytest.mark.parametrize("path", ["torch", "fla"])
def test_qwen3_next_full_equals_chunked_equals_decode(path, monkeypatch):
    calls = use_delta_rule(path, monkeypatch)
    c = hf_models.case("qwen3_next")
    model = load_cuda(c)
    prompt = c.prompt.cuda()
    full = model(prompt)
    assert_logits(full, c.hf_logits, path)
    if path == "fla":
        # One call per DeltaNet layer, with [B, T, H, Dk] q already repeated to the value heads.
        shape = (1, prompt.shape[1], c.config["linear_num_value_heads"], c.config["linear_key_head_dim"])
        assert calls == [shape] * model.layer_types.count("linear_attention")
    state = new_state(model)
    chunks = [model(prompt[:, a:b], state) for a, b in ((0, 13), (13, 30), (30, 40))]
    assert_logits(torch.cat(chunks, dim=1), full, path)
    calls.clear()
    state = new_state(model)
    steps = [model(prompt[:, i:i + 1], state) for i in range(prompt.shape[1])]
    assert not calls   # one token at a time is the recurrent form, never the chunked kernel
    assert_logits(torch.cat(steps, dim=1), full, path)
    assert state.num_tokens == prompt.shape[1]
    assert all(t.is_cuda for s in state.layers for t in vars(s).values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dk,dv,dtype,tol", [
    (16, 12, torch.float32, 3e-3),     # the test model's heads (dk != dv: a transposed state shows)
    (16, 12, torch.bfloat16, 3e-2),
    (128, 128, torch.float32, 3e-3),   # Qwen3-Next's heads (our layer always hands fla fp32)
], ids=["fp32-16x12", "bf16-16x12", "fp32-128x128"])
def test_fla_chunk_matches_torch_delta_rule(dk, dv, dtype, tol):
    """fla through kernels.chunked_delta_rule against deltanet.chunked_gated_delta_rule in fp64 on the
    same inputs. Bounds: rounding the operands of our dots and triangular solve to TF32 (bf16) on the
    CPU gives relative errors up to 6e-4 (5e-3) per (batch, head); a wrong layout gives O(0.1-1)."""
    if kernels._fla_chunk is None:
        pytest.skip(fla_missing())
    batch, hk, hv, num_tokens = 2, 2, 4, 100   # Hv > Hk as in Qwen3-Next; one full 64-chunk and a partial one
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)

    # As GatedDeltaNet builds them: unit-norm q and k, q scaled by dk^-0.5, both repeated to the value heads.
    q = F.normalize(randn(batch, hk, num_tokens, dk), dim=-1).repeat_interleave(hv // hk, dim=1) * dk ** -0.5
    k = F.normalize(randn(batch, hk, num_tokens, dk), dim=-1).repeat_interleave(hv // hk, dim=1)
    v = randn(batch, hv, num_tokens, dv)
    # g = -exp(A_log) * softplus(a + dt_bias), per-head rates from slow (the state carries every token) to fast.
    rate = torch.tensor([0.02, 0.1, 0.5, 2.0], device="cuda", dtype=torch.float64)
    g = -rate[:, None] * F.softplus(randn(batch, hv, num_tokens))
    beta = torch.sigmoid(randn(batch, hv, num_tokens))
    state = 0.5 * randn(batch, hv, dk, dv)   # non-zero, as for every prefill chunk after the first
    inputs = [t.to(dtype) for t in (q, k, v, g, beta)]
    want_out, want_state = deltanet.chunked_gated_delta_rule(*(t.double() for t in inputs), state)

    def torch_fallback(*args):
        raise AssertionError("the torch delta rule ran on CUDA although fla is installed")

    out, final = kernels.chunked_delta_rule(*inputs, state.float(), torch_fallback)
    assert out.shape == want_out.shape and out.dtype == dtype
    assert final.shape == want_state.shape and final.dtype == torch.float32
    for got, want, what in ((out, want_out, "output"), (final, want_state, "final state")):
        # Relative error per (batch, head), so that one wrong head cannot hide among correct ones.
        err = (got.double() - want).flatten(2).norm(dim=-1) / want.flatten(2).norm(dim=-1)
        assert err.max().item() <= tol, f"{what}: relative error up to {err.max().item():.2e} per (batch, head)"


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_bf16_generates_and_tracks_fp32(family):
    """bf16 keeps ~3 digits and a router near-tie may pick another expert at some position, so the
    logits are not close to fp32's, only the same function: on the CPU the cosine is >= 0.999 and
    the top-1 agrees at >= 95% of positions."""
    c = hf_models.case(family)
    model = load_cuda(c, torch.bfloat16)
    tokens = list(Generator(model).generate(c.prompt[0].tolist(), GREEDY, max_new_tokens=16))
    assert len(tokens) == 16 and all(0 <= t < c.hf_model.config.vocab_size for t in tokens)
    prompt = c.prompt.cuda()
    got = model(prompt)
    assert got.dtype == torch.bfloat16
    got, want = got.float(), load_cuda(c)(prompt)
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert cosine > 0.99 and agree >= 0.75, f"cosine {cosine:.4f}, top-1 agreement {agree:.2f}"


@pytest.mark.parametrize("family,path", [("qwen3_next", "torch"), ("qwen3_next", "fla"), ("qwen3_moe", "torch"),
                                         ("mixtral", "torch"), ("olmoe", "torch")])
def test_greedy_matches_transformers_generate(family, path, monkeypatch):
    """fp32 greedy on CUDA (prefill in chunks, then decode) equals transformers' on the CPU. With fla
    the smallest top-2 logit gap on this sequence (0.017) is ~50x what TF32 moved it on the CPU."""
    calls = use_delta_rule(path, monkeypatch)
    c = hf_models.case(family)
    ours = list(Generator(load_cuda(c), prefill_chunk_tokens=16).generate(
        c.prompt[0].tolist(), GREEDY, max_new_tokens=32))
    assert ours == c.hf_greedy(32)
    assert bool(calls) == (path == "fla")
