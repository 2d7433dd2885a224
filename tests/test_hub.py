"""`lean-qwenflash pull` against a local stand-in for the Hub (tests/hub_mock.py; HF_ENDPOINT points
at it, no network): quant and shard selection, packing a GGUF repo and a checkpoint repo, resuming a
cut download, a gated repo, no network, offline mode, and the disk-space check before any download."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_mock import MockHub
from lean_qwenflash.hub import HubError, RepoFile, plan, plan_gguf, quant_label
from lean_qwenflash.runtime import DEFAULT_MODEL_DIR

HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The built-in model as a GGUF file, as a 3-shard split, and as checkpoint files."""
    from lean_qwenflash.store.gguf_export import export_gguf
    root = tmp_path_factory.mktemp("hubsrc")
    single = export_gguf(DEFAULT_MODEL_DIR, root / "one" / "Tiny-F32.gguf", "f32")
    first = export_gguf(DEFAULT_MODEL_DIR, root / "split" / "Tiny-F32.gguf", "f32", split_max_tensors=40)
    shards = sorted(first.parent.glob("*.gguf"))
    assert len(shards) > 1 and all("-of-" in s.name for s in shards)
    return {"single": single, "shards": shards,
            "hf": {n: (DEFAULT_MODEL_DIR / n).read_bytes() for n in HF_FILES}}


@pytest.fixture()
def hub(sources):
    with MockHub() as h:
        h.add("lqf/tiny-GGUF", {"Tiny-F32.gguf": sources["single"].read_bytes(), "README.md": b"# tiny\n",
                                "mmproj-Tiny-F16.gguf": b"not a model"})
        h.add("lqf/split-GGUF", {f"F32/{s.name}": s.read_bytes() for s in sources["shards"]})
        h.add("lqf/tiny", sources["hf"])
        h.add("lqf/gated", sources["hf"], token="hf_secret")
        yield h


