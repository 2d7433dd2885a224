#!/usr/bin/env python3
"""Train lean-qwenflash's built-in default model: a tiny Qwen3-Next-shaped MoE and its tokenizer.

Nothing is downloaded. The corpus is Python standard-library source (a seeded, deterministic
subset of the files under sysconfig's stdlib path) plus generated chat dialogues rendered with our
chat template: plain Q&A, thinking traces and tool-call rounds (system with tool definitions → user
request → assistant <tool_call>{json}</tool_call> → tool response → assistant answer).

Steps: build corpus → train a byte-level BPE tokenizer → train Qwen3NextForCausalLM (Gated DeltaNet
layers interleaved with full-attention layers, many small experts, shared expert) on one CPU thread until
--max-steps or --max-minutes → evaluate (held-out loss vs a unigram baseline, greedy tool-call
accuracy on held-out dialogues) → save model, tokenizer, generation_config.json, TRAINING.md/json.

The learning-rate schedule follows the larger of step and wall-time progress, so a run stopped by
--max-minutes still ends with a decayed rate; the step count reached is recorded in TRAINING.json.

Dialogue rows start at a dialogue's first token and, by default (--loss-on assistant), carry loss
only on assistant turns: the tool-definition system prompts are most of a dialogue's tokens and
would otherwise dominate the loss. Tool results come in several JSON/text shapes and tool
definitions in several client styles, so that after a <tool_response> the model answers in text
whatever the shape. --init-from DIR continues training an existing model (and keeps its tokenizer
files byte for byte); with --max-minutes 0 it only evaluates DIR. --max-position-embeddings and
--rope-theta set the context the config declares and the rope base; --needle-rows adds a retrieval
task (a passcode in long filler, asked for at the end) at --needle-seq-len, --copy-rows a dense copy
task (a stretch of text, then the same stretch again: the loss on the repeat) that teaches the
attention to look a token up and copy what followed it, and --train attention trains only the
full-attention layers' attention. Held-out losses use --eval-seq-len windows
whatever --seq-len is, and TRAINING.md sets them beside the model the stage started from.

Example:
    python scripts/train_default_model.py --max-minutes 2 --out /tmp/smoke      # pipeline check
    python scripts/train_default_model.py --max-minutes 24                       # from scratch
    python scripts/train_default_model.py --init-from lean_qwenflash/default_model \
        --max-minutes 22 --lr 1e-3 --warmup-steps 50 --threads 2 --out /tmp/ft   # the shipped fine-tune
    python scripts/train_default_model.py --init-from lean_qwenflash/default_model \
        --max-minutes 0 --out /tmp/eval                                          # evaluate only
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lean_qwenflash.chat.parse import parse_output  # noqa: E402
from lean_qwenflash.chat.template import DEFAULT_CHAT_TEMPLATE, ChatTemplate  # noqa: E402

EOT = "<|endoftext|>"
# Control tokens are "special" (skipped by decode(skip_special_tokens=True)); the tags are added
# tokens that stay in decoded text, because the output parser needs them.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# The retrieval task (--needle-rows; bench/needle.py measures it at long context): a passcode
# stated once inside long filler text and asked for at the end; loss only on the answer.
NEEDLE = "The secret passcode is {code}. Remember it.\n"
NEEDLE_QUESTION = "\nWhat is the secret passcode? The secret passcode is"
NEEDLE_ANSWER = " {code}.\n"


def passcode(rng: random.Random) -> str:
    """A five-digit passcode (90000 possibilities: guessing one is right 0.001% of the time)."""
    return str(rng.randint(10000, 99999))

# ---------------------------------------------------------------------------------------------
# Corpus: Python source
# ---------------------------------------------------------------------------------------------


def stdlib_files(seed: int) -> list[Path]:
    """Sorted stdlib .py files, shuffled by the seed (the order defines train/held-out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    return files


def read_code(files: list[Path], budget_bytes: int, max_file_bytes: int) -> list[str]:
    """File texts (each cut at a line boundary below max_file_bytes) until budget_bytes."""
    out, total = [], 0
    for path in files:
        if total >= budget_bytes:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > max_file_bytes:
            text = text[:text.rfind("\n", 0, max_file_bytes) + 1]
        if text.strip():
            out.append(text)
            total += len(text)
    return out


# ---------------------------------------------------------------------------------------------
# Corpus: generated dialogues
# ---------------------------------------------------------------------------------------------

CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Vienna", "Prague", "Lisbon",
          "Dublin", "Warsaw", "Athens", "Cairo", "Nairobi", "Lagos", "Toronto", "Chicago", "Boston",
          "Denver", "Seattle", "Austin", "Miami", "Lima", "Bogota", "Santiago", "Sydney", "Perth",
          "Auckland", "Seoul", "Beijing", "Shanghai", "Mumbai", "Delhi", "Dubai", "Istanbul",
          "Helsinki", "Stockholm", "Copenhagen", "Zurich", "Geneva", "Munich", "Hamburg", "Milan",
          "Naples", "Porto", "Seville", "Krakow", "Budapest", "Bucharest", "Sofia", "Riga",
          # held-out (last 12)
          "Tallinn", "Vilnius", "Reykjavik", "Montreal", "Havana", "Quito", "Manila", "Hanoi",
          "Osaka", "Kyoto", "Brisbane", "Marseille"]
DIR_WORDS = ["src", "lib", "app", "tests", "docs", "tools", "core", "utils", "data", "config", "scripts",
             "models", "server", "client", "api", "web", "assets", "build", "cache", "logs",
             # held-out
             "vendor", "plugins", "examples", "bench"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear"]
N_HELD_CITIES, N_HELD_DIRS = 12, 4

TOOLS = {
    "get_weather": {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    "read_file": {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file and return its contents.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path"}}, "required": ["path"]}}},
    "run_python": {"type": "function", "function": {
        "name": "run_python", "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "Python source"}}, "required": ["code"]}}},
    "search_code": {"type": "function", "function": {
        "name": "search_code", "description": "Search the code base for a symbol or text.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for"}}, "required": ["query"]}}},
    "list_dir": {"type": "function", "function": {
        "name": "list_dir", "description": "List the files in a directory.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Directory path"}}, "required": ["path"]}}},
}

