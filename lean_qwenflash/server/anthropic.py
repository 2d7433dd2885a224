"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), so that
Claude Code and the ``anthropic`` SDK can talk to the server directly.

Nothing here generates: a request is translated into the ``ChatCompletionRequest`` the OpenAI
route takes (``to_chat_request``) and runs as the same chat job (``service.Service.chat_job``),
with the same checks, queue and prefix cache. The job's deltas become Anthropic content blocks
through ``ContentBlocks``, one fold for streamed and whole answers, so the two cannot disagree.

Usage follows Anthropic's convention: ``input_tokens`` are the prompt tokens computed for this
request and ``cache_read_input_tokens`` those the prefix cache supplied; their sum is the prompt.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from lean_qwenflash.server.engine import Job
from lean_qwenflash.server.protocol import (MAX_STOP, REASONING_BUDGETS, ApiError, ChatCompletionRequest, Strict,
                                            check_unsupported, schema_problem)
from lean_qwenflash.server.service import Service
from lean_qwenflash.server.sse import event_stream, sse_event

# output_config.effort (with thinking "adaptive") -> our reasoning_effort, whose budget is used.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
_BLOCK_JOIN = "\n\n"             # between the text blocks of one message when they become one string


# -- request shapes -------------------------------------------------------------------------------

class TextPart(Strict):
    """A block of a system prompt or of a tool result's content (only "text" is accepted)."""
    type: str
    text: Optional[str] = None


class ContentBlock(Strict):
    """Any block of a message's content: one shape for every kind, whose fields
    ``to_chat_request`` checks (so an error names the block: messages[1].content[0].id)."""
    type: str
    text: Optional[str] = None                                  # text
    id: Optional[str] = None                                    # tool_use
    name: Optional[str] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[str] = None                           # tool_result
    content: Union[str, list[TextPart], None] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None                              # thinking (signature ignored)
    signature: Optional[str] = None


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class AnthropicTool(Strict):
    type: Optional[str] = None                                  # None / "custom": a client tool
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")


class OutputConfig(Strict):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class CountTokensRequest(Strict):
    """The prompt part of a request: what ``count_tokens`` takes (unknown fields are ignored:
    metadata, service_tier, cache_control...)."""
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextPart], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: Optional[bool] = False
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)


# -- Anthropic request -> chat request ------------------------------------------------------------

def _bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", where)


def _joined_text(parts: list[TextPart], where: str, inside: str) -> str:
    out = []
    for k, part in enumerate(parts):
        if part.type != "text":
            raise _bad(f"{where}[{k}].type", f"{part.type!r} blocks are not supported in {inside} (text only)")
        out.append(part.text or "")
    return _BLOCK_JOIN.join(out)


def _refuse_media(b: ContentBlock, at: str) -> None:
    if b.type in ("image", "document"):
        raise _bad(at, f"{b.type} blocks are not supported: this server's model reads text only")


def _user_message(blocks: list[ContentBlock], where: str, call_ids: set) -> list[dict]:
    """A user turn's blocks -> a tool message per tool_result (in order), then a user message
    with the text blocks (if any, or if there were no results)."""
    results, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_result":
            if not b.tool_use_id:
                raise _bad(f"{at}.tool_use_id", "a tool_result block needs the id of the tool_use it answers")
            if b.tool_use_id not in call_ids:
                known = f" (tool_use ids: {', '.join(sorted(call_ids))})" if call_ids else ""
                raise _bad(f"{at}.tool_use_id", f"{b.tool_use_id!r} matches no tool_use block before it{known}")
            content = b.content if isinstance(b.content, str) else \
                _joined_text(b.content or [], f"{at}.content", "a tool_result")
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": ("Error: " + content) if b.is_error else content})
        else:
            _refuse_media(b, at)
            raise _bad(f"{at}.type", f"content block type {b.type!r} is not supported in a user message "
                                     "(text and tool_result are)")
    return results + ([{"role": "user", "content": _BLOCK_JOIN.join(texts)}] if texts or not results else [])


