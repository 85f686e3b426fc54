"""``palaestra lab selection``: same policy distribution, different decision rule (Loop B) vs a changed policy
(Loop C)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from palaestra.labs.common import (
    LabRun,
    arithmetic_grpo_config,
    config_from_args,
    parse_floats,
    print_result,
    require,
    require_at_least,
)
from palaestra.trajectories.io import DataError
from palaestra.trajectories.runs import fmt


@dataclass(frozen=True)
class SelectionConfig:
    """Knobs of the selection lab."""

    model: str = "arith-base"
    split: str = "test"
    examples: int = 200
    ns: tuple[int, ...] = (1, 2, 4, 8, 16)
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

    def __post_init__(self) -> None:
        require(self.ns and all(n >= 1 for n in self.ns), "ns", "need one or more N >= 1", list(self.ns))
        require_at_least(self, 1, "examples", "max_tokens", "groups_per_step")
        require_at_least(self, 0, "train_steps")
        require_at_least(self, 2, "group_size")
        require(0.0 < self.temperature <= 2.0, "temperature", "must be in (0, 2]", self.temperature)


@dataclass(frozen=True)
class PhaseTable:
    """Per N, the pass@N, majority-vote and max-logprob accuracy of one set of samples (and greedy, if measured)."""

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
    votes = Counter(p for _, p, _ in chunk if p is not None)  # most_common: ties go to the answer seen first
    return bool(votes) and votes.most_common(1)[0][0] == expected


def decision_table(
    phase: str,
    examples: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    ns: Sequence[int],
    *,
    greedy: float | None = None,
) -> PhaseTable:
    """Score the samples with the strict verifier; per N: unbiased pass@N over all samples of an example, majority
    vote (ties: the answer seen first) and max-logprob (ties: the earlier sample) over chunks of N samples."""
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.evals.passk import mean_pass_at_k

    strict = StrictFinalVerifier()
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(str(r["id"]), []).append(r)
    if missing := [ex["id"] for ex in examples if str(ex["id"]) not in by_id]:
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
        max_lp[n] = sum(max(c, key=lambda s: s[2])[0] > 0 for _, c in chunks) / len(chunks)
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


def run_selection_lab(
    cfg: SelectionConfig,
    outdir: str | Path,
    *,
    plot: bool = True,
    printer: Callable[[str], None] | None = None,
) -> SelectionResult:
    """Loop B on the base policy, a short Loop C run, Loop B again; write ``outdir``."""
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.envs.arithmetic_data import load_split
    from palaestra.evals.sampling import policy_record, sampling_settings, sidecar_meta
    from palaestra.models.registry import load
    from palaestra.trainer.validation import evaluate_accuracy

    examples = load_split(cfg.split)[: cfg.examples]
    if not examples:
        raise DataError(f"split {cfg.split!r} has no examples")
    lab = LabRun(outdir, lab="selection", seed=cfg.seed, knobs=asdict(cfg))
    model = load(cfg.model)
    settings: dict[str, Any] = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    strict = StrictFinalVerifier()
    convs = [[{"role": "user", "content": str(ex["prompt"])}] for ex in examples]

    def measure(phase: str) -> PhaseTable:
        out = asyncio.run(model.generate(convs, n=cfg.n_max, seed=cfg.seed, **settings))
        per_conv = cast("list[list[Any]]", out)  # one list of samples per conversation
        rows = []  # harness sample rows; the strict verdict rides along, so ``palaestra show`` can browse them
        for ex, samples in zip(examples, per_conv):
            for j, s in enumerate(samples):
                score = strict.score(ex, s.text)
                lp = round(float(sum(s.logprobs)), 4)
                row = {"id": ex["id"], "sample": j, "completion": s.text, "sum_logprob": lp, "phase": phase}
                rows.append({**row, "reward": score.reward, "outcome": score.outcome})
        lab.write_jsonl(f"samples_{phase}.jsonl", rows)
        # the sidecar ``palaestra select`` reads; the policy record changes with training
        meta = sidecar_meta(
            sampling=sampling_settings(**settings, samples_per_id=cfg.n_max),
            seed=cfg.seed,
            policy=policy_record(model),
            dataset={"split": cfg.split, "examples": cfg.examples},
            seed_rule="EmbeddedModel.generate(seed): choice i of example c seeded from (seed, c, i)",
        )
        lab.write_json(f"samples_{phase}.meta.json", meta)
        acc = asyncio.run(evaluate_accuracy(model, examples, max_tokens=cfg.max_tokens, seed=cfg.seed))
        return decision_table(phase, examples, rows, cfg.ns, greedy=float(acc.greedy or 0.0))

    before = measure("before")
    after, summary = None, None
    if cfg.train_steps > 0:
        from palaestra.trainer.experiment import Experiment

        exp_cfg = arithmetic_grpo_config(
            lab.fresh_subfolder("train"),
            name="selection-train",
            model=cfg.model,
            seed=cfg.seed,
            steps=cfg.train_steps,
            reward={"kind": "verifier", "verifier": "arith-strict"},
            run={"groups_per_step": cfg.groups_per_step, "group_size": cfg.group_size, "samples_per_step": 8},
            env={"temperature": 1.0, "max_tokens": cfg.max_tokens},
            validation={"every": cfg.train_steps, "max_examples": 200},
            train={"lr": cfg.lr},
            stopping={"hacking_window": None, "restore_best": False},
        )
        summary = Experiment(exp_cfg, model=model, printer=printer).run_sync()
        after = measure("after")
    lab.write_jsonl("dataset.jsonl", examples)  # for ``palaestra select --dataset dataset.jsonl ...``
    numbers = {"examples": len(examples), "samples_per_example": cfg.n_max, **_phase_numbers(before)}
    if after is not None and summary is not None:
        numbers.update({"train_steps": summary["steps"], "train_stop_reason": summary["stop"]["reason"]})
        numbers.update(_phase_numbers(after))
        for n in (min(cfg.ns), cfg.n_max):
            numbers[f"pass@{n}_gain"] = after.pass_at[n] - before.pass_at[n]
    res = SelectionResult(cfg, before, after, summary, numbers)
    res.outdir = _write_report(res, lab, plot=plot)
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


_D = SelectionConfig()
HELP = "pass@1 vs pass@N from one policy (Loop B) next to GRPO's effect on pass@1 (Loop C)"
OPTIONS: tuple[tuple[Any, ...], ...] = (
    ("--model", _D.model, "embedded model name or .npz path"),
    ("--split", _D.split, "examples to sample (default: %(default)s)"),
    ("--examples", _D.examples, "examples to sample"),
    ("--ns", ",".join(map(str, _D.ns)), "comma-separated N values"),
    ("--temperature", _D.temperature, "sampling temperature"),
    ("--max-tokens", _D.max_tokens, "tokens per sample"),
    ("--train-steps", _D.train_steps, "GRPO steps (0: Loop B only)"),
    ("--groups-per-step", _D.groups_per_step, "GRPO groups per step"),
    ("--group-size", _D.group_size, "GRPO samples per group"),
    ("--lr", _D.lr, "GRPO learning rate"),
)


def command(args: argparse.Namespace) -> int:
    """``palaestra lab selection`` with its parsed arguments; the exit code."""
    ns = tuple(sorted(set(parse_floats(args.ns, field="--ns", kind=int))))
    cfg = config_from_args(SelectionConfig, args, ns=ns)
    res = run_selection_lab(cfg, args.outdir, plot=not args.no_plot, printer=None if args.quiet else print)
    table = res.before.rows() + (res.after.rows() if res.after else [])
    return print_result(res.outdir, quiet=args.quiet, blocks=["", table, *shows(res)])


def shows(res: SelectionResult) -> list[str]:
    """What the run shows, in sentences (``summary.md`` and the command's output)."""
    b, a, cfg = res.before, res.after, res.config
    lo, hi = min(cfg.ns), cfg.n_max
    passes = ", ".join(f"N={n}: {fmt(b.pass_at[n], 3)}" for n in cfg.ns)
    lines = [
        f"Loop B, one frozen policy ({cfg.model}, T={fmt(cfg.temperature)}), {res.numbers['examples']} "
        f"{cfg.split} examples x {hi} samples: pass@N {passes}.",
        f"Same samples, rules that need no verifier at decision time, N={hi}: majority vote "
        f"{fmt(b.majority[hi], 3)}, highest log-probability {fmt(b.max_logprob[hi], 3)}; greedy decoding "
        f"{fmt(b.greedy, 3)}.",
    ]
    if a is not None and res.train_summary is not None:
        lines.append(
            f"Loop C, {res.train_summary['steps']} GRPO steps on the strict verifier: pass@{lo} "
            f"{fmt(b.pass_at[lo], 3)} -> {fmt(a.pass_at[lo], 3)}, pass@{hi} {fmt(b.pass_at[hi], 3)} -> "
            f"{fmt(a.pass_at[hi], 3)}, majority@{hi} {fmt(b.majority[hi], 3)} -> {fmt(a.majority[hi], 3)}, "
            f"greedy {fmt(b.greedy, 3)} -> {fmt(a.greedy, 3)}."
        )
        lines.append(
            "Selection raises the reported number without changing the policy (pass@N needs the verifier at "
            "decision time); training changes the policy, so the rules that need no verifier move."
        )
    return lines


_RULES = (
    ("pass_at", "o", "tab:blue", "pass@N (oracle)"),
    ("majority", "s", "tab:green", "majority vote"),
    ("max_logprob", "^", "tab:gray", "max log-prob"),
)


def _write_report(res: SelectionResult, lab: LabRun, *, plot: bool) -> Path:
    rows = res.before.rows() + (res.after.rows() if res.after else [])
    lab.write_csv("passk.csv", rows, table="Decision rules (passk.csv)")

    def draw(plt: Any) -> None:
        _fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for table, style in ((res.before, "-"), (res.after, "--")):
            if table is None:
                continue
            ns = list(table.ns)
            for attr, marker, color, label in _RULES:
                values = getattr(table, attr)
                ax.plot(
                    ns, [values[n] for n in ns], marker + style, color=color, label=f"{label}, {table.phase}"
                )
            if table.greedy is not None:
                ax.axhline(table.greedy, color="tab:red", ls=style, lw=0.8, label=f"greedy, {table.phase}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(res.config.ns))
        ax.set_xticklabels([str(n) for n in res.config.ns])
        ax.set(xlabel="N samples per prompt", ylabel="accuracy (strict verifier)", ylim=(0, 1.02))
        ax.set_title("Same policy, different decision rule (solid) vs trained policy (dashed)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=2)

    lab.plot("selection.png", draw, enabled=plot)
    if res.after is not None:
        lab.note("The training run's own folder (manifest, history, samples, checkpoints) is train/.")
    lab.note(
        "Re-select with the harness, inside this folder: palaestra select --dataset dataset.jsonl --samples "
        f"samples_before.jsonl --n {res.config.n_max} --outdir select-before"
    )
    title = "Selection lab: pass@N from one policy vs pass@1 after training"
    knob = "decision rule (N; oracle, majority vote, max log-prob, greedy) and, separately, GRPO training"
    return lab.finish(title, knob, shows(res), res.numbers)
