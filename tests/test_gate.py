"""The promotion gate: one test per Locked-Room violation, the delta rule, a valid PROMOTE, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic import StrictFinalVerifier
from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import evaluate_completions, select_best
from palaestra.evals.inputs import register_scorer
from palaestra.evals.manifest import gate
from palaestra.trajectories.io import DataError


def write(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


EXAMPLES = load_split("dev")[:10]


def completions(
    n_right: int, examples: list[dict[str, Any]] = EXAMPLES, samples: int = 0
) -> list[dict[str, Any]]:
    rows = []
    for i, e in enumerate(examples):
        gold = int(e["expected_answer"])
        text = f"Final: {gold}" if i < n_right else f"Final: {gold + 1}"
        for j in range(max(samples, 1)):
            row: dict[str, Any] = {"id": e["id"], "completion": text}
            if samples:
                row.update(sample=j, sum_logprob=-float(j))
            rows.append(row)
    return rows


def eval_run(
    tmp: Path,
    name: str,
    n_right: int,
    *,
    examples: list[dict[str, Any]] = EXAMPLES,
    scorer: str = "arith-strict",
    meta: dict[str, Any] | None = None,
) -> Path:
    d = write(tmp / name / "data.jsonl", examples)
    c = write(tmp / name / "comp.jsonl", completions(n_right, examples))
    if meta is not None:
        (tmp / name / "comp.meta.json").write_text(json.dumps(meta))
    evaluate_completions(d, c, tmp / name / "run", scorer=scorer)
    return tmp / name / "run"


SAMPLING = {"temperature": 0.0, "max_tokens": 16, "samples_per_id": 1, "rollout": "r", "top_p": 1.0}


def test_valid_promote(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4, meta={"sampling": SAMPLING, "seed": 0, "policy": {"model": "a"}})
    cand = eval_run(tmp_path, "cand", 7, meta={"sampling": SAMPLING, "seed": 0, "policy": {"model": "b"}})
    result = gate(base, cand, min_delta=0.2)
    assert result.decision == "PROMOTE" and result.promoted and result.exit_code == 0
    assert result.delta == pytest.approx(0.3) and result.violations == []
    assert any("locked room intact" in r for r in result.reasons)
    assert any("delta +0.3 >= min-delta +0.2" in r for r in result.reasons)
    # exactly reaching min-delta promotes despite float rounding (0.7 - 0.4 = 0.29999999999999993)
    assert gate(base, cand, min_delta=0.3).promoted


def test_min_delta_tolerance_is_inclusive_and_tiny(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4)
    same = eval_run(tmp_path, "same", 4)
    # delta 0.0 reaches a min-delta of 1e-12 (0.0 >= 1e-12 - 1e-12) but not one of 2e-12
    assert gate(base, same, min_delta=1e-12).promoted
    assert not gate(base, same, min_delta=2e-12).promoted


def test_delta_below_min_rejects(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 5)
    result = gate(base, cand, min_delta=0.2)
    assert result.decision == "REJECT" and result.violations == [] and result.exit_code == 1
    assert any("improvement too small" in r and "+0.1" in r for r in result.reasons)
    worse = gate(cand, base, min_delta=0.0)
    assert not worse.promoted and worse.delta == pytest.approx(-0.1)


def test_dataset_fingerprint_differs(tmp_path: Path) -> None:
    other = [dict(e) for e in EXAMPLES]
    other[0]["expected_answer"] = str(int(other[0]["expected_answer"]) + 5)  # same ids and prompts, new gold
    result = gate(eval_run(tmp_path, "base", 4), eval_run(tmp_path, "cand", 8, examples=other), min_delta=0.0)
    assert result.decision == "REJECT" and result.violations == ["dataset_fingerprint"]
    reason = next(r for r in result.reasons if "dataset_fingerprint" in r)
    assert "baseline" in reason and "candidate" in reason


def test_number_of_examples_differs(tmp_path: Path) -> None:
    result = gate(
        eval_run(tmp_path, "base", 4), eval_run(tmp_path, "cand", 4, examples=EXAMPLES[:8]), min_delta=0.0
    )
    assert not result.promoted
    assert "n_examples" in result.violations and "dataset_fingerprint" in result.violations
    assert any("n_examples differs: baseline 10 vs candidate 8" in r for r in result.reasons)


def test_scorer_name_differs(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 4, scorer="arith-naive-TEACHING-ONLY")
    result = gate(base, cand, min_delta=0.0)
    assert result.violations == ["scorer_name"]
    assert any(
        "scorer_name differs: baseline arith-strict vs candidate arith-naive-TEACHING-ONLY" in r
        for r in result.reasons
    )


def test_scorer_version_differs(tmp_path: Path) -> None:
    register_scorer("arith-strict-short-test", lambda: StrictFinalVerifier(max_chars=64))
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 6, scorer="arith-strict-short-test")
    result = gate(base, cand, min_delta=0.0)
    assert result.violations == ["scorer_version"]  # same instrument name, another rule
    assert any("baseline 1.0.0 vs candidate 1.0.0+max_chars=64" in r for r in result.reasons)


def test_prompt_template_differs(tmp_path: Path) -> None:
    other = [
        dict(e, prompt=e["prompt"].replace("Reply with one line", "Answer in one line")) for e in EXAMPLES
    ]
    result = gate(eval_run(tmp_path, "base", 4), eval_run(tmp_path, "cand", 9, examples=other), min_delta=0.0)
    assert "prompt_template_hash" in result.violations and not result.promoted


def test_sampling_settings_differ(tmp_path: Path) -> None:
    hot = dict(SAMPLING, temperature=1.0)
    base = eval_run(tmp_path, "base", 4, meta={"sampling": SAMPLING})
    cand = eval_run(tmp_path, "cand", 9, meta={"sampling": hot})
    result = gate(base, cand, min_delta=0.0)
    assert result.violations == ["sampling"]
    reason = next(r for r in result.reasons if "sampling" in r)
    assert '"temperature": 0.0' in reason and '"temperature": 1.0' in reason
    unknown = eval_run(tmp_path, "frozen", 9)  # no sidecar: settings unknown, so not comparable either
    assert gate(base, unknown, min_delta=0.0).violations == ["sampling"]
    # a manifest whose sampling keys are stored in another order is still shown with sorted keys
    manifest_path = cand / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["sampling"] = dict(reversed(list(hot.items())))
    manifest_path.write_text(json.dumps(manifest))
    reason = next(r for r in gate(base, cand, min_delta=0.0).reasons if "sampling" in r)
    assert reason.endswith(f"vs candidate {json.dumps(hot, sort_keys=True)}")


def test_selection_n_differs(tmp_path: Path) -> None:
    d = write(tmp_path / "data.jsonl", EXAMPLES)
    s = write(tmp_path / "samples.jsonl", completions(5, samples=8))
    select_best(d, s, tmp_path / "n4", n=4)
    select_best(d, s, tmp_path / "n8", n=8)
    result = gate(tmp_path / "n4", tmp_path / "n8", min_delta=0.0, metric="pass@1")
    assert "selection_n" in result.violations and not result.promoted
    assert any("selection_n differs: baseline 4 vs candidate 8" in r for r in result.reasons)
    loop_a = eval_run(tmp_path, "a", 5)
    assert "selection_n" in gate(loop_a, tmp_path / "n4", min_delta=0.0).violations


def test_every_violation_is_listed(tmp_path: Path) -> None:
    other = [dict(e, prompt=e["prompt"] + " ") for e in EXAMPLES[:9]]
    base = eval_run(tmp_path, "base", 6, meta={"sampling": SAMPLING})
    cand = eval_run(tmp_path, "cand", 1, examples=other, scorer="arith-naive-TEACHING-ONLY")
    result = gate(base, cand, min_delta=0.1)
    assert result.violations == [
        "dataset_fingerprint",
        "n_examples",
        "scorer_name",
        "prompt_template_hash",
        "sampling",
    ]
    assert len(result.reasons) == 6 and "improvement too small" in result.reasons[-1]


def test_cli_exit_codes_and_unusable_input(tmp_path: Path, capsys: Any) -> None:
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 8)
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand), "--min-delta", "0.1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROMOTE") and "pass_rate: baseline 0.4 -> candidate 0.8" in out
    assert main(["gate", "--baseline", str(cand), "--candidate", str(base), "--min-delta", "0.1"]) == 1
    assert capsys.readouterr().out.startswith("REJECT")
    (tmp_path / "empty").mkdir()
    assert (
        main(["gate", "--baseline", str(base), "--candidate", str(tmp_path / "empty"), "--min-delta", "0"])
        == 2
    )
    assert "manifest.json: file not found" in capsys.readouterr().err
    assert (
        main(
            [
                "gate",
                "--baseline",
                str(base),
                "--candidate",
                str(cand),
                "--min-delta",
                "0",
                "--metric",
                "nope",
            ]
        )
        == 2
    )
    assert "metric 'nope' not in the summary" in capsys.readouterr().err
    with pytest.raises(DataError, match="run folder not found"):
        gate(tmp_path / "missing", cand, 0.0)


def test_unusable_summary_metric_and_min_delta_are_named(tmp_path: Path, capsys: Any) -> None:
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 8)
    flags = ["gate", "--baseline", str(base), "--candidate", str(cand)]
    assert main([*flags, "--min-delta", "nan"]) == 2
    assert "error: min_delta must be finite, got nan" in capsys.readouterr().err
    # a summary key that exists but is not a number (a per-category count table)
    assert main([*flags, "--min-delta", "0", "--metric", "counts_by_category"]) == 2
    err = capsys.readouterr().err
    assert f"{base / 'summary.json'}: metric 'counts_by_category' is not a finite number: {{" in err
    (cand / "summary.json").write_text("[0.8]")
    assert main([*flags, "--min-delta", "0"]) == 2
    assert f"{cand / 'summary.json'}: summary must be a JSON object" in capsys.readouterr().err
    lab = tmp_path / "lab"  # a lab run folder: a manifest, but not an eval or select run's
    lab.mkdir()
    (lab / "manifest.json").write_text(json.dumps({"kind": "palaestra-lab-manifest", "lab": "kl"}))
    assert main(["gate", "--baseline", str(base), "--candidate", str(lab), "--min-delta", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{lab / 'manifest.json'}: not a palaestra run manifest (kind must be 'palaestra-run-manifest')"
        in err
    )


def test_training_run_is_refused_with_the_command_to_evaluate_it(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4)
    train = tmp_path / "train"
    train.mkdir()
    (train / "manifest.json").write_text(json.dumps({"kind": "train"}))
    with pytest.raises(DataError, match="the candidate is a training run") as caught:
        gate(base, train, min_delta=0.0)
    assert f"--model {train / 'model.npz'}" in str(caught.value)
    with pytest.raises(DataError, match="the baseline is a training run"):
        gate(train, base, min_delta=0.0)


def test_unknown_metric_lists_only_the_numeric_ones(tmp_path: Path) -> None:
    base = eval_run(tmp_path, "base", 4)
    cand = eval_run(tmp_path, "cand", 8)
    summary_path = cand / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["flag"] = True  # a bool is not a metric
    summary_path.write_text(json.dumps(summary))
    numeric = sorted(k for k, v in summary.items() if type(v) in (int, float))
    assert "pass_rate" in numeric and "flag" not in numeric and "counts_by_category" not in numeric
    with pytest.raises(DataError, match="metric 'nope' not in the summary") as caught:
        gate(cand, base, min_delta=0.0, metric="nope")
    assert str(caught.value).endswith(f"numeric metrics: {', '.join(numeric)}")
