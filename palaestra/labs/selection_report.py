"""Reporting half of ``palaestra lab selection``: samples sidecars, summary sentences and the plot (the
sampling, decision rules and training run are in :mod:`palaestra.labs.selection`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.labs.common import LabRun, fmt

if TYPE_CHECKING:
    from palaestra.labs.selection import SelectionConfig, SelectionResult

__all__ = ["shows", "write_report", "write_sidecar"]


def write_sidecar(lab: LabRun, name: str, cfg: SelectionConfig, model: Any) -> None:
    from palaestra.evals.sampling import policy_record, sampling_settings
    from palaestra.trajectories.runs import code_version, utc_now

    meta = {
        "sampling": sampling_settings(
            temperature=cfg.temperature, max_tokens=cfg.max_tokens, samples_per_id=cfg.n_max
        ),
        "seed": cfg.seed,
        "policy": policy_record(model),
        "dataset": {"split": cfg.split, "examples": cfg.examples},
        "created": utc_now(),
        "code": code_version(),
        "seed_rule": "EmbeddedModel.generate(seed): choice i of example c seeded from (seed, c, i)",
    }
    lab.write_json(name.removesuffix(".jsonl") + ".meta.json", meta)


def shows(res: SelectionResult) -> list[str]:
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


def write_report(res: SelectionResult, lab: LabRun, *, plot: bool) -> Path:
    rows = res.before.rows() + (res.after.rows() if res.after else [])
    lab.write_csv("passk.csv", rows)

    def draw(plt: Any) -> None:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
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
        fig.tight_layout()

    lab.plot("selection.png", draw, enabled=plot)
    if res.after is not None:
        lab.note("The training run's own folder (manifest, history, samples, checkpoints) is train/.")
    lab.note(
        "Re-select with the harness, inside this folder: palaestra select --dataset dataset.jsonl --samples "
        f"samples_before.jsonl --n {res.config.n_max} --outdir select-before"
    )
    return lab.finish(
        title="Selection lab: pass@N from one policy vs pass@1 after training",
        knob="decision rule (N; oracle, majority vote, max log-prob, greedy) and, separately, GRPO training",
        shows=shows(res),
        numbers=res.numbers,
        tables=[("Decision rules (passk.csv)", rows)],
    )
