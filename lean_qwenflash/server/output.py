"""Generated token ids -> the pieces of an OpenAI answer (no model, no HTTP: unit-testable).

One pipeline serves streamed and whole answers, so they can never disagree:

    token id -> IncrementalDecoder -> StopStringMatcher -> StreamParser -> deltas

A *delta* is a small dict: ``{"content": str}``, ``{"reasoning_content": str}`` or
``{"tool_call": {"index", "id", "name", "arguments"}}`` (arguments: a JSON string). ``ChatMessage``
folds deltas into the final message; ``chunk_deltas`` turns one delta into the ``delta`` objects of
streamed chunks (a tool call becomes a header chunk with id and name, then its arguments).
"""
from __future__ import annotations

import json
import uuid
from typing import Iterable, Optional

from lean_qwenflash.chat import InvalidToolCall, ParseEvent, StopStringMatcher, StreamParser, ToolCall
from lean_qwenflash.chat.parse import TOOL_CLOSE, TOOL_OPEN


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class TextOutput:
    """Token ids -> text deltas for /v1/completions (stop strings cut the text)."""

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
        self.stop = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        """A stop string matched: generation should end (finish_reason "stop")."""
        return self.stop.stopped

    def push(self, token_id: int) -> list[dict]:
        return self._deltas(self.stop.push(self.decoder.push(token_id)), last=False)

    def finish(self) -> list[dict]:
        tail = self.stop.push(self.decoder.finish()) if not self.stop.stopped else ""
        return self._deltas(tail + self.stop.finish(), last=True)

    def _deltas(self, text: str, last: bool) -> list[dict]:
        """Text that passed the stop strings -> deltas; ``last``: the generation ended."""
        return [{"text": text}] if text else []


class ChatOutput(TextOutput):
    """Token ids -> chat deltas: reasoning, content and tool calls kept apart.

    ``in_reasoning``: the prompt already opened ``<think>``. ``parse_tools=False`` (tool_choice
    "none") returns any ``<tool_call>`` block as content text. A malformed or unterminated block is
    returned as content text too, so nothing the model wrote is lost.
    """

    def __init__(self, tokenizer, stop: Iterable[str] = (), in_reasoning: bool = False, parse_tools: bool = True):
        super().__init__(tokenizer, stop)
        self.parser = StreamParser(in_reasoning)
        self.parse_tools = parse_tools
        self.num_tool_calls = 0

    def _deltas(self, text: str, last: bool) -> list[dict]:
        events = self.parser.push(text) if text else []
        return self.events(events + self.parser.finish() if last else events)

    def events(self, events: list[ParseEvent]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if ev.kind == "content":
                out.append({"content": ev.text})
            elif ev.kind == "reasoning":
                out.append({"reasoning_content": ev.text})
            elif ev.kind == "tool_call" and self.parse_tools:
                call: ToolCall = ev.tool_call
                out.append({"tool_call": {"index": self.num_tool_calls, "id": new_tool_call_id(),
                                          "name": call.name, "arguments": call.arguments_json}})
                self.num_tool_calls += 1
            else:
                call = ev.tool_call
                raw = call.raw if isinstance(call, InvalidToolCall) else json.dumps(
                    {"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
                closed = not (isinstance(call, InvalidToolCall) and call.error.startswith("unterminated"))
                out.append({"content": TOOL_OPEN + raw + (TOOL_CLOSE if closed else "")})
        return out


def chunk_deltas(delta: dict) -> list[dict]:
    """The ``choices[0].delta`` objects that stream one delta."""
    if "tool_call" in delta:
        c = delta["tool_call"]
        return [{"tool_calls": [{"index": c["index"], "id": c["id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": c["index"], "function": {"arguments": c["arguments"]}}]}]
    return [dict(delta)]


class ChatMessage:
    """Folds deltas (or streamed chunk deltas, as a client does) into one assistant message."""

    def __init__(self):
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict] = []

    def add(self, delta: dict) -> None:
        """Add a pipeline delta or a streamed ``choices[0].delta`` object."""
        if "tool_call" in delta:
            for d in chunk_deltas(delta):
                self.add(d)
            return
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for part in delta.get("tool_calls") or ():
            index = part["index"]
            while len(self.tool_calls) <= index:
                self.tool_calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call = self.tool_calls[index]
            call["id"] = part.get("id") or call["id"]
            fn = part.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def to_dict(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content if (self.content or not self.tool_calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def finish_reason(engine_reason: str, message: Optional[ChatMessage] = None) -> str:
    """OpenAI's finish_reason: "tool_calls" when the answer holds calls and ended naturally."""
    if engine_reason == "cancelled":    # e.g. server shutdown under a live client: not an OpenAI reason
        engine_reason = "stop"
    if message is not None and message.tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
