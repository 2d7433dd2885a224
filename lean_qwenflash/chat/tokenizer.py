"""Tokenizer of an HF model directory: encode/decode, chat template, EOS ids, streaming decode.

Reads ``tokenizer.json`` (the ``tokenizers`` library does the work), ``tokenizer_config.json``
(special tokens, chat template) and, when present, ``chat_template.jinja`` and
``generation_config.json`` (extra EOS ids, as Qwen ships them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from .parse import THINK_OPEN, held_prefix
from .template import ChatTemplate, TemplateError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
LONG_TEXT_CHARS = 64 * 1024     # from here on, encode without holding the GIL (see Tokenizer.encode)


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores tokens either as strings or as serialised AddedToken dicts.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _byte_level_inverse() -> dict[str, int]:
    """Byte-level BPE's alphabet read back: each byte is written as one printable character (the
    printable Latin-1 bytes as themselves, the others as U+0100 onwards, in byte order)."""
    global _BYTE_LEVEL_INVERSE
    if _BYTE_LEVEL_INVERSE is None:
        printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
        chars = {b: chr(b) for b in printable}
        for n, b in enumerate(b for b in range(256) if b not in chars):
            chars[b] = chr(256 + n)
        _BYTE_LEVEL_INVERSE = {c: b for b, c in chars.items()}
    return _BYTE_LEVEL_INVERSE


_BYTE_LEVEL_INVERSE = None


class Tokenizer:
    """Text ↔ token ids for one model, plus its chat template and stop tokens."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()):
        self.backend = backend
        self.config = dict(config or {})
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        if chat_template is None:
            chat_template = self.config.get("chat_template")
        if isinstance(chat_template, list):
            # Some configs ship several named templates; "default" is the chat one.
            named = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None

        eos_ids: list[int] = []
        eos_id = self.token_to_id(self.special_tokens["eos_token"]) if self.special_tokens["eos_token"] else None
        for tid in ([eos_id] if eos_id is not None else []) + list(extra_eos_ids):
            if tid not in eos_ids:
                eos_ids.append(tid)
        self.eos_token_ids: list[int] = eos_ids
        pad = self.special_tokens["pad_token"]
        self.pad_token_id: int | None = self.token_to_id(pad) if pad else None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from an HF-style model directory (ours or a downloaded one)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"{tok_file} not found: the directory needs a fast-tokenizer "
                                    "tokenizer.json (re-save with a recent transformers to get one)")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        gen = _read_json(os.path.join(path, "generation_config.json"))
        extra = gen.get("eos_token_id", [])
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        return cls(backend, config, template, extra)

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (a byte-level BPE token may hold part of a UTF-8
        character, which ``decode`` cannot show); an added token's are its text's."""
        table = self.__dict__.get("_token_bytes")
        if table is None:
            table = self._token_bytes = {}
        found = table.get(token_id)
        if found is None:
            found = table[token_id] = self._bytes_of(token_id)
        return found

    def _bytes_of(self, token_id: int) -> bytes:
        added = self.backend.get_added_tokens_decoder().get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level():
            inverse = _byte_level_inverse()
            if all(ch in inverse for ch in piece):
                return bytes(inverse[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):     # byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _byte_level(self) -> bool:
        flag = self.__dict__.get("_is_byte_level")
        if flag is None:
            decoder = json.loads(self.backend.to_str()).get("decoder") or {}
            kinds = [d.get("type") for d in decoder.get("decoders", [decoder])] if isinstance(decoder, dict) else []
            flag = self._is_byte_level = "ByteLevel" in kinds
        return flag

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of added tokens flagged special (skipped by ``decode(skip_special_tokens=True)``)."""
        return {tid for tid, tok in self.backend.get_added_tokens_decoder().items() if tok.special}

    # -- text ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_end|>``) map to their
        ids. ``add_special_tokens`` adds the post-processor's BOS/EOS; rendered chat prompts carry
        their own, hence the default False.

        Long texts go through ``encode_batch``, which releases the GIL while it works (measured:
        ``encode`` of a 3.5 MB conversation held it for 1.5 s, freezing the server's event loop
        even from a worker thread); short ones through ``encode`` (no thread-pool start-up)."""
        return self._encoding(text, add_special_tokens).ids

    def _encoding(self, text: str, add_special_tokens: bool = False):
        if len(text) >= LONG_TEXT_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def encode_with_boundaries(self, text: str, prefixes: Sequence[str]) -> tuple[list[int], list[int]]:
        """(ids of ``text``, and for each of ``prefixes`` that is a prefix of ``text`` ending on a
        token boundary, how many tokens cover it), tokenizing once. A boundary is only where a
        token ends exactly at the prefix's end (e.g. after a turn's end token)."""
        enc = self._encoding(text)
        out = []
        for prefix in prefixes:
            if not prefix or not text.startswith(prefix) or len(prefix) >= len(text):
                continue
            # the token holding the first character after the prefix must start right there
            n = enc.char_to_token(len(prefix))
            if n and enc.token_to_chars(n)[0] == len(prefix) and enc.token_to_chars(n - 1)[1] == len(prefix):
                out.append(n)
        return enc.ids, out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, tokenize: bool = False,
                            **extra: Any) -> str | list[int]:
        """Render ``messages`` with the model's chat template; token ids when ``tokenize``.

        Unlike HF, ``add_generation_prompt`` defaults to True: a runtime renders prompts to
        generate from. ``enable_thinking=False`` asks templates that know the switch (ours,
        Qwen3's) to pre-fill an empty think block."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); it cannot format chat messages")
        text = self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking, **extra)
        return self.encode(text) if tokenize else text

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None,
                    thinking: bool = False) -> "ChatPrompt":
        """The prompt to generate the next assistant turn from, with its prefix-reuse checkpoints.

        With ``thinking`` the answer starts inside ``<think>`` (opened here unless the template
        did). ``checkpoints`` are token counts of turn boundaries a later prompt of the same
        conversation will likely share (see ``generate/prefix.py``): the end of the conversation so
        far, and the bare assistant header (thinking on adds no empty think block), which is where
        later turns re-render this answer from. One tokenization serves all of them.
        """
        text = self.apply_chat_template(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking)
        try:
            marks = [self.apply_chat_template(messages, tools=tools, add_generation_prompt=False),
                     text if thinking else self.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                    enable_thinking=True)]
        except TemplateError:
            # The extra renders are only an optimisation: a template refusing one costs no request.
            marks = [text] if thinking else []
        if thinking and not text.rstrip().endswith(THINK_OPEN):
            text += THINK_OPEN + "\n"
        ids, checkpoints = self.encode_with_boundaries(text, marks)
        return ChatPrompt(ids, checkpoints, thinking)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


