"""Checkpoints: a nested dict in one ``.npz`` file, written atomically, no pickle: arrays as npz entries under
their ``/``-joined paths, the rest as one JSON document, with a sha256 digest of it all checked on load (a
damaged file is a :class:`DataError` naming it, never a traceback or silently wrong weights)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.trajectories.io import DataError, PathLike, atomic_write_bytes

FORMAT = "palaestra-checkpoint/1"
_ARRAY = "__array__"
_DIGEST = "__sha256__"


def _split(obj: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, np.ndarray):
        arrays[prefix] = obj
        return {_ARRAY: prefix}
    if isinstance(obj, dict):
        return {str(k): _split(v, f"{prefix}/{k}" if prefix else str(k), arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split(v, f"{prefix}/{i}", arrays) for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _join(obj: Any, arrays: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY}:
            return np.array(arrays[obj[_ARRAY]])
        return {k: _join(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, arrays) for v in obj]
    return obj


def _digest(meta: bytes, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\x00{name}\x00{a.dtype.str}\x00{a.shape}\x00".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_checkpoint(path: PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (a reader never sees a partial checkpoint), with its digest."""
    arrays: dict[str, np.ndarray] = {}
    tree = _split(state, "", arrays)
    meta = json.dumps({"format": FORMAT, "tree": tree}, allow_nan=True).encode("utf-8")
    digest = np.frombuffer(_digest(meta, arrays).encode("ascii"), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(meta, dtype=np.uint8), **{_DIGEST: digest}, **arrays)  # type: ignore[arg-type]
    atomic_write_bytes(path, buf.getvalue(), before_rename=_fault_delay)


def _fault_delay() -> None:
    """Fault injection for kill-and-resume tests: ``PALAESTRA_FAULT_CHECKPOINT_DELAY=<seconds>`` waits between
    the temp file and the rename, so a test can kill the process in the middle of a checkpoint write."""
    delay = os.environ.get("PALAESTRA_FAULT_CHECKPOINT_DELAY")
    if delay:
        print("palaestra: writing checkpoint", file=sys.stderr, flush=True)
        time.sleep(float(delay))


class CheckpointError(DataError):
    """A checkpoint file that is missing, damaged (truncated, empty, bit-flipped) or of an unknown format."""


def load_checkpoint(path: PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, verifying its digest (else :class:`CheckpointError`)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError("checkpoint not found", path=p)
    if p.stat().st_size == 0:
        raise CheckpointError("damaged checkpoint (empty file)", path=p)
    try:
        with np.load(p, allow_pickle=False) as data:
            raw_meta = bytes(data["__meta__"])
            meta = json.loads(raw_meta.decode("utf-8"))
            arrays = {k: data[k] for k in data.files if k not in ("__meta__", _DIGEST)}
            stored = bytes(data[_DIGEST]).decode("ascii") if _DIGEST in data.files else None
    except Exception as exc:  # BadZipFile, EOFError, zlib/struct errors, bad JSON: all mean a damaged file
        raise CheckpointError(f"damaged checkpoint ({type(exc).__name__}: {exc})", path=p) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"unknown checkpoint format {found!r} (expected {FORMAT})", path=p)
    # A checkpoint written before digests were stored has none: the zip CRC-32s checked while reading are all
    # there is to go on (it is not set aside as damaged, so older runs still resume).
    if stored is not None and _digest(raw_meta, arrays) != stored:
        raise CheckpointError("damaged checkpoint (content digest mismatch)", path=p)
    state: dict[str, Any] = _join(meta["tree"], arrays)
    return state
