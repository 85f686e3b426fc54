"""Any palaestra run folder (train, eval, select, lab) as one view: manifest, curves (plain data, drawn by the
report), rollouts (with each sampled token's logprob and entropy), counts; rollout files are read when asked
for (docs/harness.md)."""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice

from palaestra.envs.registry import get_env
from palaestra.evals.manifest import locked_room
from palaestra.evals.taxonomy import category_of
from palaestra.trajectories.io import DataError, PathLike, iter_jsonl, json_object, read_groups, sha256_file
from palaestra.trajectories.runs import read_json
from palaestra.trajectories.types import Trajectory, field_of

Key = tuple[int | None, str]  # (step, source) of a rollout file
SOURCES = ("train", "val", "eval", "select", "lab")  # in display order


@dataclass
class Rollout:
    """One rollout in the uniform view (a sampled trajectory, a validation row or an eval result row); ``note``
    says what is missing or why (a truncated completion preview, the verifier's reason)."""

    uid: str
    step: int | None
    source: str
    example_id: str | None
    reward: float
    outcome: str | None
    category: str | None = None  # default: the table category of ``outcome``
    advantage: float | None = None
    group: int | None = None
    index: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    logs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.outcome is not None:
            self.outcome = str(self.outcome)
            self.category = self.category or category_of(self.outcome)

    def _last(self, role: str) -> str:
        return next(
            (str(m.get("content") or "") for m in reversed(self.messages) if m.get("role") == role), ""
        )

    @property
    def completion(self) -> str:
        """Content of the last assistant message ("" when there is none)."""
        return self._last("assistant")

    @property
    def prompt(self) -> str:
        """Content of the last user message ("" when there is none)."""
        return self._last("user")

    @property
    def key(self) -> str:
        """What identifies the prompt across steps: ``id:<example id>`` or ``prompt:<text>``."""
        return f"id:{self.example_id}" if self.example_id is not None else f"prompt:{self.prompt}"

    @property
    def correct(self) -> bool:
        return self.reward > 0.0


def _entropy_from_top(top: Sequence[Any] | None) -> float | None:
    """Entropy (nats) from one position's top logprobs, the rest of the mass as one more outcome: a lower bound,
    exact when the alternatives cover the distribution; None without any."""
    lps = [field_of(alt, "logprob") for alt in top or []]
    ps = [math.exp(min(float(lp), 0.0)) for lp in lps if isinstance(lp, (int, float)) and math.isfinite(lp)]
    if not ps:
        return None
    h = -sum(p * math.log(p) for p in ps if p > 0.0)
    rest = 1.0 - sum(ps)
    if rest > 1e-12:
        h -= rest * math.log(rest)
    return max(h, 0.0)


