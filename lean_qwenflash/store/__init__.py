"""The packed expert store: format (format.py), checkpoint reading (checkpoint.py), the packer
(packer.py) and the reader (reader.py). HF key layouts live in naming.py."""
from .format import FORMAT_VERSION, StoreError
from .packer import pack
from .reader import ChecksumError, ExpertStore

__all__ = ["ExpertStore", "StoreError", "ChecksumError", "FORMAT_VERSION", "pack"]
