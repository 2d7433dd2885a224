"""Tokenizer, chat template, streaming detokenisation, stop strings and output parsing."""

import json
import os
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from lean_qwenflash.chat import (  # noqa: E402
    DEFAULT_CHAT_TEMPLATE, ChatTemplate, InvalidToolCall, StopStringMatcher, StreamParser, TemplateError,
    Tokenizer, ToolCall, parse_output,
)

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
UNICODE_TEXTS = [
    "plain ascii, def f(x):\n    return x  # tabs\tand spaces  ",
    "emoji 😀 family 👩‍👩‍👧 flag 🇯🇵 keycap 1️⃣",
    "CJK 中文字符 日本語のテキスト 한국어",
    "combining e\u0301 a\u0308 n\u0303 Z\u0351\u0352 and precomposed é ä",
    "mixed العربية עברית Ελληνικά кириллица ∑∫√ \u200b zero-width \ufeff bom",
]
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "lean_qwenflash", "default_model")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny byte-level BPE model directory built in a second, shaped like the shipped one."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = UNICODE_TEXTS * 3 + ["def hello(name):\n    print('hello', name)\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROL + TAGS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    data = json.loads(backend.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] in CONTROL
    path = tmp_path_factory.mktemp("tiny_model")
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
              "bos_token": None, "chat_template": DEFAULT_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


# -- encode / decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_special_tokens_and_eos(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in ids and tok.token_to_id("<think>") in ids
    # eos from tokenizer_config (a dict-form AddedToken) first, then generation_config's extras
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert {tok.token_to_id(t) for t in CONTROL} <= tok.special_token_ids
    assert tok.token_to_id("<think>") not in tok.special_token_ids
    # skipping specials drops control tokens but keeps the tags the parser needs
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


def test_missing_tokenizer_json_says_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_file_wins(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")]  # no generation_config here


# -- chat template ------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & später",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_template_tools_and_tool_round(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"t": 3}'},
    ]
    text = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "These functions are available, one JSON signature per line:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>\n\n"
        'To use one, answer with <tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>. '
        "Its result arrives in <tool_response></tool_response>.<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response>{"t": 3}</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    # tojson must not HTML-escape (jinja's own filter would turn '<' into \u003c)
    assert "Weather <now> & später" in text


def test_template_arguments_as_json_string_equal_dict(tok):
    def conv(args):
        return [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "Calling.", "tool_calls": [
                    {"function": {"name": "f", "arguments": args}}, {"function": {"name": "g", "arguments": {}}}]}]
    a = tok.apply_chat_template(conv({"a": 1}), add_generation_prompt=False)
    b = tok.apply_chat_template(conv('{"a": 1}'), add_generation_prompt=False)
    assert a == b
    assert a.endswith('Calling.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
                      '<tool_call>{"name": "g", "arguments": {}}</tool_call><|im_end|>\n')


def test_template_thinking_switch(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_template_drops_reasoning_before_last_user_turn(tok):
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "old thought"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "new thought"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert "old thought" not in text
    assert "<|im_start|>assistant\na1<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\na2<|im_end|>" in text


def test_template_content_parts_and_errors(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"
    with pytest.raises(TemplateError, match="system message"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "a"}])


def test_template_is_sandboxed():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError):
        evil.render([])
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


# -- incremental detokenisation -----------------------------------------------------------------

