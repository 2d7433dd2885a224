"""Server benchmark: prefix reuse, an agent-shaped session, side requests, grammar-mask cost.

    python bench/server.py [--model PACK] [--config configs/X.yaml] [--system-tokens 600] [--out FILE]

Runs a real uvicorn on 127.0.0.1 in this process (torch threads = 1) with the official ``openai``
client, and measures side by side in one run:

1. follow-up-turn TTFT on a server with the prefix cache and on one without (same model,
   ``prefix_cache_bytes=0``), over ``--repeats`` conversations (long system prompt, first turn,
   follow-up);
2. an agent-shaped session: a system prompt, ``--tools`` tool definitions and 5 turns in which
   tool calls get tool results back, TTFT per turn with and without prefix reuse;
3. the side-request wait: a short chat request (an agent's title request) sent while a long answer
   streams, on ``server.max_active=1`` (first come, first served) and on the configured
   ``max_active`` (interleaved decoding);
4. client-seen streaming rate against the engine's own decode rate (/metrics);
5. the grammar mask: per-token cost of the tool-call grammar (llguidance mask + token advance)
   against a decode step, in-process on the same model, and the grammar's build time.

Only one server runs a request at a time (they share one model).
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

import lean_qwenflash  # noqa: E402,F401  (before torch: it sets torch's OpenMP spin)
import torch  # noqa: E402


def _serve(app, cfg):
    """A real server for ``app`` (configured as ``lean-qwenflash serve`` configures it) on a free port."""
    import uvicorn

    from lean_qwenflash.server.http import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, cfg, "warning", host="127.0.0.1", port=port))
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


def _agent_tools(n: int) -> list[dict]:
    """``n`` tool definitions shaped like a coding agent's (path/command/pattern arguments)."""
    kinds = [("read_file", {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
              ["path"]),
             ("list_files", {"path": {"type": "string"}, "recursive": {"type": "boolean"}}, ["path"]),
             ("run_command", {"command": {"type": "string"}, "timeout": {"type": "integer"}}, ["command"]),
             ("search", {"pattern": {"type": "string"}, "path": {"type": "string"},
                         "mode": {"enum": ["regex", "literal"]}}, ["pattern"]),
             ("edit_file", {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
              ["path", "old", "new"]),
             ("get_weather", {"city": {"type": "string"}}, ["city"])]
    tools = []
    for i in range(n):
        name, props, req = kinds[i % len(kinds)]
        name = name if i < len(kinds) else f"{name}_{i}"
        tools.append({"type": "function", "function": {
            "name": name, "description": f"{name.replace('_', ' ')}: a tool of the agent",
            "parameters": {"type": "object", "properties": props, "required": req}}})
    return tools


def _agent_turn(client, model, messages, tools, max_tokens):
    """One streamed agent turn: (ttft_s to the first delta of any kind, cached tokens, assistant
    message dict, tool calls)."""
    from lean_qwenflash.server.output import ChatMessage

    t0 = time.perf_counter()
    first = None
    msg = ChatMessage()
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=max_tokens,
                                                stream=True, temperature=0, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta.model_dump(exclude_none=True)
            if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                first = first or time.perf_counter()
            msg.add(d)
    out = msg.to_dict()
    return (first or time.perf_counter()) - t0, usage.prompt_tokens_details.cached_tokens, out, out.get("tool_calls")


def agent_session(client, model, system_words: int, tools: list[dict], turns: int = 5):
    """TTFT and cached tokens per turn of a deterministic agent session (greedy)."""
    words = "repository module function test build config cache server client token".split()
    messages = [{"role": "system", "content": "You are a coding agent. " + " ".join(
        words[i % len(words)] for i in range(system_words))},
        {"role": "user", "content": "What's the weather like in Paris?"}]
    followups = ["List the files in the config directory.", "Show me lines 10 to 20 of setup.py",
                 "Run the tests", "Find where the tokenizer is defined", "Thanks."]
    rows = []
    for turn in range(turns):
        ttft, cached, message, calls = _agent_turn(client, model, messages, tools, 48)
        rows.append({"turn": turn + 1, "ttft_s": ttft, "cached_tokens": cached, "tool_calls": len(calls or [])})
        messages.append({k: v for k, v in message.items() if k != "reasoning_content"})
        for call in calls or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"ok": True, "lines": [
                "alpha", "beta", "gamma"]})})
        if not calls:
            messages.append({"role": "user", "content": followups[turn % len(followups)]})
    return rows


def side_request_wait(client, model, main_tokens: int):
    """(side request latency s, its TTFT s, main request total s): a title request sent once a
    long completion has started streaming."""
    result = {}
    started = threading.Event()

    def main_request():
        t0 = time.perf_counter()
        for chunk in client.completions.create(model=model, prompt="import os\nimport sys\n\n\ndef ",
                                               max_tokens=main_tokens, stream=True, temperature=0):
            if any(c.text for c in chunk.choices):
                started.set()
        result["main_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=main_request)
    thread.start()
    started.wait(120)
    time.sleep(0.05)
    t0 = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Generate a short title for this conversation."}],
            max_tokens=16, stream=True, temperature=0):
        if any(c.delta.content for c in chunk.choices):
            first = first or time.perf_counter()
    side = time.perf_counter() - t0
    thread.join()
    return side, (first or time.perf_counter()) - t0, result["main_s"]


