"""Checkpoints: one ``.npz`` file per checkpoint, written atomically, no pickle.

A checkpoint is a nested dict (the trainer's, stopper's and experiment's state). Its numpy arrays are stored as
npz entries under their ``/``-joined paths; everything else is stored as one JSON document. Loading rebuilds the
same nested dict, arrays included, bit for bit.
"""

from __future__ import annotations

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


def save_checkpoint(path: PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (a reader never sees a partial checkpoint)."""
    arrays: dict[str, np.ndarray] = {}
    tree = _split(state, "", arrays)
    meta = json.dumps({"format": FORMAT, "tree": tree}, allow_nan=True)
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(meta.encode("utf-8"), dtype=np.uint8), **arrays)  # type: ignore[arg-type]
    atomic_write_bytes(path, buf.getvalue(), before_rename=_fault_delay)


def _fault_delay() -> None:
    """Fault injection for kill-and-resume tests: with ``PALAESTRA_FAULT_CHECKPOINT_DELAY=<seconds>`` set, the
    writer announces itself on stderr and waits after the temp file is written and before the rename, so a test
    can SIGKILL the process in the middle of a checkpoint write."""
    delay = os.environ.get("PALAESTRA_FAULT_CHECKPOINT_DELAY")
    if delay:
        print("palaestra: writing checkpoint", file=sys.stderr, flush=True)
        time.sleep(float(delay))


def load_checkpoint(path: PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`."""
    p = Path(path)
    if not p.exists():
        raise DataError("checkpoint not found", path=p)
    try:
        with np.load(p, allow_pickle=False) as data:
            meta = json.loads(bytes(data["__meta__"]).decode("utf-8"))
            if meta.get("format") != FORMAT:
                raise DataError(
                    f"unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})", path=p
                )
            arrays = {k: data[k] for k in data.files if k != "__meta__"}
    except (ValueError, OSError, KeyError) as exc:
        raise DataError(f"unreadable checkpoint ({exc})", path=p) from None
    state: dict[str, Any] = _join(meta["tree"], arrays)
    return state
