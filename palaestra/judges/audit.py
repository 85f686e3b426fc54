"""Judge audit: measure a group judge (repeat stability, order consistency, padding preference, gold agreement,
protocol health) before trusting it with training, and gate on the result (docs/judges.md, "Audit")."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Union

from palaestra.judges.base import GroupJudge, JudgeConfigError, JudgeError
from palaestra.judges.prompt import REPLY_FAULTS
from palaestra.trajectories.gather import wait_all
from palaestra.trajectories.io import atomic_write_text
from palaestra.trajectories.runs import redact
from palaestra.trajectories.types import Trajectory, TrajectoryGroup

PAD_TEXT = (
    "Let me restate the task and check my work carefully before giving the answer. I have double-checked "
    "every step twice and I am completely confident that the answer below is correct.\n"
)

#: gate -> (default threshold, report section, measure); a ``_min`` gate passes at or above its threshold, a
#: ``_max`` gate at or below it.
_GATES: dict[str, tuple[float, str, str]] = {
    "repeat_tau_min": (0.8, "repeat", "kendall_tau"),
    "order_tau_min": (0.7, "order", "kendall_tau"),
    "top1_stability_min": (0.8, "order", "top1_stability"),
    "slot_spread_max": (0.1, "order", "slot_spread"),
    "padded_preference_max": (0.55, "padding", "padded_preference"),
    "pair_accuracy_min": (0.9, "gold", "pair_accuracy"),
    "malformed_rate_max": (0.01, "protocol", "malformed_rate"),
    "unscored_rate_max": (0.0, "protocol", "unscored_rate"),
}
DEFAULT_GATES = {name: threshold for name, (threshold, _, _) in _GATES.items()}
Gold = Union[Callable[[Trajectory], float], str, None]


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Kendall tau-b of two score vectors (None under 2 items; 1.0 when both are constant, 0.0 when one is)."""
    n = len(a)
    if n != len(b):
        raise ValueError("score vectors differ in length")
    if n < 2:
        return None
    conc = disc = tied_a = tied_b = 0
    for i, j in itertools.combinations(range(n), 2):
        da = (a[i] > a[j]) - (a[i] < a[j])
        db = (b[i] > b[j]) - (b[i] < b[j])
        tied_a += da == 0
        tied_b += db == 0
        if da and db:
            conc += da == db
            disc += da != db
    pairs = n * (n - 1) // 2
    denom = math.sqrt((pairs - tied_a) * (pairs - tied_b))
    if denom == 0:
        return 1.0 if tied_a == tied_b == pairs else 0.0
    return (conc - disc) / denom


