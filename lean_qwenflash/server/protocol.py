"""OpenAI request shapes (validated with pydantic; they also make the OpenAPI schema) and errors.

Unknown request fields are ignored (clients send many vendor extensions); fields we cannot honour
(images, ``suffix``, ``best_of``) are refused with a 400 naming them.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from lean_qwenflash.config import REASONING_EFFORTS

# reasoning_effort -> thinking-token budget (None: thinking off). When the budget runs out the
# engine forces "</think>" and the answer follows; reasoning tokens count toward max_tokens.
REASONING_BUDGETS: dict[str, Optional[int]] = {
    "none": None,
    "minimal": 32,
    "low": 256,
    "medium": 1024,
    "high": 4096,
    "xhigh": 16384,
}
# config.py checks server.default_reasoning_effort against REASONING_EFFORTS and chat_job looks
# its budget up here: one list of names for both.
assert tuple(REASONING_BUDGETS) == REASONING_EFFORTS
ReasoningEffort = Literal[REASONING_EFFORTS]
MAX_STOP = 16                   # stop strings per request (OpenAI's stop, Anthropic's stop_sequences)
MAX_N = 16                      # choices per request (each holds its own copy of the prompt's state)
MAX_TOP_LOGPROBS = 20           # most likely tokens listed per position (OpenAI's chat limit)
MAX_SCORED = 64                 # continuations per choice-scoring request


# Anthropic's error types by status; other statuses are invalid_request_error (4xx) or api_error.
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """The Anthropic Messages API's routes (/v1/messages, /v1/messages/count_tokens, ...)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, or on
    the Anthropic routes in Anthropic's: {"type": "error", "error": {"type", "message"}}
    (``anthropic_message``, when given, replaces the message there)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None, anthropic_message: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
        self.headers = headers
        self.anthropic_message = anthropic_message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_for(self, path: str) -> dict:
        """The body answering a request to ``path``: Anthropic's shape on its routes, else OpenAI's."""
        if not is_anthropic_path(path):
            return self.body()
        kind = _ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.anthropic_message or self.message}}