def _stream(tok, ids, skip=False):
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.finish()


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decode_random_ids_equals_full_decode(tok, skip):
    rng = random.Random(0)
    byte_ids = [tok.token_to_id(c) for c in "ÃĤâĢį"]  # byte-level symbols of lead/continuation bytes
    for _ in range(300):
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 40))]
        pieces, tail = _stream(tok, ids, skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_decode_never_emits_broken_characters(tok):
    text = "".join(UNICODE_TEXTS)
    # Encode byte by byte-level symbol so every multi-byte character is split across tokens.
    ids = []
    for word in text.split(" "):
        ids.extend(tok.encode(word + " "))
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text + " "
    assert not any("\ufffd" in p for p in pieces)
    assert tail == ""
    assert sum(1 for p in pieces if p == "") > 0  # some tokens really ended mid-character


# -- stop strings -------------------------------------------------------------------------------

def _cut(text, stops):
    hits = [(text.find(s), s) for s in stops if s in text]
    return text[:min(hits)[0]] if hits else text


@pytest.mark.parametrize("text,stops", [
    ("hello world<|stop|> more", ["<|stop|>"]),
    ("abcabcabd!", ["abd"]),
    ("no stop here <|sto", ["<|stop|>"]),
    ("x END y STOP z", ["STOP", "END"]),
    ("aaaab", ["aab", "ab"]),
    ("中文停止符號 later", ["停止"]),
])
def test_stop_strings_any_chunking(text, stops):
    rng = random.Random(1)
    want = _cut(text, stops)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(stops)
        out = []
        for c in chunks:
            piece = m.push(c)
            out.append(piece)
            # what was emitted so far is always a prefix of the final answer: nothing retracted
            assert want.startswith("".join(out))
        got = "".join(out) + m.finish()
        assert got == want
        assert m.stopped == (want != text)


def test_stop_string_holds_back_possible_prefix():
    m = StopStringMatcher(["</answer>"])
    assert m.push("result </ans") == "result "
    assert m.push("wer> tail") == ""
    assert m.stopped and m.matched == "</answer>"
    m = StopStringMatcher(["</answer>"])
    assert m.push("a </ans") == "a "
    assert m.push("i") == "</ansi"


def test_stop_string_across_token_borders(tok):
    text = "def hello(name):\n    print('hello', name)\n"
    ids = tok.encode(text)
    assert len(ids) > 3
    dec, m, out = tok.incremental_decoder(), StopStringMatcher(["'hello'"]), ""
    for i in ids:
        out += m.push(dec.push(i))
        if m.stopped:
            break
    assert out == "def hello(name):\n    print("


# -- output parser ------------------------------------------------------------------------------

def test_parse_think_content_and_calls():
    text = ('<think>\nThe user wants Oslo.\n</think>\n\nSure.\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "run_python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    p = parse_output(text)
    assert p.reasoning == "The user wants Oslo."
    assert p.content == "Sure."
    assert p.tool_calls == [ToolCall("get_weather", {"city": "Oslo"}), ToolCall("run_python", {"code": "print(1)"})]
    assert p.tool_calls[0].arguments_json == '{"city": "Oslo"}'
    assert p.invalid_tool_calls == []


@pytest.mark.parametrize("body,error", [
    ('{"name": "f", "arguments": {"a": 1}', "not valid JSON"),
    ("not json at all", "not valid JSON"),
    ('["f"]', "JSON object"),
    ('{"arguments": {}}', "name"),
    ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "f", "arguments": "{broken"}', "'arguments' string"),
])
def test_parse_malformed_tool_calls(body, error):
    p = parse_output(f"ok <tool_call>{body}</tool_call> done")
    assert p.tool_calls == []
    assert len(p.invalid_tool_calls) == 1
    assert p.invalid_tool_calls[0].raw == body and error in p.invalid_tool_calls[0].error
    assert p.content == "ok done"  # one side of the block's whitespace survives


def test_parse_truncated_and_edge_cases():
    p = parse_output('<tool_call>{"name": "f", "argu')
    assert p.tool_calls == [] and "unterminated" in p.invalid_tool_calls[0].error
    p = parse_output("<think>still thinking when cut off")
    assert p.reasoning == "still thinking when cut off" and p.content == ""
    p = parse_output("reasoning from the prompt's open tag</think>answer", in_reasoning=True)
    assert (p.reasoning, p.content) == ("reasoning from the prompt's open tag", "answer")
    p = parse_output("a < b and <tool_ is not a tag")
    assert p.content == "a < b and <tool_ is not a tag"
    p = parse_output('{"name": "f"} without tags')
    assert p.tool_calls == [] and p.content == '{"name": "f"} without tags'
    p = parse_output('<tool_call>{"name": "f"}</tool_call>')
    assert p.tool_calls == [ToolCall("f", {})] and p.content == ""


def test_stream_parser_matches_whole_parse_under_any_chunking():
    text = ('<think>\nplan: call f\n</think>\n\nLet me check.\n'
            '<tool_call>{"name": "f", "arguments": {"x": "<tool_call>?"}}</tool_call>\n'
            '<tool_call>{bad json}</tool_call>\nDone <thi')
    whole = parse_output(text)
    rng = random.Random(2)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        parser = StreamParser()
        events = []
        for i, j in zip([0] + cuts, cuts + [len(text)]):
            events += parser.push(text[i:j])
        events += parser.finish()
        assert "".join(e.text for e in events if e.kind == "content") == whole.content
        assert "".join(e.text for e in events if e.kind == "reasoning") == whole.reasoning
        assert [e.tool_call for e in events if e.kind == "tool_call"] == whole.tool_calls
        assert [e.tool_call for e in events if e.kind == "invalid_tool_call"] == whole.invalid_tool_calls
    assert whole.reasoning == "plan: call f"
    assert whole.content == "Let me check.\nDone <thi"
    assert whole.tool_calls == [ToolCall("f", {"x": "<tool_call>?"})]
    assert isinstance(whole.invalid_tool_calls[0], InvalidToolCall)


# -- the shipped default model's tokenizer ------------------------------------------------------

@pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED, "tokenizer.json")),
                    reason="default model not trained yet (scripts/train_default_model.py)")
