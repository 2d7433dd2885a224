"""`lean-qwenflash chat`: an interactive chat in the terminal.

Turns reuse the model state through the same prefix cache as the server (``generate/prefix.py``,
sized by ``server.prefix_cache_bytes``): only what a turn adds to the conversation is prefilled. Ctrl-C during an answer stops
that answer; Ctrl-C or Ctrl-D at the prompt leaves.
"""
from __future__ import annotations

import sys
import time

from .chat import parse_output
from .chat.parse import TOOL_OPEN
from .generate import Generator, PrefixCache, SamplingParams
from .generate.grammar import BannedTokens

HELP = "commands: /stats (expert tier statistics), /reset (new conversation), /think on|off, /quit"


def chat_loop(rt, params: SamplingParams, max_tokens: int, think: bool = False, system: str | None = None,
              inp=input, out=sys.stdout) -> int:
    tok = rt.tokenizer
    if tok is None or tok.chat_template is None:
        raise ValueError(f"the pack {rt.store.path} has no tokenizer with a chat template; use `generate --prompt-ids`")
    cache = PrefixCache(rt.cfg.server.prefix_cache_bytes)
    gen = Generator(rt.model, rt.prefill_chunk_tokens, cache)
    messages = [{"role": "system", "content": system}] if system else []
    # No tools here: the model may not call one (as the server does when none are offered).
    tool_id = tok.token_to_id(TOOL_OPEN)
    hooks = [BannedTokens([tool_id])] if tool_id is not None else []
    out.write(f"chatting with {rt.store.path.name} ({rt.store.manifest.architecture}). {HELP}\n")
    while True:
        try:
            line = inp("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()
            if cmd[0] in ("/quit", "/exit"):
                return 0
            if cmd[0] == "/stats":
                out.write(rt.stats_table(per_layer="layers" in cmd) + "\n")
            elif cmd[0] == "/reset":
                messages = messages[:1] if system else []
                out.write("(new conversation)\n")
            elif cmd[0] == "/think" and len(cmd) == 2 and cmd[1] in ("on", "off"):
                think = cmd[1] == "on"
                out.write(f"(thinking {cmd[1]})\n")
            else:
                out.write(HELP + "\n")
            continue
        messages.append({"role": "user", "content": line})
        prompt = tok.chat_prompt(messages, thinking=think)
        decoder = tok.incremental_decoder(skip_special_tokens=False)
        produced, text = [], []
        t0 = time.perf_counter()
        run = gen.start(prompt.ids, params, max_tokens, stop_token_ids=tok.eos_token_ids, hooks=hooks,
                        checkpoints=prompt.checkpoints)
        try:
            for token in run:
                produced.append(token)
                piece = decoder.push(token)
                text.append(piece)
                out.write(piece)
                out.flush()
            text.append(decoder.finish())
            out.write(text[-1])
        except KeyboardInterrupt:
            out.write(" [stopped]")
        dt = time.perf_counter() - t0
        out.write(f"\n({len(produced)} tokens, {len(prompt.ids) - run.cached_tokens} prefilled, {dt:.1f} s)\n")
        parsed = parse_output("".join(text), in_reasoning=prompt.in_think)
        messages.append({"role": "assistant", "content": parsed.content})
