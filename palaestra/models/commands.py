"""CLI commands of the models package: ``palaestra serve`` and ``palaestra tokens``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from palaestra.models.registry import load
from palaestra.models.tokenizer import Tokenizer

_LIMIT_FLAGS = (  # flag, ServerLimits field, type, default (ServerLimits' own), help
    ("--max-body-bytes", "max_body_bytes", int, 1 << 20, "largest request body accepted (413 above)"),
    ("--body-timeout", "body_timeout_s", float, 30.0, "seconds allowed to upload a request body (408)"),
    ("--max-rows-per-request", "max_rows", int, 256, "prompts x n allowed in one request (400)"),
    ("--max-tokens-per-request", "max_request_tokens", int, 65_536, "rows x (prompt + max_tokens) (400)"),
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``serve`` and ``tokens`` subcommands."""
    p = sub.add_parser(
        "serve",
        help="serve embedded models over an OpenAI-compatible HTTP API",
        description="Serve embedded models over HTTP (/v1/chat/completions, /v1/completions, /v1/models).",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME_OR_PATH",
        help="shipped model name or .npz checkpoint (repeat to serve several; default arith-base)",
    )
    p.add_argument("--name", action="append", help="served name of each --model, in order (default: its own)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=256,
        help="rows (choices) per generation pass (smaller passes: a new request waits less behind a busy "
        "server, at about the same tokens per CPU-second)",
    )
    for flag, dest, kind, default, what in _LIMIT_FLAGS:
        p.add_argument(flag, dest=dest, type=kind, default=default, help=what)
    levels = ["critical", "error", "warning", "info", "debug"]
    p.add_argument("--log-level", default="warning", choices=levels)
    p.set_defaults(func=serve_command)

    t = sub.add_parser(
        "tokens",
        help="show how a text is tokenized (and, with --model, each token's logprob)",
        description=(
            "Print the token split and ids of TEXT. With --model, also print each token's logprob under "
            "the model, conditional on the tokens before it. The text is scored as the start of an assistant "
            "reply: the first token is conditional on the chat prompt (the --prompt user message, if given, "
            "then the <|assistant|> role token): the figures are what the policy assigns to writing TEXT."
        ),
    )
    t.add_argument("text", help="text to tokenize")
    t.add_argument("--model", help="shipped model name or .npz checkpoint to score the tokens")
    t.add_argument("--prompt", help="user message the text answers (chat template; needs --model)")
    t.add_argument("--end", action="store_true", help="append the <|end|> token (score ending the turn)")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.set_defaults(func=tokens_command)


def _error(command: str, message: object) -> int:
    print(f"palaestra {command}: error: {message}", file=sys.stderr)
    return 2


def serve_command(args: argparse.Namespace) -> int:
    """``palaestra serve``: load the models and run uvicorn on the same app as the in-process client."""
    import socket

    import uvicorn

    from palaestra.models.server import ServerLimits, create_app

    specs = args.model or ["arith-base"]
    names = args.name or []
    models = {}
    try:  # the limits are checked before any model is loaded
        limits = ServerLimits(**{dest: getattr(args, dest) for _, dest, *_ in _LIMIT_FLAGS})
        if len(names) > len(specs):
            raise ValueError("more --name than --model")
        for i, spec in enumerate(specs):
            m = load(spec, name=names[i] if i < len(names) else None, max_batch_rows=args.max_batch_rows)
            if m.name in models:
                raise ValueError(f"two models are named {m.name!r}; use --name")
            models[m.name] = m
    except (KeyError, ValueError, FileNotFoundError) as exc:
        return _error("serve", exc)
    app = create_app(models, limits=limits)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET  # create_server: SO_REUSEADDR too
    try:  # bind before announcing the URL: a busy port is one line and exit code 2, never a URL then a crash
        # "::" takes IPv4 too, as uvicorn's own bind does
        dual = family == socket.AF_INET6 and socket.has_dualstack_ipv6()
        sock = socket.create_server((args.host, args.port), family=family, backlog=2048, dualstack_ipv6=dual)
        sock.set_inheritable(True)
    except OSError as exc:
        why = f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        return _error("serve", f"{why} (is another server running there? pick another --port)")
    port = sock.getsockname()[1]
    served = ", ".join(f"{k} (step {m.step})" for k, m in models.items())
    host = f"[{args.host}]" if family == socket.AF_INET6 else args.host  # an IPv6 address in a URL: [::1]
    print(f"palaestra serve: {served} at http://{host}:{port}/v1", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False)).run(sockets=[sock])
    return 0


def token_rows(
    text: str, model: Any = None, *, prompt: str | None = None, end: bool = False
) -> list[dict[str, Any]]:
    """One row per token of ``text``: index, id, token string and, with a model, logprob and probability (of
    the text as the start of an assistant reply)."""
    tok: Tokenizer = model.tokenizer if model is not None else Tokenizer.default()
    ids = tok.encode(text)
    if end:
        ids.append(tok.end_id)
    rows: list[dict[str, Any]] = [{"index": i, "id": t, "token": tok.token_str(t)} for i, t in enumerate(ids)]
    if model is None or not ids:
        return rows
    messages = [{"role": "user", "content": prompt}] if prompt is not None else []
    context = tok.render(messages, add_generation_prompt=True).ids
    full = context + ids
    limit = model.gpt.config.block_size + 1
    if len(full) > limit:
        raise ValueError(f"prompt and text are {len(full)} tokens; the model scores at most {limit}")
    with model.lock:
        logp = model.gpt.logprobs_of(np.asarray([full]))[0]
    for row, lp in zip(rows, logp[len(context) - 1 :]):
        row.update(logprob=float(lp), prob=math.exp(float(lp)))
    return rows


def tokens_command(args: argparse.Namespace) -> int:
    """``palaestra tokens``: print the token split, ids and (with --model) logprobs."""
    try:
        if args.prompt is not None and args.model is None:
            raise ValueError("--prompt needs --model")
        model = load(args.model) if args.model is not None else None
        rows = token_rows(args.text, model, prompt=args.prompt, end=args.end)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        return _error("tokens", exc)
    if args.json:
        out = {"text": args.text, "model": getattr(model, "name", None), "tokens": rows}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(rows)} tokens: " + " | ".join(repr(r["token"])[1:-1] for r in rows))
    print(f"{'#':>3}  {'id':>4}  {'token':<24}" + (f"  {'logprob':>9}  {'prob':>7}" if model else ""))
    for r in rows:
        scores = f"  {r['logprob']:>9.4f}  {r['prob']:>7.4f}" if "logprob" in r else ""
        print(f"{r['index']:>3}  {r['id']:>4}  {r['token']!r:<24}{scores}")
    if model is not None:
        total = sum(r.get("logprob", 0.0) for r in rows)
        context = ("user prompt + " if args.prompt is not None else "") + "<|assistant|>"
        print(f"total logprob {total:.4f} under {model.name} (step {model.step}); context: {context}")
    return 0
