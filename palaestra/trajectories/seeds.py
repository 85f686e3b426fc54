"""The one way palaestra derives a seed from several values: a hash of their text, the same on any platform."""

from __future__ import annotations

import hashlib

_SEP = "\x1f"  # ASCII unit separator: ("a", "bc") and ("ab", "c") give different seeds


def derive_seed(*parts: object) -> int:
    """A non-negative 63-bit seed from ``parts`` (as ``str``): sha256's first 8 bytes, little-endian, shifted right
    by one bit to fit a signed 64-bit integer (numpy, SQLite, OpenAI)."""
    text = _SEP.join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
