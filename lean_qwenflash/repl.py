"""`lean-qwenflash chat`: an interactive chat in the terminal.

The conversation's model state is kept between turns: when the next rendered prompt extends the
tokens already in the state, only the new tokens are prefilled. Ctrl-C during an answer stops
that answer; Ctrl-C or Ctrl-D at the prompt leaves.
"""
from __future__ import annotations

import sys
import time

from .chat import parse_output
from .generate.generator import Generator
from .generate.sampling import SamplingParams

HELP = "commands: /stats (expert tier statistics), /reset (new conversation), /think on|off, /quit"


def chat_loop(rt, params: SamplingParams, max_tokens: int, think: bool = False, system: str | None = None,
              inp=input, out=sys.stdout) -> int:
    tok = rt.tokenizer
    if tok is None or tok.chat_template is None:
        raise ValueError(f"the pack {rt.store.path} has no tokenizer with a chat template; use `generate --prompt-ids`")
    gen = Generator(rt.model, rt.cfg.generation.prefill_chunk_tokens)
    messages = [{"role": "system", "content": system}] if system else []
    state, state_tokens = None, []
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
                state, state_tokens = None, []
                out.write("(new conversation)\n")
            elif cmd[0] == "/think" and len(cmd) == 2 and cmd[1] in ("on", "off"):
                think = cmd[1] == "on"
                out.write(f"(thinking {cmd[1]})\n")
            else:
                out.write(HELP + "\n")
            continue
        messages.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(messages, enable_thinking=think, tokenize=True)
        reuse = state is not None and len(state_tokens) < len(prompt) and prompt[:len(state_tokens)] == state_tokens
        if not reuse:
            state, state_tokens = gen.new_state(), []
        decoder = tok.incremental_decoder(skip_special_tokens=False)
        produced, text = [], []
        t0 = time.perf_counter()
        try:
            for token in gen.generate(prompt, params, max_tokens, stop_token_ids=tok.eos_token_ids, state=state):
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
        out.write(f"\n({len(produced)} tokens, {len(prompt) - len(state_tokens) if reuse else len(prompt)} "
                  f"prefilled, {dt:.1f} s)\n")
        # The state now covers the prompt and all generated tokens but the last.
        state_tokens = prompt + produced[:-1] if produced else list(prompt)
        if state.num_tokens != len(state_tokens):
            state, state_tokens = None, []
        parsed = parse_output("".join(text))
        messages.append({"role": "assistant", "content": parsed.content})
