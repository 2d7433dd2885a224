"""The live dashboard (/ui) in a real browser: headless Chromium (Debian's package; scripts/setup.sh
--test installs it) renders the page against a running `lean-qwenflash serve` of the built-in model
after a few requests; the DOM it dumps must show charts with data, and it takes a screenshot.
Also: /v1/stats (the JSON the page polls) and `serve --trace`."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _get(url, data=None, timeout=60):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`lean-qwenflash serve` of the built-in model with a small host cache (misses happen), prefetch
    off, tracing on; three chat requests already answered."""
    root = tmp_path_factory.mktemp("ui")
    cfg = root / "cfg.yaml"
    cfg.write_text("host_cache_bytes: 900KiB\nprefetch: false\n")
    port = _port()
    trace = root / "serve.lqft"
    env = dict(os.environ, HOME=str(root))
    proc = subprocess.Popen([sys.executable, "-m", "lean_qwenflash", "serve", "--config", str(cfg), "--port", str(port),
                             "--log-level", "warning", "--trace", str(trace)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            _get(url + "/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
    for i, text in enumerate(("Hello there", "What is a mixture of experts?", "Count to five")):
        # Greedy: a sampled answer of the random model could end at its first token, and a generation
        # of one token has no decode speed (no point on the dashboard's tok/s series).
        status, _, body = _get(url + "/v1/chat/completions", {"model": "default", "max_tokens": 12 + 4 * i,
                                                             "temperature": 0,
                                                             "messages": [{"role": "user", "content": text}]})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 2
    yield url, proc, trace, root
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_stats_json_and_static_files(server):
    url, *_ = server
    status, ctype, body = _get(url + "/v1/stats")
    s = json.loads(body)
    assert status == 200 and ctype.startswith("application/json")
    assert s["tokens"]["generated"] > 0 and len(s["series"]["decode"]) == 3 and len(s["series"]["ttft"]) == 3
    ex = s["experts"]
    assert ex["total"]["lookups"] == sum(l["lookups"] for l in ex["layers"].values()) > 0
    assert ex["total"]["misses"] > 0
    host = s["caches"]["host"]
    assert 0 < host["used"] <= host["slots"] and host["pinned"] == 0 and s["requests"] == {**s["requests"], "active": 0}
    for name, kind in (("/ui", "text/html"), ("/ui/dashboard.js", "text/javascript"), ("/ui/dashboard.css", "text/css")):
        status, ctype, body = _get(url + name)
        assert status == 200 and ctype.startswith(kind) and body
    page = _get(url + "/ui")[2].decode()
    assert "http" not in re.sub(r"<!--.*?-->", "", page).replace("http-equiv", "")   # no CDN, nothing remote
    with pytest.raises(urllib.error.HTTPError):
        _get(url + "/ui/other.js")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh --test installs it)")
def test_dashboard_renders_with_data_in_chromium(server):
    url, _, _, root = server
    shot = root / "dashboard.png"
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", f"--user-data-dir={root / 'chromium'}", "--window-size=1280,1500",
            "--virtual-time-budget=6000"]
    r = subprocess.run(base + ["--dump-dom", url + "/ui"], capture_output=True, text=True, timeout=180)
    dom = r.stdout
    assert "<canvas" in dom, r.stderr[-2000:]

    def attr(el_id, name):
        m = re.search(rf'id="{el_id}"[^>]*data-{name}="(\d+)"', dom) or \
            re.search(rf'data-{name}="(\d+)"[^>]*id="{el_id}"', dom)
        assert m, f"{el_id} has no data-{name} in the DOM"
        return int(m.group(1))

    assert attr("chart-tps", "points") == 3          # one point per finished generation
    assert attr("chart-ttft", "points") == 3
    assert attr("heatmap", "cells") >= 4             # since start: one cell per MoE layer (4)
    assert attr("chart-caches", "bars") == 1         # the host tier (CPU: no device tier)
    assert attr("chart-requests", "points") >= 2     # polled more than once
    assert attr("chart-io", "points") >= 1
    assert 'class="status ok"' in dom
    assert re.search(r'id="tile-active">0<', dom) and re.search(r'id="tile-tps">[0-9.]+<', dom)
    assert "expert lookups" in dom
    r = subprocess.run(base + [f"--screenshot={shot}", url + "/ui"], capture_output=True, text=True, timeout=180)
    assert shot.is_file(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000      # a drawn page, not a blank one
    keep = os.environ.get("LQF_UI_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def test_serve_trace_replays_to_the_servers_counts(server):
    """`serve --trace`: after shutdown the trace replays (the server's cache policy and host slots)
    to exactly the server's own expert counters."""
    url, proc, trace, _ = server
    s = json.loads(_get(url + "/v1/stats")[2])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "records appended to" in err, err[-2000:]
    from lean_qwenflash.experts.trace import read_trace, simulate
    t = read_trace(trace)
    assert s["caches"]["host"]["policy"] == "lfu"          # (the default)
    r = simulate(t, s["caches"]["host"]["slots"], s["caches"]["host"]["policy"])
    tot = s["experts"]["total"]
    assert (r.lookups, r.hits, r.misses) == (tot["lookups"], tot["hits_host"] + tot["hits_device"], tot["misses"])