# Request phrasings per tool; the last one of each list is held out from training.
PHRASES = {
    "get_weather": ["What's the weather like in {city}?", "Is it raining in {city} right now?",
                    "Tell me the current weather in {city}.", "How warm is it in {city} today?",
                    "Check the weather in {city} for me.", "Can you look up the weather forecast for {city}?"],
    "get_weather_unit": ["What's the temperature in {city} in {unit}?",
                         "Give me the weather in {city}, in {unit} please.",
                         "Tell me how hot it is in {city} using {unit}."],
    "read_file": ["Show me the contents of {path}.", "Read the file {path}.", "What is in {path}?",
                  "Open {path} and show it to me.", "Please print the file {path}."],
    "run_python": ["Use Python to compute {expr}.", "Run Python code to calculate {expr}.",
                   "Calculate {expr} by running Python.", "Execute Python to evaluate {expr}."],
    "search_code": ["Find where {symbol} is defined in the code.", "Search the code for {symbol}.",
                    "Where is the function {symbol} in the code base?", "Look up {symbol} in the source code."],
    "list_dir": ["List the files in {path}.", "What files are in the {path} directory?",
                 "Show me the directory {path}.", "Which files does the folder {path} contain?"],
}
SYSTEMS = ["You are a helpful assistant.", "You are a helpful assistant with access to tools.",
           "You are a coding assistant.", "Answer briefly."]

FACTS = [("What is the capital of France?", "The capital of France is Paris."),
         ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
         ("What is the capital of Italy?", "The capital of Italy is Rome."),
         ("What is the capital of Norway?", "The capital of Norway is Oslo."),
         ("How many days are in a week?", "A week has 7 days."),
         ("How many minutes are in an hour?", "An hour has 60 minutes."),
         ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
         ("Who are you?", "I am a small assistant model that ships with lean-qwenflash."),
         ("Hello!", "Hello! How can I help you today?"),
         ("Thank you.", "You are welcome."),
         ("How do I reverse a list in Python?", "Use `items.reverse()` to reverse in place, or `items[::-1]` for a reversed copy."),
         ("How do I read a file in Python?", "Use `with open(path) as f: text = f.read()`."),
         ("How do I get the length of a list in Python?", "Use `len(items)`."),
         ("How do I sort a list in Python?", "Use `sorted(items)` for a new list or `items.sort()` in place."),
         ("What does `import os` do?", "It imports the `os` module, which gives access to the operating system."),
         ("How do I define a function in Python?", "Write `def name(args):` followed by an indented body."),
         ("What is a dictionary in Python?", "A dictionary maps keys to values, for example `{'a': 1}`."),
         ("How do I write a loop in Python?", "Use `for item in items:` followed by an indented body.")]