def _env(hub_url, tmp_path, **extra):
    env = dict(os.environ, HF_ENDPOINT=hub_url, HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"),
               HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    env.pop("HF_HUB_OFFLINE", None)
    env.update(extra)
    return env


def _pull(env, *args):
    return subprocess.run([sys.executable, "-m", "lean_qwenflash", "pull", *args, "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300)


def _pack_line(stdout: str) -> Path:
    return Path(next(l for l in stdout.splitlines() if l.startswith("pack: "))[6:])


# -- choosing files ------------------------------------------------------------------------------

def test_quant_labels_from_file_names():
    assert quant_label("Qwen3-30B-A3B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_label("Q4_K_M/Qwen3-235B-A22B-Q4_K_M-00002-of-00003.gguf") == "Q4_K_M"
    assert quant_label("Qwen3-30B-A3B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_label("model-iq4_xs.gguf") == "IQ4_XS"
    assert quant_label("gpt-oss-20b-MXFP4.gguf") == "MXFP4"
    assert quant_label("Tiny-F32.gguf") == "F32" and quant_label("x-bf16.gguf") == "BF16"
    assert quant_label("model.gguf") is None


def test_gguf_selection_picks_quant_and_all_shards():
    files = [RepoFile(n, 10) for n in ("README.md", "M-Q8_0.gguf", "mmproj-M-F16.gguf",
                                       "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf")]
    p = plan_gguf("o/m", files, "q4_k_m")                 # case-insensitive
    assert [f.name for f in p.files] == ["Q4_K_M/M-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf"]
    assert p.label == "Q4_K_M" and p.total_bytes == 20
    assert [f.name for f in plan_gguf("o/m", files, None).files][0].startswith("Q4_K_M/")   # Q4_K_M by default
    assert [f.name for f in plan_gguf("o/m", files, "M-Q8_0.gguf").files] == ["M-Q8_0.gguf"]
    # A shard named by file brings its siblings.
    assert len(plan_gguf("o/m", files, "M-Q4_K_M-00002-of-00002.gguf").files) == 2
    with pytest.raises(HubError, match=r"no Q2_K file\. Available quants: Q4_K_M, Q8_0"):
        plan_gguf("o/m", files, "Q2_K")
    with pytest.raises(HubError, match="lacks Q4_K_M/M-Q4_K_M-00002-of-00002.gguf"):
        plan_gguf("o/m", files[:4], "Q4_K_M")
    with pytest.raises(HubError, match="several quants"):
        plan_gguf("o/m", [RepoFile("a-Q8_0.gguf", 1), RepoFile("a-Q6_K.gguf", 1)], None)
    with pytest.raises(HubError, match="neither GGUF files nor a Hugging Face checkpoint"):
        plan("o/m", [RepoFile("README.md", 1)], None, None)
    with pytest.raises(HubError, match="--quant PRESET"):
        plan("o/m", [RepoFile("config.json", 1), RepoFile("model.safetensors", 1)], "Q4_K_M", None)


# -- end to end against the mock hub ------------------------------------------------------------

def test_pull_gguf_repo_packs_the_file_byte_for_byte(hub, sources, tmp_path):
    from lean_qwenflash.store.packer import pack
    r = _pull(_env(hub.url, tmp_path), "lqf/tiny-GGUF:f32")
    assert r.returncode == 0, r.stderr
    out = _pack_line(r.stdout)
    assert out == tmp_path / "home/.cache/lean-qwenflash/packs/lqf--tiny-GGUF--F32"
    assert f"lean-qwenflash generate --model {out} --prompt" in r.stdout
    assert f"lean-qwenflash serve --model {out}" in r.stdout
    # Only the model file was fetched (not the README, not the vision projector).
    got = {p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert got == {"/lqf/tiny-GGUF/resolve/main/Tiny-F32.gguf"}
    ref = pack(sources["single"], tmp_path / "direct", progress=False)
    assert (out / "experts.bin").read_bytes() == (tmp_path / "direct" / "experts.bin").read_bytes()
    assert sum(l["num_experts"] for l in json.loads((out / "manifest.json").read_text())["layers"]) == ref.num_records
    # A second pull finds the pack and downloads nothing.
    n = len(hub.requests)
    again = _pull(_env(hub.url, tmp_path), "lqf/tiny-GGUF:F32")
    assert again.returncode == 0 and "already packed" in again.stdout
    assert not [q for q in hub.requests[n:] if "/resolve/" in q[1]]


def test_pull_split_gguf_downloads_every_shard(hub, sources, tmp_path):
    r = _pull(_env(hub.url, tmp_path), "lqf/split-GGUF:F32")
    assert r.returncode == 0, r.stderr
    got = sorted(p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    assert got == [s.name for s in sources["shards"]]
    m = json.loads((_pack_line(r.stdout) / "manifest.json").read_text())
    assert m["layers"] and all(l["num_experts"] == 16 for l in m["layers"])


def test_pull_never_replaces_a_directory_that_is_not_a_pack(hub, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    n = len(hub.requests)
    r = _pull(_env(hub.url, tmp_path), "lqf/tiny-GGUF:f32", "--out", str(mine))
    assert r.returncode == 2 and "already exists and is not a pack" in r.stderr and "--force" in r.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
    assert not [q for q in hub.requests[n:] if "/resolve/" in q[1]]      # refused before downloading


def test_missing_quant_lists_the_available_ones(hub, tmp_path):
    r = _pull(_env(hub.url, tmp_path), "lqf/tiny-GGUF:Q4_K_M")
    assert r.returncode == 2
    assert "has no Q4_K_M file. Available quants: F32" in r.stderr


def test_pull_checkpoint_repo_with_quant_and_resume_after_a_cut(hub, tmp_path):
    # The connection drops after 11 MiB, once. huggingface_hub writes what it got in 10 MiB chunks
    # (DOWNLOAD_CHUNK_SIZE) and asks for the rest from there.
    from huggingface_hub import constants
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    assert len(hub.repos["lqf/tiny"].files["model.safetensors"]) > chunk + (1 << 20)
    hub.fail_after["model.safetensors"] = chunk + (1 << 20)
    r = _pull(_env(hub.url, tmp_path), "lqf/tiny", "--quant", "q8_0")
    assert r.returncode == 0, r.stderr
    ranges = [rng for m, p, rng in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert ranges == [None, f"bytes={chunk}-"], ranges    # resumed, not restarted
    out = _pack_line(r.stdout)
    assert out.name == "lqf--tiny--q8_0"
    m = json.loads((out / "manifest.json").read_text())
    assert {t["encoding"] for layer in m["layers"] for t in layer["tensors"]} == {"q8_0"}
    blob = next((tmp_path / "hf/hub/models--lqf--tiny/snapshots").iterdir()) / "model.safetensors"
    assert blob.read_bytes() == (DEFAULT_MODEL_DIR / "model.safetensors").read_bytes()
    assert "tokenizer.json" in m["tokenizer_files"]


def test_gated_repo_needs_a_token(hub, tmp_path):
    r = _pull(_env(hub.url, tmp_path), "lqf/gated")
    assert r.returncode == 2
    assert "lqf/gated is gated" in r.stderr and "HF_TOKEN" in r.stderr
    ok = _pull(_env(hub.url, tmp_path, HF_TOKEN="hf_secret"), "lqf/gated")
    assert ok.returncode == 0, ok.stderr
    r = _pull(_env(hub.url, tmp_path), "lqf/nothing-here")
    assert r.returncode == 2 and "no repository lqf/nothing-here" in r.stderr


def test_no_network_says_so(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                           # nothing listens there now
    r = _pull(_env(f"http://127.0.0.1:{port}", tmp_path), "lqf/tiny")
    assert r.returncode == 2
    assert "cannot reach" in r.stderr and "HF_HUB_OFFLINE=1" in r.stderr, r.stderr


def test_offline_mode_packs_from_the_download_cache(hub, tmp_path):
    env = _env(hub.url, tmp_path)
    assert _pull(env, "lqf/tiny-GGUF:F32").returncode == 0
    out = tmp_path / "home/.cache/lean-qwenflash/packs/lqf--tiny-GGUF--F32"
    import shutil
    shutil.rmtree(out)
    n = len(hub.requests)
    off = dict(env, HF_HUB_OFFLINE="1")
    r = _pull(off, "lqf/tiny-GGUF:F32")
    assert r.returncode == 0, r.stderr
    assert "offline" in r.stdout and (out / "manifest.json").is_file()
    assert len(hub.requests) == n                       # not one request
    r = _pull(off, "lqf/tiny")
    assert r.returncode == 2 and "not in the download cache" in r.stderr


def test_disk_space_is_checked_before_downloading(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants
    from lean_qwenflash import hub as hubmod
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)           # (what HF_ENDPOINT sets at import)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    size = len(hub.repos["lqf/tiny"].files["model.safetensors"])
    with pytest.raises(HubError, match=r"not enough disk space: lqf/tiny needs .* to download.* but 1\.0MiB is free"):
        hubmod.pull("lqf/tiny", progress=False, out=lambda *_: None, free_fn=lambda p: (1 << 20, Path("/")))
    assert not [q for q in hub.requests if "/resolve/" in q[1]]      # nothing was downloaded
    r = hubmod.pull("lqf/tiny", progress=False, out=lambda *_: None, free_fn=lambda p: (4 * size, Path("/")))
    assert (r.pack_dir / "manifest.json").is_file()


# -- the README's first five minutes, as written ---------------------------------------------------

def readme_block() -> str:
    """The first ```bash block under "## First five minutes" in README.md."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## First five minutes", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_readme_first_five_minutes_runs_as_written(sources, tmp_path):
    """The block runs in bash, unchanged, with HF_ENDPOINT at the stand-in hub, which serves the
    built-in model's weights (an f32 GGUF) under the real repository's Q4_K_M file name: the
    commands, the quant selection, the pack path they use, serving, the dashboard and the API are
    what is tested, not that model."""
    import socket
    block = readme_block()
    assert "lean-qwenflash pull Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M" in block
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is in use; the README's serve needs it"
    with MockHub() as hub:
        hub.add("Qwen/Qwen3-30B-A3B-GGUF", {"Qwen3-30B-A3B-Q4_K_M.gguf": sources["single"].read_bytes(),
                                            "Qwen3-30B-A3B-Q8_0.gguf": b"not fetched", "README.md": b"# card\n"})
        root = Path(__file__).resolve().parents[1]
        env = _env(hub.url, tmp_path, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        r = subprocess.run(["bash", "-e", "-c", block], env=env, cwd=root, capture_output=True, text=True,
                           timeout=900, stdin=subprocess.DEVNULL)
        fetched = {p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    pack_dir = tmp_path / "home/.cache/lean-qwenflash/packs/Qwen--Qwen3-30B-A3B-GGUF--Q4_K_M"
    assert f"pack: {pack_dir}" in r.stdout and (pack_dir / "manifest.json").is_file()
    assert [p.rsplit("/", 1)[-1] for p in fetched] == ["Qwen3-30B-A3B-Q4_K_M.gguf"]
    assert "dashboard: http://127.0.0.1:8000/ui" in r.stdout
    answer = json.loads(r.stdout[r.stdout.index('{"id"'):].splitlines()[0])
    assert answer["choices"][0]["message"]["content"] is not None and answer["usage"]["completion_tokens"] > 0
