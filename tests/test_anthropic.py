"""The Anthropic Messages API, end to end: a real uvicorn on 127.0.0.1 and the official ``anthropic``
SDK. The fixtures and the server thread are test_server.py's (the tiny random pack for paths and
agreement checks, the built-in default model for tools). This SDK has no sampling arguments, so
``temperature`` travels in ``extra_body``.
"""
from __future__ import annotations

import json
import os
import re
import sys

import anthropic
import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_server import (HAS_DEFAULT_MODEL, MODEL, ServerThread, _wait_cancelled, default_srv, srv,  # noqa: E402,F401
                         tiny_runtime)

from lean_qwenflash.server.anthropic import (ContentBlocks, CountTokensRequest, MessagesRequest,  # noqa: E402
                                             to_chat_request)
from lean_qwenflash.server.protocol import ApiError  # noqa: E402

GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "Write a haiku about disks."}]
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _client(server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=60, **kw)


def _blocks(message) -> list[dict]:
    """Content blocks as plain dicts, tool_use ids dropped (each answer draws new ones)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if not (b.type == "tool_use" and k == "id")}
            for b in message.content]


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- no model ---------------------------------------------------------------------------------------

def test_request_translation():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 20}, "stop_sequences": ["END"], "metadata": {"user_id": "u"}})
    chat = to_chat_request(req)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got[0] == {"role": "system", "content": "A\n\nB"}
    assert got[2]["reasoning_content"] == "Two calls." and got[2]["content"] == "Checking."
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in got[2]["tool_calls"]] == \
           [("toolu_1", {"city": "Paris"}), ("toolu_2", {"city": "Rome"})]
    assert got[3:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
                       {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
                       {"role": "user", "content": "Thanks."}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat.thinking_budget == 20 and chat.max_tokens == 50 and chat.stop == ["END"]

    named = to_chat_request(MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 5, "messages": USER, "tools": [WEATHER],
         "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert named.tool_choice.function.name == "get_weather" and named.thinking_budget == 0
    counted = to_chat_request(CountTokensRequest.model_validate({"model": "m", "messages": USER}))
    assert counted.max_tokens is None and counted.thinking_budget == 0

    def refused(body) -> str:
        with pytest.raises(ApiError) as e:
            to_chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 50, **body}))
        return e.value.message
    assert "messages[1].content[0].tool_use_id" in refused(
        {"messages": USER + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]})
    assert "prefill" in refused({"messages": USER + [{"role": "assistant", "content": "Sure"}]})
    assert "greater than thinking.budget_tokens" in refused(
        {"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 50}})
    assert "tools[0].type" in refused({"messages": USER, "tools": [{"type": "web_search_20250305",
                                                                     "name": "web_search"}]})
    assert "tool_choice.name" in refused({"messages": USER, "tools": [WEATHER],
                                          "tool_choice": {"type": "tool", "name": "nope"}})


def test_content_blocks_stream_what_they_return_whole():
    """The stream events, folded as the SDK folds them, rebuild the blocks a whole answer returns."""
    blocks = ContentBlocks()
    deltas = [{"reasoning_content": "Hmm, "}, {"reasoning_content": "weather."}, {"content": "Let me "},
              {"content": "check."}, {"tool_call": {"index": 0, "id": "call_ab", "name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}},
              {"content": ""}, {"content": "Done."}]
    events = [e for d in deltas for e in blocks.add(d)] + blocks.close()
    rebuilt: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(rebuilt)
            rebuilt.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = rebuilt[data["index"]], data["delta"]
            kind = delta["type"]
            if kind == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                block[kind.removesuffix("_delta")] += delta[kind.removesuffix("_delta")]
    assert rebuilt == blocks.blocks
    assert [b["type"] for b in blocks.blocks] == ["thinking", "text", "tool_use", "text"]
    assert blocks.blocks[0]["thinking"] == "Hmm, weather." and blocks.blocks[0]["signature"]
    assert blocks.blocks[2] == {"type": "tool_use", "id": "toolu_ab", "name": "get_weather",
                                "input": {"city": "Paris"}}
    # a thinking block's signature arrives before it stops; every start has its stop
    names = [(n, d.get("delta", {}).get("type")) for n, d in events]
    assert names[3] == ("content_block_delta", "signature_delta") and names[4][0] == "content_block_stop"
    assert sum(n == "content_block_start" for n, _ in names) == sum(n == "content_block_stop" for n, _ in names) == 4


# -- against the tiny model -------------------------------------------------------------------------

def test_text_whole_streamed_and_openai_agree(srv):
    c = _client(srv)
    kw = dict(model=MODEL, max_tokens=16, system="You are terse.", messages=USER, extra_body=GREEDY)
    whole = c.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.model == MODEL and whole.role == "assistant"
    assert whole.stop_reason in ("end_turn", "max_tokens") and _text(whole)
    with c.messages.stream(**kw) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and streamed_text == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens

    # the raw event sequence
    names = [ev.type for ev in c.messages.create(stream=True, **kw)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"

    oa = srv.client().chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}] + USER)
    assert oa.choices[0].message.content == _text(whole)
    assert {"length": "max_tokens", "stop": "end_turn"}[oa.choices[0].finish_reason] == whole.stop_reason
    for u in (whole.usage, final.usage):
        assert u.input_tokens + u.cache_read_input_tokens == oa.usage.prompt_tokens
        assert u.output_tokens == oa.usage.completion_tokens and u.cache_creation_input_tokens == 0
    # the third identical prompt is served from the prefix cache, as Anthropic reports a cache hit
    assert final.usage.cache_read_input_tokens > 0 and final.usage.input_tokens < oa.usage.prompt_tokens


def test_thinking_budget_gives_a_thinking_block_then_the_answer(srv):
    c = _client(srv)
    kw = dict(model=MODEL, max_tokens=40, messages=USER, thinking={"type": "enabled", "budget_tokens": 8},
              extra_body=GREEDY, extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    whole = c.messages.create(**kw)
    kinds = [b.type for b in whole.content]
    assert kinds[0] == "thinking" and "text" in kinds, whole.content
    assert whole.content[0].thinking and whole.content[0].signature
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole)
    oa = srv.client().chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=USER,
                                              extra_body={"thinking_budget": 8})
    assert oa.choices[0].message.reasoning_content == whole.content[0].thinking
    assert oa.choices[0].message.content == _text(whole)
    assert whole.usage.output_tokens == oa.usage.completion_tokens <= 40


def test_max_tokens_and_stop_sequences(srv):
    c = _client(srv)
    messages = [{"role": "user", "content": "Tell me about SSD wear levelling."}]
    long = c.messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body=GREEDY)
    assert long.stop_reason == "max_tokens" and long.stop_sequence is None and long.usage.output_tokens == 12
    text = _text(long)
    middle = text.strip()[len(text.strip()) // 2:][:3]
    assert middle.strip(), text
    cut = c.messages.create(model=MODEL, max_tokens=12, messages=messages, stop_sequences=["zzzq", middle],
                            extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == middle
    assert _text(cut).strip() == text[:text.find(middle)].strip() and middle not in _text(cut)
    with c.messages.stream(model=MODEL, max_tokens=12, messages=messages, stop_sequences=[middle],
                           extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, _text(final)) == ("stop_sequence", middle, _text(cut))


def test_count_tokens_is_the_prompt_the_message_runs(srv):
    c = _client(srv)
    kw = dict(model=MODEL, system="Count me.", messages=[{"role": "user", "content": "How many tokens is this?"}],
              tools=[WEATHER])
    counted = c.messages.count_tokens(**kw).input_tokens
    assert counted > 0 and srv.metric("lqf_generations_running") == 0
    r = c.messages.create(max_tokens=2, extra_body=GREEDY, **kw)
    assert r.usage.cache_read_input_tokens == 0 and r.usage.input_tokens == counted     # a new prompt
    assert c.messages.count_tokens(**kw).input_tokens == counted
    # thinking changes the prompt (an open think block), and count_tokens counts what runs
    thinking = {"type": "enabled", "budget_tokens": 4}
    r = c.messages.create(max_tokens=8, thinking=thinking, extra_body=GREEDY, **kw)
    assert c.messages.count_tokens(thinking=thinking, **kw).input_tokens == \
           r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_a_departed_stream_cancels_its_generation(srv):
    cancelled0, tokens0 = srv.metric("lqf_generations_cancelled_total"), srv.metric("lqf_generation_tokens_total")
    body = {"model": MODEL, "max_tokens": 900, "messages": USER, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            if events.count("content_block_delta") >= 3:
                break
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    _wait_cancelled(srv, cancelled0, tokens0, 900)


def test_errors_have_anthropic_shape(srv):
    c = _client(srv)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=anthropic.NOT_GIVEN, messages=USER)
    assert e.value.status_code == 400
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error" and MODEL in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]: image blocks"):
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "disk " * 1500}])
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 1023 maximum \(the model's context is 1024 tokens; "
                        r"the completion needs at least 1 more\)", e.value.body["error"]["message"])
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "disk " * 1500}])

    r = httpx.post(srv.url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(srv.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.url + "/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    body = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x\\ud800"}]}' % MODEL
    r = httpx.post(srv.url + "/v1/messages", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "messages[0].content" in r.json()["error"]["message"]
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"
    assert c.messages.create(model=MODEL, max_tokens=2, messages=USER).usage.output_tokens <= 2


def test_api_key_by_x_api_key_or_bearer(tiny_runtime, monkeypatch):
    import copy

    from lean_qwenflash.server.app import create_app

    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    rt, cfg = tiny_runtime
    keyed = copy.deepcopy(cfg)
    keyed.server.api_key = "s3cret"
    s = ServerThread(create_app(rt, keyed, model_name=MODEL))
    try:
        for bad in (_client(s, api_key="wrong"), _client(s, api_key=None, default_headers={"x-api-key": "wrong"})):
            with pytest.raises(anthropic.AuthenticationError) as e:
                bad.messages.create(model=MODEL, max_tokens=2, messages=USER)
            assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        for good in (_client(s, api_key="s3cret"), _client(s, api_key=None, default_headers={"x-api-key": "s3cret"})):
            assert good.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
        # x-api-key opens the OpenAI routes too
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        r = httpx.get(s.url + "/v1/models", headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        s.stop()


# -- with the built-in default model ---------------------------------------------------------------

def test_tool_round_trip_with_default_model(default_srv):
    c = _client(default_srv)
    # A wording the default model was trained on (see test_server.py's round trip).
    messages = [{"role": "user", "content": "What's the weather like in Paris?"}]
    kw = dict(model="default", max_tokens=64, tools=[WEATHER], extra_body=GREEDY)
    r = c.messages.create(messages=messages, **kw)
    assert r.stop_reason == "tool_use", r.content
    call = next(b for b in r.content if b.type == "tool_use")
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input, dict)
    with c.messages.stream(messages=messages, **kw) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(r) and final.stop_reason == "tool_use"
    oa = default_srv.client().chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=64,
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}])
    oa_call = oa.choices[0].message.tool_calls[0].function
    assert (oa_call.name, json.loads(oa_call.arguments)) == (call.name, call.input)

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": json.dumps({"temp_c": 18, "sky": "clear"})}]}]
    answer = c.messages.create(messages=messages, **kw)
    assert answer.stop_reason == "end_turn" and _text(answer)
    assert not any(b.type == "tool_use" for b in answer.content)


def test_tool_choice_any_forces_a_tool_use(default_srv):
    c = _client(default_srv)
    r = c.messages.create(model="default", max_tokens=64, tools=[WEATHER], tool_choice={"type": "any"},
                          messages=[{"role": "user", "content": "Hello there!"}], extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and [b.name for b in r.content if b.type == "tool_use"] == ["get_weather"]


def test_output_config_format_gives_json_of_the_schema(default_srv):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    r = _client(default_srv).messages.create(
        model="default", max_tokens=120, messages=[{"role": "user", "content": "Is the sky blue?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    assert r.stop_reason == "end_turn", r.content
    answer = json.loads(_text(r))
    assert set(answer) == {"answer", "sure"} and isinstance(answer["sure"], bool)
    with pytest.raises(anthropic.BadRequestError, match="output_config.format.schema"):
        _client(default_srv).messages.create(model="default", max_tokens=4, messages=USER,
                                             output_config={"format": {"type": "json_schema"}})