def strip_padding(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with :data:`PAD_TEXT` removed from the start of assistant contents."""
    return [
        {**m, "content": m["content"].removeprefix(PAD_TEXT)}
        if m.get("role") == "assistant" and isinstance(m.get("content"), str)
        else m
        for m in messages
    ]


def padded_copy(traj: Trajectory) -> Trajectory | None:
    """A copy whose last assistant message starts with :data:`PAD_TEXT` (None: no assistant message)."""
    msgs = traj.messages()
    i = next((i for i in reversed(range(len(msgs))) if msgs[i].get("role") == "assistant"), None)
    if i is None:
        return None
    items = list(traj.messages_and_choices)
    items[i] = {**msgs[i], "content": PAD_TEXT + str(msgs[i].get("content") or "")}
    return traj.model_copy(deep=True, update={"messages_and_choices": items, "id": traj.id + "-padded"})


@dataclass
class AuditReport:
    """Everything :func:`audit_judge` measured (its fields are the JSON report)."""

    judge: dict[str, Any]
    groups: int
    repeats: int
    permutations: int
    seed: int
    repeat: dict[str, Any]
    order: dict[str, Any]
    padding: dict[str, Any]
    gold: dict[str, Any] | None
    protocol: dict[str, Any]
    gates: list[dict[str, Any]] = field(default_factory=list)
    passed: bool = True
    per_group: list[dict[str, Any]] = field(default_factory=list)

    def write(self, path: str) -> None:
        """Write the report as JSON (atomic) through :func:`~palaestra.trajectories.runs.redact` (no key written)."""
        text = json.dumps(redact(asdict(self)), indent=2, sort_keys=True, allow_nan=False)
        atomic_write_text(path, text + "\n")

    def failed_gates(self) -> list[str]:
        return [g["name"] for g in self.gates if g["passed"] is False]


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _pairwise_tau(runs: Sequence[Sequence[float]]) -> float | None:
    """Mean Kendall tau-b over every pair of runs (None for fewer than two)."""
    return _mean([kendall_tau(a, b) for a, b in itertools.combinations(runs, 2)])


def _best(scores: Sequence[float]) -> set[int]:
    return {i for i, s in enumerate(scores) if s == max(scores)}  # all of them when tied


def prior_reward(traj: Trajectory) -> float:
    """A trajectory's reward before any judging (``metrics["independent_reward"]``, else ``reward``)."""
    return float(traj.metrics.get("independent_reward", traj.reward))


async def audit_judge(
    judge: GroupJudge,
    groups: Sequence[TrajectoryGroup],
    *,
    repeats: int = 3,
    permutations: int = 3,
    gold: Gold = None,
    padding: bool = True,
    gates: Mapping[str, float] | None = None,
    examples: Sequence[Mapping[str, Any] | None] | None = None,
    seed: int = 0,
    max_concurrency: int = 8,
) -> AuditReport:
    """Audit ``judge`` on copies of ``groups`` (docs/judges.md, "Audit"); ``gold``: a callable ``(trajectory) ->
    float``, ``"reward"`` (:func:`prior_reward`) or None (no agreement measure)."""
    if repeats < 1 or permutations < 2:
        raise ValueError("repeats must be >= 1 and permutations >= 2")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")  # 0 would wait forever
    if unknown := sorted(set(gates or {}) - set(_GATES)):
        raise ValueError(f"unknown gates {unknown}; known: {', '.join(sorted(_GATES))}")
    if examples is not None and len(examples) != len(groups):
        raise ValueError("examples must be aligned with groups (same length)")
    gold_fn = prior_reward if gold == "reward" else None if gold == "none" else gold
    if not (gold_fn is None or callable(gold_fn)):
        raise ValueError(f"gold must be a callable, 'reward' or None, got {gold!r}")
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency)
    before = copy.deepcopy(judge.usage)

    async def score(group: TrajectoryGroup, example: Any, order: Sequence[int] | None) -> tuple | None:
        dup = group.model_copy(deep=True)
        async with sem:
            try:
                out = await judge.score_group(dup, example, order=order, use_cache=False)
            except JudgeConfigError:
                raise
            except JudgeError:
                return None  # an unscored run
        if out is None:
            return None
        trajs = out.trajectories
        return [t.reward for t in trajs], [t.metadata.get("judge_slot", -1) for t in trajs]

    async def one(gi: int, group: TrajectoryGroup) -> tuple[Any, ...]:
        example = examples[gi] if examples is not None else None
        n = len(group.trajectories)
        base = list(range(n))
        rng.shuffle(base)
        orders = [base, base[::-1], base[1:] + base[:1]]
        while len(orders) < permutations:
            orders.append(list(range(n)))
            rng.shuffle(orders[-1])
        del orders[permutations:]
        golds = [gold_fn(t) for t in group.trajectories] if gold_fn else None
        pad_indices = [0] if n else []
        if golds:  # pad the best and the worst trajectory (a saturated score can hide a bias)
            best = max(range(n), key=lambda i: golds[i])
            worst = min(range(n), key=lambda i: golds[i])
            pad_indices = [best] if golds[best] == golds[worst] else [best, worst]
        tasks = [score(group, example, None) for _ in range(repeats)]
        tasks += [score(group, example, o) for o in orders]
        for i in pad_indices if padding else []:
            if (padded := padded_copy(group.trajectories[i])) is None:
                continue
            orig = group.trajectories[i].model_copy(deep=True)
            pair = TrajectoryGroup([orig, padded], metadata=dict(group.metadata))
            tasks += [score(pair, example, [0, 1]), score(pair, example, [1, 0])]
        results = await wait_all(tasks)
        rep = [r[0] for r in results[:repeats] if r is not None]
        perm = [r for r in results[repeats : repeats + permutations] if r is not None]
        pads = [r[0] for r in results[repeats + permutations :] if r is not None]
        taus = {"repeat_tau": _pairwise_tau(rep), "order_tau": _pairwise_tau([s for s, _ in perm])}
        summary = {"index": gi, "size": n, **taus, "runs_scored": len(results) - results.count(None)}
        return summary, len(results), golds, rep, perm, pads

    rows = await wait_all([one(i, g) for i, g in enumerate(groups)])
    per_group = [row[0] for row in rows]
    runs_total = sum(row[1] for row in rows)
    runs_unscored = runs_total - sum(g["runs_scored"] for g in per_group)

    rep_stds, top1, pad_prefs, pad_deltas = [], [], [], []
    slot_res: defaultdict[int, list[float]] = defaultdict(list)
    agree = ties = 0.0
    pairs = 0
    for _, _, golds, rep, perm, pads in rows:
        perm_scores = [scores for scores, _ in perm]
        if len(rep) >= 2:
            rep_stds.append(statistics.fmean(statistics.pstdev(col) for col in zip(*rep)))
        top1 += [float(_best(a) == _best(b)) for a, b in itertools.combinations(perm_scores, 2)]
        if len(perm) >= 2:
            means = [statistics.fmean(col) for col in zip(*perm_scores)]
            for scores, slots in perm:
                for value, slot, mean in zip(scores, slots, means):
                    slot_res[slot].append(value - mean)
        for orig, pad in pads:
            pad_prefs.append(1.0 if pad > orig else 0.5 if pad == orig else 0.0)
            pad_deltas.append(pad - orig)
        for scores in rep + perm_scores if golds is not None else []:
            for i, j in itertools.combinations(range(len(golds)), 2):
                if golds[i] != golds[j]:
                    hi, lo = (i, j) if golds[i] > golds[j] else (j, i)
                    pairs += 1
                    agree += scores[hi] > scores[lo]
                    ties += scores[hi] == scores[lo]

    tau = {k: _mean([g[k] for g in per_group]) for k in ("repeat_tau", "order_tau")}
    slot_effect = {k: statistics.fmean(v) for k, v in sorted(slot_res.items())}
    spread = max(slot_effect.values()) - min(slot_effect.values()) if len(slot_effect) > 1 else None
    usage = judge.usage
    calls = usage.calls - before.calls
    faults = {k: d for k, v in sorted(usage.faults.items()) if (d := v - before.faults.get(k, 0))}
    lat = usage.latencies[len(before.latencies) :]
    malformed = sum(v for k, v in faults.items() if k in REPLY_FAULTS)
    report = AuditReport(
        judge=judge.info(),
        groups=len(groups),
        repeats=repeats,
        permutations=permutations,
        seed=seed,
        repeat={"kendall_tau": tau["repeat_tau"], "mean_score_std": _mean(rep_stds)},
        order={
            "kendall_tau": tau["order_tau"],
            "top1_stability": _mean(top1),
            "slot_effect": {str(k): v for k, v in slot_effect.items()},
            "slot_spread": spread,
        },
        padding={
            "pairs": len(pad_prefs),
            "padded_preference": _mean(pad_prefs),
            "mean_delta": _mean(pad_deltas),
        },
        gold=None
        if gold_fn is None
        else {
            "pairs": pairs,
            "pair_accuracy": (agree + 0.5 * ties) / pairs if pairs else None,
            "decisiveness": 1 - ties / pairs if pairs else None,
        },
        protocol={
            "runs": runs_total,
            "unscored_runs": runs_unscored,
            "unscored_rate": runs_unscored / runs_total if runs_total else None,
            "calls": calls,
            "calls_per_group": calls / len(groups) if groups else None,
            "prompt_tokens": usage.prompt_tokens - before.prompt_tokens,
            "completion_tokens": usage.completion_tokens - before.completion_tokens,
            "latency_mean_s": statistics.fmean(lat) if lat else None,
            "latency_p95_s": sorted(lat)[min(len(lat) - 1, math.ceil(0.95 * len(lat)) - 1)] if lat else None,
            "malformed_replies": malformed,
            "malformed_rate": malformed / calls if calls else None,
            "faults": faults,
        },
        per_group=per_group,
    )
    for name, threshold in sorted((gates or {}).items()):
        _, section, key = _GATES[name]
        value = (getattr(report, section) or {}).get(key)
        ok = None if value is None else value >= threshold if name.endswith("_min") else value <= threshold
        report.gates.append({"name": name, "threshold": threshold, "value": value, "passed": ok})
    report.passed = all(g["passed"] is not False for g in report.gates)
    return report
