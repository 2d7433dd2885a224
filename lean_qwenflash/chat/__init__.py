"""Tokenizer, chat template and output parsing for chat models."""

from .parse import InvalidToolCall, ParsedOutput, ParseEvent, StreamParser, ToolCall, parse_output
from .template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, TemplateError
from .tokenizer import IncrementalDecoder, StopStringMatcher, Tokenizer

__all__ = [
    "ChatTemplate", "DEFAULT_CHAT_TEMPLATE", "IncrementalDecoder", "InvalidToolCall", "ParseEvent",
    "ParsedOutput", "StopStringMatcher", "StreamParser", "TemplateError", "Tokenizer", "ToolCall",
    "parse_output",
]
