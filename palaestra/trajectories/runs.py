"""Run-folder records: code version, JSON files, credential scrubbing, command lines, the ``README.md`` run note."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from palaestra.trajectories.io import DataError, PathLike, atomic_write_text

LOOPS = {
    "A": "Loop A - evaluation: fixed outputs are scored; nothing learns",
    "B": "Loop B - selection: best-of-N / pass@k over samples; the policy does not change",
    "C": "Loop C - learning: sample, score, advantage, update; the policy and so the data shift",
    "lab": "Lab - a mechanism microscope",
}

SECRET_KEY_PARTS = ("api_key", "apikey", "secret", "token", "password", "authorization")


@lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The git commit of the palaestra source tree (with ``-dirty`` when modified), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
        return run.stdout.strip() if run.returncode == 0 else ""

    try:
        rev = git("rev-parse", "HEAD")
        return (
            rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "") if rev else None
        )
    except Exception:
        return None


def code_version() -> dict[str, Any]:
    """``{"palaestra": installed version, "git": revision or None, "python": "3.x.y"}``."""
    try:
        installed = version("palaestra")
    except PackageNotFoundError:
        installed = "0+unknown"
    python = ".".join(map(str, sys.version_info[:3]))
    return {"palaestra": installed, "git": git_revision(), "python": python}


def utc_now() -> str:
    """Current UTC time, ISO 8601, seconds precision."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s\"'<>]*@")
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.\-]+)=(?P<value>[^&#\s\"'<>]*)")
_SECRET_PARAM_PARTS = (*SECRET_KEY_PARTS, "key", "auth", "pass", "pwd", "sig", "credential", "session")
_SECRETS: set[str] = set()
REDACTED = "<redacted>"


def _names_secret(key: str, parts: Sequence[str] = SECRET_KEY_PARTS) -> bool:
    """Whether a lower-case name names a secret (``*_env`` names a variable, ``*_tokens`` counts: neither is one)."""
    return any(p in key for p in parts) and not key.endswith(("_env", "_tokens"))


def _is_secret_param(name: str) -> bool:
    return _names_secret(name.lower().replace("-", "_"), _SECRET_PARAM_PARTS)


#: Keys that local servers accept and that are not secrets: never registered (they are ordinary words that
#: scrubbing would blot out of every error message).
_PLACEHOLDER_WORDS = ("empty", "none", "null", "test", "dummy", "fake", "local", "key", "token")
PLACEHOLDER_KEYS = frozenset((*_PLACEHOLDER_WORDS, "no-key", "sk-no-key", "sk-xxx"))


def register_secret(value: str | None) -> None:
    """Remember an API key in use, hidden by :func:`scrub_text` (keys under 8 characters: only by :func:`scrub_error`,
    where they stand alone); placeholders and values under 3 characters are not remembered."""
    if not value:
        return
    value = value.strip()
    if len(value) >= 3 and value.lower() not in PLACEHOLDER_KEYS:
        _SECRETS.add(value)


def scrub_text(text: str, secrets: Sequence[str | None] = (), *, short_known: bool = False) -> str:
    """``text`` with credentials hidden: URL user info, values of query parameters that name a secret,
    ``secrets``, and the keys given to :func:`register_secret` (the short ones too with ``short_known``)."""
    if not text:
        return text
    if "://" in text:
        text = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    if "=" in text:
        text = _QUERY_PARAM.sub(
            lambda m: (
                f"{m['sep']}{m['name']}={REDACTED}" if _is_secret_param(m["name"]) and m["value"] else m[0]
            ),
            text,
        )
    known = _SECRETS if short_known else (s for s in _SECRETS if len(s) >= 8)
    for secret in (*(s for s in secrets if s), *known):
        if secret in text and len(secret) >= 8:
            text = text.replace(secret, REDACTED)
        elif secret in text:  # a short value only where it stands alone
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", REDACTED, text)
    return text


def scrub_error(text: str) -> str:
    """Error text (which may quote what an endpoint echoed) with every known key hidden, however short."""
    return scrub_text(text, short_known=True)


def url_secrets(url: str | None) -> list[str]:
    """The credentials inside ``url``: its user info's password (else user name), secret query parameters."""
    if not url:
        return []
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    userinfo = parts.password or parts.username  # ``KEY@``: a token as the user name
    found = [unquote(userinfo)] if userinfo else []
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=False) if _is_secret_param(k)]
    return found


