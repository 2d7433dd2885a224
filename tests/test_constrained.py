"""Grammar-constrained answers: tool calls that can only name offered tools with valid arguments,
forced calls for tool_choice required / named, JSON answers for response_format.

The grammar itself is checked with random logits (any token the mask allows may be sampled, so
every output must still parse and validate); the server path with the built-in default model,
which has learned to call tools, over varied prompts, tool sets and seeds.
"""
from __future__ import annotations

import json
import os
import sys

import jsonschema
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lean_qwenflash.chat import Tokenizer, parse_output  # noqa: E402
from lean_qwenflash.server.constrain import answer_grammar  # noqa: E402
from lean_qwenflash.generate.grammar import BannedTokens, GrammarError, GrammarHook  # noqa: E402
from lean_qwenflash.runtime import DEFAULT_MODEL_DIR  # noqa: E402

from test_server import default_srv  # noqa: E402,F401  (a fixture)


def _fn(name, description, properties, required=(), **extra):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required), **extra}}}


TOOLS = [
    _fn("get_weather", "Current weather for a city", {"city": {"type": "string", "maxLength": 24},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("list_files", "List files in a directory", {"path": {"type": "string", "maxLength": 32},
                                                    "recursive": {"type": "boolean"}}, ["path"],
        additionalProperties=False),
    _fn("read_file", "Read lines of a file", {"path": {"type": "string", "maxLength": 32},
                                              "start": {"type": "integer", "minimum": 1, "maximum": 9999},
                                              "count": {"type": "integer", "minimum": 1, "maximum": 500}},
        ["path", "start"], additionalProperties=False),
    _fn("run_command", "Run a shell command", {"command": {"type": "string", "maxLength": 40},
                                               "env": {"type": "object", "properties": {
                                                   "CI": {"type": "string", "maxLength": 8}},
                                                   "additionalProperties": False}}, ["command"]),
    _fn("search", "Search the code", {"query": {"type": "string", "maxLength": 24},
                                      "paths": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "maxItems": 3},
                                      "mode": {"anyOf": [{"const": "regex"}, {"const": "literal"}]}}, ["query"]),
]
TOOL_SETS = [[TOOLS[0]], [TOOLS[1]], [TOOLS[0], TOOLS[1]], TOOLS[1:4], TOOLS]
PROMPTS = ["hi", "What's the weather like in Paris?", "List the files in the config directory.",
           "Show me lines 10 to 20 of setup.py", "Run the tests", "Find where the tokenizer is defined",
           "Write a poem about the sea.", "Is it raining in Oslo?", "What is 2 + 2?", "Thanks, that's all."]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                                  "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                                  "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                           "maxItems": 3}},
                 "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEFAULT_MODEL_DIR)


def _by_name(tools):
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


def _assert_valid_calls(calls, tools):
    schemas = _by_name(tools)
    for call in calls:
        assert call.name in schemas, f"{call.name!r} was not offered ({sorted(schemas)})"
        jsonschema.validate(call.arguments, schemas[call.name])


def _sample_under(hook, vocab, gen, eos, steps=400):
    """Sample random tokens under the grammar's mask until EOS; the token ids."""
    ids = []
    for _ in range(steps):
        logits = torch.randn(vocab, generator=gen)
        logits[eos] += 6.0        # lets a finished answer end instead of running to `steps`
        token = int(torch.multinomial(torch.softmax(hook.mask(logits), 0), 1, generator=gen))
        if token == eos:
            return ids
        hook.observe(token)
        ids.append(token)
    raise AssertionError("the grammar never allowed the answer to end")


@pytest.mark.parametrize("mode, parallel", [("auto", None), ("required", True), ("required", False), ("named", None)])
def test_any_token_the_tool_grammar_allows_keeps_calls_valid(tok, mode, parallel):
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    eos = tok.eos_token_ids[0]
    gen = torch.Generator().manual_seed(1)
    tools = [TOOLS[2]] if mode == "named" else TOOLS
    lark = answer_grammar(tok, tools, mode, parallel, None)
    calls_seen = 0
    for _ in range(12):
        hook = GrammarHook(tok, vocab, lark)
        text = tok.decode(_sample_under(hook, vocab, gen, eos))
        parsed = parse_output(text)
        assert not parsed.invalid_tool_calls, text
        _assert_valid_calls(parsed.tool_calls, tools)
        calls_seen += len(parsed.tool_calls)
        if mode != "auto":
            assert parsed.tool_calls and not parsed.content.strip(), text
            assert parsed.tool_calls[0].name in _by_name(tools)
        if parallel is False:
            assert len(parsed.tool_calls) == 1
    assert mode == "auto" or calls_seen >= 12


def test_free_text_cannot_spell_the_call_tag(tok):
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    hook = GrammarHook(tok, vocab, answer_grammar(tok, TOOLS[:1], "auto", None, None))
    # "<tool" then "_call>" as plain text would open an unconstrained call: the grammar refuses it.
    for t in tok.encode("see <tool"):
        hook.observe(t)
    rest = tok.encode("_call>")
    allowed = hook.allowed()
    for t in rest[:-1]:
        if not allowed[t]:
            break
        hook.observe(t)
        allowed = hook.allowed()
    else:
        assert not allowed[rest[-1]]
    assert allowed[tok.token_to_id("<tool_call>")]


