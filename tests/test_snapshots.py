"""Prefix snapshots on disk (generate/snapshots.py under PrefixCache): spilled and restored bit for
bit, checked (a corrupt or stale file is ignored, logged and deleted), bounded (LRU), reused by a
new cache over the same directory, and by a restarted server."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models  # noqa: E402
from lean_qwenflash.generate import Generator, PrefixCache, SamplingParams  # noqa: E402
from lean_qwenflash.generate.snapshots import SnapshotDir  # noqa: E402
from lean_qwenflash.loader import load_hf_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
# DeltaNet + full attention; sliding-window ring + sinks; latent attention (MLA)
FAMILIES = ["qwen3_next", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model_and_prompt(request):
    c = hf_models.case(request.param)
    model, _ = load_hf_checkpoint(c.path)
    return model, c.prompt[0].tolist()


def _states_equal(a, b) -> bool:
    """Every tensor and scalar of two ModelStates identical (KV compared over the tokens held)."""
    if (a.num_tokens, a.tokens, len(a.layers)) != (b.num_tokens, b.tokens, len(b.layers)):
        return False
    for la, lb in zip(a.layers, b.layers):
        if type(la) is not type(lb) or vars(la).keys() != vars(lb).keys():
            return False
        for key, va in vars(la).items():
            vb = vars(lb)[key]
            if isinstance(va, torch.Tensor):
                if key in ("keys", "values") and hasattr(la, "append"):
                    va, vb = va[:, :, :la.num_tokens], vb[:, :, :lb.num_tokens]
                if va.dtype != vb.dtype or va.shape != vb.shape or not torch.equal(va, vb):
                    return False
            elif va != vb:
                return False
    return True


def test_spilled_snapshot_restores_bit_exact_and_continues_the_same(model_and_prompt, tmp_path):
    model, prompt = model_and_prompt
    head = prompt[:28]
    live_gen = Generator(model, prefill_chunk_tokens=8)
    live = list(live_gen.start(prompt, GREEDY, max_new_tokens=12))
    # A RAM tier too small for any snapshot: every snapshot goes straight to disk.
    disk = SnapshotDir(tmp_path / "snaps", 1 << 30, "fp")
    cache = PrefixCache(1, disk)
    gen = Generator(model, prefill_chunk_tokens=8, prefix_cache=cache)
    list(gen.start(head, GREEDY, max_new_tokens=1))          # snapshot of the 28 prompt tokens
    assert len(cache) == 0 and len(disk) >= 1 and disk.writes >= 1
    assert tuple(head) in disk

    restored = SnapshotDir(tmp_path / "snaps", 1 << 30, "fp").read(tuple(head))
    reference = live_gen.new_state()
    live_gen.prefill(head, reference)
    assert _states_equal(restored, reference), "the restored state differs from a live prefill"

    g = gen.start(prompt, GREEDY, max_new_tokens=12)
    tokens = list(g)
    assert g.cached_tokens == len(head) and disk.restores >= 1
    assert tokens == live, (tokens, live)
    # The logits after the restored state, not only the argmax: identical bits.
    a, b = restored.clone(), reference.clone()
    assert torch.equal(live_gen.feed(prompt[len(head):], a), live_gen.feed(prompt[len(head):], b))


def test_ram_evictions_spill_and_flush_writes_the_rest(model_and_prompt, tmp_path):
    model, prompt = model_and_prompt
    gen = Generator(model, prefill_chunk_tokens=8)
    states = []
    for n in (10, 20, 30):
        s = gen.new_state()
        gen.prefill(prompt[:n], s)
        states.append(s)
    one = states[-1].nbytes() + 8 * 30                # what the cache counts for the largest
    disk = SnapshotDir(tmp_path, 1 << 30, "fp")
    cache = PrefixCache(one, disk)                   # room in RAM for about one
    for s in states:
        cache.put(s)
    assert len(cache) == 1 and len(disk) == 2 and cache.evictions == 2
    assert cache.flush() == 1 and len(disk) == 3
    # Each is found again from disk by a fresh cache, and is the state that was put.
    fresh = PrefixCache(one, SnapshotDir(tmp_path, 1 << 30, "fp"))
    for n, s in zip((10, 20, 30), states):
        got = fresh.lookup(prompt[:n + 1])
        assert got is not None and got.num_tokens == n and _states_equal(got, s)


def test_corrupt_truncated_foreign_and_stale_files_are_ignored_logged_and_deleted(model_and_prompt, tmp_path, caplog):
    model, prompt = model_and_prompt
    gen = Generator(model, prefill_chunk_tokens=8)
    disk = SnapshotDir(tmp_path, 1 << 30, "fp")
    for n in (12, 24):
        s = gen.new_state()
        gen.prefill(prompt[:n], s)
        assert disk.write(s)
    long_file = tmp_path / disk.name_for(tuple(prompt[:24]))
    data = bytearray(long_file.read_bytes())
    data[-5] ^= 0x40                                 # one bit of the payload
    long_file.write_bytes(bytes(data))
    cache = PrefixCache(1 << 30, disk)
    with caplog.at_level(logging.WARNING, logger="lean_qwenflash.snapshots"):
        got = cache.lookup(prompt)
    # The corrupt 24-token snapshot is dropped; the lookup falls back to the 12-token one.
    assert got is not None and got.num_tokens == 12
    assert not long_file.exists() and tuple(prompt[:24]) not in disk
    assert any("corrupt payload" in r.message for r in caplog.records), caplog.text

    # At start: a truncated file, a file that is not a snapshot, a leftover .tmp and (with another
    # fingerprint) a stale one are all deleted, each with a line saying why.
    short = tmp_path / disk.name_for(tuple(prompt[:12]))
    good = short.read_bytes()
    (tmp_path / ("0" * 40 + ".snap")).write_bytes(b"not a snapshot at all")
    (tmp_path / "x.snap.tmp").write_bytes(b"half")
    trunc = tmp_path / disk.name_for(tuple(prompt[:5]))
    trunc.write_bytes(good[:len(good) // 2])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lean_qwenflash.snapshots"):
        again = SnapshotDir(tmp_path, 1 << 30, "fp")
    assert len(again) == 1 and again.dropped == 3 and sorted(p.name for p in tmp_path.iterdir()) == [short.name]
    text = caplog.text
    assert "not a snapshot file" in text and "unfinished write" in text and "truncated" in text, text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lean_qwenflash.snapshots"):
        other = SnapshotDir(tmp_path, 1 << 30, "another pack")
    assert len(other) == 0 and not short.exists() and "stale" in caplog.text


def test_directory_budget_is_respected_least_recently_used_first(model_and_prompt, tmp_path):
    model, prompt = model_and_prompt
    gen = Generator(model, prefill_chunk_tokens=8)
    states = []
    for n in (8, 9, 10, 11, 12):
        s = gen.new_state()
        gen.prefill(prompt[:n], s)
        states.append(s)
    probe = SnapshotDir(tmp_path / "probe", 1 << 30, "fp")
    probe.write(states[-1])
    size = probe.used_bytes
    budget = int(2.5 * size)                         # two snapshots fit, not three
    disk = SnapshotDir(tmp_path / "d", budget, "fp")
    disk.write(states[0])
    disk.write(states[1])
    assert disk.read(tuple(prompt[:8])) is not None  # used: now the most recent
    for s in states[2:]:
        disk.write(s)
        on_disk = sum(f.stat().st_size for f in (tmp_path / "d").iterdir())
        assert disk.used_bytes == on_disk <= budget
    assert sorted(len(k) for k in disk.keys()) == [11, 12] and disk.evictions == 3
    # A snapshot larger than the whole budget is not written (and evicts nothing).
    tiny = SnapshotDir(tmp_path / "t", size // 2, "fp")
    assert not tiny.write(states[0]) and len(tiny) == 0 and not list((tmp_path / "t").iterdir())


def test_restarted_server_reuses_snapshots_when_pack_and_numerics_are_unchanged(tmp_path):
    """A server's snapshots outlive it: after a restart (a new app over the same directory) the same
    conversation is answered from a restored snapshot; a config that changes numerics does not
    reuse them (their fingerprint differs)."""
    import copy

    from test_server import MODEL, ServerThread, make_tiny_pack

    from lean_qwenflash.config import load_config
    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.server.app import create_app
    from lean_qwenflash.server.engine import snapshot_fingerprint

    pack = make_tiny_pack(str(tmp_path / "tiny-pack"))
    cfg = load_config(None, model=pack, host_cache_bytes="2MiB")
    cfg.generation.temperature = 0.0
    cfg.server.snapshot_dir = str(tmp_path / "snaps")
    cfg.server.prefix_cache_bytes = 64 * 1024**2
    with Runtime.open(cfg) as rt:
        fp = snapshot_fingerprint(rt, cfg)
        for key, value in (("dtype", "bfloat16"), ("expert_kernels", "exact")):
            other = copy.deepcopy(cfg)
            setattr(other, key, value)
            assert snapshot_fingerprint(rt, other) != fp, key
        other = copy.deepcopy(cfg)
        other.generation.prefill_chunk_tokens += 1
        assert snapshot_fingerprint(rt, other) != fp

        first = rt.tokenizer.encode("The history of the disk drive begins with " * 8)
        follow_up = first + rt.tokenizer.encode(" a second question about heads")
        answers = []
        for run, (prompt, snapshots) in enumerate(((first, True), (follow_up, True), (follow_up, False))):
            c = copy.deepcopy(cfg)
            if not snapshots:          # the reference: no snapshots anywhere
                c.server.snapshot_dir, c.server.prefix_cache_bytes = None, 0
            srv = ServerThread(create_app(rt, c, model_name=MODEL), c)
            try:
                r = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6)
                answers.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
            finally:
                srv.stop()          # the engine closes: what is in RAM is written to the directory
            if run == 0:
                assert list((tmp_path / "snaps").glob("*.snap")), "no snapshot written at shutdown"
    (_, cached0), (text1, cached1), (text_ref, cached_ref) = answers
    assert cached0 == 0 and cached_ref == 0, answers
    assert cached1 == len(first), (cached1, len(first))     # restored from the first server's file
    assert text1 == text_ref, answers
