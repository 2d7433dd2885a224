"""The execution policy is per model: two models with different policies in one process each
compute what they compute alone, with their own workspaces, and a policy comes from the config."""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lean_qwenflash.config import load_config
from lean_qwenflash.generate.state import new_state
from lean_qwenflash.common import ConfigError
from lean_qwenflash.models import affinity, native
import lean_qwenflash
from lean_qwenflash.models.policy import DECODE_SPIN, ExecPolicy, available_cpus, cgroup_cpu_limit, torch_spin_unbound
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.store import pack

hf_models = pytest.importorskip("hf_models")


@pytest.fixture(scope="module")
def q4_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    model, _ = hf_models.make_hf_model("qwen3_moe", "quant")
    ckpt = hf_models.save_checkpoint(model, str(root / "ckpt"))
    pack(ckpt, root / "pack", quant="q4_k_m", progress=False)
    return root / "pack"


def _steps(model, prompt):
    """Prefill logits of the prompt's first half, then one-token steps over the second half."""
    state = new_state(model)
    half = prompt.shape[1] // 2
    out = [model(prompt[:, :half], state)]
    out += [model(prompt[:, i:i + 1], state) for i in range(half, prompt.shape[1])]
    return torch.cat(out, dim=1)


def test_two_models_with_different_policies_in_one_process(q4_pack):
    prompt = hf_models.prompt_ids(96, 24)
    with Runtime.open(load_config(model=str(q4_pack), expert_kernels="fast"), resident_experts=True) as rt:
        fast_alone = _steps(rt.model, prompt)
    with Runtime.open(load_config(model=str(q4_pack), expert_kernels="exact"), resident_experts=True) as rt:
        exact_alone = _steps(rt.model, prompt)
    assert not torch.equal(fast_alone, exact_alone)      # the modes really differ on q4_k_m records

    with Runtime.open(load_config(model=str(q4_pack), expert_kernels="fast"), resident_experts=True) as a, \
            Runtime.open(load_config(model=str(q4_pack), expert_kernels="exact"), resident_experts=True) as b:
        assert a.model.policy.kernel_mode == "fast" and b.model.policy.kernel_mode == "exact"
        assert a.model.exec.workspace is not b.model.exec.workspace
        # every computing module of a model holds its model's context, none the other's
        for rt in (a, b):
            bound = {id(m.ctx) for m in rt.model.modules() if hasattr(type(m), "ctx")}
            assert bound == {id(rt.model.exec)}
        # interleaved step by step, each computes exactly what it computes alone
        sa, sb = new_state(a.model), new_state(b.model)
        half = prompt.shape[1] // 2
        got_a, got_b = [a.model(prompt[:, :half], sa)], [b.model(prompt[:, :half], sb)]
        for i in range(half, prompt.shape[1]):
            got_a.append(a.model(prompt[:, i:i + 1], sa))
            got_b.append(b.model(prompt[:, i:i + 1], sb))
        assert torch.equal(torch.cat(got_a, dim=1), fast_alone)
        assert torch.equal(torch.cat(got_b, dim=1), exact_alone)
        assert b.model.exec.workspace.nbytes() > 0          # exact mode dequantized into b's buffers
        # changing one model's policy leaves the other alone
        b.model.set_policy(b.model.policy.with_kernels("fast"))
        assert a.model.policy.kernel_mode == "fast" and b.model.policy.kernel_mode == "fast"
        a.model.set_policy(a.model.policy.with_kernels("exact"))
        assert b.model.policy.kernel_mode == "fast"
        assert torch.equal(_steps(a.model, prompt), exact_alone)
        assert torch.equal(_steps(b.model, prompt), fast_alone)