@pytest.mark.parametrize("fmt, schema", [({"type": "json_object"}, {"type": "object"}),
                                         ({"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}},
                                          ANSWER_SCHEMA)])
def test_any_token_the_json_grammar_allows_gives_valid_json(tok, fmt, schema):
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    gen = torch.Generator().manual_seed(2)
    lark = answer_grammar(tok, [], None, None, fmt)
    for _ in range(8):
        hook = GrammarHook(tok, vocab, lark)
        text = tok.decode(_sample_under(hook, vocab, gen, tok.eos_token_ids[0], steps=3000))
        jsonschema.validate(json.loads(text), schema)


def test_no_constraint_means_no_grammar_and_bad_schemas_are_named(tok):
    assert answer_grammar(tok, [], None, None, None) is None
    assert answer_grammar(tok, [], None, None, {"type": "text"}) is None
    with pytest.raises(GrammarError, match=r"tools\[0\].function.parameters \(bad\).*look-around"):
        answer_grammar(tok, [_fn("bad", "", {"x": {"type": "string", "pattern": "(?<=a)b"}})], "auto", None, None)
    # A keyword the engine does not implement is ignored (lenient), not a refusal.
    assert answer_grammar(tok, [_fn("ok", "", {"x": {"not": {"type": "string"}}})], "auto", None, None)
    banned = BannedTokens([3, 5])
    assert torch.isinf(banned.mask(torch.zeros(8))[[3, 5]]).all() and banned.mask(torch.zeros(8))[4] == 0


# -- the server with the default model ------------------------------------------------------------

def _cases(n):
    """n varied (prompt, tool set, seed) combinations."""
    return [(PROMPTS[i % len(PROMPTS)], TOOL_SETS[(i * 3 + i // len(PROMPTS)) % len(TOOL_SETS)], i) for i in range(n)]


def _ask(srv, prompt, seed, max_tokens=80, **kw):
    r = srv.client().chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                             temperature=0.8, seed=seed, max_tokens=max_tokens, **kw)
    return r.choices[0]


def _calls(choice):
    from lean_qwenflash.chat.parse import ToolCall
    return [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_auto_tool_calls_always_name_an_offered_tool_with_valid_arguments(default_srv):
    n_calls = 0
    for prompt, tools, seed in _cases(50):
        choice = _ask(default_srv, prompt, seed, tools=tools)
        calls = _calls(choice)
        _assert_valid_calls(calls, tools)
        assert "<tool_call>" not in (choice.message.content or "")
        n_calls += len(calls)
    assert n_calls >= 10        # the model does call tools here: the check above was exercised


@pytest.mark.parametrize("choice_kind", ["required", "named"])
def test_required_and_named_tool_choice_always_give_a_valid_call(default_srv, choice_kind):
    for prompt, tools, seed in _cases(25):
        if choice_kind == "named":
            name = tools[seed % len(tools)]["function"]["name"]
            choice = _ask(default_srv, prompt, seed, tools=tools, max_tokens=240,
                          tool_choice={"type": "function", "function": {"name": name}})
        else:
            # (the schemas bound every string, so a call always fits in max_tokens)
            choice = _ask(default_srv, prompt, seed, tools=tools, tool_choice="required", max_tokens=240)
        calls = _calls(choice)
        assert choice.finish_reason == "tool_calls" and calls, (prompt, choice.message)
        _assert_valid_calls(calls, tools)
        if choice_kind == "named":
            assert {c.name for c in calls} == {name}


def test_no_tools_never_gives_a_tool_call(default_srv):
    for prompt, _, seed in _cases(20):
        choice = _ask(default_srv, prompt, seed)
        assert choice.finish_reason != "tool_calls" and not choice.message.tool_calls
        assert "<tool_call>" not in (choice.message.content or "")
        choice = _ask(default_srv, prompt, seed, tools=TOOLS, tool_choice="none")
        assert not choice.message.tool_calls


def test_parallel_tool_calls_false_gives_at_most_one_call(default_srv):
    for prompt, tools, seed in _cases(10):
        assert len(_calls(_ask(default_srv, prompt, seed, tools=tools, tool_choice="required", max_tokens=240,
                               parallel_tool_calls=False))) == 1


def test_json_schema_answers_always_validate(default_srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    for prompt, _, seed in _cases(15):
        choice = _ask(default_srv, prompt, seed, response_format=fmt, max_tokens=160)
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
    choice = _ask(default_srv, "hi", 0, response_format={"type": "json_object"}, max_tokens=160)
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


def test_bad_response_format_and_unusable_schema_are_400s(default_srv):
    import openai

    c = default_srv.client()
    kw = dict(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        c.chat.completions.create(response_format={"type": "json_schema", "json_schema": {"name": "x"}}, **kw)
    bad = _fn("bad", "", {"x": {"type": "string", "pattern": "(?<=a)b"}})
    with pytest.raises(openai.BadRequestError, match="look-around") as e:
        c.chat.completions.create(tools=[bad], **kw)
    assert e.value.body["param"] == "tools[0].function.parameters"


def test_closed_objects_only_closes_objects_that_list_their_properties():
    from lean_qwenflash.generate.grammar import closed_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "free": {"type": "object"},
                                               "open": {"properties": {}, "additionalProperties": True},
                                               "e": {"enum": [{"properties": {}}]}},
              "$defs": {"d": {"properties": {"x": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]   # a name map
    assert "additionalProperties" not in closed["properties"]["free"]
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["e"] == {"enum": [{"properties": {}}]}      # data, not a schema
    assert closed["$defs"]["d"]["additionalProperties"] is False