def token_info(choice: Choice) -> list[dict[str, Any]]:
    """``[{"t": text, "lp": logprob, "h": entropy}]`` per sampled token of a Choice (the server's entropy, else
    :func:`_entropy_from_top`)."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    out: list[dict[str, Any]] = []
    for entry in content or []:
        lp = float(entry.logprob) if isinstance(entry.logprob, (int, float)) else None
        h = (entry.model_extra or {}).get("entropy")
        if not isinstance(h, (int, float)) or isinstance(h, bool):
            h = _entropy_from_top(entry.top_logprobs)
        out.append({"t": entry.token, "lp": lp, "h": None if h is None else float(h)})
    return out


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    out: dict[str, Any] = {
        "role": str(m.get("role", "?")),
        "content": "" if content is None else str(content),
    }
    fns = [tc.get("function", tc) if isinstance(tc, Mapping) else {} for tc in m.get("tool_calls") or []]
    if fns:
        out["tool_calls"] = [
            {"name": str(f.get("name", "?")), "arguments": str(f.get("arguments", ""))} for f in fns
        ]
    out.update({k: str(m[k]) for k in ("tool_call_id", "name") if m.get(k) is not None})
    return out


def _messages(t: Trajectory) -> list[dict[str, Any]]:
    """A trajectory's messages; sampled turns with ``tokens``, ``turn`` and ``turn_reward``, tool results with
    ``tool_name``."""
    rewards = t.turn_rewards or []
    names: dict[str, str] = {}
    out = []
    turn = 0
    for m, x in zip(t.messages(), t.messages_and_choices):
        msg = _message(m)
        if isinstance(x, Choice):
            msg |= {"tokens": token_info(x), "turn": turn}
            if turn < len(rewards):
                msg["turn_reward"] = float(rewards[turn])
            turn += 1
        for call in m.get("tool_calls") or []:
            if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
                names[str(call.get("id"))] = str(call["function"].get("name"))
        if msg["role"] == "tool" and msg.get("tool_call_id") in names:
            msg["tool_name"] = names[msg["tool_call_id"]]
        out.append(msg)
    return out


def train_rollouts(path: Path, step: int | None) -> Iterator[Rollout]:
    """The sampled trajectories of a ``samples/step_N.jsonl`` file."""
    for g_i, group in enumerate(read_groups(path)):
        gmeta = group.metadata
        g_idx = gmeta.get("group_index")
        g_num = g_idx if isinstance(g_idx, int) and not isinstance(g_idx, bool) else g_i
        for t_i, t in enumerate(group.trajectories):
            meta = dict(t.metadata)
            outcome: Any = meta.pop("outcome", None)
            ex_id = meta.pop("example_id", None) or gmeta.get("example_id") or gmeta.get("id")
            choices = t.choices()
            extra: dict[str, Any] = {}
            if choices and choices[-1].finish_reason:
                extra["finish_reason"] = choices[-1].finish_reason
            if t.policy_version is not None:
                extra["policy_version"] = t.policy_version
            extra |= {k: v for k, v in t.metrics.items() if k != "advantage" and not k.startswith("outcome/")}
            extra |= {k: v for k, v in meta.items() if k != "score_details"}
            yield Rollout(
                uid=f"s{step}/g{g_num}/{t_i}",
                step=step,
                source="train",
                example_id=None if ex_id is None else str(ex_id),
                reward=float(t.reward),
                outcome=outcome,
                advantage=num(t.metrics.get("advantage")),
                messages=_messages(t),
                group=g_num,
                index=t_i,
                extra=extra,
                logs=list(t.logs),
                note=_details_note(meta.get("score_details")),
            )


def _details_note(details: Any) -> str | None:
    if not details:
        return None
    try:
        d = json.loads(str(details))
    except ValueError:
        d = None
    if not isinstance(d, dict):
        return f"verifier details: {details}"
    rest = ", ".join(f"{k} {json.dumps(v)}" for k, v in d.items() if k != "reason")
    return (f"why: {d['reason']}" if d.get("reason") else "verifier details") + (f" ({rest})" if rest else "")


def _first(row: Mapping[str, Any], *names: str) -> Any:
    return next((row[n] for n in names if n in row), None)


def _exchange(prompts: Mapping[str, str], ex_id: str | None, completion: str) -> list[dict[str, Any]]:
    msgs = [{"role": "user", "content": prompts[ex_id]}] if ex_id is not None and ex_id in prompts else []
    return [*msgs, {"role": "assistant", "content": completion}]


_VAL_KEYS = ("id", "reward", "greedy_reward", "outcome", "greedy_outcome", "completion", "greedy_completion")
_RESULT_EXTRAS = ("suspect", "table_category", "selector_reward", "n_correct", "n_samples", "sum_logprob")


def val_rollouts(path: Path, step: int | None, prompts: Mapping[str, str]) -> Iterator[Rollout]:
    """The greedy validation rows of a ``val/step_N.jsonl`` file."""
    for line, row in iter_jsonl(path):
        reward = num(_first(row, "reward", "greedy_reward"))
        if not isinstance(row, dict) or reward is None:
            raise DataError(
                "validation row lacks a numeric 'reward' (or 'greedy_reward')", path=path, line=line
            )
        ex_id = None if row.get("id") is None else str(row["id"])
        completion = _first(row, "completion", "greedy_completion")
        msgs = _exchange(prompts, ex_id, "" if completion is None else str(completion))
        yield Rollout(
            uid=f"v{step}/{line}",
            step=step,
            source="val",
            example_id=ex_id,
            reward=reward,
            outcome=_first(row, "outcome", "greedy_outcome"),
            messages=msgs,
            extra={k: v for k, v in row.items() if k not in _VAL_KEYS},
            note=None if len(msgs) == 2 else "prompt not found (not stored in val rows)",
        )


def result_rollouts(path: Path, source: str, prompts: Mapping[str, str]) -> Iterator[Rollout]:
    """The rows of an eval or select ``results.jsonl``."""
    for line, row in iter_jsonl(path):
        row = json_object(row, path, line)
        for key in ("id", "reward", "outcome"):
            if key not in row:
                raise DataError(f"result row lacks field {key!r}", path=path, line=line)
        ex_id, category = str(row["id"]), row.get("category")
        text = str(_first(row, "completion", "completion_preview") or "")
        notes = []
        full = row.get("completion_chars")
        if isinstance(full, int) and full > len(text):
            notes.append(f"completion preview: first {len(text)} of {full} characters")
        details = row.get("details")
        if isinstance(details, Mapping) and details.get("reason"):
            notes.append(f"why: {details['reason']}")
        extra = {k: row[k] for k in _RESULT_EXTRAS if row.get(k) is not None}
        cc = row.get("cross_check")
        if isinstance(cc, Mapping):
            extra["cross_check"] = f"strict {cc.get('strict')}, lenient {cc.get('lenient')}"
        sample = _first(row, "chosen_sample", "sample")
        yield Rollout(
            uid=f"r{line}",
            step=None,
            source=source,
            example_id=ex_id,
            reward=float(row["reward"]),
            outcome=row["outcome"],
            category=category if isinstance(category, str) else None,
            messages=_exchange(prompts, ex_id, text),
            index=sample if isinstance(sample, int) else None,
            extra=extra,
            note="; ".join(notes) or None,
        )


def lab_rollouts(path: Path) -> Iterator[Rollout]:
    """The rows of a lab's JSONL artifact that carry a numeric ``reward``."""
    for line, row in iter_jsonl(path):
        if not isinstance(row, dict) or num(row.get("reward")) is None:
            continue
        step = row.get("step")
        yield Rollout(
            uid=f"l{path.stem}/{line}",
            step=step if isinstance(step, int) else None,
            source="lab",
            example_id=None,
            reward=float(row["reward"]),
            outcome=row.get("outcome"),
            advantage=num(row.get("advantage")),
            extra={k: v for k, v in row.items() if k not in ("step", "reward", "advantage", "outcome")},
        )


