"""Grammar-constrained decoding: token masks from a grammar, applied as a ``TokenHook``.

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance, on PyPI): it computes
the set of allowed next tokens for a Lark grammar with embedded JSON schemas in tens of
microseconds on a CPU, needs no torch, reads our ``tokenizer.json`` directly, and has *lazy*
lexemes, so a tool call can be constrained from the moment it starts in the middle of free text.

``GrammarHook`` masks the logits of every sampled token while its ``gate`` says the grammar
applies (the server: once the think block is closed) and advances the matcher with every emitted
token. ``BannedTokens`` is the grammar-free special case: a fixed set of tokens never sampled.
"""
from __future__ import annotations

import json
import logging
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from lean_qwenflash.generate.generator import TokenHook

log = logging.getLogger("lean_qwenflash.grammar")

# JSON the way models see it in their chat templates (json.dumps): ", " and ": ", no other
# whitespace (a flexible-whitespace grammar lets a small model pad forever).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or schema the engine cannot use; the message says what and where."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:       # a hard dependency, but say what to do if it is missing
        raise GrammarError("constrained decoding needs the llguidance package: pip install llguidance") from e
    return llguidance


def grammar_tokenizer(tokenizer, vocab_size: int):
    """The llguidance tokenizer for our ``Tokenizer`` (built once, ~0.1-1 s, then kept on it)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is not None and cached[0] == vocab_size:
        return cached[1]
    llg = _llguidance()
    n_vocab = max(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
    lltok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab,
                            eos_token=list(tokenizer.eos_token_ids) or None)
    tokenizer._llg_tokenizer = (vocab_size, lltok)
    return lltok


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUED = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then",
                  "else", "contains", "propertyNames", "additionalItems", "unevaluatedProperties")


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` wherever an object lists its ``properties``
    and says nothing about others: what a model writes then still validates against the original,
    but it cannot invent argument names (or wander off into an unbounded key). A schema that sets
    additionalProperties, or lists no properties, is left as it is."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):      # name -> schema
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_VALUED:
            out[key] = closed_objects(value)
        else:                                                  # data (enum, const, default...) or words
            out[key] = value
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Optional[dict], where: str) -> str:
    """A ``%json`` grammar fragment for ``schema`` (None: any JSON object), objects closed (see
    ``closed_objects``), with our layout; falls back to llguidance's lenient mode (unsupported
    keywords ignored, logged) before refusing."""
    llg = _llguidance()
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
    schema = closed_objects(schema)
    for lenient in (False, True):
        options = dict(JSON_LAYOUT, lenient=True) if lenient else JSON_LAYOUT
        candidate = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
        text = json.dumps(candidate, ensure_ascii=False)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            llg.LLMatcher.grammar_from_json_schema(text))
        if not is_error:
            if lenient:
                log.warning("%s: constrained decoding ignores parts of this schema: %s", where, "; ".join(messages))
            return "%json " + text
    why = " ".join((messages[0] if messages else "?").split())      # one line (regex errors span several)
    raise GrammarError(f"{where}: constrained decoding cannot use this JSON schema: {why}")


class GrammarHook(TokenHook):
    """Masks sampled tokens to a Lark grammar (llguidance syntax) while ``gate()`` is true.

    Hooks run in list order: put this one before a hook whose ``observe`` flips the gate (the
    thinking ``Steering`` of generate/steering.py), so the token that closes the think block is not fed to it.
    """

    def __init__(self, tokenizer, vocab_size: int, lark: str, gate: Optional[Callable[[], bool]] = None):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(grammar_tokenizer(tokenizer, vocab_size), lark, log_level=1)
        if self.matcher.is_error():
            raise GrammarError(f"grammar rejected: {self.matcher.get_error()}")
        self.gate = gate
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bits = np.zeros(self.words, dtype=np.int32)

    @property
    def active(self) -> bool:
        return self.gate is None or self.gate()

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self.words * 4)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        if self.matcher.is_error():
            raise GrammarError(f"grammar matcher failed: {self.matcher.get_error()}")
        allowed = self.allowed().to(logits.device)[:logits.shape[-1]]
        return torch.where(allowed, logits, float("-inf"))

    def observe(self, token_id: int) -> None:
        if not self.active:
            return
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} violates the grammar: {self.matcher.get_error()}")


class BannedTokens(TokenHook):
    """Never sample these token ids (forced tokens are not affected)."""

    def __init__(self, token_ids: Iterable[int]):
        self.ids = sorted(set(int(t) for t in token_ids))
        self._index = None              # (device, vocabulary size, the ids within it), made once

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.ids:
            return logits
        n = logits.shape[-1]
        if self._index is None or self._index[:2] != (logits.device, n):
            self._index = (logits.device, n, torch.tensor([i for i in self.ids if i < n], dtype=torch.long,
                                                          device=logits.device))
        return logits.index_fill(0, self._index[2], float("-inf"))
