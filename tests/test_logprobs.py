"""Log-probabilities, n > 1, echo and choice scoring: the generator's records checked against the
model's own logits, then the OpenAI shapes end to end (the official client parses them), and the
context error both APIs answer.

Every logprob is the log-softmax of the model's logits after the hooks' masks, before temperature
and the sampling filters (generate/generator.py's docstring); the tests check exactly that.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lean_qwenflash.config import load_config  # noqa: E402
from lean_qwenflash.generate import Generator, SamplingParams, TokenHook, new_state  # noqa: E402
from lean_qwenflash.generate.generator import LogprobCapture, continuation_ids  # noqa: E402
from lean_qwenflash.generate.grammar import BannedTokens, GrammarHook  # noqa: E402
from lean_qwenflash.runtime import Runtime  # noqa: E402

import test_server as ts  # noqa: E402  (the tiny pack and the uvicorn thread)

MODEL = "tiny"
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = ts.make_tiny_pack(str(tmp_path_factory.mktemp("logprobs") / "tiny-pack"))
    cfg = load_config(None, model=path, host_cache_bytes="2MiB")
    cfg.generation.max_tokens = 16
    cfg.server.max_output_tokens = 16
    cfg.generation.temperature = 0.0
    rt = Runtime.open(cfg)
    yield rt, cfg, path
    rt.close()


@pytest.fixture(scope="module")
def srv(tiny):
    from lean_qwenflash.server.app import create_app

    rt, cfg, _ = tiny
    s = ts.ServerThread(create_app(rt, cfg, model_name=MODEL))
    yield s
    s.stop()


def _replay(model, prompt, tokens, masks=None):
    """log_softmax of the model's logits before each of ``tokens``, fed one by one after the prompt
    (the calls the generator makes), ``masks[i]`` (bool [V]) applied first when given."""
    state = new_state(model)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), state, last_logits_only=True)[0, -1]
        out = []
        for i, t in enumerate(tokens):
            if masks is not None:
                logits = torch.where(masks[i], logits, float("-inf"))
            out.append(torch.log_softmax(logits.float(), dim=-1))
            logits = model(torch.tensor([[t]]), state, last_logits_only=True)[0, -1]
    return out


class CountingFeed:
    """Counts the tokens a Generator feeds (to show a prompt is computed once)."""

    def __init__(self, gen: Generator):
        self.fed: list[int] = []
        inner = gen.feed

        def feed(token_ids, state, all_logits=False):
            self.fed.append(len(token_ids))
            return inner(token_ids, state, all_logits)
        gen.feed = feed


# -- the generator ------------------------------------------------------------------------------

def test_greedy_logprobs_equal_log_softmax_of_the_models_logits(tiny):
    rt, _, _ = tiny
    prompt = rt.tokenizer.encode("Once upon a time there was a disk")
    capture = LogprobCapture(top=5)
    tokens = list(Generator(rt.model).generate(prompt, GREEDY, 12, hooks=[capture]))
    assert len(tokens) == 12 and [e.token for e in capture.entries] == tokens
    for entry, ref, token in zip(capture.entries, _replay(rt.model, prompt, tokens), tokens):
        assert entry.logprob == float(ref[token])                      # exactly: the same calls
        values, ids = torch.topk(ref, 5)
        assert entry.top == list(zip(ids.tolist(), values.tolist()))
        assert entry.top[0][0] == token                                # greedy took the best


def test_sampled_logprobs_are_the_models_before_temperature_and_filters(tiny):
    rt, _, _ = tiny
    prompt = rt.tokenizer.encode("Write a haiku about disks.")
    params = SamplingParams(temperature=1.7, top_k=4, seed=11)
    capture = LogprobCapture(top=4)
    tokens = list(Generator(rt.model).generate(prompt, params, 12, hooks=[capture]))
    refs = _replay(rt.model, prompt, tokens)
    hot = 0
    for entry, ref, token in zip(capture.entries, refs, tokens):
        assert entry.logprob == float(ref[token])
        assert token in [t for t, _ in entry.top]          # sampled within top_k=4 ...
        tempered = float(torch.log_softmax(ref / 1.7, -1)[token])
        hot += not math.isclose(tempered, entry.logprob, abs_tol=1e-3)
    assert hot == len(tokens)                               # ... yet reported without temperature


class AllowOnly(TokenHook):
    def __init__(self, allowed):
        self.allowed = allowed

    def mask(self, logits):
        return torch.where(self.allowed.to(logits.device), logits, float("-inf"))


def test_masked_logprobs_are_renormalised_over_the_allowed_tokens(tiny):
    rt, _, _ = tiny
    prompt = rt.tokenizer.encode("Pick a number:")
    vocab = Generator(rt.model).vocab_size
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[torch.tensor([11, 12, 13, 500, 501, 777])] = True
    capture = LogprobCapture(top=10)
    tokens = list(Generator(rt.model).generate(prompt, SamplingParams(temperature=1.0, seed=3), 6,
                                               hooks=[AllowOnly(allowed), capture]))
    assert set(tokens) <= {11, 12, 13, 500, 501, 777}
    refs = _replay(rt.model, prompt, tokens, [allowed] * len(tokens))
    for entry, ref, token in zip(capture.entries, refs, tokens):
        assert entry.logprob == float(ref[token])
        assert {t for t, _ in entry.top} == {11, 12, 13, 500, 501, 777}      # masked ones never listed
        assert math.isclose(sum(math.exp(lp) for _, lp in entry.top), 1.0, rel_tol=1e-5)
    raw = _replay(rt.model, prompt, tokens)
    assert all(e.logprob > float(r[t]) for e, r, t in zip(capture.entries, raw, tokens))


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(tiny):
    rt, _, _ = tiny
    tok = rt.tokenizer
    gen = Generator(rt.model)
    prompt = tok.encode("Answer yes or no:")
    grammar = GrammarHook(tok, gen.vocab_size, 'start: " yes" | " no" | " maybe"')
    probe = GrammarHook(tok, gen.vocab_size, 'start: " yes" | " no" | " maybe"')
    capture = LogprobCapture(top=20)
    tokens = list(gen.generate(prompt, SamplingParams(temperature=1.0, seed=5), 8, tok.eos_token_ids,
                               hooks=[grammar, capture]))
    assert tok.decode(tokens) in (" yes", " no", " maybe")
    masks = []
    for t in tokens:                    # the grammar's allowed set before each token
        masks.append(probe.allowed()[:gen.vocab_size].clone())
        probe.observe(t)
    refs = _replay(rt.model, prompt, tokens, masks)
    for entry, ref, mask, token in zip(capture.entries, refs, masks, tokens):
        assert entry.logprob == float(ref[token])
        assert all(mask[t] for t, _ in entry.top)
        assert math.isclose(sum(math.exp(lp) for _, lp in entry.top), 1.0, rel_tol=1e-4)   # few allowed


class ForceOnce(TokenHook):
    def __init__(self, token):
        self.token = token

    def forced(self):
        token, self.token = self.token, None
        return token


def test_a_forced_token_has_probability_one(tiny):
    rt, _, _ = tiny
    capture = LogprobCapture(top=3)
    tokens = list(Generator(rt.model).generate(rt.tokenizer.encode("Hi"), GREEDY, 3,
                                               hooks=[ForceOnce(42), capture]))
    assert tokens[0] == 42 and capture.entries[0].logprob == 0.0 and capture.entries[0].top == [(42, 0.0)]
    assert capture.entries[1].logprob < 0


def test_prompt_logprobs_equal_a_full_forward_across_chunks(tiny):
    rt, _, _ = tiny
    prompt = rt.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it rests by the disk.")
    gen = Generator(rt.model, prefill_chunk_tokens=5)     # several chunks: boundaries are predicted too
    run = gen.start(prompt, GREEDY, 3, prompt_logprobs=2)
    tokens = list(run)
    with torch.no_grad():
        full = torch.log_softmax(rt.model(torch.tensor([prompt]))[0].float(), -1)
    first = run.prompt_logprobs[0]
    assert first.token == prompt[0] and first.logprob is None and first.top is None
    assert len(run.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        e = run.prompt_logprobs[i]
        assert e.token == prompt[i] and len(e.top) == 2
        assert e.logprob == pytest.approx(float(full[i - 1, prompt[i]]), abs=1e-4)
    assert tokens == list(Generator(rt.model).generate(prompt, GREEDY, 3))     # and it generates the same


def test_choice_scores_come_from_one_prefill_and_equal_teacher_forcing(tiny):
    rt, _, _ = tiny
    tok = rt.tokenizer
    text = "The capital of France is"
    prompt = tok.encode(text)
    conts = [continuation_ids(tok.encode, prompt, text, c) for c in (" Paris", " London, of course", " a")]
    gen = Generator(rt.model)
    counter = CountingFeed(gen)
    scores = gen.score(prompt, conts)
    assert counter.fed == [len(prompt)] + [len(c) - 1 for c in conts if len(c) > 1]   # the prompt once
    assert [s.index for s in scores] == [0, 1, 2]
    for s, c in zip(scores, conts):
        assert s.tokens == c and len(s.logprobs) == len(c)
        with torch.no_grad():
            full = torch.log_softmax(rt.model(torch.tensor([prompt + c]))[0].float(), -1)
        ref = [float(full[len(prompt) - 1 + j, t]) for j, t in enumerate(c)]
        assert [e.logprob for e in s.logprobs] == pytest.approx(ref, abs=1e-4)
        assert s.total == pytest.approx(sum(ref), abs=1e-3) and s.mean == pytest.approx(sum(ref) / len(c), abs=1e-3)


def test_siblings_share_the_prefill_and_decode_as_independent_runs(tiny):
    rt, _, _ = tiny
    prompt = rt.tokenizer.encode("Once upon a time")
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9)]
    gen = Generator(rt.model)
    counter = CountingFeed(gen)
    lead = gen.start(prompt, params[0], 8)
    runs = [lead] + [lead.sibling(p) for p in params[1:]]
    with pytest.raises(RuntimeError):
        runs[1].sibling(params[0])
    outs = [[] for _ in runs]
    while not all(r.done for r in runs):
        for out, r in zip(outs, runs):
            t = r.step()
            if t is not None:
                out.append(t)
    assert counter.fed.count(len(prompt)) == 1 and sum(counter.fed) == len(prompt) + 3 * 7
    for out, p in zip(outs, params):
        assert out == list(Generator(rt.model).generate(prompt, p, 8))
    assert len({tuple(o) for o in outs}) > 1
    assert all(r.cached_tokens == len(prompt) for r in runs[1:])


# -- the server ---------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Write a haiku about disks."}]


def test_chat_logprobs_equal_the_generators_whole_and_streamed(srv, tiny):
    rt, _, _ = tiny
    tok = rt.tokenizer
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0, logprobs=True,
                                  top_logprobs=3, reasoning_effort="none")
    content = r.choices[0].logprobs.content          # the client's own types parsed them
    assert type(content[0]).__name__ == "ChatCompletionTokenLogprob" and len(content) == r.usage.completion_tokens
    capture = LogprobCapture(top=3)
    hooks = [BannedTokens([tok.token_to_id("<tool_call>")]), capture]
    ids = list(Generator(rt.model).generate(tok.chat_prompt(USER).ids, GREEDY, 10, tok.eos_token_ids, hooks=hooks))
    # (the server prefills in pieces, at the turn boundaries it snapshots: equal to rounding)
    assert [bytes(t.bytes) for t in content] == [tok.token_bytes(i) for i in ids]
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in capture.entries], abs=1e-5)
    for t, e in zip(content, capture.entries):
        assert [bytes(x.bytes) for x in t.top_logprobs] == [tok.token_bytes(i) for i, _ in e.top]
        assert [x.logprob for x in t.top_logprobs] == pytest.approx([lp for _, lp in e.top], abs=1e-5)
    assert b"".join(bytes(t.bytes) for t in content).decode().strip() == r.choices[0].message.content.strip()
    streamed = []
    for chunk in c.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=3, reasoning_effort="none", stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    plain = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_under_response_format_list_only_allowed_tokens(srv):
    c = srv.client()
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=20, response_format={"type": "json_object"}, reasoning_effort="none")
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content.lstrip().startswith("{")
    # the first position allows only whitespace and "{..." (the grammar's lead): fewer than 20
    # tokens, which carry all the probability, and nothing else is listed
    top = content[0].top_logprobs
    assert len(top) < 20 and all(bytes(t.bytes).decode().strip() in ("", "{") or
                                 bytes(t.bytes).decode().strip().startswith("{") for t in top)
    assert math.isclose(sum(math.exp(t.logprob) for t in top), 1.0, rel_tol=1e-4)


def test_completions_logprobs_echo_and_text_offsets(srv, tiny):
    rt, _, _ = tiny
    tok = rt.tokenizer
    c = srv.client()
    prompt = "Once upon a time there was a disk"
    ids = tok.encode(prompt)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    ch = r.choices[0]
    lp = ch.logprobs
    assert ch.text.startswith(prompt) and len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    for token, offset in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert ch.text[offset:offset + len(token)] == token
    gen = Generator(rt.model)
    run = gen.start(ids, GREEDY, 5, tok.eos_token_ids, prompt_logprobs=2)
    capture = LogprobCapture(top=2)
    run.hooks.append(capture)
    list(run)
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in run.prompt_logprobs[1:] + capture.entries],
                                                  abs=1e-5)
    only = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    streamed, text = [], ""
    for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                      echo=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                streamed.append(chunk.choices[0].logprobs)
    assert text == ch.text
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    echo_only = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert echo_only.choices[0].text.startswith(prompt) and echo_only.choices[0].logprobs is None


def test_n_choices_are_seeded_share_the_prompt_and_stream_with_their_index(srv):
    c = srv.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5)
    computed0 = srv.metric("lqf_prefill_tokens_computed_total")
    a = c.completions.create(n=3, **kw)
    computed = srv.metric("lqf_prefill_tokens_computed_total") - computed0
    assert computed <= a.usage.prompt_tokens                 # prompt computed once for the 3 choices
    b = c.completions.create(n=3, **kw)
    texts = [ch.text for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2] and texts == [ch.text for ch in b.choices]
    assert len(set(texts)) > 1
    # choice i is what a single request with seed + i gives
    assert [c.completions.create(**dict(kw, seed=5 + i)).choices[0].text for i in range(3)] == texts
    single = [c.completions.create(**dict(kw, seed=5 + i)).usage.completion_tokens for i in range(3)]
    assert a.usage.completion_tokens == sum(single)
    parts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in c.completions.create(n=3, stream=True, **kw):
        for ch in chunk.choices:
            parts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert [parts[i] for i in range(3)] == texts and finished == {0, 1, 2}
    chat = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=1.0, seed=2, n=2,
                                     logprobs=True, reasoning_effort="none")
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert all(len(ch.logprobs.content) >= 1 for ch in chat.choices)
    messages = {0: "", 1: ""}
    for chunk in c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=1.0, seed=2, n=2,
                                           reasoning_effort="none", stream=True):
        for ch in chunk.choices:
            messages[ch.index] += ch.delta.content or ""
    assert [messages[0], messages[1]] == [ch.message.content for ch in chat.choices]


def test_choices_are_ranked_by_log_likelihood_from_one_prefill(srv, tiny):
    rt, _, _ = tiny
    tok = rt.tokenizer
    prompt = "The capital of France is"
    choices = [" Paris", " London, of course", " a disk"]
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "choices": choices,
                                                      "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    got = body["choices"]
    ids = tok.encode(prompt)
    ref = Generator(rt.model).score(ids, [continuation_ids(tok.encode, ids, prompt, c) for c in choices])
    order = sorted(ref, key=lambda s: s.total, reverse=True)
    assert [g["text"] for g in got] == [choices[s.index] for s in order]
    assert [g["index"] for g in got] == [0, 1, 2] and [g["choice_index"] for g in got] == [s.index for s in order]
    for g, s in zip(got, order):
        assert g["total_logprob"] == pytest.approx(s.total, abs=1e-6)
        assert g["mean_logprob"] == pytest.approx(s.mean, abs=1e-6) and g["num_tokens"] == len(s.tokens)
        assert g["logprobs"]["token_logprobs"] == [e.logprob for e in s.logprobs]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    by_mean = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "choices": choices,
                                                            "rank_by": "mean"}, timeout=60).json()["choices"]
    assert [g["text"] for g in by_mean] == [choices[s.index] for s in sorted(ref, key=lambda s: s.mean, reverse=True)]
    # the openai client passes it through extra_body
    oc = srv.client().completions.create(model=MODEL, prompt=prompt, extra_body={"choices": choices})
    assert [ch.text for ch in oc.choices] == [g["text"] for g in got]


@pytest.mark.parametrize("body, param, needle", [
    ({"choices": ["a", "b"], "stream": True}, "stream", "cannot be combined with stream"),
    ({"choices": ["a", "b"], "n": 2}, "n", "cannot be combined with n"),
    ({"choices": ["a", ""]}, "choices[1]", "choices[1] is empty"),
    ({"choices": []}, "choices", "choices"),
    ({"rank_by": "mean"}, "rank_by", "needs choices"),
    ({"max_tokens": 0}, "max_tokens", "needs echo"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"n": 17}, "n", "at most 16"),
])
def test_bad_logprob_and_choice_requests_are_400s_naming_the_field(srv, body, param, needle):
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_top_logprobs_needs_logprobs(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_the_context_error_says_what_is_enforced_on_both_routes(srv, tiny):
    from lean_qwenflash.server.service import context_error

    rt, _, _ = tiny
    context = srv.app.state.server.context_tokens
    assert context == 1024
    # the prompt may have at most context - 1 tokens (one is left for the answer): 1023 is served ...
    ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * (context - 1),
                                                       "max_tokens": 50, "temperature": 0}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 1, ok.text
    # ... 1024 is refused, and the text says so
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [5] * context, "max_tokens": 5})
    assert r.status_code == 400
    assert r.json()["error"] == context_error(context, context, "prompt").body()["error"]
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 1024 tokens. However, your prompt resulted in 1024 tokens, and at "
        "most 1023 fit (the completion needs at least 1 more). Please reduce the length of the prompt.")
    long = [{"role": "user", "content": "disk " * 1500}]
    n = len(rt.tokenizer.chat_prompt(long).ids)
    expected = context_error(n, context, "messages")
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": long})
    assert r.status_code == 400 and r.json()["error"] == expected.body()["error"]
    a = httpx.post(srv.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": long})
    assert a.status_code == 400
    assert a.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": expected.anthropic_message}}
    assert expected.anthropic_message == (f"prompt is too long: {n} tokens > 1023 maximum (the model's context is "
                                          "1024 tokens; the completion needs at least 1 more)")
    # both say the same two numbers
    assert "1024" in expected.message and "1023" in expected.message and "1024" in expected.anthropic_message


def test_cli_generate_choices_ranks_from_one_prefill(tiny):
    rt, _, path = tiny
    tok = rt.tokenizer
    prompt = "The capital of France is"
    choices = [" Paris", " London", " a disk"]
    r = subprocess.run([sys.executable, "-m", "lean_qwenflash", "generate", "--model", path, "--prompt", prompt,
                        "--raw", "--host-cache-bytes", "2MiB", "--choices", "|".join(choices)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split(None, 4) for line in r.stdout.splitlines()[1:] if line.strip()]
    ids = tok.encode(prompt)
    ref = sorted(Generator(rt.model).score(ids, [continuation_ids(tok.encode, ids, prompt, c) for c in choices]),
                 key=lambda s: s.total, reverse=True)
    assert [row[4] for row in rows] == [choices[s.index].strip() for s in ref]
    assert [float(row[1]) for row in rows] == pytest.approx([s.total for s in ref], abs=1e-3)
    assert "prefilled once" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "lean_qwenflash", "generate", "--model", path, "--prompt", prompt,
                          "--raw", "--choices", "A||B"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--choices must be non-empty" in bad.stderr and "Traceback" not in bad.stderr
