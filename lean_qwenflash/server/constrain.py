"""The grammar of an assistant answer, from the request: which tools may be called, and how.

(Server-side: it reads request semantics — tool_choice, response_format — and joins the chat
format of ``chat/parse.py`` with the grammar engine of ``generate/grammar.py``.)

The answer (what follows the think block) is written in the tool-call format of ``parse.py``:
free text and/or ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` blocks. This module
turns the offered tools, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` into a
Lark grammar for ``generate.grammar.GrammarHook`` (llguidance syntax), so that

- a call can only name an offered tool (the named one for a named ``tool_choice``), and its
  arguments always validate against that tool's JSON schema;
- ``required`` / named choices start the answer with a call; ``parallel_tool_calls`` false allows
  one call at most;
- ``response_format`` json_object / json_schema makes the answer one JSON value of that schema.

``None`` means no grammar is needed (no tools offered, or ``tool_choice`` none, and no
``response_format``): the server then only bans the tool-call token.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from lean_qwenflash.chat.parse import TOOL_CLOSE, TOOL_OPEN
from lean_qwenflash.generate.grammar import json_schema_grammar

# Text outside a call: anything that does not spell the call tag itself (else it would be parsed
# as an unconstrained call).
_TEXT = "/(?s:.*)/ & ~/(?s:.*)" + TOOL_OPEN + "(?s:.*)/"
_LEAD = r"/[ \n]{0,4}/"         # layout the template or the think close leaves before the answer
_GAP = r"/[ \n]{0,2}/"          # between parallel calls


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _tag(tokenizer, tag: str) -> str:
    """A tag as a grammar terminal: the token itself when the vocabulary has it as one token."""
    return tag if tokenizer.token_to_id(tag) is not None else _literal(tag)


def answer_grammar(tokenizer, tools: Sequence[dict], tool_choice, parallel_tool_calls: Optional[bool],
                   response_format: Optional[dict]) -> Optional[str]:
    """The Lark grammar for the answer, or None when nothing constrains it.

    ``tools``: OpenAI function tools (``{"type": "function", "function": {name, parameters}}``), already
    filtered by ``tool_choice`` none / named. ``tool_choice``: "auto", "required", "named" or None.
    ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": ...}}`` or None.
    """
    rules = ["%llguidance {}"]
    content = None
    if response_format is not None and response_format.get("type") in ("json_object", "json_schema"):
        schema = None
        if response_format["type"] == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            schema = {} if schema is None else schema
        rules.append("json_answer: " + json_schema_grammar(schema, "response_format.json_schema.schema"))
        content = "json_answer"
    if not tools:
        if content is None:
            return None
        rules.insert(1, f"start: LEAD {content}")
        rules.append(f"LEAD: {_LEAD}")
        return "\n".join(rules) + "\n"

    open_tag, close_tag = _tag(tokenizer, TOOL_OPEN), _tag(tokenizer, TOOL_CLOSE)
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
        args = json_schema_grammar(fn.get("parameters"), f"tools[{i}].function.parameters ({fn['name']})")
        rules.append(f"fn_{i}: {_literal(head)} {args} {_literal('}')}")
        alternatives.append(f"fn_{i}")
    rules.append(f"call: {open_tag} ({' | '.join(alternatives)}) {close_tag}")
    rules.append("calls: call (GAP call)*" if parallel_tool_calls is not False else "calls: call")
    if tool_choice in ("required", "named"):
        start = "start: LEAD calls"
    elif content is not None:          # JSON answer or calls
        start = f"start: LEAD ({content} | calls)"
    else:
        start = "start: TEXT | TEXT? calls"
        rules.append(f"TEXT: {_TEXT}")
    rules.insert(1, start)
    rules.append(f"LEAD: {_LEAD}")
    rules.append(f"GAP: {_GAP}")
    return "\n".join(rules) + "\n"
