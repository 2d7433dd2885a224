"""`lean-qwenflash chat`: turns reuse the conversation's state through the shared prefix cache."""
import io
import re

import pytest

from lean_qwenflash.config import load_config
from lean_qwenflash.generate import Generator, SamplingParams
from lean_qwenflash.generate.grammar import BannedTokens
from lean_qwenflash.repl import chat_loop
from lean_qwenflash.runtime import DEFAULT_MODEL_DIR, Runtime

HAS_DEFAULT_MODEL = (DEFAULT_MODEL_DIR / "config.json").is_file() or (DEFAULT_MODEL_DIR / "manifest.json").is_file()


@pytest.mark.skipif(not HAS_DEFAULT_MODEL, reason="the built-in default model is missing (CI has it)")
@pytest.mark.parametrize("think", [False, True])
def test_second_turn_prefills_only_what_it_adds_and_answers_as_a_fresh_run(think):
    greedy = SamplingParams(temperature=0)
    budget = 200 if think else 40
    system = "You are a helpful assistant who answers briefly. " * 12
    lines = iter(["Tell me about disks.", "And about memory?", "/quit"])
    out = io.StringIO()
    with Runtime.open(load_config(None)) as rt:
        assert chat_loop(rt, greedy, budget, think=think, system=system, inp=lambda _: next(lines), out=out) == 0
        stats = [(int(a), int(b)) for a, b in re.findall(r"\((\d+) tokens, (\d+) prefilled", out.getvalue())]
        assert len(stats) == 2
        tok = rt.tokenizer
        # The second turn's prompt, rendered as the REPL does, fed fresh: same answer.
        sys_msg = {"role": "system", "content": system}
        first = tok.chat_prompt([sys_msg, {"role": "user", "content": "Tell me about disks."}], thinking=think)
        no_calls = [BannedTokens([tok.token_to_id("<tool_call>")])]
        produced = list(Generator(rt.model).generate(first.ids, greedy, budget, tok.eos_token_ids, hooks=no_calls))
        from lean_qwenflash.chat import parse_output
        content = parse_output(tok.decode(produced), in_reasoning=think).content
        second = tok.chat_prompt([sys_msg, {"role": "user", "content": "Tell me about disks."},
                                  {"role": "assistant", "content": content},
                                  {"role": "user", "content": "And about memory?"}], thinking=think)
        fresh = tok.decode(list(Generator(rt.model).generate(second.ids, greedy, budget, tok.eos_token_ids,
                                                             hooks=no_calls)))
    assert stats[0][1] == len(first.ids)
    # At least the conversation before the first answer came from the cache (the first prompt's
    # turn-boundary checkpoint); the answer itself is re-rendered by the template.
    assert 0 < stats[1][1] <= len(second.ids) - first.checkpoints[0], (stats, len(second.ids), first.checkpoints)
    assert content and fresh in out.getvalue()
