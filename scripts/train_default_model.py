#!/usr/bin/env python3
"""Train lean-qwenflash's built-in default model: a tiny Qwen3-Next-shaped MoE and its tokenizer.

Nothing is downloaded. The corpus is Python standard-library source (a seeded, deterministic
subset of the files under sysconfig's stdlib path) plus generated chat dialogues rendered with our
chat template: plain Q&A, thinking traces and tool-call rounds (system with tool definitions → user
request → assistant <tool_call>{json}</tool_call> → tool response → assistant answer).

Steps: build corpus → train a byte-level BPE tokenizer → train Qwen3NextForCausalLM (Gated DeltaNet
layers + one full-attention layer, many small experts, shared expert) on one CPU thread until
--max-steps or --max-minutes → evaluate (held-out loss vs a unigram baseline, greedy tool-call
accuracy on held-out dialogues) → save model, tokenizer, generation_config.json, TRAINING.md/json.

The learning-rate schedule follows the larger of step and wall-time progress, so a run stopped by
--max-minutes still ends with a decayed rate; the step count reached is recorded in TRAINING.json.

Example:
    python scripts/train_default_model.py --max-minutes 2 --out /tmp/smoke      # pipeline check
    python scripts/train_default_model.py --max-minutes 40                       # the shipped model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
import zlib
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
    """Generates message lists. held=True draws only held-out values and phrasings."""

    def __init__(self, rng: random.Random, modules: list[str], symbols: list[str], held: bool):
        self.rng, self.held = rng, held
        def split(values, n_held):
            return values[-n_held:] if held else values[:-n_held]
        self.cities = split(CITIES, N_HELD_CITIES)
        self.dirs = split(DIR_WORDS, N_HELD_DIRS)
        self.modules = split(modules, max(1, len(modules) // 5))
        self.symbols = split(symbols, max(1, len(symbols) // 5))

    def phrase(self, key: str) -> str:
        options = PHRASES[key]
        return options[-1] if self.held else self.rng.choice(options[:-1])

    def dir_path(self) -> str:
        parts = self.rng.sample(self.dirs, self.rng.choice([1, 1, 2]))
        return "/".join(parts)

    def tool_round(self, name: str) -> tuple[str, dict, str, str, str]:
        """(user request, arguments, tool result, final answer, purpose) for one tool."""
        r = self.rng
        if name == "get_weather":
            city = r.choice(self.cities)
            temp, cond = r.randint(-10, 35), r.choice(CONDITIONS)
            if r.random() < 0.35:
                unit = r.choice(["celsius", "fahrenheit"])
                args = {"city": city, "unit": unit}
                user = self.phrase("get_weather_unit").format(city=city, unit=unit)
                temp = temp if unit == "celsius" else round(temp * 9 / 5 + 32)
            else:
                args = {"city": city}
                user = self.phrase("get_weather").format(city=city)
            result = json.dumps({"city": city, "temperature": temp, "condition": cond})
            answer = f"It is {cond} in {city} with a temperature of {temp} degrees."
            return user, args, result, answer, f"the weather in {city}"
        if name == "read_file":
            path = f"{self.dir_path()}/{r.choice(self.modules)}.py"
            n = r.randint(3, 400)
            result = f'"""Module {path}."""\nimport os\n\n\ndef main():\n    return os.getcwd()\n'
            return (self.phrase(name).format(path=path), {"path": path}, result,
                    f"The file {path} defines a function `main` that returns the working directory.",
                    f"the contents of {path}")
        if name == "run_python":
            a, b = r.randint(2, 999), r.randint(2, 999)
            op = r.choice(["+", "-", "*"])
            expr = f"{a} {op} {b}"
            value = eval(expr)  # noqa: S307 - our own generated arithmetic
            return (self.phrase(name).format(expr=expr), {"code": f"print({expr})"}, str(value),
                    f"{expr} = {value}.", f"the value of {expr}")
        if name == "search_code":
            sym = r.choice(self.symbols)
            path = f"{self.dir_path()}/{r.choice(self.modules)}.py"
            line = r.randint(1, 900)
            result = json.dumps([{"file": path, "line": line, "text": f"def {sym}("}])
            return (self.phrase(name).format(symbol=sym), {"query": sym}, result,
                    f"`{sym}` is defined in {path} at line {line}.", f"where {sym} is defined")
        path = self.dir_path()
        files = sorted(r.sample(self.modules, 3))
        result = json.dumps([f + ".py" for f in files])
        return (self.phrase("list_dir").format(path=path), {"path": path}, result,
                f"The directory {path} contains {files[0]}.py, {files[1]}.py and {files[2]}.py.",
                f"the files in {path}")

    def tool_dialogue(self, name: str | None = None, think: bool | None = None) -> tuple[list, list]:
        """A full tool round: returns (messages, tools)."""
        r = self.rng
        name = name or r.choice(sorted(TOOLS))
        others = [t for t in sorted(TOOLS) if t != name]
        chosen = [name] + r.sample(others, r.randint(0, 2))
        r.shuffle(chosen)
        tools = [TOOLS[t] for t in chosen]
        user, args, result, answer, purpose = self.tool_round(name)
        think = r.random() < 0.3 if think is None else think
        reasoning = f"The user wants {purpose}. I will call {name}." if think else ""
        messages = []
        if r.random() < 0.7:
            messages.append({"role": "system", "content": r.choice(SYSTEMS)})
        messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": "", "reasoning_content": reasoning,
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
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


def tokenizer_config(tok) -> dict:
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
        "model_max_length": 4096,
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
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
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
    ap.add_argument("--dialogue-fraction", type=float, default=0.5, help="share of rows that are dialogues")
    ap.add_argument("--tool-fraction", type=float, default=0.6, help="share of dialogues that call a tool")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--full-attention-interval", type=int, default=4)
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate-size", type=int, default=64)
    ap.add_argument("--shared-expert-intermediate-size", type=int, default=128)
    ap.add_argument("--eval-tool-dialogues", type=int, default=60)
    ap.add_argument("--eval-windows", type=int, default=48)
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
    eval_cases = [held_maker.tool_dialogue(name=tool_names[i % len(tool_names)], think=False)
                  for i in range(args.eval_tool_dialogues)]
    log(f"corpus: {len(train_code)} code files ({sum(map(len, train_code)) / 1e6:.1f} MB), "
        f"{len(train_dialogues)} dialogues ({sum(map(len, train_dialogues)) / 1e6:.1f} MB)")

    # -- tokenizer ------------------------------------------------------------------------------
    tok = train_tokenizer(train_code + train_dialogues, args.vocab_size)
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tok), f, indent=2, ensure_ascii=False)
    eot_id, im_end_id = tok.token_to_id(EOT), tok.token_to_id("<|im_end|>")

    def encode_docs(texts):
        ids, starts = [], []
        for enc in tok.encode_batch([t + EOT for t in texts]):
            starts.append(len(ids))
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)

    code_ids, _ = encode_docs(train_code)
    dlg_ids, dlg_starts = encode_docs(train_dialogues)
    held_code_ids, _ = encode_docs(held_code)
    held_dlg_ids, held_dlg_starts = encode_docs(held_dialogues)
    lengths = (dlg_starts[1:] - dlg_starts[:-1]).float()
    log(f"tokenizer: vocab {tok.get_vocab_size()}; code {len(code_ids)} tokens "
        f"({sum(map(len, train_code)) / len(code_ids):.2f} chars/token), dialogues {len(dlg_ids)} tokens "
        f"(mean {lengths.mean():.0f}, max {lengths.max():.0f} per dialogue)")

    # -- model ----------------------------------------------------------------------------------
    config = model_config(tok.get_vocab_size(), args)
    config.eos_token_id, config.pad_token_id = im_end_id, eot_id
    model = Qwen3NextForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log(f"model: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in routed experts), "
        f"layer_types {config.layer_types}")

    gen = torch.Generator().manual_seed(args.seed)
    T = args.seq_len

    def batch():
        n_dlg = int(round(args.batch_size * args.dialogue_fraction))
        rows = []
        for i in range(args.batch_size):
            if i < n_dlg:
                # Half the dialogue rows start at a dialogue's first token, so the model learns
                # conversations from their beginning; the others start anywhere, which reaches the
                # tails of dialogues longer than seq_len.
                if i % 2 == 0:
                    s = int(dlg_starts[torch.randint(len(dlg_starts), (1,), generator=gen)])
                else:
                    s = int(torch.randint(len(dlg_ids), (1,), generator=gen))
                s = min(s, len(dlg_ids) - T - 1)
                rows.append(dlg_ids[s:s + T + 1])
            else:
                s = int(torch.randint(len(code_ids) - T - 1, (1,), generator=gen))
                rows.append(code_ids[s:s + T + 1])
        return torch.stack(rows)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget_s = args.max_minutes * 60.0
    t_train = time.time()
    step, ema = 0, None
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
        x = batch()
        out_ = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        # labels are shifted inside the model; x[:, :-1] keeps shapes equal to the input.
        loss = out_.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step == 1:
            log(f"step {step} loss {loss.item():.3f} (ema {ema:.3f}) lr {lr:.2e} "
                f"{(time.time() - t_train) / step:.2f}s/step")
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
    def held_loss(ids, starts=None):
        g = torch.Generator().manual_seed(1234)
        total, count = 0.0, 0
        for i in range(args.eval_windows):
            if starts is not None:
                s = int(starts[i % len(starts)])
            else:
                s = int(torch.randint(len(ids) - T - 1, (1,), generator=g))
            s = min(s, len(ids) - T)
            window = ids[s:s + T].unsqueeze(0)
            logits = model(input_ids=window).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum"))
            count += T - 1
        return total / count

    train_all = torch.cat([code_ids, dlg_ids])
    metrics = {
        "held_out_code_loss": held_loss(held_code_ids),
        "held_out_dialogue_loss": held_loss(held_dlg_ids, held_dlg_starts),
        "unigram_code_loss": unigram_baseline(train_all, held_code_ids, tok.get_vocab_size()),
        "unigram_dialogue_loss": unigram_baseline(train_all, held_dlg_ids, tok.get_vocab_size()),
    }
    log(f"held-out loss: {metrics}")

    ok_format = ok_name = ok_args = 0
    samples = []
    t_eval = time.time()
    for messages, tools in eval_cases:
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
        ok_format += good
        ok_name += good and parsed.tool_calls[0].name == want["name"]
        ok_args += good and parsed.tool_calls[0].name == want["name"] and parsed.tool_calls[0].arguments == want["arguments"]
        if len(samples) < 6:
            samples.append({"request": prompt_msgs[-1]["content"], "output": text})
    n = len(eval_cases)
    metrics.update({"tool_call_well_formed": ok_format / n, "tool_call_right_name": ok_name / n,
                    "tool_call_exact_arguments": ok_args / n, "tool_eval_dialogues": n})
    log(f"tool calls: well-formed {ok_format}/{n}, right name {ok_name}/{n}, exact args {ok_args}/{n} "
        f"({time.time() - t_eval:.0f}s)")

    code_prompt = "import os\n\n\ndef "
    with torch.no_grad():
        g_ids = model.generate(torch.tensor([tok.encode(code_prompt).ids]), max_new_tokens=80, do_sample=False,
                               pad_token_id=eot_id, eos_token_id=eot_id)
    code_sample = tok.decode(g_ids[0].tolist(), skip_special_tokens=True)

    st_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    report = {
        "seed": args.seed, "steps": step, "train_minutes": round(train_s / 60, 2),
        "tokens_seen": step * args.batch_size * T, "params": n_params, "routed_expert_params": n_expert,
        "safetensors_bytes": st_bytes, "vocab_size": tok.get_vocab_size(),
        "layer_types": config.layer_types, "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok, "args": vars(args), "metrics": metrics,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__, "python": sys.version.split()[0],
        "samples": samples, "code_sample": code_sample,
    }
    with open(out / "TRAINING.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    write_markdown(out / "TRAINING.md", report)
    log(f"saved to {out} ({st_bytes / 1e6:.1f} MB safetensors)")
    return 0


def write_markdown(path: Path, r: dict) -> None:
    m = r["metrics"]
    a = r["args"]
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
        f"- tokenizer: byte-level BPE, vocab {r['vocab_size']}",
        f"- safetensors: {r['safetensors_bytes'] / 1e6:.1f} MB (fp32)",
        f"- training: {r['steps']} steps × {a['batch_size']} × {a['seq_len']} tokens "
        f"({r['tokens_seen'] / 1e6:.1f}M tokens) in {r['train_minutes']} min on {a['threads']} CPU thread(s), "
        f"seed {r['seed']}, lr {a['lr']}",
        f"- software: python {r['python']}, torch {r['torch']}, transformers {r['transformers']}, "
        f"tokenizers {r['tokenizers']}",
        "",
        "## Held-out results",
        "",
        "| | model (nats/token) | unigram baseline |",
        "|---|---|---|",
        f"| stdlib files not trained on | {m['held_out_code_loss']:.3f} | {m['unigram_code_loss']:.3f} |",
        f"| tool dialogues, unseen values and phrasings | {m['held_out_dialogue_loss']:.3f} | "
        f"{m['unigram_dialogue_loss']:.3f} |",
        "",
        f"Greedy generation after the generation prompt (thinking off) on {m['tool_eval_dialogues']} held-out "
        "tool requests:",
        "",
        f"- well-formed `<tool_call>{{json}}</tool_call>`: {m['tool_call_well_formed']:.0%}",
        f"- right tool name: {m['tool_call_right_name']:.0%}",
        f"- exactly the expected arguments: {m['tool_call_exact_arguments']:.0%}",
        "",
        "## Samples",
        "",
    ]
    for s in r["samples"]:
        lines += [f"- request: {s['request']!r}", f"  output: `{s['output']!r}`"]
    lines += ["", "Code continuation of `import os\\n\\n\\ndef `:", "", "```python", r["code_sample"], "```", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
