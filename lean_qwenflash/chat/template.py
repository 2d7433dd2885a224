"""Chat templates: render a conversation to the prompt text a model was trained on.

HF model directories ship a jinja2 template (in ``tokenizer_config.json`` or ``chat_template.jinja``).
Templates are data from outside, so they run in jinja2's immutable sandbox; the few helpers that
HF-style templates expect (``tojson``, ``raise_exception``, ``strftime_now``) are provided here.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox


class TemplateError(ValueError):
    """The template could not be compiled or refused the conversation (``raise_exception``)."""


# Our own ChatML-style template, shipped with the default model. Layout, decided here:
#   <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{json per tool}\n</tools> ...<|im_end|>\n
#   <|im_start|>user\n{content}<|im_end|>\n
#   <|im_start|>assistant\n[<think>\n{reasoning}\n</think>\n\n]{content}[<tool_call>{json}</tool_call>]<|im_end|>\n
#   <|im_start|>tool\n<tool_response>{content}</tool_response><|im_end|>\n
# Reasoning is kept only for assistant turns after the last user turn (the tool loop in progress):
# older thoughts are noise for the next answer and cost context. An empty reasoning_content renders
# an empty think block, which is exactly what the generation prompt emits when thinking is off, so
# a model trained on such turns sees the same prefix at inference.
DEFAULT_CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- set has_system = (messages | length > 0) and messages[0].role == 'system' %}
{%- if has_system or tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- messages[0].content or '' }}
        {%- if tools %}{{- '\n\n' }}{% endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\nThese functions are available, one JSON signature per line:\n<tools>\n' }}
        {%- for tool in tools %}
            {{- (tool | tojson) + '\n' }}
        {%- endfor %}
        {{- '</tools>\n\nTo use one, answer with <tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>. Its result arrives in <tool_response></tool_response>.' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('a system message may only come first') }}{% endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user and message.reasoning_content is defined and message.reasoning_content is not none %}
            {{- '<think>\n' + (message.reasoning_content | trim) + '\n</think>\n\n' }}
        {%- endif %}
        {{- message.content or '' }}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if (not loop.first) or message.content %}{{- '\n' }}{% endif %}
                {{- '<tool_call>{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
                {%- if fn.arguments is string %}{{- fn.arguments }}{% else %}{{- fn.arguments | tojson }}{% endif %}
                {{- '}</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>tool\n<tool_response>' + (message.content or '') + '</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{% endif %}
{%- endif %}
""".strip()


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    # jinja2's built-in tojson HTML-escapes '<', '>', '&' for web pages; prompts need the raw JSON.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: some HF templates mark assistant text with it to
    build training masks; for inference the block is plain output, but without this tag such
    templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks match how HF renders templates, so whitespace comes out identical.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _normalise_message(message: Mapping[str, Any]) -> dict:
    # OpenAI clients may send content as a list of {"type": "text", "text": ...} parts; templates
    # written for HF expect a plain string.
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(part.get("text", "") for part in content
                                 if isinstance(part, Mapping) and part.get("type", "text") == "text")
    return out


class ChatTemplate:
    """A compiled chat template.

    ``special_tokens`` (e.g. ``{"bos_token": "<s>", "eos_token": "<|im_end|>"}``) are exposed to the
    template as variables, as HF does.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = False, enable_thinking: bool | None = None,
               **extra: Any) -> str:
        """Render ``messages`` (dicts with ``role``, ``content``, optional ``tool_calls`` and
        ``reasoning_content``) to prompt text.

        ``enable_thinking=None`` leaves the variable undefined so the template's own default holds;
        ``extra`` reaches the template as further variables (e.g. ``reasoning_effort``).
        """
        context = dict(self.special_tokens)
        context.update(extra)
        context["messages"] = [_normalise_message(m) for m in messages]
        context["tools"] = list(tools) if tools else None
        context["add_generation_prompt"] = add_generation_prompt
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
