"""Prefix snapshots on disk: the tier under ``PrefixCache``'s RAM, bounded in bytes, LRU.

One file per snapshot, named by a hash of (fingerprint, tokens), written as ``NAME.tmp`` then
renamed, so a reader never sees half a file:

    b"LQFSNAP1"  u64 header length  header (JSON)  tokens (int32 LE)  payload (tensors, 64-aligned)

The header holds the fingerprint (the pack and the config fields that change numerics: a
snapshot is only valid for the model and arithmetic that made it), the state's layout
(``state.state_parts``), each tensor's dtype, shape, device and offset, and CRC-32s of the tokens
and of the payload. At start the directory is scanned (headers and tokens only): files of another
fingerprint or version, unreadable ones and leftover ``.tmp`` files are logged and deleted; the
rest are indexed, least recently used first (by mtime, which every use refreshes). A restore reads
the whole file and checks the payload's CRC; a file that fails is logged and deleted, and the
lookup goes on as if it had not been there.

Not thread-safe, like ``PrefixCache``: the thread that owns the cache owns the directory.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Iterator, Optional

import torch

from lean_qwenflash.generate.state import ModelState, state_from_parts, state_parts

log = logging.getLogger("lean_qwenflash.snapshots")

MAGIC = b"LQFSNAP1"
VERSION = 1
SUFFIX = ".snap"
_ALIGN = 64
_PREFIX = struct.Struct("<8sQ")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _tensor_bytes(t: torch.Tensor):
    """The bytes of ``t`` (on the CPU, contiguous) as a buffer for write() and crc32()."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class SnapshotError(ValueError):
    """A snapshot file is not usable (wrong magic, version or fingerprint, truncated, bad CRC)."""


