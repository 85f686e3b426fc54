"""``palaestra lab selection``: same policy distribution, different decision rule (Loop B) vs a changed policy
(Loop C).

Loop B: draw ``n_max`` samples per example from one frozen policy (``arith-base`` at temperature 1) and score
each with the strict verifier. From those same samples, three decision rules pick the answer for N in
{1, 2, 4, 8, 16}: *oracle best-of-N* (pass@N: a verifier picks; the unbiased estimator of
:func:`palaestra.evals.passk.pass_at_k`), *majority vote* over the answers of the first N samples (no
verifier needed) and *highest log-probability* among the first N. pass@N climbs steeply with N although the
policy is unchanged: only the rule that turns samples into an answer differs.

Loop C: a short GRPO run (an :class:`~palaestra.trainer.experiment.Experiment` rewarded by the strict
verifier) changes the policy itself; the same examples are sampled again and the same table is computed.
Training moves pass@1; pass@N at large N moves much less (it mostly measures what the policy could already
reach with enough tries).

The examples come from a split the training run never sees (``test`` by default). The run folder holds
``passk.csv`` (phase, N, pass@N, majority vote, max-logprob), the samples before and after training in the
format ``palaestra select`` reads (``dataset.jsonl``, ``samples_before.jsonl``, ``samples_after.jsonl``), the
training run in ``train/`` and ``selection.png``.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from palaestra.labs.common import LabRun, add_common_args, print_table
from palaestra.labs.selection_report import shows, write_report, write_sidecar
from palaestra.trajectories.io import DataError

__all__ = [
    "DEFAULT_NS",
    "PhaseTable",
    "SelectionConfig",
    "SelectionResult",
    "decision_table",
    "register_lab",
    "run_selection_lab",
    "sample_policy",
]

DEFAULT_NS: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SelectionConfig:
    """Knobs of the selection lab."""

    model: str = "arith-base"
    split: str = "test"
    examples: int = 200
    ns: tuple[int, ...] = DEFAULT_NS
    temperature: float = 1.0
    max_tokens: int = 16
    seed: int = 0
    train_steps: int = 100
    groups_per_step: int = 16
    group_size: int = 8
    lr: float = 2e-4

    @property
    def n_max(self) -> int:
        return max(self.ns)

    def check(self) -> None:
        """Raise ``DataError`` naming the first bad knob."""
        if not self.ns or any(n < 1 for n in self.ns):
            raise DataError(f"ns: need one or more N >= 1, got {list(self.ns)}")
        for name in ("examples", "max_tokens", "groups_per_step"):
            if getattr(self, name) < 1:
                raise DataError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.train_steps < 0:
            raise DataError(f"train_steps: must be >= 0, got {self.train_steps}")
        if self.group_size < 2:
            raise DataError(f"group_size: must be >= 2, got {self.group_size}")
        if not 0.0 < self.temperature <= 2.0:
            raise DataError(f"temperature: must be in (0, 2], got {self.temperature}")


async def sample_policy(
    model: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int,
) -> list[dict[str, Any]]:
    """``n`` samples per example as harness sample rows ``{id, sample, completion, sum_logprob}``.

    An embedded model is sampled through :meth:`EmbeddedModel.generate` (one batched pass); any other chat
    model through the harness' :func:`palaestra.evals.sampling.sample_completions`.
    """
    from palaestra.models.embedded import EmbeddedModel

    if not isinstance(model, EmbeddedModel):
        from palaestra.evals.sampling import sample_completions

        return await sample_completions(
            model, examples, samples=n, temperature=temperature, max_tokens=max_tokens, seed=seed
        )
    convs = [[{"role": "user", "content": str(ex["prompt"])}] for ex in examples]
    out = await model.generate(convs, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed)
    rows = []
    for ex, samples in zip(examples, out):
        assert isinstance(samples, list)  # one list of samples per conversation
        for j, s in enumerate(samples):
            rows.append(
                {
                    "id": ex["id"],
                    "sample": j,
                    "completion": s.text,
                    "sum_logprob": round(float(sum(s.logprobs)), 4),
                }
            )
    return rows


@dataclass(frozen=True)
class PhaseTable:
    """Decision rules on one set of samples: per N, pass@N, majority-vote and max-logprob accuracy; plus the
    greedy (temperature 0) accuracy of the same policy when measured."""

    phase: str
    ns: tuple[int, ...]
    pass_at: dict[int, float]
    majority: dict[int, float]
    max_logprob: dict[int, float]
    greedy: float | None = None

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "phase": self.phase,
                "N": n,
                "pass_at_N": self.pass_at[n],
                "majority_vote": self.majority[n],
                "max_logprob": self.max_logprob[n],
                "greedy": self.greedy,
            }
            for n in self.ns
        ]


Scored = list[tuple[float, "str | None", float]]  # per sample: strict reward, parsed answer, sum_logprob


def _majority_ok(chunk: Scored, expected: str) -> bool:
    votes = Counter(p for _, p, _ in chunk if p is not None)
    if not votes:
        return False
    top = max(votes.values())
    return next(p for _, p, _ in chunk if p is not None and votes[p] == top) == expected


def _max_logprob_ok(chunk: Scored) -> bool:
    best = max(range(len(chunk)), key=lambda i: (chunk[i][2], -i))
    return chunk[best][0] > 0


def decision_table(
    phase: str,
    examples: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    ns: Sequence[int],
    *,
    greedy: float | None = None,
) -> PhaseTable:
    """Score every sample with the strict verifier and apply the decision rules for each N.

    pass@N is the unbiased estimator over all ``n`` samples of an example. Majority vote and max-logprob
    are averaged over the ``n // N`` disjoint chunks of N consecutive samples (so at N = 1 both equal the
    mean sample accuracy, i.e. pass@1). Majority vote counts the integers of well-formed answers (ties: the
    answer seen first; none well-formed: wrong); max-logprob takes the sample with the highest
    ``sum_logprob`` (ties: the earlier sample).
    """
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.evals.passk import mean_pass_at_k

    strict = StrictFinalVerifier()
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(str(r["id"]), []).append(r)
    missing = [ex["id"] for ex in examples if str(ex["id"]) not in by_id]
    if missing:
        raise DataError(f"samples: example {missing[0]!r} has no samples")
    n_total = min(len(by_id[str(ex["id"])]) for ex in examples)
    if n_total < max(ns):
        raise DataError(f"samples: {n_total} per example, fewer than N={max(ns)}")
    scored: list[tuple[str, Scored]] = []
    for ex in examples:
        samples = sorted(by_id[str(ex["id"])], key=lambda r: int(r["sample"]))[:n_total]
        per: Scored = []
        for r in samples:
            s = strict.score(ex, str(r["completion"]))
            lp = r.get("sum_logprob")
            per.append((s.reward, s.details.get("parsed"), float(lp) if lp is not None else float("-inf")))
        scored.append((str(ex["expected_answer"]), per))
    counts = [sum(rw > 0 for rw, _, _ in per) for _, per in scored]
    pass_at = {n: mean_pass_at_k(n_total, counts, n) for n in ns}
    majority, max_lp = {}, {}
    for n in ns:
        chunks = [(exp, per[i * n : (i + 1) * n]) for exp, per in scored for i in range(n_total // n)]
        majority[n] = sum(_majority_ok(c, exp) for exp, c in chunks) / len(chunks)
        max_lp[n] = sum(_max_logprob_ok(c) for _, c in chunks) / len(chunks)
    return PhaseTable(phase, tuple(ns), pass_at, majority, max_lp, greedy)


@dataclass
class SelectionResult:
    """Before/after decision tables, the training run's summary and the headline numbers."""

    config: SelectionConfig
    before: PhaseTable
    after: PhaseTable | None
    train_summary: dict[str, Any] | None
    numbers: dict[str, Any]
    outdir: Path | None = None