PALETTE = ("#d9730d", "#2f6fdd", "#2e9e5b", "#c23b3b", "#8a55c9", "#6b7280", "#b8860b", "#0f9bb5")


@dataclass
class Series:
    """One named line: points ``(x, y)``; ``dots`` draws a marker at each point; ``dashed`` a dashed line."""

    name: str
    points: list[tuple[float, float]]
    color: str
    dots: bool = False
    dashed: bool = False


@dataclass
class Marker:
    """A vertical line at step ``x`` with a label (``kind``: ``"stop"`` or ``"best"``)."""

    x: float
    label: str
    kind: str = "stop"


@dataclass
class Chart:
    """A chart: title, y label, series, markers; ``y_range`` fixes the y axis (else it fits the data)."""

    key: str
    title: str
    y_label: str
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)
    y_range: tuple[float, float] | None = None


def num(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    pts = [(row.get("step"), num(row.get(key))) for row in history]
    return [(float(x), y) for x, y in pts if isinstance(x, int) and y is not None]


def charts_for_history(history: Sequence[Mapping[str, Any]], stop: Mapping[str, Any] | None) -> list[Chart]:
    """The train-run charts (only those with data)."""
    reward = [
        Series("train reward (mean)", _series(history, "train/reward_mean"), PALETTE[0]),
        Series("val accuracy (greedy)", _series(history, "val/greedy_accuracy"), PALETTE[1], dots=True),
        Series(
            "val pass@1 (T=1)", _series(history, "val/sampled_accuracy"), PALETTE[2], dots=True, dashed=True
        ),
    ]
    reward = [s for s in reward if s.points]
    ys = [y for s in reward for _, y in s.points]
    fit = None if ys and (min(ys) < 0.0 or max(ys) > 1.0) else (0.0, 1.0)
    kl = Series("KL", _series(history, "train/kl"), PALETTE[3])
    zero = Series("groups with equal rewards", _series(history, "train/frac_zero_std"), PALETTE[5])
    marks = []
    if stop and isinstance(stop.get("step"), int):
        marks.append(Marker(float(stop["step"]), f"stop: {stop.get('reason')}", "stop"))
    if stop and isinstance(stop.get("best_step"), int):
        best = num(stop.get("best_value"))
        marks.append(Marker(float(stop["best_step"]), "best" if best is None else f"best {best:.3g}", "best"))
    no_spread = "Groups with no reward spread (no learning signal)"
    charts = [
        Chart("reward", "Train reward and validation accuracy", "reward / accuracy", reward, marks, fit),
        Chart("kl", "KL to the reference policy", "KL (k3)", [kl], marks),
        Chart("signal", no_spread, "fraction", [zero], marks, (0.0, 1.0)),
    ]
    return [c for c in charts if any(s.points for s in c.series)]


def charts_for_lab(tables: Mapping[str, Sequence[Mapping[str, str]]]) -> list[Chart]:
    """For each CSV with a ``step`` column, one chart per numeric column (split by any text column's values),
    at most 12 in all."""
    charts: list[Chart] = []
    for name, rows in tables.items():
        if not rows or "step" not in rows[0]:
            continue
        cols = [c for c in rows[0] if c != "step"]
        numeric = [
            c
            for c in cols
            if all(_to_float(r.get(c)) is not None or r.get(c) in ("", None) for r in rows)
            and any(_to_float(r.get(c)) is not None for r in rows)
        ]
        group_cols = [c for c in cols if c not in numeric]
        for col in numeric:
            by_group: dict[str, list[tuple[float, float]]] = {}
            for r in rows:
                x, y = _to_float(r.get("step")), _to_float(r.get(col))
                if x is not None and y is not None:
                    tag = ", ".join(f"{g}={r.get(g)}" for g in group_cols)
                    by_group.setdefault(tag, []).append((x, y))
            series = [
                Series(tag or col, pts, PALETTE[i % len(PALETTE)], dashed=i >= len(PALETTE))
                for i, (tag, pts) in enumerate(by_group.items())
            ]
            if series and len(charts) < 12:
                charts.append(Chart(f"lab-{name}-{col}", f"{name}: {col}", col, series))
    return charts


def _to_float(v: Any) -> float | None:
    try:
        return num(float(v))
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class StepCounts:
    """Outcome and category counts of one step and source (``complete``: over every rollout, not a sample)."""

    step: int | None
    source: str
    n: int
    outcomes: dict[str, int]
    categories: dict[str, int]
    reward_mean: float | None
    complete: bool

    @classmethod
    def of(
        cls, step: int | None, src: str, codes: dict[str, int], mean: float | None, complete: bool
    ) -> StepCounts:
        cats: Counter[str] = Counter()
        for code, n in codes.items():
            cats["-" if code == "-" else category_of(code)] += n
        return cls(step, src, sum(codes.values()), dict(sorted(codes.items())), dict(cats), mean, complete)


@dataclass
class RunView:
    """A run folder read into one shape, whatever wrote it."""

    root: Path
    kind: str
    manifest: dict[str, Any]
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)
    files: dict[Key, Path] = field(default_factory=dict)
    _cache: dict[Key, list[Rollout]] = field(default_factory=dict, init=False, repr=False)

    @property
    def title(self) -> str:
        run = self.config.get("run")
        return f"{self.kind} run {(run.get('name') if isinstance(run, dict) else None) or self.root.name}"

    @property
    def stop(self) -> dict[str, Any] | None:
        """``summary["stop"]`` of a finished train run (reason, step, message, best_step), else None."""
        stop = self.summary.get("stop")
        return stop if isinstance(stop, dict) else None

    def locked_room(self) -> dict[str, Any]:
        """The facts two runs must share to be compared, as the run's manifest records them."""
        m = self.manifest
        if self.kind == "train":
            return dict(m.get("locked_room") or {})
        if self.kind == "lab":
            knobs = m.get("knobs") or {}
            return {"lab": m.get("lab"), "seed": m.get("seed"), **knobs, "code": m.get("code")}
        return {**locked_room(m), "code": m.get("code")}

    def sources(self) -> list[str]:
        """Rollout sources of this run in display order."""
        found = {src for _, src in self.files}
        return [s for s in SOURCES if s in found]

    def steps(self, source: str | None = None) -> list[int]:
        """Steps that have rollouts (of ``source`` when given), ascending."""
        found = {s for s, src in self.files if s is not None and (source is None or src == source)}
        if self.kind == "lab" and source in (None, "lab") and (None, "lab") in self.files:
            found |= {r.step for r in self.load((None, "lab")) if r.step is not None}
        return sorted(found)

    def rollouts(
        self, *, steps: Iterable[int] | None = None, sources: Iterable[str] | None = None
    ) -> list[Rollout]:
        """Rollouts of the chosen steps and sources (all by default), in step then file order."""
        want_steps = None if steps is None else set(steps)
        want_src = None if sources is None else set(sources)
        out: list[Rollout] = []
        for step, src in self.file_keys():
            if want_src is not None and src not in want_src:
                continue
            if want_steps is None or step in want_steps:
                out += self.load((step, src))
            elif step is None:  # a file without a step (lab rows): filter its rows
                out += [r for r in self.load((step, src)) if r.step in want_steps]
        return out

    def file_keys(self) -> list[Key]:
        """``(step, source)`` of every rollout file, in step order (train samples before val rows)."""
        return sorted(self.files, key=lambda k: (-1 if k[0] is None else k[0], k[1] != "train", k[1]))

    def _lazy(self, key: Key) -> bool:
        return key not in self._cache and key[1] not in ("train", "lab")

    def count_rollouts(self, key: Key) -> int:
        """How many rollouts the file ``key`` holds (a validation or result file: its non-blank lines)."""
        if not self._lazy(key):
            return len(self.load(key))
        with open(self.files[key], encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())

    def head(self, key: Key, n: int) -> list[Rollout]:
        """The first ``n`` rollouts of file ``key``; validation and result files are read only that far."""
        return list(islice(self._read(key), n)) if self._lazy(key) else self.load(key)[:n]

    def load(self, key: Key) -> list[Rollout]:
        """The rollouts of one file (read once, then cached)."""
        if key not in self._cache:
            self._cache[key] = list(self._read(key))
        return self._cache[key]

    def _read(self, key: Key) -> Iterator[Rollout]:
        step, src = key
        path = self.files[key]
        if src == "train":
            return train_rollouts(path, step)
        if src == "lab":
            return lab_rollouts(path)
        if src == "val":
            return val_rollouts(path, step, self._prompts)
        return result_rollouts(path, src, self._prompts)

    @cached_property
    def _prompts(self) -> dict[str, str]:
        """id -> prompt: the environment's val split (train runs) or the eval dataset file (eval runs)."""
        rows: list[Mapping[str, Any]] = []
        if self.kind == "train":
            env, env_cfg = self.manifest.get("environment"), self.config.get("env")
            env = env if isinstance(env, dict) else {}
            env_cfg = env_cfg if isinstance(env_cfg, dict) else {}
            try:
                spec = get_env(str(env.get("name") or env_cfg.get("name")))
                rows = list(spec.load_split(str(env_cfg.get("val_split", "val"))))
            except Exception:  # an unknown or unavailable environment: prompts just stay unknown
                rows = []
        elif self.kind in ("eval", "select"):
            rec = (self.manifest.get("inputs") or {}).get("dataset") or {}
            for cand in (Path(str(rec.get("path", ""))), self.root.parent / str(rec.get("path", ""))):
                if rec.get("path") and cand.is_file() and sha256_file(cand) == rec.get("sha256"):
                    rows = [r for _, r in iter_jsonl(cand) if isinstance(r, dict)]
                    break
        return {
            str(r["id"]): str(r["prompt"]) for r in rows if "id" in r and isinstance(r.get("prompt"), str)
        }

    def step_counts(self) -> list[StepCounts]:
        """Outcome/category counts per step and source: from the history's ``<src>/outcome/*`` keys when
        logged, else from the saved rollouts."""
        logged: dict[tuple[int, str], StepCounts] = {}
        for row in self.history:
            for src in ("train", "val"):
                codes = {
                    k.split("/", 2)[2]: int(v)
                    for k, v in row.items()
                    if k.startswith(f"{src}/outcome/") and num(v) is not None
                }
                if codes:
                    mean = num(row.get("train/reward_mean" if src == "train" else "val/greedy_accuracy"))
                    logged[(row["step"], src)] = StepCounts.of(row["step"], src, codes, mean, complete=True)
        out: list[StepCounts] = []
        for step, src in self.file_keys():
            if step is not None and (step, src) in logged:
                out.append(logged.pop((step, src)))
                continue
            rows = self.load((step, src))
            codes = dict(Counter(r.outcome or "-" for r in rows))
            mean = sum(r.reward for r in rows) / len(rows) if rows else None
            out.append(StepCounts.of(step, src, codes, mean, complete=src != "train"))
        out += logged.values()
        return sorted(out, key=lambda c: (-1 if c.step is None else c.step, c.source))