def test_shipped_default_tokenizer():
    tok = Tokenizer.from_dir(SHIPPED)
    for text in UNICODE_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for t in CONTROL + TAGS:
        assert len(tok.encode(t)) == 1, t
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER], enable_thinking=False)
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<think>\n\n</think>\n\n")
    assert tok.chat_template.source == DEFAULT_CHAT_TEMPLATE


@pytest.mark.skipif(not os.path.exists(os.path.join(SHIPPED, "model.safetensors")),
                    reason="default model not trained yet (scripts/train_default_model.py)")
def test_shipped_default_model_files_agree():
    tok = Tokenizer.from_dir(SHIPPED)
    with open(os.path.join(SHIPPED, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(SHIPPED, "generation_config.json")) as f:
        gen = json.load(f)
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["vocab_size"] == tok.vocab_size
    assert "full_attention" in config["layer_types"] and "linear_attention" in config["layer_types"]
    assert set(gen["eos_token_id"]) == set(tok.eos_token_ids)
    assert os.path.getsize(os.path.join(SHIPPED, "model.safetensors")) <= 25 * 2**20  # ships in the wheel


def test_long_texts_encode_to_the_same_ids():
    from lean_qwenflash.chat.tokenizer import LONG_TEXT_CHARS, Tokenizer
    from lean_qwenflash.runtime import DEFAULT_MODEL_DIR
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    text = ("Grüße 😀 <|im_start|>user\nqwen disks " * (LONG_TEXT_CHARS // 30 + 1))
    assert len(text) >= LONG_TEXT_CHARS
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids


def test_boundaries_from_one_tokenization_equal_tokenizing_each_prefix():
    from lean_qwenflash.chat.tokenizer import Tokenizer
    from lean_qwenflash.runtime import DEFAULT_MODEL_DIR
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    convs = [[{"role": "user", "content": "Grüße, how are disks? 😀"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "again  \n\n"}]]
    for messages in convs:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        marks = [tok.apply_chat_template(messages, add_generation_prompt=False), text[:-3], "nope", text]
        ids, cuts = tok.encode_with_boundaries(text, marks)
        assert ids == tok.encode(text)
        expected = []
        for mark in marks:
            m = tok.encode(mark)
            if 0 < len(m) < len(ids) and ids[:len(m)] == m and text.startswith(mark):
                expected.append(len(m))
        assert cuts == expected and cuts, (cuts, expected)