def _train_config(cfg: SelectionConfig, run_dir: Path) -> dict[str, Any]:
    return {
        "run": {
            "name": "selection-train",
            "seed": cfg.seed,
            "output_dir": str(run_dir),
            "groups_per_step": cfg.groups_per_step,
            "group_size": cfg.group_size,
            "max_steps": cfg.train_steps,
            "samples_per_step": 8,
        },
        "model": {"name": cfg.model},
        "env": {"name": "arithmetic", "temperature": 1.0, "max_tokens": cfg.max_tokens},
        "reward": {"kind": "verifier", "verifier": "arith-strict"},
        "validation": {"every": cfg.train_steps, "max_examples": 200, "sampled": False},
        "train": {"lr": cfg.lr, "seed": cfg.seed},
        "stopping": {
            "patience": cfg.train_steps + 1,
            "hacking_window": None,
            "collapse_window": None,
            "restore_best": False,
        },
    }


def run_selection_lab(
    cfg: SelectionConfig,
    outdir: str | Path,
    *,
    plot: bool = True,
    printer: Callable[[str], None] | None = None,
    argv: Sequence[str] | None = None,
) -> SelectionResult:
    """Loop B on the base policy, a short Loop C run, Loop B again; write ``outdir``."""
    import asyncio

    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.envs.arithmetic_data import load_split
    from palaestra.models.registry import load

    cfg.check()
    examples = load_split(cfg.split)[: cfg.examples]
    if not examples:
        raise DataError(f"split {cfg.split!r} has no examples")
    lab = LabRun(outdir, lab="selection", seed=cfg.seed, knobs=asdict(cfg), argv=argv)
    model = load(cfg.model)

    def sample() -> list[dict[str, Any]]:
        return asyncio.run(
            sample_policy(
                model,
                examples,
                n=cfg.n_max,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=cfg.seed,
            )
        )

    def greedy() -> float:
        from palaestra.trainer.validation import evaluate_accuracy

        acc = asyncio.run(evaluate_accuracy(model, examples, max_tokens=cfg.max_tokens, seed=cfg.seed))
        return float(acc.greedy or 0.0)

    def measure(phase: str) -> PhaseTable:
        rows = sample()
        by_id = {str(ex["id"]): ex for ex in examples}
        for r in rows:  # the strict verdict rides along, so ``palaestra show`` can browse the samples
            score = strict.score(by_id[str(r["id"])], str(r["completion"]))
            r.update(phase=phase, reward=score.reward, outcome=score.outcome)
        lab.write_jsonl(f"samples_{phase}.jsonl", rows)
        write_sidecar(lab, f"samples_{phase}.jsonl", cfg, model)
        return decision_table(phase, examples, rows, cfg.ns, greedy=greedy())

    strict = StrictFinalVerifier()
    before = measure("before")
    after, summary = None, None
    if cfg.train_steps > 0:
        from palaestra.trainer.experiment import Experiment

        run_dir = lab.outdir / "train"
        if run_dir.exists():  # an earlier selection run in this folder (LabRun checked the folder is ours)
            shutil.rmtree(run_dir)
        summary = Experiment(_train_config(cfg, run_dir), model=model, printer=printer).run_sync()
        after = measure("after")
    lab.write_jsonl("dataset.jsonl", examples)  # for ``palaestra select --dataset dataset.jsonl ...``
    numbers: dict[str, Any] = {"examples": len(examples), "samples_per_example": cfg.n_max}
    numbers.update(_phase_numbers(before))
    if after is not None and summary is not None:
        numbers.update({"train_steps": summary["steps"], "train_stop_reason": summary["stop"]["reason"]})
        numbers.update(_phase_numbers(after))
        lo, hi = min(cfg.ns), cfg.n_max
        numbers[f"pass@{lo}_gain"] = after.pass_at[lo] - before.pass_at[lo]
        numbers[f"pass@{hi}_gain"] = after.pass_at[hi] - before.pass_at[hi]
    res = SelectionResult(cfg, before, after, summary, numbers)
    res.outdir = write_report(res, lab, plot=plot)
    return res