def grammar_cost(rt, tools: list[dict], tokens: int):
    """Per-token cost of the tool-call grammar next to a decode step, in-process (greedy)."""
    from lean_qwenflash.server.constrain import answer_grammar
    from lean_qwenflash.generate import Generator, SamplingParams
    from lean_qwenflash.generate.grammar import GrammarHook

    class Timed(GrammarHook):
        spent = 0.0

        def mask(self, logits):
            t = time.perf_counter()
            out = super().mask(logits)
            Timed.spent += time.perf_counter() - t
            return out

        def observe(self, token_id):
            t = time.perf_counter()
            super().observe(token_id)
            Timed.spent += time.perf_counter() - t

    tok = rt.tokenizer
    gen = Generator(rt.model)
    prompt = tok.chat_prompt([{"role": "user", "content": "Write a long story about a disk."}], tools=tools).ids
    t = time.perf_counter()
    lark = answer_grammar(tok, tools, "auto", True, None)
    hook = Timed(tok, gen.vocab_size, lark)
    build_s = time.perf_counter() - t
    greedy = SamplingParams(temperature=0)
    timings = {}
    for name, hooks in (("plain", []), ("grammar", [hook])):
        run = gen.start(prompt, greedy, tokens, hooks=hooks)
        run.step()                        # prefill + first token
        Timed.spent = 0.0
        t = time.perf_counter()
        while not run.done:
            run.step()
        timings[name] = ((time.perf_counter() - t) / max(run.num_generated - 1, 1), run.num_generated)
    mask_s = Timed.spent / max(timings["grammar"][1] - 1, 1)
    return {"build_ms": build_s * 1e3, "mask_us_per_token": mask_s * 1e6,
            "step_ms_plain": timings["plain"][0] * 1e3, "step_ms_grammar": timings["grammar"][0] * 1e3,
            "tokens": [timings["plain"][1], timings["grammar"][1]],
            "mask_over_step": mask_s / timings["plain"][0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="pack directory (default: the built-in default model)")
    ap.add_argument("--config", help="runtime config YAML")
    ap.add_argument("--system-tokens", type=int, default=600, help="approximate length of the shared system prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=200, help="length of the streamed answer for the rate")
    ap.add_argument("--tools", type=int, default=12, help="tool definitions in the agent session")
    ap.add_argument("--main-tokens", type=int, default=300, help="length of the long answer beside a side request")
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
    fifo = copy.deepcopy(cfg)
    fifo.server.max_active = 1
    servers = {name: _serve(create_app(rt, c, model_name="bench"), c) for name, c in
               (("reuse", cfg), ("no_reuse", no_cache), ("fifo", fifo))}
    clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
               for name, (_, _, url) in servers.items()}
    words = "storage bandwidth latency experts router cache prefetch token layer".split()
    ttft = {"reuse": [], "no_reuse": []}
    cached = {"reuse": [], "no_reuse": []}
    prompt_tokens = []
    try:
        for rep in range(args.repeats):
            for name in ("reuse", "no_reuse"):
                client = clients[name]
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

        tools = _agent_tools(args.tools)
        agent = {name: agent_session(clients[name], "bench", args.system_tokens, tools)
                 for name in ("reuse", "no_reuse")}
        side = {name: side_request_wait(clients[name], "bench", args.main_tokens) for name in ("fifo", "reuse")}
        grammar = grammar_cost(rt, tools, 128)
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
        "agent_session": agent, "side_request": {
            name: {"side_s": v[0], "side_ttft_s": v[1], "main_s": v[2]} for name, v in side.items()},
        "max_active": cfg.server.max_active, "grammar": grammar,
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
    rows += [(f"agent turn {a['turn']} TTFT reuse / none (cached)",
              f"{a['ttft_s'] * 1000:.1f} / {b['ttft_s'] * 1000:.1f} ms ({a['cached_tokens']} / {b['cached_tokens']}),"
              f" {b['ttft_s'] / a['ttft_s']:.2f}x") for a, b in zip(agent["reuse"], agent["no_reuse"])]
    f_side, i_side = result["side_request"]["fifo"], result["side_request"]["reuse"]
    rows += [("side request: max_active=1 (FIFO)", f"{f_side['side_s'] * 1000:.0f} ms total, "
                                                  f"TTFT {f_side['side_ttft_s'] * 1000:.0f} ms; main {f_side['main_s']:.2f} s"),
             (f"side request: max_active={cfg.server.max_active}", f"{i_side['side_s'] * 1000:.0f} ms total, "
                                                  f"TTFT {i_side['side_ttft_s'] * 1000:.0f} ms; main {i_side['main_s']:.2f} s"),
             ("side request wait ratio (FIFO / interleaved)", f"{f_side['side_s'] / i_side['side_s']:.1f}x"),
             (f"grammar build ({args.tools} tools)", f"{grammar['build_ms']:.1f} ms"),
             ("grammar mask + advance per token", f"{grammar['mask_us_per_token']:.0f} us"),
             ("decode step plain / with grammar", f"{grammar['step_ms_plain']:.2f} / {grammar['step_ms_grammar']:.2f} ms"),
             ("mask / decode step", f"{grammar['mask_over_step'] * 100:.1f}%")]
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