def test_policy_from_config():
    fast = ExecPolicy.from_config(load_config(cpu_threads=3))
    assert (fast.kernel_mode, fast.float_native, fast.native_threads, fast.decode_torch_threads) == ("fast", True, 3, 1)
    assert fast.torch_threads == 3                      # one budget for torch and the native kernels
    auto = ExecPolicy.from_config(load_config())
    assert auto.torch_threads == auto.native_threads == available_cpus()
    assert fast.decode_spin == DECODE_SPIN
    exact = ExecPolicy.from_config(load_config(expert_kernels="exact", cpu_isa="scalar"))
    assert (exact.kernel_mode, exact.float_native, exact.isa, exact.decode_torch_threads) == ("exact", False, "scalar", None)
    with pytest.raises(ValueError, match="expert kernels must be one of"):
        ExecPolicy(kernel_mode="turbo")
    with pytest.raises(ValueError, match="decode_torch_threads"):
        ExecPolicy(decode_torch_threads=0)
    with pytest.raises(TypeError, match="expected an ExecPolicy"):
        from lean_qwenflash.models.base import CausalLM
        CausalLM.set_policy(object.__new__(CausalLM), "fast")


def test_cgroup_limits_are_read_where_the_process_is(tmp_path):
    """A process in a nested group (a systemd slice, a capped benchmark group) is limited there and
    by its parents, not at the mount root: the tightest memory room (usage less inactive page
    cache) and CPU quota over the group and its parents, v1 and v2."""
    from lean_qwenflash._host import cgroup_dirs
    from lean_qwenflash.generate.budget import cgroup_memory

    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    proc.write_text("5:memory:/slice/job\n4:cpu,cpuacct:/slice/job\n0::/slice/job\n")
    job, outer = root / "memory" / "slice" / "job", root / "memory" / "slice"
    job.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))     # the root: unlimited
    (outer / "memory.limit_in_bytes").write_text(str(8 << 30))
    (outer / "memory.usage_in_bytes").write_text(str(1 << 30))
    (job / "memory.limit_in_bytes").write_text(str(2 << 30))
    (job / "memory.usage_in_bytes").write_text(str(2 << 30))                  # full, but 1.5 GiB of it page cache
    (job / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {3 << 29}\nrss 5\n")
    assert cgroup_dirs("memory", str(root), str(proc))[:3] == [job, outer, root / "memory"]
    assert cgroup_memory(str(root), str(proc)) == (2 << 30, 1 << 29)
    (outer / "memory.limit_in_bytes").write_text(str(1536 << 20))           # the parent leaves less room
    assert cgroup_memory(str(root), str(proc)) == (1536 << 20, 1 << 30)
    v2 = tmp_path / "v2"
    (v2 / "slice" / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "slice" / "job" / "memory.max").write_text("max\n")
    (v2 / "slice" / "memory.max").write_text(str(4 << 30))
    (v2 / "slice" / "memory.current").write_text(str(1 << 30))
    assert cgroup_memory(str(v2), str(proc)) == (4 << 30, 1 << 30)
    (v2 / "slice" / "cpu.max").write_text("50000 100000\n")
    (v2 / "slice" / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2), str(proc)) == 0.5
    v1 = root / "cpu,cpuacct" / "slice"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(root), str(proc)) == 2.5
    assert cgroup_memory(str(tmp_path / "none"), str(proc)) == (None, None)


def test_cpu_budget_reads_the_cgroup_quota(tmp_path, monkeypatch):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) == 1.0
    assert cgroup_cpu_limit(str(tmp_path / "missing")) is None
    import lean_qwenflash.models.policy as policy
    monkeypatch.setattr(policy, "cgroup_cpu_limit", lambda: 1.0)
    assert available_cpus() == 1                        # a 1-core quota caps the affinity mask
    monkeypatch.setattr(policy, "cgroup_cpu_limit", lambda: None)
    assert available_cpus() == len(__import__("os").sched_getaffinity(0))