def _detect_kind(root: Path, manifest: Mapping[str, Any]) -> str:
    kind = manifest.get("kind")
    if kind == "palaestra-lab-manifest" or manifest.get("loop") == "lab":
        return "lab"
    if kind == "train" or (root / "history.jsonl").exists():
        return "train"
    if manifest.get("command") == "select" or manifest.get("loop") == "B":
        return "select"
    if manifest.get("command") == "eval" or manifest.get("loop") == "A" or (root / "results.jsonl").exists():
        return "eval"
    raise DataError(
        "not a palaestra run folder (no history.jsonl, results.jsonl or known manifest.json)", path=root
    )


def _json_file(path: Path) -> dict[str, Any]:
    return json_object(read_json(path), path, None) if path.exists() else {}


def load_run(run_dir: PathLike) -> RunView:
    """Read a run folder's manifest, summary and history and index its rollout files."""
    root = Path(run_dir)
    if not root.is_dir():
        raise DataError("run folder not found", path=root)
    manifest = _json_file(root / "manifest.json")
    view = RunView(root, _detect_kind(root, manifest), manifest, _json_file(root / "summary.json"))
    if view.kind == "train":
        view.config = _json_file(root / "config.json")
        history = root / "history.jsonl"
        if history.exists():
            for line, row in iter_jsonl(history):
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise DataError("history row needs an integer 'step'", path=history, line=line)
                view.history.append(row)
        for folder, src in (("samples", "train"), ("val", "val")):
            for p in (root / folder).glob("step_*.jsonl"):
                if m := re.fullmatch(r"step_(\d+)\.jsonl", p.name):
                    view.files[(int(m.group(1)), src)] = p
        view.charts = charts_for_history(view.history, view.stop)
    elif view.kind == "lab":
        tables = {}
        for name in manifest.get("artifacts") or []:
            p = root / str(name)
            if p.suffix == ".csv" and p.is_file():
                with open(p, encoding="utf-8", newline="") as fh:
                    tables[p.name] = list(csv.DictReader(fh))
            elif p.suffix == ".jsonl" and p.is_file() and (None, "lab") not in view.files:
                view.files[(None, "lab")] = p  # the first JSONL artifact: rows with a reward are browsed
        view.charts = charts_for_lab(tables)
    elif (root / "results.jsonl").exists():
        view.files[(None, view.kind)] = root / "results.jsonl"
    else:  # an eval or select run always writes it: without it there is nothing to read
        raise DataError("file not found", path=root / "results.jsonl")
    return view
