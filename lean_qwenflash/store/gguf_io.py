"""The GGUF files themselves: which files make one model (a file, split shards, a directory), a
reader that checks every tensor's type and extent before anything is used, and metadata values.
:mod:`.gguf_file` reads a model from them in Hugging Face terms."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError

GGUF_MAGIC = b"GGUF"
_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be used; the message names the file and the tensor or key."""


def is_gguf(path) -> bool:
    """True for a .gguf file or a directory holding .gguf files (and no config.json)."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC or p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def gguf_shards(path) -> list[Path]:
    """The files of one GGUF model: ``path`` itself, all shards of a ``-0000i-of-0000N.gguf`` split
    (given any shard), or the shards in a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if not files:
            raise GGUFError(f"{p} holds no .gguf files")
        stems = {m.group("stem") if (m := _SHARD_RE.match(f.name)) else f.name for f in files}
        if len(stems) > 1:
            raise GGUFError(f"{p} holds several GGUF models ({', '.join(sorted(stems))}); pass one file")
        p = files[0]
    if not p.is_file():
        raise GGUFError(f"{p} does not exist")
    m = _SHARD_RE.match(p.name)
    if not m:
        return [p]
    n = int(m.group("n"))
    shards = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise GGUFError(f"{p.name} is shard {int(m.group('i'))} of {n}, but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing from {p.parent}")
    return shards


def _reader_class():
    import gguf

    class CheckedReader(gguf.GGUFReader):
        """GGUFReader that names the tensor when its type is unknown or its data runs past the file's end."""

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            known = {t.value for t in gguf.GGMLQuantizationType}
            for fld in fields:
                _, name_data, _, dims, raw_dtype, offset = fld.parts
                name = bytes(name_data).decode("utf-8", "replace")
                kind = int(raw_dtype[0])
                if kind not in known:
                    raise GGUFError(f"tensor {name!r} has GGML type {kind}, which the gguf package "
                                    f"{gguf.__version__ if hasattr(gguf, '__version__') else ''} does not know "
                                    "(a newer llama.cpp format?); upgrade gguf or use another file")
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                nbytes = int(np.prod(dims)) * type_size // block
                end = int(start_offs + offset[0]) + nbytes
                if end > size:
                    raise GGUFError(f"the file is truncated: tensor {name!r} needs bytes up to {end:,} "
                                    f"but the file has {size:,}; download it again")
            super()._build_tensors(start_offs, fields)
    return CheckedReader


def open_gguf(path: Path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        return _reader_class()(str(path))
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:   # the reader indexes past the end of a cut header, or finds garbage
        raise GGUFError(f"{path}: cannot read the GGUF header ({type(e).__name__}: {e}); the file is "
                        "truncated or corrupt") from None


def field_value(fld):
    import gguf
    types = fld.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8", "surrogateescape") for i in fld.data]
        return [fld.parts[i].tolist()[0] for i in fld.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(fld.parts[fld.data[0]]).decode("utf-8", "surrogateescape")
    return fld.parts[fld.data[0]].tolist()[0]