def scrub(obj: Any, *, keys: bool = False) -> Any:
    """Copy of ``obj`` with :func:`scrub_text` applied to every string; with ``keys``, also :func:`redact`."""
    if isinstance(obj, str):
        return scrub_text(obj)
    if isinstance(obj, Mapping):
        return {
            k: REDACTED
            if keys and _names_secret(str(k).lower()) and v not in (None, "")
            else scrub(v, keys=keys)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [scrub(v, keys=keys) for v in obj]
    return obj


def redact(obj: Any) -> Any:
    """:func:`scrub` that also replaces every value under a key that looks like a secret by ``"<redacted>"``."""
    return scrub(obj, keys=True)


def write_json(path: PathLike, obj: Any) -> None:
    """Write JSON atomically, sorted keys, indent 2, trailing newline; every string passes :func:`scrub_text`."""
    text = json.dumps(scrub(obj), indent=2, sort_keys=True, ensure_ascii=False, default=str)
    atomic_write_text(path, text + "\n")


def read_json(path: PathLike) -> Any:
    """Read a JSON file; errors name the file."""
    p = Path(path)
    if not p.exists():
        raise DataError("file not found", path=p)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"malformed JSON ({exc.msg})", path=p, line=exc.lineno) from None


_COMMAND_LINE: list[str] | None = None


def set_command_line(argv: Sequence[str]) -> None:
    """Record the command line being run (the CLI calls this, so manifests show it even when called in-process)."""
    global _COMMAND_LINE
    _COMMAND_LINE = list(argv)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of any flag that names a secret hidden, every other argument scrubbed."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        flag = arg.split("=", 1)[0].lower().replace("-", "_")
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif flag.startswith("__") and _names_secret(flag):
            hide_next = "=" not in arg
            out.append(arg.split("=", 1)[0] + "=<redacted>" if "=" in arg else arg)
        else:
            out.append(scrub_text(arg))
    return out


def command_line() -> list[str]:
    """The command line for manifests (what the CLI recorded, else ``sys.argv``) through :func:`redact_argv`."""
    argv = _COMMAND_LINE if _COMMAND_LINE is not None else [os.path.basename(sys.argv[0]), *sys.argv[1:]]
    return redact_argv(argv)


def args_of(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """``{name: args.<name>}``: flags passed on as keywords of the same name."""
    return {name: getattr(args, name) for name in names}


def add_options(p: argparse.ArgumentParser, *options: tuple[Any, ...]) -> None:
    """Add ``(flag, default, help[, argparse keywords])`` options; True: ``--x/--no-x``, False: a ``--x`` flag,
    any other default gives the option its type (None: text)."""
    for flag, default, help, *extra in options:
        kw: dict[str, Any] = {"default": default, "help": help, **(extra[0] if extra else {})}
        if isinstance(default, bool):
            kw.setdefault("action", argparse.BooleanOptionalAction if default else "store_true")
        elif default is not None:
            kw.setdefault("type", type(default))
        p.add_argument(flag, **kw)


def fmt(value: Any, digits: int = 4) -> str:
    """Floats to ``digits`` significant digits, dicts and lists as JSON (cut at 120 characters), else ``str``."""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True, default=str)
        return text if len(text) <= 120 else text[:117] + "..."
    return str(value)


def write_run_note(
    outdir: PathLike,
    *,
    loop: str,
    title: str,
    knob: str,
    locked_room: Mapping[str, Any],
    numbers: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> Path:
    """Write ``README.md`` in ``outdir``: loop, knob turned, locked-room evidence, numbers, notes."""
    lines = [
        f"# Run note: {title}",
        "",
        f"- **Loop:** {LOOPS.get(loop, loop)}",
        f"- **Knob turned:** {knob}",
        f"- **Written:** {utc_now()}",
        "",
        "## Locked-room evidence (quoted from manifest.json)",
        "",
        "Two runs may be compared only when all of these match (`palaestra gate` checks them).",
        "",
        "| fact | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | `{fmt(v)}` |" for k, v in locked_room.items()]
    lines += ["", "## Numbers", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in numbers.items()]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    path = Path(outdir) / "README.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