@dataclass
class ChatPrompt:
    """A rendered, tokenized chat prompt (``Tokenizer.chat_prompt``)."""
    ids: list[int]
    checkpoints: list[int]
    in_think: bool          # the answer starts inside a think block


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces without ever emitting half a character.

    Invariant: ``"".join(push(t) for t in ids) + finish() == tokenizer.decode(ids)`` for
    byte-level BPE. A token may end inside a multi-byte UTF-8 character; its text is held back
    (decoding shows U+FFFD at the end) until a later token completes it. Only the tokens since the
    last clean boundary are re-decoded, so the cost per token stays constant.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        # _prefix: start of the window re-decoded for context; _read: end of text already emitted.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        self._ids.append(token_id)
        window = self._tok.decode(self._ids[self._prefix:], self._skip)
        if window.endswith("\ufffd"):
            return ""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        new_text = window[len(done):]
        self._prefix = self._read
        self._read = len(self._ids)
        return new_text

    def finish(self) -> str:
        """Text still held at the end of the stream (a truncated character decodes as U+FFFD)."""
        window = self._tok.decode(self._ids[self._prefix:], self._skip)
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        self._prefix = self._read = len(self._ids)
        return window[len(done):]


class StopStringMatcher:
    """Cuts streamed text at the first stop string, even when it spans several pushes.

    Text that could be the beginning of a stop string is held back until it is clear that it is
    not, so a client never sees part of a stop string.
    """

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Feed generated text; return the part safe to emit. After a match, ``stopped`` is True
        and nothing more is returned."""
        if self.stopped:
            return ""
        buf = self._held + text
        first, which = -1, None
        for s in self.stop_strings:
            i = buf.find(s)
            if i != -1 and (first == -1 or i < first):
                first, which = i, s
        if which is not None:
            self.stopped, self.matched, self._held = True, which, ""
            return buf[:first]
        keep = held_prefix(buf, self.stop_strings)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> str:
        """End of generation without a match: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