def _assistant_message(blocks: list[ContentBlock], where: str, call_ids: set) -> dict:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "thinking":
            thoughts.append(b.thinking or "")
        elif b.type == "redacted_thinking":
            continue                    # encrypted thoughts of another model: nothing we can read
        elif b.type == "tool_use":
            for field in ("id", "name"):
                if not getattr(b, field):
                    raise _bad(f"{at}.{field}", f"a tool_use block needs {'an' if field == 'id' else 'a'} {field}")
            call_ids.add(b.id)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
        else:
            _refuse_media(b, at)
            raise _bad(f"{at}.type", f"content block type {b.type!r} is not supported in an assistant message "
                                     "(text, thinking, redacted_thinking and tool_use are)")
    msg: dict = {"role": "assistant", "content": _BLOCK_JOIN.join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = _BLOCK_JOIN.join(thoughts)
    return msg


def _thinking_budget(req: CountTokensRequest, max_tokens: Optional[int]) -> int:
    """thinking -> our thinking_budget (0: off). Reasoning tokens count toward max_tokens."""
    t = req.thinking
    if t is None or t.type == "disabled":
        return 0
    if t.type == "enabled":
        if t.budget_tokens is None:
            raise _bad("thinking.budget_tokens", "Field required (with thinking type 'enabled')")
        if max_tokens is not None and t.budget_tokens >= max_tokens:
            raise _bad("max_tokens", f"must be greater than thinking.budget_tokens ({t.budget_tokens}): thinking "
                                     "tokens count toward max_tokens")
        return t.budget_tokens
    effort = (req.output_config.effort if req.output_config else None) or "high"
    return REASONING_BUDGETS[_EFFORTS[effort]]


def _tools(req: CountTokensRequest) -> tuple[list[dict], Any, Optional[bool]]:
    """tools and tool_choice -> our tools, tool_choice and parallel_tool_calls."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise _bad(f"tools[{i}].type", f"tool type {t.type!r} (an Anthropic server tool) is not supported; "
                                           "define the tool with name, description and input_schema")
        if t.input_schema is None:
            raise _bad(f"tools[{i}].input_schema", "Field required")
        why = schema_problem(t.input_schema, "input_schema")
        if why:
            raise _bad(f"tools[{i}].input_schema", f"invalid schema for tool {t.name!r}: {why}")
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.input_schema}})
    c = req.tool_choice
    if c is None:
        return tools, None, None
    names = [t.name for t in req.tools or []]
    if c.type in ("any", "tool") and not tools:
        raise _bad("tool_choice", f"tool_choice type {c.type!r} requires tools")
    if c.type == "tool":
        if not c.name:
            raise _bad("tool_choice.name", "Field required (with tool_choice type 'tool')")
        if c.name not in names:
            raise _bad("tool_choice.name", f"{c.name!r} is not among the tools ({', '.join(names)})")
        choice: Any = {"type": "function", "function": {"name": c.name}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[c.type]
    parallel = None if c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use
    return tools, choice, parallel


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request running ``req`` (a MessagesRequest, or a CountTokensRequest for counting);
    an ApiError (400) naming the Anthropic field for what cannot be translated."""
    full = isinstance(req, MessagesRequest)
    messages: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _joined_text(req.system, "system", "system")
        messages.append({"role": "system", "content": system})
    call_ids: set = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user_message(m.content, f"messages[{i}].content", call_ids)
        else:
            messages.append(_assistant_message(m.content, f"messages[{i}].content", call_ids))
    if req.messages[-1].role == "assistant":
        raise _bad(f"messages[{len(req.messages) - 1}].role", "a final assistant message (prefilling the answer) "
                                                               "is not supported: end with a user message")
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        if fmt.schema_ is None:
            raise _bad("output_config.format.schema", "Field required (the JSON Schema the answer must follow)")
        why = schema_problem(fmt.schema_, "schema")
        if why:
            raise _bad("output_config.format.schema", f"invalid schema: {why}")
    tools, choice, parallel = _tools(req)
    max_tokens = req.max_tokens if full else None
    stops = (req.stop_sequences or []) if full else []
    if len(stops) > MAX_STOP:
        raise _bad("stop_sequences", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    chat = ChatCompletionRequest.model_validate({
        "model": req.model, "messages": messages, "max_tokens": max_tokens, "stop": stops or None,
        "temperature": req.temperature if full else None, "top_p": req.top_p if full else None,
        "top_k": req.top_k if full else None, "tools": tools or None, "tool_choice": choice,
        "parallel_tool_calls": parallel, "thinking_budget": _thinking_budget(req, max_tokens),
        # structured output: the answer is one JSON value of the schema (the grammar the OpenAI
        # route's response_format json_schema gets)
        "response_format": None if fmt is None else {"type": "json_schema",
                                                     "json_schema": {"name": "output", "schema": fmt.schema_}}})
    check_unsupported(chat)       # what the OpenAI route checks too (the checks above name the fields first)
    return chat


# -- deltas -> content blocks ---------------------------------------------------------------------

def _signature(thinking: str) -> str:
    """The opaque signature a thinking block carries (we do not check signatures sent back)."""
    return "lqf-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def tool_use_id(call_id: str) -> str:
    """Our "call_…" tool-call id as Anthropic spells one: "toolu_…"."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """Folds a job's deltas into Anthropic content blocks (thinking, text, tool_use, in the order
    they were written) and returns, for each delta, the stream events that build them."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open: Optional[str] = None        # "thinking" / "text": the last block can still grow

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        self.blocks.append(block)
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                         "content_block": dict(block)})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        if "tool_call" in delta:
            call = delta["tool_call"]
            events = self.close()
            events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"],
                                   "input": {}})
            self.blocks[-1]["input"] = json.loads(call["arguments"])
            events.append(self._delta({"type": "input_json_delta", "partial_json": call["arguments"]}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
            return events
        # The block's text field and its delta's are named after the kind: "thinking" / "text".
        kind, text = ("thinking", delta["reasoning_content"]) if "reasoning_content" in delta \
            else ("text", delta.get("content") or "")
        if not text:
            return []
        events = []
        if self._open != kind:
            events += self.close()
            events += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
            self._open = kind
        self.blocks[-1][kind] += text
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        """End the open thinking/text block (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        events = []
        block = self.blocks[-1]
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
        self._open = None
        return events


def _stop_reason(info: dict, job: Job, blocks: ContentBlocks, max_tokens: int) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished job."""
    if info["finish_reason"] == "length":
        # max_new_tokens is below max_tokens only when the context had no more room.
        return ("max_tokens" if job.max_new_tokens >= max_tokens else "model_context_window_exceeded"), None
    matched = job.output.stop.matched
    if matched is not None:
        return "stop_sequence", matched
    return ("tool_use" if blocks.has_tool_use else "end_turn"), None


def _usage(info: dict) -> dict:
    prompt, cached = info.get("prompt_tokens", 0), info.get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": info.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(mid: str, model: str, content: list, stop: tuple, usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _stream(srv: Service, job: Job, request: Request, mid: str, max_tokens: int) -> AsyncIterator[str]:
    blocks = ContentBlocks()
    # The prefix-cache hit is known only at the end: message_delta's usage (cumulative, as the SDK
    # reads it) then splits input_tokens into computed and cache-read tokens.
    start_usage = {"input_tokens": len(job.prompt_ids), "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
    head = (sse_event("message_start", {"type": "message_start",
                                        "message": _message(mid, srv.model_name, [], (None, None), start_usage)})
            + sse_event("ping", {"type": "ping"}))

    def on_deltas(deltas) -> str:
        return "".join(sse_event(name, data) for d in deltas for name, data in blocks.add(d))

    def on_done(info) -> str:
        reason, sequence = _stop_reason(info, job, blocks, max_tokens)
        return ("".join(sse_event(name, data) for name, data in blocks.close())
                + sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": _usage(info)})
                + sse_event("message_stop", {"type": "message_stop"}))

    def on_error(message: str) -> str:
        return sse_event("error", ApiError(500, message, code="generation_failed").body_for("/v1/messages"))

    return srv.stream(job, request, head, on_deltas, on_done, on_error)


# -- routes ---------------------------------------------------------------------------------------

def register(app: FastAPI, srv: Service) -> None:
    """Add the Messages API routes to ``app`` (built by ``create_app`` around ``srv``)."""

    async def prepare(req: CountTokensRequest) -> Job:
        srv.check_text(req)
        srv.check_model(req.model)
        chat = to_chat_request(req)
        # Rendering and tokenizing a long conversation takes a while: off the event loop.
        return await srv.build_job(srv.chat_job, chat)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        job = await prepare(req)
        srv.submit(job)
        mid = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return event_stream(_stream(srv, job, request, mid, req.max_tokens))
        blocks = ContentBlocks()
        info = await srv.collect(job, request, lambda deltas: [blocks.add(d) for d in deltas])
        if info is None:
            return Response(status_code=499)
        blocks.close()
        return _message(mid, srv.model_name, blocks.blocks, _stop_reason(info, job, blocks, req.max_tokens),
                        _usage(info))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        # The job is built (template rendered, prompt tokenized) and dropped unsubmitted: it holds
        # no engine resource, only its prompt ids.
        job = await prepare(req)
        return {"input_tokens": len(job.prompt_ids)}