def _phase_numbers(t: PhaseTable) -> dict[str, Any]:
    lo, hi = min(t.ns), max(t.ns)
    ordered = [t.pass_at[n] for n in sorted(t.ns)]
    return {
        f"pass@{lo}_{t.phase}": t.pass_at[lo],
        f"pass@{hi}_{t.phase}": t.pass_at[hi],
        f"majority@{hi}_{t.phase}": t.majority[hi],
        f"max_logprob@{hi}_{t.phase}": t.max_logprob[hi],
        f"greedy_{t.phase}": t.greedy,
        f"pass@N_nondecreasing_{t.phase}": all(b >= a - 1e-12 for a, b in itertools.pairwise(ordered)),
    }


def _parse_ns(text: str) -> tuple[int, ...]:
    try:
        ns = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise DataError(f"--ns: expected comma-separated integers, got {text!r}") from None
    return tuple(sorted(set(ns)))


def register_lab(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``lab selection``."""
    d = SelectionConfig()
    p = sub.add_parser(
        "selection",
        help="pass@1 vs pass@N from one policy (Loop B) next to GRPO's effect on pass@1 (Loop C)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_common_args(p, lab="selection")
    p.add_argument("--model", default=d.model, help="embedded model name or .npz path")
    p.add_argument("--split", default=d.split, help="examples to sample (default: %(default)s)")
    p.add_argument("--examples", type=int, default=d.examples)
    p.add_argument("--ns", default=",".join(map(str, d.ns)), help="comma-separated N values")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--train-steps", type=int, default=d.train_steps, help="GRPO steps (0: Loop B only)")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.set_defaults(func=selection_command)


def selection_command(args: argparse.Namespace) -> int:
    """``palaestra lab selection``."""
    cfg = SelectionConfig(
        model=args.model,
        split=args.split,
        examples=args.examples,
        ns=_parse_ns(args.ns),
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        train_steps=args.train_steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        lr=args.lr,
    )
    res = run_selection_lab(cfg, args.outdir, plot=not args.no_plot, printer=None if args.quiet else print)
    if not args.quiet:
        print()
        print_table(res.before.rows() + (res.after.rows() if res.after else []))
        for line in shows(res):
            print(line)
    print(f"wrote {res.outdir}")
    return 0
