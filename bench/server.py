"""Server benchmark: follow-up-turn TTFT with vs without prefix reuse, and client-seen streaming rate.

    python bench/server.py [--model PACK] [--config configs/X.yaml] [--system-tokens 600] [--out FILE]

Runs a real uvicorn on 127.0.0.1 in this process (torch threads = 1) with the official ``openai``
client. For each of ``--repeats`` conversations (a long system prompt, a first turn, then a
follow-up turn) it measures the follow-up's time to first streamed token on a server with the
prefix cache and on one without (same model, ``prefix_cache_bytes=0``). Then one long streamed
answer compares tokens/s seen by the client with the engine's own decode rate (/metrics).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _serve(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _stream(client, model, messages, max_tokens):
    """(ttft_s, first->last delta seconds, completion tokens, cached tokens, message text)."""
    t0 = time.perf_counter()
    first = last = None
    text = ""
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                                                temperature=0, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            piece = (d.content or "") + (getattr(d, "reasoning_content", None) or "")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text += d.content or ""
    return ((first or time.perf_counter()) - t0, (last - first) if first else 0.0, usage.completion_tokens,
            usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens, text)


def _stream_completion(client, model, prompt, max_tokens):
    """(first->last text chunk seconds, completion tokens) of a streamed /v1/completions call."""
    first = last = None
    usage = None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           temperature=0, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if any(c.text for c in chunk.choices):
            now = time.perf_counter()
            first = first or now
            last = now
    return ((last - first) if first else 0.0), usage.completion_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="pack directory (default: the built-in default model)")
    ap.add_argument("--config", help="runtime config YAML")
    ap.add_argument("--system-tokens", type=int, default=600, help="approximate length of the shared system prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=200, help="length of the streamed answer for the rate")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "server.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import copy

    import openai

    from lean_qwenflash.config import load_config
    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.server.app import create_app

    cfg = load_config(args.config, model=args.model)
    cfg.generation.temperature = 0.0
    rt = Runtime.open(cfg)
    no_cache = copy.deepcopy(cfg)
    no_cache.server.prefix_cache_bytes = 0
    servers = {name: _serve(create_app(rt, c, model_name="bench")) for name, c in
               (("reuse", cfg), ("no_reuse", no_cache))}
    clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
               for name, (_, _, url) in servers.items()}
    words = "storage bandwidth latency experts router cache prefetch token layer".split()
    ttft = {"reuse": [], "no_reuse": []}
    cached = {"reuse": [], "no_reuse": []}
    prompt_tokens = []
    try:
        for rep in range(args.repeats):
            for name, client in clients.items():
                # A distinct system prompt per conversation and server: no hit from an earlier one.
                system = f"Conversation {rep}-{name}. " + " ".join(words[i % len(words)]
                                                                   for i in range(args.system_tokens))
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the topic."}]
                _, _, _, _, _, answer = _stream(client, "bench", msgs, 24)
                msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on, briefly."}]
                t, _, _, c, p, _ = _stream(client, "bench", msgs, 8)
                ttft[name].append(t)
                cached[name].append(c)
                if name == "reuse":
                    prompt_tokens.append(p)

        url = servers["reuse"][2]
        d_tok0, d_s0 = _metric(url, "lqf_decode_tokens_total"), _metric(url, "lqf_decode_seconds_total")
        # A raw code continuation through /v1/completions: it runs long and streams every token as
        # text (a chat answer may be one tool call, which arrives as a single delta).
        span_s, n = _stream_completion(clients["reuse"], "bench", "import os\nimport sys\n\n\ndef ",
                                       args.decode_tokens)
        engine_rate = (_metric(url, "lqf_decode_tokens_total") - d_tok0) / max(
            _metric(url, "lqf_decode_seconds_total") - d_s0, 1e-9)
        client_rate = (n - 1) / span_s if span_s > 0 else 0.0
    finally:
        for server, thread, _ in servers.values():
            server.should_exit = True
            thread.join(10)
        rt.close()

    med = {k: statistics.median(v) for k, v in ttft.items()}
    result = {
        "model": str(rt.store.path), "system_tokens_approx": args.system_tokens, "repeats": args.repeats,
        "followup_prompt_tokens": statistics.median(prompt_tokens),
        "followup_cached_tokens": {k: statistics.median(v) for k, v in cached.items()},
        "followup_ttft_s": med, "ttft_ratio_no_reuse_over_reuse": med["no_reuse"] / med["reuse"],
        "stream_tokens": n, "client_tokens_per_s": client_rate, "engine_tokens_per_s": engine_rate,
        "client_over_engine": client_rate / engine_rate if engine_rate else 0.0,
    }
    rows = [("follow-up prompt tokens", f"{result['followup_prompt_tokens']:.0f}"),
            ("cached tokens (reuse / no reuse)", f"{result['followup_cached_tokens']['reuse']:.0f} / "
                                                 f"{result['followup_cached_tokens']['no_reuse']:.0f}"),
            ("follow-up TTFT with reuse", f"{med['reuse'] * 1000:.1f} ms"),
            ("follow-up TTFT without reuse", f"{med['no_reuse'] * 1000:.1f} ms"),
            ("TTFT ratio (without / with)", f"{result['ttft_ratio_no_reuse_over_reuse']:.2f}x"),
            ("streamed tokens", f"{n}"),
            ("client-seen tokens/s", f"{client_rate:.1f}"),
            ("engine tokens/s", f"{engine_rate:.1f}"),
            ("client / engine", f"{result['client_over_engine'] * 100:.1f}%")]
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
