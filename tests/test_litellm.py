"""The server through litellm, the client library Aider and many agents call models with: a real
uvicorn on 127.0.0.1 (test_server.py's fixtures), called the way Aider calls an OpenAI-compatible
endpoint, ``litellm.completion(model="openai/NAME", api_base=URL + "/v1", api_key=...)``.

What matters here is litellm's reading of our answers: text and reasoning split as it expects,
usage numbers it can account, tool calls (and reasoning) it can hand to an agent and take back, and
errors mapped to its exception classes (Aider handles ``ContextWindowExceededError`` as its own
case, and litellm recognises it only by the OpenAI / vLLM wording of the message).

litellm must not reach the network: its model cost map is read from the copy it ships
(``LITELLM_LOCAL_MODEL_COST_MAP``, set before the import) and its tiktoken encodings are bundled.
Every connection to a non-loopback address is refused and recorded, from the import on, and a test
that caused one fails.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import socket
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_constrained import default_srv  # noqa: E402,F401
from test_server import MODEL, WEATHER_TOOL, ServerThread, srv, tiny_runtime  # noqa: E402,F401

# litellm's own types and pydantic's deprecations warn on first use: not ours to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm.*")]

# -- no network -------------------------------------------------------------------------------------

_network_attempts: list = []


def _is_loopback(host) -> bool:
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    return host is None or host in ("localhost", "::1") or str(host).startswith("127.")


@contextlib.contextmanager
def _offline():
    """Connections and name lookups for anything but loopback raise (and are recorded)."""
    real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def refuse(what):
        _network_attempts.append(what)
        return OSError(errno.ENETUNREACH, f"test_litellm: network access refused ({what!r})")

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise refuse(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            raise refuse(address)
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kw):
        if not _is_loopback(host):
            _network_attempts.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"test_litellm: name lookup refused ({host!r})")
        return real_getaddrinfo(host, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        yield


os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
with _offline():
    import litellm  # noqa: E402
assert not _network_attempts, f"importing litellm tried the network: {_network_attempts}"
# Without this litellm prints a "Provider List" banner whenever it cannot price a model name.
litellm.suppress_debug_info = True


@pytest.fixture(autouse=True)
def offline():
    _network_attempts.clear()
    with _offline():
        yield
    assert not _network_attempts, f"litellm tried the network: {_network_attempts}"


# -- helpers ----------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Write a haiku about disks."}]
PARIS = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _complete(server, model=MODEL, **kw):
    """litellm.completion as Aider calls it: the openai/ prefix, our base URL, any key."""
    kw.setdefault("api_key", "x")
    return litellm.completion(model="openai/" + model, api_base=server.url + "/v1", timeout=60, **kw)


def _stream(server, model=MODEL, **kw):
    """A streamed litellm.completion: (the chunks, litellm's assembly of them)."""
    chunks = list(_complete(server, model, stream=True, **kw))
    return chunks, litellm.stream_chunk_builder(chunks, messages=kw.get("messages"))


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# -- the tiny random model --------------------------------------------------------------------------

def test_greedy_text_whole_streamed_and_openai_agree(srv):
    kw = dict(messages=USER, max_tokens=12, temperature=0)
    whole = _complete(srv, **kw)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    assert whole.model == MODEL and whole.choices[0].message.role == "assistant"
    assert not getattr(whole.choices[0].message, "reasoning_content", None)

    chunks, built = _stream(srv, **kw)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, "the answer did not come in pieces"
    assert "".join(pieces) == text == built.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

    official = srv.client().chat.completions.create(model=MODEL, **kw)
    assert official.choices[0].message.content == text


def test_usage_is_the_servers_and_adds_up(srv):
    kw = dict(messages=USER, max_tokens=10, temperature=0)
    official = srv.client().chat.completions.create(model=MODEL, **kw).usage
    u = _complete(srv, **kw).usage
    assert (u.prompt_tokens, u.completion_tokens) == (official.prompt_tokens, official.completion_tokens)
    assert u.completion_tokens == 10 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens_details.reasoning_tokens == 0
    # The same prompt again: its prefix comes from the prefix cache, and litellm passes that on.
    assert 0 < u.prompt_tokens_details.cached_tokens < u.prompt_tokens

    # A stream reports usage only when asked (litellm asks only OpenAI's own endpoints); then the
    # numbers are the server's, the same as the whole answer's.
    chunks, built = _stream(srv, stream_options={"include_usage": True}, **kw)
    reported = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert len(reported) == 1
    for v in (reported[0], built.usage):
        assert (v.prompt_tokens, v.completion_tokens, v.total_tokens) == (u.prompt_tokens, 10, u.total_tokens)
    # stream_options on a request that does not stream (Aider's extra_params with --no-stream) is harmless
    v = _complete(srv, stream_options={"include_usage": True}, **kw).usage
    assert (v.prompt_tokens, v.completion_tokens) == (u.prompt_tokens, 10)


def test_without_max_tokens_the_server_cap_applies(srv):
    """Aider sends no max_tokens and litellm adds none: the reply runs to the turn's end or to
    server.max_output_tokens (32 in this fixture)."""
    r = _complete(srv, messages=USER, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 32
    # Streamed as Aider streams (no stream_options): litellm counts the usage itself, with its
    # bundled tiktoken encoding (no download: the offline fixture would fail the test).
    chunks, built = _stream(srv, messages=USER, temperature=0)
    assert built.choices[0].message.content == r.choices[0].message.content
    assert built.usage.completion_tokens > 0 and built.usage.prompt_tokens > 0


def test_reasoning_reaches_litellm_as_reasoning_content(srv):
    kw = dict(messages=USER, max_tokens=40, temperature=0, reasoning_effort="low")
    whole = _complete(srv, **kw)
    msg = whole.choices[0].message
    assert msg.reasoning_content, msg
    assert "<think>" not in msg.reasoning_content and "<think>" not in (msg.content or "")
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens <= whole.usage.completion_tokens <= 40

    chunks, built = _stream(srv, **kw)
    assert sum(bool(getattr(c.choices[0].delta, "reasoning_content", None)) for c in chunks if c.choices) > 1
    assert built.choices[0].message.reasoning_content == msg.reasoning_content
    assert (built.choices[0].message.content or "") == (msg.content or "")

    # reasoning_effort "none" turns it off (the server default here)
    off = _complete(srv, **dict(kw, reasoning_effort="none"))
    assert not getattr(off.choices[0].message, "reasoning_content", None) and off.choices[0].message.content
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_prompt_longer_than_the_context_is_a_context_window_error(srv):
    long = "disk " * 1500      # ~3000 tokens; the tiny model's context is 1024
    with pytest.raises(litellm.ContextWindowExceededError, match="maximum context length is 1024 tokens"):
        _complete(srv, messages=[{"role": "user", "content": long}], max_tokens=5)
    with pytest.raises(litellm.ContextWindowExceededError, match="maximum context length is 1024 tokens"):
        _complete(srv, messages=[{"role": "user", "content": long}], max_tokens=5, stream=True)
    with pytest.raises(litellm.ContextWindowExceededError, match="1024 tokens"):
        litellm.text_completion(model="openai/" + MODEL, api_base=srv.url + "/v1", api_key="x", prompt=long,
                                max_tokens=5, timeout=60)
    # litellm.text_completion goes to /v1/completions, which works with it too
    r = litellm.text_completion(model="openai/" + MODEL, api_base=srv.url + "/v1", api_key="x",
                                prompt="Once upon a time", max_tokens=6, temperature=0, timeout=60)
    official = srv.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.choices[0].text == official.choices[0].text and r.usage.completion_tokens == 6
    assert _status_count(srv, "/v1/completions", "400") >= 1


def test_other_errors_map_to_litellms_exceptions(srv, tiny_runtime):
    with pytest.raises(litellm.NotFoundError, match="not found"):
        _complete(srv, model="gpt-17", messages=USER, max_tokens=2)
    # an ordinary 400 is a BadRequestError, not taken for a context-window error
    with pytest.raises(litellm.BadRequestError, match="top_p") as e:
        _complete(srv, messages=USER, max_tokens=2, top_p=1.5)
    assert not isinstance(e.value, litellm.ContextWindowExceededError)

    from lean_qwenflash.server.app import create_app

    rt, cfg = tiny_runtime
    keyed = copy.deepcopy(cfg)
    keyed.server.api_key = "s3cret"
    s = ServerThread(create_app(rt, keyed, model_name=MODEL))
    try:
        with pytest.raises(litellm.AuthenticationError):
            _complete(s, messages=USER, max_tokens=2, api_key="wrong")
        assert _complete(s, messages=USER, max_tokens=2, api_key="s3cret").choices[0].message.content
    finally:
        s.stop()


def _status_count(server, route: str, status: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("lqf_requests_total{") and f'route="{route}"' in line and f'status="{status}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_reasoning_sent_back_in_a_tool_loop_reaches_the_prompt(srv):
    """An agent resends the assistant message (reasoning and tool call) with the tool's result; the
    chat template keeps that turn's reasoning, so litellm must pass reasoning_content through."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def prompt_tokens(**extra):
        messages = PARIS + [{"role": "assistant", "content": "", "tool_calls": [call], **extra},
                            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]
        return _complete(srv, messages=messages, tools=[WEATHER_TOOL], max_tokens=2).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_content="The user wants the weather in Paris; I will look it up.") > plain + 8


# -- the built-in default model (has learned to call get_weather) ----------------------------------

def test_tool_round_trip(default_srv):
    kw = dict(tools=[WEATHER_TOOL], temperature=0, max_tokens=128)
    r = _complete(default_srv, "default", messages=PARIS, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = _calls(choice.message)
    assert len(calls) == 1 and calls[0][0] == "get_weather" and isinstance(calls[0][1], dict)
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function"

    chunks, built = _stream(default_srv, "default", messages=PARIS, **kw)
    assert built.choices[0].finish_reason == "tool_calls"
    assert _calls(built.choices[0].message) == calls

    # The agent appends litellm's own message object and the tool's result, as agents do.
    messages = PARIS + [choice.message, {"role": "tool", "tool_call_id": call.id,
                                         "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
    final = _complete(default_srv, "default", messages=messages, **kw)
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls
    chunks, built = _stream(default_srv, "default", messages=messages, **kw)
    assert built.choices[0].message.content == final.choices[0].message.content
    assert not built.choices[0].message.tool_calls