def invalid_text_param(value, path: str = "") -> Optional[str]:
    """The first place in a decoded request body holding text that is not valid Unicode (a lone
    UTF-16 surrogate such as ``"\\ud800"``, which JSON can spell but no tokenizer can encode), as
    "messages[0].content"; None if every string is valid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = invalid_text_param(k, path) or invalid_text_param(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = invalid_text_param(v, f"{path}[{i}]")
            if found:
                return found
    return None


def error_param(loc: tuple) -> Optional[str]:
    """pydantic error location -> "messages[0].role" (the body prefix dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or "-" in str(part) or str(part) in ("str", "int", "list", "dict", "float"):
            continue          # union-member tags pydantic adds, e.g. "list[ContentPart]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


class Strict(BaseModel):
    """A request shape: field types are checked strictly, unknown fields ignored (both APIs' models)."""
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(Strict):
    type: str
    text: Optional[str] = None


class ToolCallFunction(Strict):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallIn(Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDef(Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: Optional[bool] = None


class JsonSchemaFormat(Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class _Sampling(Strict):
    model: str
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stop: Union[str, list[str], None] = Field(None)
    n: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[ReasoningEffort] = None
    # Extension (also what the Anthropic endpoint's thinking.budget_tokens becomes): the thinking
    # budget in tokens, overriding reasoning_effort's; 0 turns thinking off.
    thinking_budget: Optional[int] = Field(None, ge=0)
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    max_tokens: Optional[int] = Field(None, ge=0)       # 0: with echo, the prompt's logprobs only
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # Extension (choice mode): rank these continuations of the prompt by log-likelihood instead of
    # generating; "rank_by" picks the order (total logprob, or mean per token).
    choices: Optional[list[str]] = Field(None, min_length=1, max_length=MAX_SCORED)
    rank_by: Optional[Literal["total", "mean"]] = None


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def schema_problem(schema, path: str = "parameters") -> Optional[str]:
    """Why ``schema`` is not a usable JSON Schema (the structural rules OpenAI checks), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path} must be a JSON Schema object, got {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if kind is not None and (not kinds or not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds)):
        return f"{path}.type must be one of {', '.join(sorted(_JSON_TYPES))} (or a list of them), got {kind!r}"
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            return f"{path}.properties must be an object mapping names to schemas, got {type(props).__name__}"
        for name, sub in props.items():
            why = schema_problem(sub, f"{path}.properties.{name}")
            if why:
                return why
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return f"{path}.required must be a list of property names"
    items = schema.get("items")
    if items is not None:
        for i, sub in enumerate(items if isinstance(items, list) else [items]):
            why = schema_problem(sub, f"{path}.items" + (f"[{i}]" if isinstance(items, list) else ""))
            if why:
                return why
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{path}.{key} must be a list of schemas"
            for i, sub in enumerate(schema[key]):
                why = schema_problem(sub, f"{path}.{key}[{i}]")
                if why:
                    return why
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{path}.enum must be a list"
    return None


def check_unsupported(req: _Sampling) -> None:
    """Refuse what we cannot honour, naming the field."""
    if req.n is not None and req.n > MAX_N:
        raise ApiError(400, f"n={req.n}: at most {MAX_N} choices per request", "n")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema (the JSON Schema the "
                                    "answer must follow)", "response_format.json_schema")
            why = schema_problem(fmt.json_schema.schema_, "response_format.json_schema.schema")
            if why:
                raise ApiError(400, f"invalid schema: {why}", "response_format.json_schema.schema")
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise ApiError(400, f"content part type {part.type!r} is not supported (text only)",
                                       f"messages[{i}].content[{j}].type")
            if m.role == "tool" and m.content is None:
                raise ApiError(400, "a tool message needs content", f"messages[{i}].content")
        # A tool result answers a call made earlier in the conversation (as OpenAI checks).
        call_ids: set = set()
        calls_seen = False
        for i, m in enumerate(req.messages):
            if m.role == "assistant" and m.tool_calls:
                calls_seen = True
                call_ids.update(c.id for c in m.tool_calls if c.id)
            elif m.role == "tool":
                if not calls_seen:
                    raise ApiError(400, "a message with role 'tool' must answer a preceding assistant message "
                                        "with 'tool_calls'", f"messages[{i}].role")
                if call_ids and m.tool_call_id not in call_ids:
                    raise ApiError(400, f"tool_call_id {m.tool_call_id!r} matches no tool call made before it "
                                        f"(calls: {', '.join(sorted(call_ids))})", f"messages[{i}].tool_call_id")
        for i, t in enumerate(req.tools or []):
            if t.function.parameters is not None:
                why = schema_problem(t.function.parameters)
                if why:
                    raise ApiError(400, f"invalid schema for function {t.function.name!r}: {why}",
                                   f"tools[{i}].function.parameters")
        if isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required":
            if not req.tools:
                raise ApiError(400, "tool_choice requires tools", "tool_choice")
            if isinstance(req.tool_choice, NamedToolChoice):
                names = [t.function.name for t in req.tools]
                if req.tool_choice.function.name not in names:
                    raise ApiError(400, f"tool_choice names {req.tool_choice.function.name!r}, which is not among "
                                        f"the tools ({', '.join(names)})", "tool_choice")
    else:
        if req.max_tokens == 0 and not req.echo and req.choices is None:
            raise ApiError(400, "max_tokens=0 generates nothing: it needs echo (the prompt's logprobs)", "max_tokens")
        if req.choices is not None:
            for key, value in (("n", req.n not in (None, 1)), ("stream", req.stream), ("echo", req.echo)):
                if value:
                    raise ApiError(400, f"choices (scoring given continuations) cannot be combined with {key}", key)
        elif req.rank_by is not None:
            raise ApiError(400, "rank_by orders the scored choices: it needs choices", "rank_by")
        if req.suffix:
            raise ApiError(400, "suffix is not supported by this server", "suffix")
        if req.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported by this server", "best_of")
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
            raise ApiError(400, "prompt: one prompt per request (a list of several strings is not supported)",
                           "prompt")


def stop_strings(req: _Sampling) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template reads them ("developer" is a system message)."""
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if isinstance(m.content, list):
            d["content"] = "".join(p.text or "" for p in m.content)
        else:
            d["content"] = m.content
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out
