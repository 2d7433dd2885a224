"""The command line: generate, doctor, chat, and clear failures with non-zero exit codes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lean_qwenflash import io_engine
from lean_qwenflash.store import pack

hf_models = pytest.importorskip("hf_models")
REPO = Path(__file__).resolve().parents[1]


def lqf(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "lean_qwenflash", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "pack"
    pack(hf_models.case("qwen3_next").path, out, progress=False)
    return out


def test_generate_streams_tokens_then_statistics(tiny_pack):
    r = lqf("generate", "--model", tiny_pack, "--prompt-ids", "1,2,3,4,5", "--max-tokens", "6", "--temperature", "0",
            "--host-cache-bytes", "64KiB")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 6 and all(t.isdigit() for t in r.stdout.split())
    assert "hit%" in r.stderr and "total" in r.stderr and "tokens/s" in r.stderr
    again = lqf("generate", "--model", tiny_pack, "--prompt-ids", "1,2,3,4,5", "--max-tokens", "6",
                "--temperature", "0", "--io-engine", "pread", "--no-stats")
    assert again.returncode == 0 and again.stdout == r.stdout and again.stderr == ""


@pytest.mark.parametrize("args,words", [
    (["generate", "--model", "/nonexistent/pack", "--prompt-ids", "1"], "does not exist"),
    (["generate", "--prompt-ids", "1"], None),  # default model: fine or a clear error, never a traceback
    (["generate"], "exactly one of --prompt or --prompt-ids"),
    (["generate", "--model", "PACK", "--prompt-ids", "1,x"], "--prompt-ids must be integers"),
    (["generate", "--model", "PACK", "--prompt-ids", "100000"], "token ids in 0.."),
    (["generate", "--model", "PACK", "--prompt", "hello"], "has no tokenizer.json"),
    (["generate", "--model", "PACK", "--prompt-ids", "1", "--host-cache-bytes", "1KiB"], "minimum is one layer's top-k"),
    (["generate", "--model", "PACK", "--prompt-ids", "1", "--config", "/nonexistent.yaml"], "does not exist"),
    (["pack", "/nonexistent", "/tmp/x"], "has no config.json"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_fails_clearly(args, words, tiny_pack):
    r = lqf(*[str(tiny_pack) if a == "PACK" else a for a in args])
    assert "Traceback" not in r.stderr, r.stderr
    if words is None:
        return
    assert r.returncode != 0
    assert words in r.stderr, r.stderr


def test_help_explains():
    r = lqf("--help")
    assert r.returncode == 0
    for cmd in ("pack", "generate", "chat", "doctor", "stats", "inspect"):
        assert cmd in r.stdout
    r = lqf("generate", "--help")
    assert "--prompt" in r.stdout and "--max-tokens" in r.stdout and "statistics" in r.stdout


def test_doctor_reports_engine_and_suggests_sizes(tiny_pack):
    r = lqf("doctor", "--model", tiny_pack, "--probe-seconds", "0.4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engine (auto):" in r.stdout and "O_DIRECT:" in r.stdout and "host_cache_bytes:" in r.stdout
    expected = "uring" if io_engine.uring_compiled() else "pread"
    assert f"engine (auto): {expected}" in r.stdout
    # the second read probe: the same reads landing across a host-cache-sized buffer
    assert "GB/s landing across a" in r.stdout and "as the host cache's reads do" in r.stdout


def test_doctor_explains_missing_io_uring(tiny_pack):
    from lean_qwenflash.doctor import run_doctor
    lines = []
    io_engine._io._force_uring_failure(True)
    try:
        assert run_doctor(str(tiny_pack), probe_seconds=0.2, out=lines.append) == 0
    finally:
        io_engine._io._force_uring_failure(False)
    text = "\n".join(lines)
    assert "io_uring:      unavailable" in text and "engine (auto): pread" in text


def test_stats_without_server_is_a_clear_error():
    r = lqf("stats", "--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "is `lean-qwenflash serve` running" in r.stderr
