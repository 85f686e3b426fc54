"""Files: atomic writes (every writer: a reader never sees a half-written file), JSONL, fingerprints, groups."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from palaestra.trajectories.types import TrajectoryGroup

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """Bad input data; the message names the file and line (or field) at fault."""

    def __init__(self, message: str, *, path: PathLike | None = None, line: int | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.line = line
        where = "" if self.path is None else f"{self.path}:{line}: " if line is not None else f"{self.path}: "
        super().__init__(where + message)


def atomic_write_bytes(
    path: PathLike, data: bytes, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename); ``before_rename``: fault injection."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write UTF-8 text atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys: the same value always gives the same string (used for hashing)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_text(text: str) -> str:
    """Hex sha256 of a UTF-8 string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: PathLike) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def iter_jsonl(path: PathLike) -> Iterable[tuple[int, Any]]:
    """Yield ``(line_number, value)`` for each non-blank line (``.gz`` decompressed); errors: :class:`DataError`."""
    p = Path(path)
    if not p.exists():
        raise DataError("file not found", path=p)
    try:
        with gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    msg = f"not valid UTF-8 (byte {exc.start + 1} of the line)"
                    raise DataError(msg, path=p, line=lineno) from None
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    msg = f"malformed JSON ({exc.msg} at column {exc.colno})"
                    raise DataError(msg, path=p, line=lineno) from None
                yield lineno, value
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged .gz
        raise DataError(f"cannot read the file ({exc})", path=p) from None


def json_object(value: Any, path: PathLike | None, line: int | None) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a DataError naming the file and line."""
    if not isinstance(value, dict):
        raise DataError(f"expected a JSON object, got {type(value).__name__}", path=path, line=line)
    return value


def read_jsonl(path: PathLike) -> list[Any]:
    """Read a JSONL file of JSON objects into a list."""
    return [json_object(value, path, lineno) for lineno, value in iter_jsonl(path)]


def dumps_jsonl(rows: Iterable[Any]) -> str:
    """Serialise rows as JSONL text (one compact JSON value per line)."""
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows)


def write_jsonl_text(path: PathLike, text: str) -> None:
    """Write JSONL text atomically; a ``.gz`` path is gzip-compressed (no timestamp: reproducible)."""
    data = text.encode("utf-8")
    atomic_write_bytes(
        path, gzip.compress(data, compresslevel=9, mtime=0) if Path(path).suffix == ".gz" else data
    )


def write_jsonl(path: PathLike, rows: Iterable[Any]) -> None:
    """Write rows as JSONL atomically (a ``.gz`` path compressed)."""
    write_jsonl_text(path, dumps_jsonl(rows))


def append_jsonl(path: PathLike, rows: Iterable[Any]) -> None:
    """Append rows to a JSONL file and fsync (for logs that grow step by step)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as fh:
        fh.write(dumps_jsonl(rows))
        fh.flush()
        os.fsync(fh.fileno())


def write_groups(path: PathLike, groups: Iterable[TrajectoryGroup]) -> None:
    """Write trajectory groups, one group per line, atomically (a ``.gz`` path compressed)."""
    write_jsonl_text(path, "".join(g.model_dump_json() + "\n" for g in groups))


def read_groups(path: PathLike) -> list[TrajectoryGroup]:
    """Read a file written by :func:`write_groups`; errors name the file, line and field."""
    groups = []
    for line, value in iter_jsonl(path):
        value = json_object(value, path, line)
        for key in ("trajectories", "exceptions"):
            if key in value and not isinstance(value[key], list):
                msg = f"invalid trajectory group at field '{key}': expected a list"
                raise DataError(f"{msg}, got {type(value[key]).__name__}", path=path, line=line)
        try:
            groups.append(TrajectoryGroup.model_validate(value))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"]) or "<root>"
            msg = f"invalid trajectory group at field '{field}': {first['msg']}"
            raise DataError(msg, path=path, line=line) from None
    return groups
