"""Split generated assistant text into reasoning, answer text and tool calls.

Format (our template and Qwen3's): ``<think>reasoning</think>`` then content with any number of
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. ``StreamParser`` works on
text as it streams; ``parse_output`` is the same machine run over a whole string, so streaming and
non-streaming answers can never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    """A well-formed call: ``name`` and a JSON-object ``arguments``."""
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        """Arguments as the JSON string OpenAI's API carries."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class InvalidToolCall:
    """A ``<tool_call>`` block that could not be used; ``raw`` is its text, ``error`` says why."""
    raw: str
    error: str


@dataclass
class ParseEvent:
    """One streamed piece: kind is "content", "reasoning", "tool_call" or "invalid_tool_call"."""
    kind: str
    text: str = ""
    tool_call: ToolCall | InvalidToolCall | None = None


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def parse_tool_call(raw: str) -> ToolCall | InvalidToolCall:
    """Parse the text between ``<tool_call>`` and ``</tool_call>``."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return InvalidToolCall(raw, f"not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return InvalidToolCall(raw, "expected a JSON object with name and arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return InvalidToolCall(raw, "missing or non-string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # Some models emit the arguments as a JSON string, the way OpenAI's API carries them.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return InvalidToolCall(raw, f"'arguments' string is not valid JSON: {exc}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return InvalidToolCall(raw, "'arguments' must be a JSON object")
    return ToolCall(name, args)


def held_prefix(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of one of ``tags``: text that
    may still grow into a tag, so a streaming reader holds it back."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


class _Channel:
    """Emits one kind of text with leading and trailing whitespace removed, as it streams:
    trailing whitespace is held until more non-space text shows it was inner whitespace."""

    def __init__(self, kind: str):
        self.kind = kind
        self.started = False
        self.pending = ""
        self.after_block = False

    def feed(self, text: str, out: list[ParseEvent]) -> None:
        # Whitespace on both sides of a tool-call block is template layout: keep one side only.
        if not self.started or (self.after_block and self.pending):
            text = text.lstrip()
        if not text:
            return
        self.after_block = False
        core = text.rstrip()
        if core:
            out.append(ParseEvent(self.kind, self.pending + core))
            self.started = True
            self.pending = text[len(core):]
        else:
            self.pending += text

    def drop_pending(self) -> None:
        self.pending = ""


class StreamParser:
    """Incremental parser; ``push`` text pieces, then ``finish``. Both return ``ParseEvent``s.

    ``in_reasoning=True`` starts inside a think block, for templates whose generation prompt
    already opened ``<think>``. A ``<tool_call>`` block is reported whole when it closes; one left
    open at the end becomes an ``invalid_tool_call``.
    """

    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "content"
        self._buf = ""
        self._content = _Channel("content")
        self._reasoning = _Channel("reasoning")

    def push(self, text: str) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        self._buf += text
        while True:
            if self._state == "content":
                hits = [(self._buf.find(t), t) for t in (THINK_OPEN, TOOL_OPEN)]
                hits = [h for h in hits if h[0] != -1]
                if hits:
                    i, tag = min(hits)
                    self._content.feed(self._buf[:i], out)
                    self._buf = self._buf[i + len(tag):]
                    self._state = "reasoning" if tag == THINK_OPEN else "tool"
                    continue
                keep = held_prefix(self._buf, (THINK_OPEN, TOOL_OPEN))
                self._content.feed(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            if self._state == "reasoning":
                i = self._buf.find(THINK_CLOSE)
                if i != -1:
                    self._reasoning.feed(self._buf[:i], out)
                    self._reasoning.drop_pending()
                    self._buf = self._buf[i + len(THINK_CLOSE):]
                    self._state = "content"
                    continue
                keep = held_prefix(self._buf, (THINK_CLOSE,))
                self._reasoning.feed(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            # state "tool": the JSON is only useful whole, so it stays buffered until closed.
            i = self._buf.find(TOOL_CLOSE)
            if i == -1:
                return out
            call = parse_tool_call(self._buf[:i].strip())
            kind = "tool_call" if isinstance(call, ToolCall) else "invalid_tool_call"
            out.append(ParseEvent(kind, tool_call=call))
            self._content.after_block = True
            self._buf = self._buf[i + len(TOOL_CLOSE):]
            self._state = "content"

    def finish(self) -> list[ParseEvent]:
        """Flush at end of generation: a held partial tag was plain text after all."""
        out: list[ParseEvent] = []
        buf, self._buf = self._buf, ""
        if self._state == "content":
            self._content.feed(buf, out)
        elif self._state == "reasoning":
            self._reasoning.feed(buf, out)
        else:
            out.append(ParseEvent("invalid_tool_call", tool_call=InvalidToolCall(
                buf, "unterminated <tool_call>: generation ended before </tool_call>")))
        self._state = "content"
        return out


def parse_output(text: str, in_reasoning: bool = False) -> ParsedOutput:
    """Parse a complete generation; never raises on malformed tool calls (see ``invalid_tool_calls``)."""
    parser = StreamParser(in_reasoning)
    result = ParsedOutput()
    for ev in parser.push(text) + parser.finish():
        if ev.kind == "content":
            result.content += ev.text
        elif ev.kind == "reasoning":
            result.reasoning += ev.text
        elif ev.kind == "tool_call":
            result.tool_calls.append(ev.tool_call)
        else:
            result.invalid_tool_calls.append(ev.tool_call)
    return result