class SnapshotDir:
    """Snapshot files under ``path``, at most ``capacity_bytes`` of them, valid for ``fingerprint``."""

    def __init__(self, path, capacity_bytes: int, fingerprint: str):
        if capacity_bytes < 0:
            raise ValueError(f"snapshot directory capacity {capacity_bytes} must be >= 0")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.fingerprint = str(fingerprint)
        self.path.mkdir(parents=True, exist_ok=True)
        # tokens -> (file name, size), least recently used first
        self._index: collections.OrderedDict[tuple, tuple[str, int]] = collections.OrderedDict()
        self.used_bytes = 0
        self.writes = self.restores = self.evictions = self.dropped = 0
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: tuple) -> bool:
        return key in self._index

    def keys(self) -> Iterator[tuple]:
        return iter(self._index)

    def name_for(self, key: tuple) -> str:
        h = hashlib.sha256(self.fingerprint.encode())
        h.update(struct.pack(f"<{len(key)}i", *key))
        return h.hexdigest()[:40] + SUFFIX

    # -- start: what is already there ------------------------------------------------------------

    def _drop(self, file: Path, why: str) -> None:
        log.warning("snapshot %s: %s; deleted", file, why)
        self.dropped += 1
        try:
            file.unlink()
        except FileNotFoundError:
            pass

    def _scan(self) -> None:
        found = []
        for file in self.path.iterdir():
            if file.name.endswith(".tmp"):
                self._drop(file, "an unfinished write (.tmp)")
                continue
            if not file.name.endswith(SUFFIX) or not file.is_file():
                continue
            try:
                with open(file, "rb") as f:
                    header, tokens = self._read_head(f, file.stat().st_size)
                if file.name != self.name_for(tokens):
                    raise SnapshotError("its name does not match its tokens")
            except (OSError, SnapshotError, ValueError, KeyError, TypeError) as e:
                self._drop(file, str(e))
                continue
            st = file.stat()
            found.append((st.st_mtime_ns, file.name, tokens, st.st_size))
        for _, name, tokens, size in sorted(found):
            self._index[tokens] = (name, size)
            self.used_bytes += size
        self._evict(0)
        if self._index:
            log.info("snapshots: %d reused from %s (%d bytes)", len(self._index), self.path, self.used_bytes)

    def _read_head(self, f, size: int) -> tuple[dict, tuple]:
        """(header, tokens) of an open snapshot file; SnapshotError if it is not one of ours for
        this fingerprint."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise SnapshotError("truncated (no header)")
        magic, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SnapshotError(f"not a snapshot file (magic {magic!r})")
        if header_len > size:
            raise SnapshotError("truncated (header longer than the file)")
        header = json.loads(f.read(header_len))
        if header.get("version") != VERSION:
            raise SnapshotError(f"format version {header.get('version')!r}, this build reads {VERSION}")
        if header.get("fingerprint") != self.fingerprint:
            raise SnapshotError("stale: made for another pack or config (fingerprint differs)")
        n = int(header["num_tokens"])
        raw = f.read(4 * n)
        if len(raw) != 4 * n or zlib.crc32(raw) != header["tokens_crc32"]:
            raise SnapshotError("its token list is truncated or corrupt (CRC mismatch)")
        if _PREFIX.size + header_len + 4 * n + header["payload_bytes"] != size:
            raise SnapshotError(f"{size} bytes, the header says "
                                f"{_PREFIX.size + header_len + 4 * n + header['payload_bytes']}")
        return header, tuple(struct.unpack(f"<{n}i", raw))

    # -- write -----------------------------------------------------------------------------------

    def _evict(self, room: int) -> None:
        while self._index and self.used_bytes + room > self.capacity_bytes:
            key, (name, size) = self._index.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
            try:
                (self.path / name).unlink()
            except FileNotFoundError:
                pass

    def write(self, state: ModelState) -> bool:
        """Store ``state`` (its tokens are the key); False when it cannot fit the budget at all.
        An existing file for the same tokens is only marked used."""
        key = tuple(state.tokens)
        if key in self._index:
            self.touch(key)
            return True
        try:
            layers, tensors = state_parts(state)
        except ValueError as e:             # a kind of state this format cannot hold: RAM only
            log.warning("snapshot of %d tokens not written to %s: %s", len(key), self.path, e)
            return False
        buffers = [_tensor_bytes(t) for t in tensors]
        entries, offset, crc = [], 0, 0
        for t, buf in zip(tensors, buffers):
            pad = -offset % _ALIGN
            crc = zlib.crc32(bytes(pad), crc)
            offset += pad
            entries.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "device": str(t.device), "offset": offset, "nbytes": buf.nbytes})
            crc = zlib.crc32(buf, crc)
            offset += buf.nbytes
        token_bytes = struct.pack(f"<{len(key)}i", *key)
        header = json.dumps({"version": VERSION, "fingerprint": self.fingerprint, "num_tokens": len(key),
                             "state_tokens": state.num_tokens, "layers": layers, "tensors": entries,
                             "tokens_crc32": zlib.crc32(token_bytes), "payload_bytes": offset,
                             "payload_crc32": crc}).encode()
        size = _PREFIX.size + len(header) + len(token_bytes) + offset
        if size > self.capacity_bytes:
            return False
        self._evict(size)
        name = self.name_for(key)
        tmp = self.path / (name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, len(header)))
                f.write(header)
                f.write(token_bytes)
                written = 0
                for entry, buf in zip(entries, buffers):
                    f.write(bytes(entry["offset"] - written))
                    f.write(buf)
                    written = entry["offset"] + buf.nbytes
            os.replace(tmp, self.path / name)
        except OSError as e:
            log.warning("snapshot %s: could not write it (%s); continuing without it", self.path / name, e)
            tmp.unlink(missing_ok=True)
            return False
        self._index[key] = (name, size)
        self.used_bytes += size
        self.writes += 1
        return True

    def touch(self, key: tuple) -> None:
        self._index.move_to_end(key)
        try:
            os.utime(self.path / self._index[key][0])
        except OSError:
            pass

    # -- restore ---------------------------------------------------------------------------------

    def read(self, key: tuple) -> Optional[ModelState]:
        """The state stored for ``key`` (tensors on the devices they were on), or None when its file
        is missing or fails its checks (the file is then deleted and forgotten)."""
        name, size = self._index[key]
        file = self.path / name
        try:
            with open(file, "rb") as f:
                header, tokens = self._read_head(f, os.fstat(f.fileno()).st_size)
                if tokens != key:
                    raise SnapshotError("it holds other tokens than its name says")
                payload = bytearray(header["payload_bytes"])
                if f.readinto(payload) != len(payload):
                    raise SnapshotError("truncated payload")
            if zlib.crc32(payload) != header["payload_crc32"]:
                raise SnapshotError("corrupt payload (CRC mismatch)")
            tensors = []
            for entry in header["tensors"]:
                dtype, shape = _dtype(entry["dtype"]), tuple(entry["shape"])
                if entry["nbytes"]:
                    raw = torch.frombuffer(payload, dtype=torch.uint8, count=entry["nbytes"], offset=entry["offset"])
                    t = raw.view(dtype).reshape(shape).clone()
                else:
                    t = torch.empty(shape, dtype=dtype)
                tensors.append(t.to(entry["device"]))
            state = state_from_parts(header["layers"], tensors, header["state_tokens"], list(tokens))
        except (OSError, SnapshotError, ValueError, KeyError, TypeError, RuntimeError) as e:
            self._index.pop(key, None)
            self.used_bytes -= size
            self._drop(file, str(e))
            return None
        self.touch(key)
        self.restores += 1
        return state
