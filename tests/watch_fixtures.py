"""Helpers for the run-watching tests and the report benchmark (not a test module).

* :func:`make_train_run`: a train-run folder written with the trainer's own writers (``RunFolder``,
  ``write_json``), trajectories scored by the real strict verifier (``VerifierReward``), advantages from the
  real ``batch_advantages`` stored as ``metrics["advantage"]``.
* :func:`make_eval_run` / :func:`make_select_run`: eval and select runs through the harness API on the
  shipped frozen rollouts / selection pack when present, else on completions written here.
* :class:`Chromium`: headless Chromium driven over the DevTools protocol on a pipe
  (``--remote-debugging-pipe``: NUL-separated JSON on fds 3/4), so no websocket client is needed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import random
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs

from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.envs.verifier import VerifierReward
from palaestra.trainer.advantages import batch_advantages
from palaestra.trainer.runfolder import RunFolder
from palaestra.trajectories.runs import write_json
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

FROZEN = Path(__file__).resolve().parents[1] / "palaestra" / "evals" / "data"


def completion_for(expected: int, rng: random.Random, p_ok: float) -> str:
    """A plausible policy output: right, wrong, or one of the format breaks (hidden characters included)."""
    u = rng.random()
    if u < p_ok:
        return f"Final: {expected}"
    kind = rng.randrange(6)
    return [
        f"Final: {expected + rng.choice([-2, -1, 1, 10])}",  # wrong_answer
        f"{expected}",  # missing_prefix
        f"Final: {expected}\u200b",  # zero-width space: non_ascii
        f"The answer is\nFinal: {expected}",  # not_single_line
        f"Final: {expected} ",  # trailing space: extra_whitespace
        f"Final: {expected + 1}",
    ][kind]


def _choice(text: str, logprobs: bool) -> Choice:
    entries = [
        ChatCompletionTokenLogprob(token=ch, logprob=-0.5, bytes=list(ch.encode()), top_logprobs=[])
        for ch in text
    ]
    return Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content=text),
        logprobs=ChoiceLogprobs(content=entries) if logprobs else None,
    )


def make_train_run(
    root: Path,
    *,
    steps: int = 6,
    groups: int = 3,
    group_size: int = 4,
    val_every: int = 2,
    val_n: int = 12,
    seed: int = 0,
    logprobs: bool = True,
    tool_call_step: int | None = 1,
) -> Path:
    """Write a finished train run: reward rises with the step; stop reason ``plateau`` at the last step."""
    rng = random.Random(seed)
    folder = RunFolder(root)
    folder.create()
    train, val = load_split("train"), load_split("val")[:val_n]
    scorer = VerifierReward(StrictFinalVerifier())
    locked = {
        "environment": "arithmetic",
        "val_split": "val",
        "val_examples": val_n,
        "validation_scorer": "arith-strict@1.0.0",
        "seed": seed,
    }
    config = {
        "run": {"name": "synthetic", "seed": seed, "groups_per_step": groups, "group_size": group_size},
        "env": {"name": "arithmetic", "val_split": "val", "train_split": "train"},
        "validation": {"every": val_every, "max_examples": val_n},
    }
    write_json(root / "config.json", config)
    write_json(
        root / "manifest.json",
        {
            "kind": "train",
            "loop": "C",
            "created": "2026-01-01T00:00:00+00:00",
            "command": ["palaestra", "train", "synthetic.toml"],
            "seed": seed,
            "environment": {"name": "arithmetic"},
            "locked_room": locked,
            "config": config,
        },
    )
    best = (0, -1.0)

    def validate(step: int) -> dict[str, Any]:
        rows, codes = [], {}
        for ex in val:
            text = completion_for(int(ex["expected_answer"]), rng, min(0.15 * step, 0.9))
            score = scorer.verifier.score(ex, text)
            rows.append(
                {
                    "id": ex["id"],
                    "greedy_completion": text,
                    "greedy_outcome": score.outcome,
                    "greedy_reward": score.reward,
                    "sampled_correct": int(score.reward > 0),
                }
            )
            codes[score.outcome] = codes.get(score.outcome, 0) + 1
        folder.write_val(step, rows)
        acc = sum(r["greedy_reward"] > 0 for r in rows) / len(rows)
        return {
            "val/n": len(rows),
            "val/greedy_accuracy": acc,
            "val/sampled_accuracy": acc * 0.9,
            **{f"val/outcome/{k}": v for k, v in codes.items()},
        }

    row0 = {"step": 0, "time": 0.0, **validate(0)}
    folder.append_history(row0)
    best = (0, row0["val/greedy_accuracy"])
    for step in range(1, steps + 1):
        batch = []
        for g in range(groups):
            ex = train[(step * groups + g) % len(train)]
            trajs = []
            for _ in range(group_size):
                text = completion_for(int(ex["expected_answer"]), rng, min(0.12 * step, 0.9))
                msgs: list[Any] = [{"role": "user", "content": ex["prompt"]}]
                if tool_call_step == step and g == 0:
                    msgs += [
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": "calc", "arguments": '{"x": 1}'},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
                    ]
                msgs.append(_choice(text, logprobs))
                trajs.append(
                    Trajectory(
                        messages_and_choices=msgs, metadata={"example_id": ex["id"]}, policy_version=step - 1
                    )
                )
            group = TrajectoryGroup(trajs, metadata={"example_id": ex["id"], "group_index": g, "step": step})
            batch.append(asyncio.run(scorer.score_group(group, ex)))
        adv = batch_advantages([g.rewards() for g in batch])
        for g, a in zip(batch, adv.advantages):
            for t, v in zip(g.trajectories, a):
                t.metrics["advantage"] = float(v)
        folder.write_samples(step, batch, cap=groups * group_size)
        rewards = [r for g in batch for r in g.rewards()]
        row = {
            "step": step,
            "train/reward_mean": sum(rewards) / len(rewards),
            "train/kl": 0.001 * step,
            "train/frac_zero_std": adv.metrics.get("frac_zero_std", 0.0),
            "faults/groups_dropped": 0,
        }
        if step % val_every == 0 or step == steps:
            row.update(validate(step))
            if row["val/greedy_accuracy"] > best[1]:
                best = (step, row["val/greedy_accuracy"])
        row["time"] = float(step)
        folder.append_history(row)
    write_json(
        root / "summary.json",
        {
            "run": str(root),
            "steps": steps,
            "stop": {
                "reason": "plateau",
                "step": steps,
                "message": "no improvement for 2 validations",
                "best_step": best[0],
                "best_value": best[1],
            },
            "base_val": {"greedy_accuracy": row0["val/greedy_accuracy"], "step": 0},
            "best_val": {"greedy_accuracy": best[1], "step": best[0]},
            "metric": "val_greedy_accuracy",
        },
    )
    return root


def shipped_frozen() -> bool:
    """True when the harness data (frozen rollouts, selection pack, math_dev) ships in the package."""
    names = ("math_dev.jsonl", "frozen_rollouts_dev.jsonl", "selection_pack_dev.jsonl")
    return all((FROZEN / n).exists() for n in names)


def _synthetic_inputs(tmp: Path, n: int, samples: int, seed: int) -> tuple[Path, Path]:
    """A dev subset and ``samples`` completions per id, one of them a verifier-suspect case (``Final: 0NN``:
    the naive verifier accepts it, the strict one rejects it)."""
    rng = random.Random(seed)
    dev = load_split("dev")[:n]
    data, comp = tmp / "dev.jsonl", tmp / f"completions-{samples}.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in dev), encoding="utf-8")
    rows = [
        {"id": e["id"], "sample": k, "completion": completion_for(int(e["expected_answer"]), rng, 0.4)}
        for e in dev
        for k in range(samples)
    ]
    pos = next(i for i, e in enumerate(dev) if int(e["expected_answer"]) >= 10)
    rows[pos * samples]["completion"] = f"Final: 0{dev[pos]['expected_answer']}"
    comp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return data, comp


def make_eval_run(tmp: Path, *, frozen: bool = True, n: int = 40, seed: int = 0) -> Path:
    """An eval run via ``evaluate_completions``: on the shipped frozen rollouts (``frozen`` and present),
    else on completions written here (which include a verifier-suspect case)."""
    from palaestra.evals.evaluate import evaluate_completions

    out = tmp / ("eval-frozen" if frozen and shipped_frozen() else "eval-synthetic")
    if frozen and shipped_frozen():
        evaluate_completions(FROZEN / "math_dev.jsonl", FROZEN / "frozen_rollouts_dev.jsonl", out)
    else:
        evaluate_completions(*_synthetic_inputs(tmp, n, 1, seed), out)
    return out


def make_select_run(tmp: Path, *, n_best: int = 4, seed: int = 0) -> Path:
    """A best-of-N select run via ``select_best``: on the shipped selection pack when present."""
    from palaestra.evals.evaluate import select_best

    out = tmp / "select-run"
    if shipped_frozen():
        select_best(FROZEN / "math_dev.jsonl", FROZEN / "selection_pack_dev.jsonl", out, n=n_best)
    else:
        select_best(*_synthetic_inputs(tmp, 30, n_best, seed), out, n=n_best)
    return out


def chromium_path() -> str | None:
    """The Chromium binary (Debian ``chromium``, or ``chromium-browser``/``google-chrome``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with one page, driven over the DevTools protocol on a pipe."""

    def __init__(self, binary: str, *, width: int = 1200, height: int = 900, timeout: float = 20.0) -> None:
        self.timeout = timeout
        self._id = 0
        self._buf = b""
        self.events: list[dict[str, Any]] = []
        self._profile = tempfile.mkdtemp(prefix="palaestra-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()

        def child_fds() -> None:  # runs in the child: our pipe ends become fds 3 (commands) and 4 (replies)
            a, b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(res_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)  # dup2 makes 3 and 4 inheritable; a, b (>= 10) are closed by subprocess
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--disable-dev-shm-usage",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=child_fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._res_r], [], [], left)[0]:
                raise CDPError("timed out waiting for Chromium")
            chunk = os.read(self._res_r, 1 << 20)
            if not chunk:
                raise CDPError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)  # type: ignore[no-any-return]

    def call(
        self, method: str, params: dict[str, Any] | None = None, *, session: bool = False
    ) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})  # type: ignore[no-any-return]
            self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            ev = self._read_message(deadline)
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self.events.clear()
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """Value of a JavaScript expression in the page (exceptions raise :class:`CDPError`)."""
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        if "exceptionDetails" in res:
            raise CDPError(
                f"{expression!r}: {res['exceptionDetails'].get('text')} "
                f"{res['exceptionDetails'].get('exception', {}).get('description', '')}"
            )
        return res["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (press + release) at the centre of the element, scrolled into view first."""
        box = self.eval(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise CDPError(f"no element matches {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
                session=True,
            )

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", params, session=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(CDPError, OSError):
            self.call("Browser.close")
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        for fd in (self._cmd_w, self._res_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
