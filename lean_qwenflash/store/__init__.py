"""The packed expert store: format (format.py), checkpoint reading (checkpoint.py), the packer
(packer.py) and the reader (reader.py). HF key layouts live in naming.py.

Importing the package loads none of them: the names below are looked up on first use, so a module
that needs only ``store.format`` does not pay for the packer, the readers and torch's I/O.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"ExpertStore": "reader", "ChecksumError": "reader", "StoreError": "format",
            "FORMAT_VERSION": "format", "pack": "packer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