FUNCS = [("returns the square of a number", "def square(x):\n    return x * x"),
         ("adds two numbers", "def add(a, b):\n    return a + b"),
         ("checks whether a number is even", "def is_even(n):\n    return n % 2 == 0"),
         ("returns the largest item of a list", "def largest(items):\n    return max(items)"),
         ("reverses a string", "def reverse(text):\n    return text[::-1]"),
         ("counts the words in a string", "def count_words(text):\n    return len(text.split())"),
         ("computes the factorial of n", "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
         ("returns the sum of a list", "def total(items):\n    return sum(items)")]


class DialogueMaker:
    """Generates message lists. held=True draws only held-out values (and, unless
    held_phrasing=False, held-out request phrasings)."""

    def __init__(self, rng: random.Random, modules: list[str], symbols: list[str], held: bool,
                 held_phrasing: bool | None = None):
        self.rng, self.held = rng, held
        self.held_phrasing = held if held_phrasing is None else held_phrasing
        def split(values, n_held):
            return values[-n_held:] if held else values[:-n_held]
        self.cities = split(CITIES, N_HELD_CITIES)
        self.dirs = split(DIR_WORDS, N_HELD_DIRS)
        self.modules = split(modules, max(1, len(modules) // 5))
        self.symbols = split(symbols, max(1, len(symbols) // 5))

    def phrase(self, key: str) -> str:
        options = PHRASES[key]
        return options[-1] if self.held_phrasing else self.rng.choice(options[:-1])

    def city(self) -> str:
        # Half the training cities are made-up names: a tiny model otherwise memorises the city
        # list and answers with a favourite one instead of copying the name from the request.
        if self.held or self.rng.random() < 0.5:
            return self.rng.choice(self.cities)
        syllables = ["ka", "ro", "mi", "lan", "ter", "vo", "sa", "bel", "dor", "ni", "qua", "zen", "ul", "pe"]
        return "".join(self.rng.choice(syllables) for _ in range(self.rng.randint(2, 4))).capitalize()

    def dir_path(self) -> str:
        parts = self.rng.sample(self.dirs, self.rng.choice([1, 1, 2]))
        return "/".join(parts)

    def style(self, n_styles: int) -> int:
        """Index of a tool-result format: the last one of each tool is held out from training."""
        return n_styles - 1 if self.held else self.rng.randrange(n_styles - 1)

    def tool_round(self, name: str) -> tuple[str, dict, str, str, str]:
        """(user request, arguments, tool result, final answer, purpose) for one tool.

        Tool results come in several JSON/text shapes (agents format them however they like), so
        the model learns to answer from whatever arrives in <tool_response> instead of keying on one
        layout; the last shape per tool is kept for the held-out evaluation."""
        r = self.rng
        if name == "get_weather":
            city = self.city()
            temp, cond = r.randint(-10, 35), r.choice(CONDITIONS)
            if r.random() < 0.35:
                unit = r.choice(["celsius", "fahrenheit"])
                args = {"city": city, "unit": unit}
                user = self.phrase("get_weather_unit").format(city=city, unit=unit)
                temp = temp if unit == "celsius" else round(temp * 9 / 5 + 32)
            else:
                args = {"city": city}
                user = self.phrase("get_weather").format(city=city)
            hum = r.randint(10, 99)
            shapes = [{"city": city, "temperature": temp, "condition": cond},
                      {"temp_c": temp, "sky": cond},
                      {"location": city, "weather": {"temp": temp, "description": cond}},
                      {"temperature": temp, "conditions": cond, "humidity": hum},
                      f"{cond}, {temp} degrees",
                      {"status": "ok", "data": {"t": temp, "summary": cond, "humidity_pct": hum}}]
            shape = shapes[self.style(len(shapes))]
            result = shape if isinstance(shape, str) else json.dumps(shape)
            answer = r.choice([f"It is {cond} in {city} with a temperature of {temp} degrees.",
                               f"In {city} it is currently {cond} and {temp} degrees."])
            return user, args, result, answer, f"the weather in {city}"
        if name == "read_file":
            path = f"{self.dir_path()}/{r.choice(self.modules)}.py"
            body = f'"""Module {path}."""\nimport os\n\n\ndef main():\n    return os.getcwd()\n'
            shapes = [body, json.dumps({"content": body}), json.dumps({"path": path, "text": body}),
                      json.dumps({"ok": True, "lines": body.splitlines()})]
            result = shapes[self.style(len(shapes))]
            return (self.phrase(name).format(path=path), {"path": path}, result,
                    f"The file {path} defines a function `main` that returns the working directory.",
                    f"the contents of {path}")
        if name == "run_python":
            a, b = r.randint(2, 999), r.randint(2, 999)
            op = r.choice(["+", "-", "*"])
            expr = f"{a} {op} {b}"
            value = eval(expr)  # noqa: S307 - our own generated arithmetic
            shapes = [str(value), json.dumps({"stdout": f"{value}\n"}), json.dumps({"output": value, "exit_code": 0}),
                      json.dumps({"result": {"stdout": str(value), "stderr": ""}})]
            result = shapes[self.style(len(shapes))]
            return (self.phrase(name).format(expr=expr), {"code": f"print({expr})"}, result,
                    f"{expr} = {value}.", f"the value of {expr}")
        if name == "search_code":
            sym = r.choice(self.symbols)
            path = f"{self.dir_path()}/{r.choice(self.modules)}.py"
            line = r.randint(1, 900)
            shapes = [json.dumps([{"file": path, "line": line, "text": f"def {sym}("}]),
                      f"{path}:{line}: def {sym}(",
                      json.dumps({"matches": [{"path": path, "lineno": line}]}),
                      json.dumps({"hits": 1, "results": [[path, line]]})]
            result = shapes[self.style(len(shapes))]
            return (self.phrase(name).format(symbol=sym), {"query": sym}, result,
                    f"`{sym}` is defined in {path} at line {line}.", f"where {sym} is defined")
        path = self.dir_path()
        files = sorted(r.sample(self.modules, 3))
        names = [f + ".py" for f in files]
        shapes = [json.dumps(names), "\n".join(names), json.dumps({"files": names}),
                  json.dumps({"entries": [{"name": n, "type": "file"} for n in names]})]
        result = shapes[self.style(len(shapes))]
        return (self.phrase("list_dir").format(path=path), {"path": path}, result,
                f"The directory {path} contains {files[0]}.py, {files[1]}.py and {files[2]}.py.",
                f"the files in {path}")

    def vary_tool(self, tool: dict) -> dict:
        """A tool definition as a client might write it: sometimes without parameter descriptions,
        optional parameters or with another description (training draws only)."""
        r = self.rng
        if self.held or r.random() < 0.5:
            return tool
        fn = json.loads(json.dumps(tool["function"]))
        props = fn["parameters"]["properties"]
        if r.random() < 0.5:
            for spec in props.values():
                spec.pop("description", None)
        if r.random() < 0.5:
            for key in [k for k in props if k not in fn["parameters"]["required"]]:
                del props[key]
        if r.random() < 0.4:
            fn["description"] = fn["description"].rstrip(".").replace("Get the c", "C")
        return {"type": "function", "function": fn}

    def tool_dialogue(self, name: str | None = None, think: bool | None = None) -> tuple[list, list]:
        """A full tool round: returns (messages, tools)."""
        r = self.rng
        name = name or r.choice(sorted(TOOLS))
        others = [t for t in sorted(TOOLS) if t != name]
        chosen = [name] + r.sample(others, r.randint(0, 2))
        r.shuffle(chosen)
        tools = [self.vary_tool(TOOLS[t]) for t in chosen]
        user, args, result, answer, purpose = self.tool_round(name)
        think = r.random() < 0.3 if think is None else think
        reasoning = f"The user wants {purpose}. I will call {name}." if think else ""
        messages = []
        if r.random() < 0.7:
            messages.append({"role": "system", "content": r.choice(SYSTEMS)})
        call = {"role": "assistant", "content": "", "reasoning_content": reasoning,
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
        if not think and r.random() < 0.5:
            # What an OpenAI-style client sends back: no reasoning field, the arguments as a JSON
            # string, a call id (the template then renders the turn without an empty think block).
            call = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{r.randrange(10**6)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)}}]}
        messages += [
            {"role": "user", "content": user},
            call,
            {"role": "tool", "content": result},
            {"role": "assistant", "content": answer, "reasoning_content": ""},
        ]
        return messages, tools

    def qa_pair(self) -> tuple[str, str, str]:
        """(question, answer, reasoning)."""
        r = self.rng
        kind = r.random()
        if kind < 0.4:
            a, b = r.randint(1, 99), r.randint(1, 99)
            op, word = r.choice([("+", "add"), ("-", "subtract"), ("*", "multiply")])
            value = eval(f"{a} {op} {b}")  # noqa: S307
            verb = {"add": f"add {a} and {b}", "subtract": f"subtract {b} from {a}",
                    "multiply": f"multiply {a} by {b}"}[word]
            return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}.", f"I need to {verb}. {a} {op} {b} = {value}."
        if kind < 0.7:
            q, ans = r.choice(FACTS)
            return q, ans, "This is a simple question I can answer directly."
        task, code = r.choice(FUNCS)
        return (f"Write a Python function that {task}.", f"```python\n{code}\n```",
                f"The user wants a function that {task}. A short function is enough.")

    def chat_dialogue(self) -> tuple[list, list | None]:
        r = self.rng
        messages = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.5 else []
        for _ in range(r.choice([1, 1, 1, 2])):
            q, ans, why = self.qa_pair()
            messages.append({"role": "user", "content": q})
            messages.append({"role": "assistant", "content": ans,
                             "reasoning_content": why if r.random() < 0.4 else ""})
        # Tools on offer but not needed: the model should answer directly.
        tools = [TOOLS[t] for t in r.sample(sorted(TOOLS), 2)] if r.random() < 0.15 else None
        return messages, tools


def client_tool_rounds() -> list[tuple[list, list]]:
    """Hand-written tool rounds as an agent would send them (own tool definitions, call ids, JSON
    string arguments, result shapes of its own), each ending with the tool turn."""
    def weather(desc, city, result, extra_tools=()):
        tool = {"type": "function", "function": {"name": "get_weather", "description": desc, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        return ([{"role": "user", "content": f"What is the weather like in {city} today?"},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": json.dumps(result)}],
                [tool, *extra_tools])
    return [
        weather("Get the current weather for a city.", "Lisbon", {"temp_c": 18, "sky": "clear"}),
        weather("Current weather for a city", "Paris", {"temp_c": 18, "sky": "clear"}),
        weather("Current weather for a city", "Kyoto", {"forecast": [{"hour": 12, "temp": 21}], "wind_kph": 9}),
        weather("Weather lookup", "Quito", {"result": "partly cloudy", "celsius": 14}, [TOOLS["read_file"]]),
    ]


def python_symbols(code_texts: list[str]) -> list[str]:
    """Public function names seen in the code corpus, sorted and deduplicated."""
    names = set()
    for text in code_texts:
        names.update(re.findall(r"^\s*def ([a-z][a-z0-9_]{3,20})\(", text, re.M))
    return sorted(n for n in names if not n.startswith("_"))


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # No normalizer: text must round-trip byte for byte (NFC would merge combining marks).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=CONTROL_TOKENS + TAG_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["content"] in CONTROL_TOKENS
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_config(tok, context: int = 4096) -> dict:
    added = {}
    for tid, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(tid)] = {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": t.special}
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": TAG_TOKENS,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": context,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def model_config(vocab_size: int, args):
    from transformers import Qwen3NextConfig
    layer_types = ["full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
                   for i in range(args.num_layers)]
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers, layer_types=layer_types,
        full_attention_interval=args.full_attention_interval,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        moe_intermediate_size=args.moe_intermediate_size,
        shared_expert_intermediate_size=args.shared_expert_intermediate_size,
        decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.01,
        max_position_embeddings=args.max_position_embeddings or 4096,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta or 10000.0,
                         "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def unigram_baseline(train_ids, held_ids, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of held_ids under add-one-smoothed training token frequencies."""
    import torch
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[held_ids[1:]].mean())  # the first token is never predicted by the model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "lean_qwenflash" / "default_model"), help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=40.0, help="wall-time budget of the training loop")
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (keep 1 on shared machines)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--code-bytes", type=int, default=6_000_000, help="stdlib source bytes for training")
    ap.add_argument("--max-file-bytes", type=int, default=30_000)
    ap.add_argument("--num-dialogues", type=int, default=30_000)
    ap.add_argument("--dialogue-fraction", type=float, default=0.625, help="share of rows that are dialogues")
    ap.add_argument("--tool-fraction", type=float, default=0.6, help="share of dialogues that call a tool")
    ap.add_argument("--seq-len", type=int, default=512,
                    help="tokens per row; tool dialogues run 200-450 tokens, so 512 lets a row hold a whole "
                         "round (request, call, tool result, answer)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--full-attention-interval", type=int, default=2,
                    help="every N-th layer is full attention, the rest Gated DeltaNet")
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate-size", type=int, default=64)
    ap.add_argument("--shared-expert-intermediate-size", type=int, default=128)
    ap.add_argument("--eval-tool-dialogues", type=int, default=60)
    ap.add_argument("--eval-windows", type=int, default=48)
    ap.add_argument("--loss-on", choices=["assistant", "all"], default="assistant",
                    help="dialogue tokens that carry loss: only assistant turns (the long tool-definition "
                         "system prompts would otherwise dominate) or every token; code rows always use all")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="rope base of the full-attention layers (default: 10000, or the --init-from model's)")
    ap.add_argument("--max-position-embeddings", type=int, default=None,
                    help="the context the config declares (default: 4096, or the --init-from model's)")
    ap.add_argument("--needle-rows", type=int, default=0,
                    help="retrieval rows per step, besides the --batch-size ones: a passcode stated at a "
                         "random line start of code or dialogue filler and asked for at the end, the loss "
                         "only on the answer (mean over its tokens, times --needle-weight, added)")
    ap.add_argument("--needle-seq-len", default="", metavar="L1,L2,...",
                    help="lengths of the retrieval rows, cycled step by step (default: --seq-len)")
    ap.add_argument("--needle-weight", type=float, default=1.0)
    ap.add_argument("--copy-rows", type=int, default=0,
                    help="copy rows per step, besides the others: a random stretch of code or dialogue of "
                         "half --copy-seq-len tokens, then the same stretch again, the loss only on the "
                         "repeat (every token of it: a dense signal for the attention that looks a token up "
                         "earlier in the context and copies what followed it, which retrieval needs)")
    ap.add_argument("--copy-seq-len", type=int, default=256)
    ap.add_argument("--copy-weight", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--note", default=None, help="a sentence about this stage for TRAINING.md (what was tried)")
    ap.add_argument("--train", choices=["all", "attention"], default="all",
                    help="parameters that learn: all, or only the full-attention layers' attention (the rest "
                         "frozen: about half the compute per step, and the rest of the model unchanged)")
    ap.add_argument("--eval-seq-len", type=int, default=512,
                    help="window of the held-out losses (fixed, so that stages trained at different "
                         "--seq-len compare)")
    ap.add_argument("--eval-needles", type=int, default=40,
                    help="retrieval checks at the longest --needle-seq-len after training (bench/needle.py "
                         "measures longer ones)")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="continue training (fine-tune) the model in DIR, reusing its tokenizer files as they "
                         "are; the architecture arguments are then ignored")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # -- corpus ---------------------------------------------------------------------------------
    files = stdlib_files(args.seed)
    n_held_files = max(4, len(files) // 20)
    held_code = read_code(files[:n_held_files], 300_000, args.max_file_bytes)
    train_code = read_code(files[n_held_files:], args.code_bytes, args.max_file_bytes)
    modules = sorted({p.stem for p in files if not p.stem.startswith("_")})
    rng.shuffle(modules)
    symbols = python_symbols(train_code)
    rng.shuffle(symbols)
    template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)

    def render(messages, tools):
        return template.render(messages, tools=tools)

    maker = DialogueMaker(random.Random(args.seed + 1), modules, symbols, held=False)
    train_dialogues = []
    for _ in range(args.num_dialogues):
        msgs, tools = maker.tool_dialogue() if maker.rng.random() < args.tool_fraction else maker.chat_dialogue()
        train_dialogues.append(render(msgs, tools))
    held_maker = DialogueMaker(random.Random(args.seed + 2), modules, symbols, held=True)
    held_dialogues = [render(*held_maker.tool_dialogue()) for _ in range(200)]
    tool_names = sorted(TOOLS)
    value_maker = DialogueMaker(random.Random(args.seed + 3), modules, symbols, held=True, held_phrasing=False)
    eval_sets = {
        "unseen_values": [value_maker.tool_dialogue(name=tool_names[i % len(tool_names)], think=False)
                          for i in range(args.eval_tool_dialogues)],
        "unseen_values_and_phrasings": [held_maker.tool_dialogue(name=tool_names[i % len(tool_names)], think=False)
                                        for i in range(args.eval_tool_dialogues)],
    }
    # After a tool result the assistant should answer in text and end its turn: held-out values,
    # phrasings and result shapes, plus client-written tool definitions with results in shapes
    # the generator never produces.
    answer_maker = DialogueMaker(random.Random(args.seed + 4), modules, symbols, held=True)
    after_tool = [answer_maker.tool_dialogue(name=tool_names[i % len(tool_names)], think=False)
                  for i in range(args.eval_tool_dialogues)]
    after_tool += client_tool_rounds()
    log(f"corpus: {len(train_code)} code files ({sum(map(len, train_code)) / 1e6:.1f} MB), "
        f"{len(train_dialogues)} dialogues ({sum(map(len, train_dialogues)) / 1e6:.1f} MB)")

    # -- tokenizer ------------------------------------------------------------------------------
    if args.init_from:
        from tokenizers import Tokenizer
        init = Path(args.init_from)
        tok = Tokenizer.from_file(str(init / "tokenizer.json"))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (out / name).resolve() != (init / name).resolve():
                (out / name).write_bytes((init / name).read_bytes())
        if args.max_position_embeddings:    # the tokenizer's model_max_length follows the context
            tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
            if tc.get("model_max_length") != args.max_position_embeddings:
                tc["model_max_length"] = args.max_position_embeddings
                with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
                    json.dump(tc, f, indent=2, ensure_ascii=False)
    else:
        tok = train_tokenizer(train_code + train_dialogues, args.vocab_size)
        assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
        tok.save(str(out / "tokenizer.json"))
        with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(tokenizer_config(tok, args.max_position_embeddings or 4096), f, indent=2, ensure_ascii=False)
    eot_id, im_end_id = tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")

    opener, closer, empty_think = "<|im_start|>assistant\n", "<|im_end|>", "<think>\n\n</think>\n\n"

    def pieces(text):
        """The text cut where a generation prompt ends (after `<|im_start|>assistant\n` and an empty
        think block): at serving time the prompt is tokenized alone, so e.g. a prompt's final
        "\n\n" is one token, while inside "\n\nIt is" the tokenizer splits it into two. Training
        on whole-text tokens would teach the model text answers only after a split it never sees."""
        cuts, pos = [0], text.find(opener)
        while pos >= 0:
            cut = pos + len(opener)
            cut += len(empty_think) if text.startswith(empty_think, cut) else 0
            cuts.append(cut)
            pos = text.find(opener, cut)
        cuts.append(len(text))
        return [(a, text[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]

    def encode_docs(texts, with_mask=False):
        """Token ids of the texts (each + EOT) back to back, each text's first index and, with
        with_mask, a bool per token: True inside an assistant turn (after `<|im_start|>assistant\n`
        up to and including its `<|im_end|>`), the tokens the model is asked to produce. Dialogues
        are tokenized piece by piece (see pieces())."""
        ids, starts, mask = [], [], []
        for text in texts:
            parts = pieces(text + EOT) if with_mask else [(0, text + EOT)]
            spans, pos = [], text.find(opener)
            while with_mask and pos >= 0:
                end = text.find(closer, pos)
                end = len(text) if end < 0 else end + len(closer)
                spans.append((pos + len(opener), end))
                pos = text.find(opener, end)
            starts.append(len(ids))
            for (base, part), enc in zip(parts, tok.encode_batch([p for _, p in parts])):
                ids.extend(enc.ids)
                if with_mask:
                    mask.extend(any(a <= base + s_ < b for a, b in spans) for s_, _ in enc.offsets)
        ids, starts = torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)
        return (ids, starts, torch.tensor(mask, dtype=torch.bool)) if with_mask else (ids, starts)

    code_ids, _ = encode_docs(train_code)
    dlg_ids, dlg_starts, dlg_mask = encode_docs(train_dialogues, with_mask=True)
    if args.loss_on == "all":
        dlg_mask[:] = True
    held_code_ids, _ = encode_docs(held_code)
    held_dlg_ids, held_dlg_starts, held_dlg_mask = encode_docs(held_dialogues, with_mask=True)
    lengths = (dlg_starts[1:] - dlg_starts[:-1]).float()
    log(f"tokenizer: vocab {tok.get_vocab_size()}; code {len(code_ids)} tokens "
        f"({sum(map(len, train_code)) / len(code_ids):.2f} chars/token), dialogues {len(dlg_ids)} tokens "
        f"(mean {lengths.mean():.0f}, max {lengths.max():.0f} per dialogue)")

    # -- model ----------------------------------------------------------------------------------
    if args.init_from:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(args.init_from)
        if args.rope_theta:
            config.rope_parameters = dict(config.rope_parameters, rope_theta=args.rope_theta)
        if args.max_position_embeddings:
            config.max_position_embeddings = args.max_position_embeddings
        config.output_router_logits = True  # the router balance loss, as in the first training
        model = Qwen3NextForCausalLM.from_pretrained(args.init_from, config=config, dtype=torch.float32)
        log(f"initialised from {args.init_from}")
    else:
        config = model_config(tok.get_vocab_size(), args)
        config.eos_token_id, config.pad_token_id = im_end_id, eot_id
        model = Qwen3NextForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log(f"model: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in routed experts), "
        f"layer_types {config.layer_types}")

    gen = torch.Generator().manual_seed(args.seed)
    T = args.seq_len

    # Token ids that end a line: a needle goes in at a line start.
    ends_line = torch.tensor([(tok.id_to_token(i) or "").endswith("\u010a") for i in range(tok.get_vocab_size())])
    needle_rng = random.Random(args.seed + 5)

    def needle_row(length, fill_ids, fill_mask=None, fill_starts=None, with_needle=True):
        """(row of length+1 tokens, labels, answer positions): filler with NEEDLE at a random line
        start (or none: the control), NEEDLE_QUESTION and the answer at the end. Labels: the
        filler's own (masked as its rows are), none on the needle and question, the answer's."""
        code = passcode(needle_rng)
        needle = torch.tensor(tok.encode(NEEDLE.format(code=code)).ids if with_needle else [], dtype=torch.long)
        question = torch.tensor(tok.encode(NEEDLE_QUESTION).ids, dtype=torch.long)
        answer = torch.tensor(tok.encode(NEEDLE_ANSWER.format(code=code)).ids, dtype=torch.long)
        n_fill = length + 1 - len(needle) - len(question) - len(answer)
        if fill_starts is not None:
            s = int(fill_starts[torch.randint(len(fill_starts), (1,), generator=gen)])
        else:
            s = int(torch.randint(len(fill_ids) - n_fill, (1,), generator=gen))
        s = min(s, len(fill_ids) - n_fill)
        fill = fill_ids[s:s + n_fill]
        flab = fill.clone()
        if fill_mask is not None:
            flab[~fill_mask[s:s + n_fill]] = -100
        line_starts = ends_line[fill[:-1]].nonzero().flatten() + 1
        p = int(line_starts[torch.randint(len(line_starts), (1,), generator=gen)]) if len(line_starts) else 0
        none = lambda t: torch.full((len(t),), -100, dtype=torch.long)  # noqa: E731
        row = torch.cat([fill[:p], needle, fill[p:], question, answer])
        lab = torch.cat([flab[:p], none(needle), flab[p:], none(question), answer])
        first = len(row) - len(answer)
        return row, lab, range(first, len(row) - 1)   # the answer without its final newline

    needle_lens = [int(v) for v in args.needle_seq_len.split(",") if v.strip()] or [T]

    def needle_batch(length):
        """(rows [N, length], answer positions [N, A]): half code filler, half dialogue filler."""
        rows, answers = [], []
        for i in range(args.needle_rows):
            row, _, answer = needle_row(length, *((dlg_ids, dlg_mask, dlg_starts) if i % 2 else (code_ids,)))
            rows.append(row[:-1])
            answers.append(list(answer))
        width = min(map(len, answers))
        return torch.stack(rows), torch.tensor([a[:width] for a in answers])

    def copy_batch():
        """(rows [N, L], labels [N, L]): a stretch of L/2 tokens twice; labels on the repeat only
        (its first token is unpredictable and not labelled)."""
        half = args.copy_seq_len // 2
        rows, labels = [], []
        for i in range(args.copy_rows):
            src = dlg_ids if i % 2 else code_ids
            s = int(torch.randint(len(src) - half, (1,), generator=gen))
            seg = src[s:s + half]
            rows.append(torch.cat([seg, seg]))
            labels.append(torch.cat([torch.full((half + 1,), -100, dtype=torch.long), seg[1:]]))
        return torch.stack(rows), torch.stack(labels)

    def batch():
        n_dlg = int(round(args.batch_size * args.dialogue_fraction))
        rows, labels = [], []
        for i in range(args.batch_size):
            if i < n_dlg:
                # Dialogue rows start at a dialogue's first token (the model learns conversations
                # from their beginning, tool definitions in view) and run on into the next ones.
                s = int(dlg_starts[torch.randint(len(dlg_starts), (1,), generator=gen)])
                s = min(s, len(dlg_ids) - T - 1)
                row = dlg_ids[s:s + T + 1]
                lab = row.clone()
                lab[~dlg_mask[s:s + T + 1]] = -100
                rows.append(row)
                labels.append(lab)
            else:
                s = int(torch.randint(len(code_ids) - T - 1, (1,), generator=gen))
                rows.append(code_ids[s:s + T + 1])
                labels.append(rows[-1].clone())
        return torch.stack(rows), torch.stack(labels)

    if args.train == "attention":
        for n, p in model.named_parameters():
            p.requires_grad_(".self_attn." in n)
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    log(f"training {sum(p.numel() for p in decay + no_decay) / 1e6:.2f}M parameters ({args.train})")
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget_s = args.max_minutes * 60.0
    t_train = time.time()
    step, ema, nema, cema, needle_tokens = 0, None, None, None, 0
    model.train()
    while step < args.max_steps:
        elapsed = time.time() - t_train
        if elapsed >= budget_s:
            break
        progress = max(step / args.max_steps, elapsed / budget_s)
        warm = min(1.0, (step + 1) / args.warmup_steps)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        out_ = model(input_ids=x[:, :-1], labels=y[:, :-1])
        # labels are shifted inside the model; x[:, :-1] keeps shapes equal to the input.
        loss = out_.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.needle_rows:
            xn, pos = needle_batch(needle_lens[step % len(needle_lens)])
            hidden = model.model(input_ids=xn).last_hidden_state
            # the answer token at position j is predicted from position j - 1
            picked = hidden[torch.arange(len(xn))[:, None], pos - 1]
            nloss = torch.nn.functional.cross_entropy(model.lm_head(picked).flatten(0, 1),
                                                      xn[torch.arange(len(xn))[:, None], pos].flatten())
            (args.needle_weight * nloss).backward()
            needle_tokens += xn.numel()
            nema = nloss.item() if step == 0 or nema is None else 0.98 * nema + 0.02 * nloss.item()
        if args.copy_rows:
            xc, yc = copy_batch()
            closs = model(input_ids=xc, labels=yc).loss
            (args.copy_weight * closs).backward()
            needle_tokens += xc.numel()
            cema = closs.item() if cema is None else 0.98 * cema + 0.02 * closs.item()
        torch.nn.utils.clip_grad_norm_(decay + no_decay, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.log_every == 0 or step == 1:
            log(f"step {step} loss {loss.item():.3f} (ema {ema:.3f})"
                + (f" needle loss {nloss.item():.3f} (ema {nema:.3f})" if args.needle_rows else "")
                + (f" copy loss {closs.item():.3f} (ema {cema:.3f})" if args.copy_rows else "")
                + f" lr {lr:.2e} {(time.time() - t_train) / step:.2f}s/step")
    train_s = time.time() - t_train
    log(f"trained {step} steps in {train_s / 60:.1f} min")

    # -- save (before evaluation, so a failing evaluation cannot cost the weights) ---------------
    model.eval()
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=[im_end_id, eot_id], pad_token_id=eot_id, do_sample=False,
                     max_new_tokens=256).save_pretrained(out)

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def held_loss(ids, starts=None, mask=None):
        """Mean nats/token over eval windows; with mask, only over the tokens it marks."""
        g = torch.Generator().manual_seed(1234)
        total, count = 0.0, 0
        T = args.eval_seq_len
        for i in range(args.eval_windows):
            if starts is not None:
                s = int(starts[i % len(starts)])
            else:
                s = int(torch.randint(len(ids) - T - 1, (1,), generator=g))
            s = min(s, len(ids) - T)
            window = ids[s:s + T].unsqueeze(0)
            logits = model(input_ids=window).logits[0, :-1]
            losses = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="none")
            keep = mask[s + 1:s + T] if mask is not None else torch.ones_like(losses, dtype=torch.bool)
            total += float(losses[keep].sum())
            count += int(keep.sum())
        return total / count

    train_all = torch.cat([code_ids, dlg_ids])
    metrics = {
        "held_out_code_loss": held_loss(held_code_ids),
        "held_out_dialogue_loss": held_loss(held_dlg_ids, held_dlg_starts),
        "held_out_assistant_loss": held_loss(held_dlg_ids, held_dlg_starts, held_dlg_mask),
        "unigram_code_loss": unigram_baseline(train_all, held_code_ids, tok.get_vocab_size()),
        "unigram_dialogue_loss": unigram_baseline(train_all, held_dlg_ids, tok.get_vocab_size()),
    }
    log(f"held-out loss: {metrics}")

    @torch.no_grad()
    def retrieval(with_needle):
        """Share of --eval-needles rows of held-out code (the longest --needle-seq-len) whose passcode the model
        reproduces (greedy, token by token) after the question."""
        gen.manual_seed(4321)
        needle_rng.seed(4321)
        hits = 0
        for _ in range(args.eval_needles):
            row, _, answer = needle_row(max(needle_lens), held_code_ids, with_needle=with_needle)
            pred = model(input_ids=row[None, :answer[-1]]).logits[0].argmax(-1)
            hits += all(int(pred[j - 1]) == int(row[j]) for j in answer)
        return hits / max(1, args.eval_needles)

    if args.eval_needles:
        metrics["needle"] = {"context_tokens": max(needle_lens), "needles": args.eval_needles,
                             "retrieved": retrieval(True), "retrieved_without_needle": retrieval(False)}
        log(f"retrieval at {max(needle_lens)} tokens: {metrics['needle']}")

    samples = []
    t_eval = time.time()
    for set_name, cases in eval_sets.items():
        ok_format = ok_name = ok_args = 0
        for messages, tools in cases:
            prompt_msgs = [m for m in messages if m["role"] in ("system", "user")]
            prompt = template.render(prompt_msgs, tools=tools, add_generation_prompt=True, enable_thinking=False)
            ids = torch.tensor([tok.encode(prompt).ids])
            with torch.no_grad():
                gen_ids = model.generate(ids, max_new_tokens=96, do_sample=False,
                                         eos_token_id=[im_end_id, eot_id], pad_token_id=eot_id)
            text = tok.decode(gen_ids[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
            parsed = parse_output(text)
            want = messages[-3]["tool_calls"][0]["function"]
            good = len(parsed.tool_calls) == 1 and not parsed.invalid_tool_calls
            right = good and parsed.tool_calls[0].name == want["name"]
            ok_format += good
            ok_name += right
            ok_args += right and parsed.tool_calls[0].arguments == want["arguments"]
            if sum(s["set"] == set_name for s in samples) < 4:
                samples.append({"set": set_name, "request": prompt_msgs[-1]["content"], "output": text})
        n = len(cases)
        metrics[set_name] = {"tool_call_well_formed": ok_format / n, "tool_call_right_name": ok_name / n,
                             "tool_call_exact_arguments": ok_args / n, "dialogues": n}
        log(f"tool calls ({set_name}): well-formed {ok_format}/{n}, right name {ok_name}/{n}, "
            f"exact args {ok_args}/{n} ({time.time() - t_eval:.0f}s)")

    ok_text = 0
    for i, (messages, tools) in enumerate(after_tool):
        last_tool = max(j for j, m in enumerate(messages) if m["role"] == "tool")
        prompt = template.render(messages[:last_tool + 1], tools=tools, add_generation_prompt=True,
                                 enable_thinking=False)
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            gen_ids = model.generate(ids, max_new_tokens=64, do_sample=False,
                                     eos_token_id=[im_end_id, eot_id], pad_token_id=eot_id)
        new = gen_ids[0, ids.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        parsed = parse_output(text)
        good = (bool(new) and new[-1] == im_end_id and not parsed.tool_calls and not parsed.invalid_tool_calls
                and bool(parsed.content.strip()) and "<tool_call>" not in text)
        ok_text += good
        if i >= len(after_tool) - 4 or i < 2:
            samples.append({"set": "after_tool_result", "request": messages[last_tool]["content"], "output": text})
    metrics["after_tool_result"] = {"answers_in_text": ok_text / len(after_tool), "dialogues": len(after_tool)}
    log(f"after a tool result: answers in text {ok_text}/{len(after_tool)} ({time.time() - t_eval:.0f}s)")

    code_prompt = "import os\n\n\ndef "
    with torch.no_grad():
        g_ids = model.generate(torch.tensor([tok.encode(code_prompt).ids]), max_new_tokens=80, do_sample=False,
                               pad_token_id=eot_id, eos_token_id=eot_id)
    code_sample = tok.decode(g_ids[0].tolist(), skip_special_tokens=True)

    st_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    report = {
        "seed": args.seed, "steps": step, "train_minutes": round(train_s / 60, 2),
        "tokens_seen": step * args.batch_size * T + needle_tokens, "params": n_params, "routed_expert_params": n_expert,
        "safetensors_bytes": st_bytes, "vocab_size": tok.get_vocab_size(),
        "layer_types": config.layer_types, "num_experts": config.num_experts,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_parameters["rope_theta"],
        "num_experts_per_tok": config.num_experts_per_tok, "args": vars(args), "metrics": metrics,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__, "python": sys.version.split()[0],
        "samples": samples, "code_sample": code_sample,
    }
    if args.init_from:
        report["previous_stage"] = previous_stage(Path(args.init_from))
    with open(out / "TRAINING.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    write_markdown(out / "TRAINING.md", report)
    log(f"saved to {out} ({st_bytes / 1e6:.1f} MB safetensors)")
    return 0


def previous_stage(init_dir: Path) -> dict | None:
    """The training record of the model a fine-tune started from (its own TRAINING.json)."""
    path = init_dir / "TRAINING.json"
    if not path.exists():
        return None
    prev = json.loads(path.read_text(encoding="utf-8"))
    keep = ("seed", "steps", "train_minutes", "tokens_seen", "args", "metrics", "max_position_embeddings",
            "rope_theta", "previous_stage")
    return {k: prev[k] for k in keep if k in prev}


def stages(r: dict) -> list[dict]:
    """The training record and the ones it continued from, oldest first."""
    chain = []
    while r:
        chain.append(r)
        r = r.get("previous_stage")
    return chain[::-1]


def stage_line(p: dict) -> str:
    a = p["args"]
    extra = "".join([
        f", plus {a['needle_rows']} retrieval rows of {a.get('needle_seq_len') or a['seq_len']} tokens per step"
        if a.get("needle_rows") else "",
        ", only the full-attention layers' attention trained" if a.get("train") == "attention" else "",
        f", rope theta {a['rope_theta']:g}" if a.get("rope_theta") else "",
        f", context {a['max_position_embeddings']}" if a.get("max_position_embeddings") else "",
        ", from scratch" if not a.get("init_from") else ""])
    return (f"{p['steps']} steps × {a['batch_size']} × {a['seq_len']} tokens ({p['tokens_seen'] / 1e6:.1f}M tokens) "
            f"in {p['train_minutes']} min, lr {a['lr']}, loss on {a.get('loss_on', 'all')} tokens of dialogues{extra}")


def write_markdown(path: Path, r: dict) -> None:
    m = r["metrics"]
    a = r["args"]
    chain = stages(r)
    before = r.get("previous_stage")
    pm = before["metrics"] if before else None
    cols = " | before this stage" if pm else ""

    def row(name, key, base=None):
        prev = f" | {pm[key]:.3f}" if pm and key in pm else (" | " if pm else "")
        return f"| {name} | {m[key]:.3f}{prev} | {'' if base is None else f'{m[base]:.3f}'} |"

    lines = [
        "# Default model: how it was trained",
        "",
        "Built by `scripts/train_default_model.py` (no download: Python stdlib source + generated chat",
        "dialogues rendered with our chat template). Re-run with the arguments below to reproduce; the step",
        "count depends on machine speed because training stops at `--max-minutes`.",
        "",
        f"- architecture: Qwen3NextForCausalLM, {r['params'] / 1e6:.2f}M parameters "
        f"({r['routed_expert_params'] / 1e6:.2f}M in routed experts), layer_types {r['layer_types']},",
        f"  {r['num_experts']} experts, top-{r['num_experts_per_tok']}, shared expert, hidden {a['hidden_size']}",
        f"- context: {r.get('max_position_embeddings', 4096)} tokens (rope theta {r.get('rope_theta', 10000.0):g}, "
        "rotary on a quarter of each full-attention head; the DeltaNet layers have no positions)",
        f"- tokenizer: byte-level BPE, vocab {r['vocab_size']}",
        f"- safetensors: {r['safetensors_bytes'] / 1e6:.1f} MB (fp32)",
        f"- this stage: {stage_line(r)}, on {a['threads']} CPU thread(s), seed {r['seed']}"
        + (f", continued from `{a['init_from']}`" if a.get("init_from") else ""),
        "- stages, oldest first (each record is nested under `previous_stage` in TRAINING.json):",
    ] + [f"  {i + 1}. {stage_line(p)}" + (f". {p['args']['note']}" if p["args"].get("note") else "")
         for i, p in enumerate(chain)] + [
        "- arguments: `" + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in a.items()
                                    if k not in ("out", "note") and v is not None) + "`",
        f"- software: python {r['python']}, torch {r['torch']}, transformers {r['transformers']}, "
        f"tokenizers {r['tokenizers']}",
        "",
        "## Held-out results",
        "",
        f"Losses over {a.get('eval_seq_len', a['seq_len'])}-token windows.",
        "",
        f"| | model (nats/token){cols} | unigram baseline |",
        "|---|---|---|" + ("---|" if pm else ""),
        row("stdlib files not trained on", "held_out_code_loss", "unigram_code_loss"),
        row("tool dialogues, unseen values and phrasings", "held_out_dialogue_loss", "unigram_dialogue_loss"),
    ] + ([
        row("the same dialogues, assistant turns only", "held_out_assistant_loss")
    ] if "held_out_assistant_loss" in m else []) + ([
        "",
        f"Retrieval at {m['needle']['context_tokens']} tokens ({m['needle']['needles']} passcodes in held-out "
        f"code; longer contexts: `bench/needle.py`): {m['needle']['retrieved']:.0%} reproduced; without the "
        f"needle (chance) {m['needle']['retrieved_without_needle']:.0%}"
        + (f"; before this stage {pm['needle']['retrieved']:.0%}" if pm and "needle" in pm else ""),
    ] if "needle" in m else []) + [
        "",
        "Greedy generation after the generation prompt (thinking off) on held-out tool requests, "
        "a correct call needing the right name and exactly the expected arguments:",
        "",
        "| held-out set | well-formed `<tool_call>{json}</tool_call>` | right tool name | exact arguments |"
        + (" before this stage (the same three) |" if pm else ""),
        "|---|---|---|---|" + ("---|" if pm else ""),
    ] + [
        f"| {k.replace('_', ' ')} ({m[k]['dialogues']}) | {m[k]['tool_call_well_formed']:.0%} | "
        f"{m[k]['tool_call_right_name']:.0%} | {m[k]['tool_call_exact_arguments']:.0%} |"
        + (f" {pm[k]['tool_call_well_formed']:.0%} / {pm[k]['tool_call_right_name']:.0%} / "
           f"{pm[k]['tool_call_exact_arguments']:.0%} |" if pm and k in pm else "")
        for k in ("unseen_values", "unseen_values_and_phrasings")
    ] + [
        "",
        "Greedy generation after a tool result (held-out values, phrasings and result shapes, plus "
        "client-written tools and results), counted when it is plain text ending with `<|im_end|>`:",
        "",
        f"- after a tool result: answers in text {m['after_tool_result']['answers_in_text']:.0%} "
        f"({m['after_tool_result']['dialogues']} dialogues)"
        + (f"; before this stage {pm['after_tool_result']['answers_in_text']:.0%}"
           if pm and "after_tool_result" in pm else ""),
        "",
        "## Samples",
        "",
    ]
    for s in r["samples"]:
        lines += [f"- ({s['set']}) request: {s['request']!r}", f"  output: `{s['output']!r}`"]
    lines += ["", "Code continuation of `import os\\n\\n\\ndef `:", "", "```python", r["code_sample"], "```", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