def test_native_kernels_called_from_two_threads_with_different_budgets():
    """Two models' kernels on two Python threads (the GIL is released in the calls): each gets its
    own pool size, calls take turns on a pool, and every result is the single-threaded one."""
    import threading
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(512, 256, generator=gen), torch.randn(256, generator=gen)
    want = native.gemv(weight, x, threads=1)
    bad = []

    def hammer(threads):
        for _ in range(200):
            if not torch.equal(native.gemv(weight, x, threads=threads), want):
                bad.append(threads)
    workers = [threading.Thread(target=hammer, args=(t,)) for t in (2, 3, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not bad


def test_cpu_bind_picks_one_core_per_thread_only_when_asked_or_when_the_budget_is_every_core():
    choose = affinity.choose_cpus
    assert choose("auto", 4, [0, 1, 2, 3]) == (0, 1, 2, 3)
    assert choose("auto", 2, [0, 1, 2, 3]) == ()          # a subset could collide with another process
    assert choose("on", 2, [4, 5, 6, 7]) == (4, 5)
    assert choose("off", 4, [0, 1, 2, 3]) == ()
    assert choose("auto", 1, [3]) == () and choose("on", 1, [0, 1]) == ()   # one thread: nothing to keep apart
    assert choose("on", 4, [0, 1]) == ()                  # fewer CPUs than threads
    with pytest.raises(ValueError, match="cpu_bind must be one of"):
        choose("sometimes", 2, [0, 1])
    with pytest.raises(ConfigError, match="cpu_bind"):
        load_config(cpu_bind="sometimes")
    assert ExecPolicy.from_config(load_config(cpu_bind="off")).bind_cpus == ()
    assert ExecPolicy.from_config(load_config(cpu_bind="on", cpu_threads=1)).bind_cpus == ()
    assert ExecPolicy.from_config(load_config(cpu_bind="on", device="cuda")).bind_cpus == ()
    with pytest.raises(ValueError, match="bind_cpus must be distinct"):
        ExecPolicy(bind_cpus=(1, 1))


def test_torch_spin_follows_the_default_binding():
    """The package picks torch's OpenMP spin before torch loads, by whether the default policy binds
    threads here; a config that leaves them unbound under the long spin is told what to do."""
    binds = bool(affinity.choose_cpus("auto", available_cpus()))
    assert lean_qwenflash.binds_by_default() == binds
    assert lean_qwenflash.OMP_SPIN_COUNT == (lean_qwenflash.OMP_SPIN_BOUND if binds else lean_qwenflash.OMP_SPIN_UNBOUND)
    bound = ExecPolicy.from_config(load_config())
    unbound = ExecPolicy.from_config(load_config(cpu_bind="off"))
    assert bound.bind_cpus == (tuple(affinity.allowed_cpus()) if binds else ())
    assert torch_spin_unbound(bound) is None
    if lean_qwenflash.TORCH_OMP_WAIT_OURS and binds:
        assert "GOMP_SPINCOUNT=3000" in torch_spin_unbound(unbound) and "cpu_bind: on" in torch_spin_unbound(unbound)
    else:
        assert torch_spin_unbound(unbound) is None


_two_cpus = pytest.mark.skipif(len(affinity.allowed_cpus()) < 2 or not native.available(),
                               reason="thread placement needs two CPUs in this process's mask and the native kernels")


def _masks() -> dict:
    return {tid: cpus for tid, cpus in affinity.thread_cpus().items()}


@_two_cpus
def test_a_bound_step_puts_each_compute_thread_on_its_own_core():
    cpus = affinity.allowed_cpus()[:2]
    everywhere = affinity.allowed_cpus()
    me = __import__("threading").get_native_id()
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(256, 256)
        with affinity.bound(cpus, 2):
            assert sorted(__import__("os").sched_getaffinity(0)) == [cpus[0]]   # the caller
            native.gemv(x, x[0], threads=2)            # the kernel pool of two exists
            (x @ x).sum()                             # torch's team runs
            inside = _masks()
        workers = native.kernel_thread_ids()
        # (pools of other sizes, from other tests, follow the same rule: worker i on cpus[i % 2])
        assert workers and all(inside[t] in ([cpus[0]], [cpus[1]]) for t in workers if t in inside)
        omp = [t for t, m in inside.items() if t != me and t not in workers and m == [cpus[1]]]
        assert omp, f"torch's OpenMP worker was not bound: {inside}"
        after = _masks()
        assert after[me] == everywhere                 # the caller's own mask came back
        assert all(after[t] == [cpus[1]] for t in omp) # torch's workers stay on their core
        with affinity.bound((), 2):                    # an unbound step lets every thread run anywhere
            pass
        assert native.kernel_thread_cpus() == []
        assert all(m == everywhere for t, m in _masks().items() if t in workers or t in omp)
    finally:
        with affinity.bound((), 2):
            torch.set_num_threads(saved)


@_two_cpus
def test_bound_and_unbound_models_compute_the_same_bits(q4_pack):
    prompt = hf_models.prompt_ids(96, 24)
    cfg = dict(model=str(q4_pack), expert_kernels="fast", cpu_threads=2)
    # this process chose the long spin for bound threads: opening unbound says what to change
    expect = pytest.warns(RuntimeWarning, match="cpu_bind: on") if lean_qwenflash.OMP_SPIN_COUNT == lean_qwenflash.OMP_SPIN_BOUND \
        and lean_qwenflash.TORCH_OMP_WAIT_OURS else contextlib.nullcontext()
    with expect, Runtime.open(load_config(cpu_bind="off", **cfg), resident_experts=True) as rt:
        assert rt.model.policy.bind_cpus == ()
        unbound = _steps(rt.model, prompt)
    with Runtime.open(load_config(cpu_bind="on", **cfg), resident_experts=True) as rt:
        cpus = list(rt.model.policy.bind_cpus)
        assert len(cpus) == 2
        try:
            assert torch.equal(_steps(rt.model, prompt), unbound)
            assert native.kernel_thread_cpus() == cpus
            assert all(_masks()[t] in ([cpus[0]], [cpus[1]]) for t in native.kernel_thread_ids())
            assert sorted(__import__("os").sched_getaffinity(0)) == affinity.allowed_cpus()
        finally:
            rt.model.set_policy(dataclasses.replace(rt.model.policy, bind_cpus=()))
            _steps(rt.model, prompt[:, :4])
        assert native.kernel_thread_cpus() == []


_IDLE_SPIN_PROBE = r"""
import json, os, sys, time
first = sys.argv[1]
if first == "torch":
    import torch
import lean_qwenflash
import torch
from lean_qwenflash.models.policy import torch_threads_spin
torch.set_num_threads(2)
a = torch.randn(512, 512)
for _ in range(20):
    a @ a                                    # parallel regions: both OpenMP threads ran
t0 = os.times()
time.sleep(0.3)                              # torch idle: what do its threads do?
t1 = os.times()
print(json.dumps({"env": os.environ.get("OMP_WAIT_POLICY"), "spin_count": os.environ.get("GOMP_SPINCOUNT"),
                  "policy": lean_qwenflash.TORCH_OMP_WAIT,
                  "spin": torch_threads_spin(), "idle_cpu_s": (t1.user - t0.user) + (t1.system - t0.system)}))
"""


def _probe(first: str, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _IDLE_SPIN_PROBE, first], capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_openmp_threads_spin_briefly_unless_the_user_chose():
    """Imported before torch, the package caps how long torch's idle OpenMP threads spin (so a busy
    neighbour does not make them hold its core for ~10 ms at every region); a user's own setting is
    kept (OMP_WAIT_POLICY=ACTIVE: the idle thread spins through the whole sleep, which shows libgomp
    reads these variables when torch loads); torch imported first with neither is reported, with
    what to do."""
    ours = _probe("lean_qwenflash")
    count = lean_qwenflash.OMP_SPIN_COUNT                # 30000 where the default policy binds threads, else 3000
    assert (ours["env"], ours["spin_count"], ours["policy"], ours["spin"]) == (None, count, f"GOMP_SPINCOUNT={count}", None)
    active = _probe("lean_qwenflash", OMP_WAIT_POLICY="ACTIVE")
    assert (active["env"], active["spin_count"], active["policy"], active["spin"]) == \
        ("ACTIVE", None, "OMP_WAIT_POLICY=ACTIVE", None)
    assert ours["idle_cpu_s"] < 0.1 < active["idle_cpu_s"], (ours, active)
    late = _probe("torch")
    assert late["policy"] is None and late["spin_count"] is None
    assert f"GOMP_SPINCOUNT={count}" in late["spin"] and "before torch" in late["spin"]
