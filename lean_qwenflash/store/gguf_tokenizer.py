"""Tokenizers between GGUF metadata (``tokenizer.ggml.*``) and Hugging Face ``tokenizer.json``.

``write_tokenizer`` turns a GGUF file's byte-level BPE vocabulary (``tokenizer.ggml.model`` =
``gpt2``, what Qwen, OLMoE and most recent models use) into ``tokenizer.json`` and
``tokenizer_config.json`` (chat template, BOS/EOS), so that a GGUF-born pack chats with no other
files. It tokenizes as llama.cpp does: the pre-tokenizer regex is the one llama.cpp uses for the
file's ``tokenizer.ggml.pre``, control and user-defined tokens are matched in text, and there is
no Unicode normalisation (llama.cpp has none). Vocabularies we cannot reproduce (SentencePiece
``llama``, unknown ``pre`` types) raise :class:`TokenizerConversionError`; the packer then asks
for ``--tokenizer HF_DIR``.

``gguf_tokenizer_metadata`` is the other direction, used by the GGUF exporter for test files.
"""
from __future__ import annotations

import json
from pathlib import Path

# llama.cpp's pre-tokenizer splits, by tokenizer.ggml.pre (the patterns are the public ones the
# model families define; llama.cpp and Hugging Face use the same).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": _GPT2, "default": _GPT2, "olmo": _GPT2, "qwen2": _QWEN2, "llama-bpe": _LLAMA3}

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class TokenizerConversionError(ValueError):
    """The GGUF vocabulary cannot be turned into an equivalent tokenizer.json."""


def _pre_tokenizer(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def tokenizer_json(metadata: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) documents for a GGUF file's metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerConversionError("the GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if model != "gpt2":
        raise TokenizerConversionError(
            f"tokenizer.ggml.model {model!r} is not converted (only byte-level BPE, 'gpt2', is)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerConversionError(f"tokenizer.ggml.pre {pre!r} is not known (known: {', '.join(PRE_TOKENIZERS)})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise TokenizerConversionError("tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerConversionError(f"{len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise TokenizerConversionError("the token list has duplicates; it cannot be a BPE vocabulary")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == TOKEN_CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    post = None
    if add_bos:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(PRE_TOKENIZERS[pre]), "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(merges)},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}
    for key, tid in (("bos_token", bos), ("eos_token", eos),
                     ("pad_token", metadata.get("tokenizer.ggml.padding_token_id")),
                     ("unk_token", metadata.get("tokenizer.ggml.unknown_token_id"))):
        if tid is not None and 0 <= int(tid) < len(tokens):
            config[key] = tokens[int(tid)]
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return doc, config


def write_tokenizer(metadata: dict, out_dir) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into ``out_dir``; returns the file names."""
    import tokenizers
    doc, config = tokenizer_json(metadata)
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    try:
        tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    except Exception as e:   # the tokenizers library refuses the document: say so, leave no file
        (out / "tokenizer.json").unlink()
        raise TokenizerConversionError(f"the converted tokenizer does not load ({e})") from None
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    return ["tokenizer.json", "tokenizer_config.json"]


# -- HF -> GGUF (the exporter) --------------------------------------------------------------------

def _pre_name(doc: dict) -> str:
    pre = doc.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        for p in pre.get("pretokenizers", []):
            if p.get("type") == "Split":
                pattern = (p.get("pattern") or {}).get("Regex")
                for name, known in PRE_TOKENIZERS.items():
                    if pattern == known:
                        return name
    raise TokenizerConversionError("tokenizer.json's pre-tokenizer matches no pre-tokenizer llama.cpp knows")


def gguf_tokenizer_metadata(hf_dir) -> dict:
    """tokenizer.ggml.* values for an HF directory's byte-level BPE tokenizer.json."""
    path = Path(hf_dir)
    doc = json.loads((path / "tokenizer.json").read_text())
    model = doc.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise TokenizerConversionError("only byte-level BPE tokenizer.json files are exported")
    vocab = dict(model["vocab"])
    special = {}
    for t in doc.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        special[t["id"]] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    types = [special.get(i, TOKEN_NORMAL if tokens[i] in model["vocab"] else TOKEN_UNUSED) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = {}
    if (path / "tokenizer_config.json").is_file():
        config = json.loads((path / "tokenizer_config.json").read_text())
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(doc), "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding")):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value in vocab:
            meta[f"tokenizer.ggml.{name}_token_id"] = vocab[value]
    meta["tokenizer.ggml.add_bos_token"] = bool(config.get("add_bos_token", False))
    template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta
