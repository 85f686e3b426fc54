"""KL lab: the closed-form KL-regularised optimum, its trade-off curve and the choice rule."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

from palaestra.cli import main
from palaestra.labs.kl import (
    DEFAULT_REF,
    DEFAULT_REWARDS,
    KLConfig,
    choose_by_objective,
    default_candidates,
    kl_divergence,
    kl_optimal_policy,
    kl_tradeoff,
    run_kl_lab,
)
from palaestra.trajectories.io import DataError

R, Q = np.array(DEFAULT_REWARDS), np.array(DEFAULT_REF) / sum(DEFAULT_REF)


def read_csv(path) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_kl_and_reward_rise_monotonically_as_beta_falls() -> None:
    betas = np.logspace(2, -2, 30)  # high to low
    pts = kl_tradeoff(R, Q, betas)
    kls = np.array([p.kl for p in pts])
    ers = np.array([p.expected_reward for p in pts])
    assert np.all(np.diff(kls) > 0)
    assert np.all(np.diff(ers) > 0)
    assert kls[0] < 1e-4 and ers[0] == pytest.approx(float(Q @ R), abs=1e-3)  # leash on: the reference
    assert ers[-1] == pytest.approx(R.max(), abs=1e-6)  # leash off: the best candidate
    assert kls[-1] == pytest.approx(-np.log(Q[np.argmax(R)]), abs=1e-4)


@pytest.mark.parametrize("beta", [0.03, 0.3, 3.0])
def test_closed_form_is_the_optimum(beta: float) -> None:
    pi = kl_optimal_policy(R, Q, beta)
    value = float(pi @ R) - beta * kl_divergence(pi, Q)
    assert value == pytest.approx(beta * np.log(np.sum(Q * np.exp(R / beta))), rel=1e-9)
    rng = np.random.default_rng(0)
    for other in rng.dirichlet(np.ones(R.size), size=200):
        assert float(other @ R) - beta * kl_divergence(other, Q) <= value + 1e-12


def test_kl_divergence_edges() -> None:
    assert kl_divergence(Q, Q) == pytest.approx(0.0)
    assert kl_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert kl_divergence([0.5, 0.5], [1.0, 0.0]) == float("inf")
    pi = kl_optimal_policy([1.0, 5.0, 0.0], [0.5, 0.0, 0.5], 0.01)  # no mass where the reference has none
    assert pi[1] == 0.0 and pi[0] == pytest.approx(1.0)


def test_choice_rule_picks_per_beta() -> None:
    cands = default_candidates(R, Q)
    choices = choose_by_objective(cands, R, Q, [100.0, 0.1, 0.001])
    assert [c.winner for c in choices] == ["reference", "optimum@beta=0.1", "greedy"]
    for c in choices:
        assert max(c.scores.values()) <= c.optimum + 1e-12
        assert c.scores[c.winner] == max(c.scores.values())


def test_bad_tables_name_the_field() -> None:
    with pytest.raises(DataError, match="ref"):
        kl_tradeoff([0.0, 1.0], [0.5, 0.25, 0.25], [1.0])
    with pytest.raises(DataError, match="beta"):
        kl_optimal_policy(R, Q, 0.0)
    with pytest.raises(DataError, match="candidate 'x'"):
        choose_by_objective({"x": [0.5, 0.6]}, [0.0, 1.0], [0.5, 0.5], [1.0])


def test_random_table_is_seeded() -> None:
    a = run_kl_lab(KLConfig(random_candidates=6, seed=4))
    b = run_kl_lab(KLConfig(random_candidates=6, seed=4))
    assert np.array_equal(a.rewards, b.rewards) and a.rewards.size == 6
    assert a.numbers["kl_monotone_as_beta_falls"] and a.numbers["reward_monotone_as_beta_falls"]


def test_cli_writes_every_artifact(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "kl"
    assert main(["lab", "kl", "--outdir", str(out), "--candidate", "mine=0,0,0,0,0,0,0.5,0.5"]) == 0
    assert "wrote" in capsys.readouterr().out
    for name in ("kl_tradeoff.csv", "kl_choice.csv", "manifest.json", "summary.md", "README.md"):
        assert (out / name).is_file(), name
    rows = read_csv(out / "kl_tradeoff.csv")
    betas = [float(r["beta"]) for r in rows]
    assert betas == sorted(betas, reverse=True)
    kls = [float(r["kl"]) for r in rows]
    assert all(np.diff(kls) > 0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["lab"] == "kl" and manifest["knobs"]["betas"]
    assert manifest["knobs"]["extra_candidates"] == {"mine": [0, 0, 0, 0, 0, 0, 0.5, 0.5]}
    choice = read_csv(out / "kl_choice.csv")
    assert {r["candidate"] for r in choice} >= {"reference", "greedy", "mine"}
    assert sum(r["winner"] == "True" for r in choice) == len(rows)
    summary = (out / "summary.md").read_text()
    assert "Choice rule" in summary and f"{manifest['numbers']['kl_at_beta_min']:.4g}" in summary
    try:
        import matplotlib  # noqa: F401

        assert (out / "kl_tradeoff.png").stat().st_size > 1000
        assert "kl_tradeoff.png" in manifest["artifacts"]
    except ImportError:
        assert "matplotlib is not installed" in summary


def test_missing_matplotlib_is_noted_not_fatal(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    res = run_kl_lab(KLConfig(betas=(1.0, 0.1)), tmp_path / "kl")
    assert res.outdir is not None
    assert not (res.outdir / "kl_tradeoff.png").exists()
    assert "kl_tradeoff.png not drawn: matplotlib is not installed" in (res.outdir / "summary.md").read_text()
    assert (res.outdir / "kl_tradeoff.csv").is_file()


def test_unusable_tables_and_flags_are_named(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    def lab(*flags: str) -> str:
        assert main(["lab", "kl", "--outdir", str(tmp_path / "kl"), "--no-plot", *flags]) == 2
        return capsys.readouterr().err  # type: ignore[no-any-return]

    assert "palaestra lab: error: rewards: need at least 2 candidates, got 1" in lab(
        "--rewards", "1", "--ref", "1"
    )
    err = lab("--rewards", "0,1", "--ref", "1.5,-0.5")
    assert "ref: probabilities must be >= 0 with a positive sum, got [1.5, -0.5]" in err
    assert "ref: probabilities must be >= 0 with a positive sum, got [0.0, 0.0]" in lab(
        "--rewards", "0,1", "--ref", "0,0"
    )
    assert "random_candidates: need at least 2, got 1" in lab("--random", "1")
    assert "--candidate: expected NAME=P1,P2,..., got 'mine'" in lab("--candidate", "mine")
    assert "--candidate: expected NAME=P1,P2,..., got '=0.5,0.5'" in lab("--candidate", "=0.5,0.5")
    assert "--betas: item 1 ('inf') is not finite" in lab("--betas", "1,inf")
    (tmp_path / "file").write_text("not a folder")
    assert main(["lab", "kl", "--outdir", str(tmp_path / "file"), "--no-plot"]) == 2
    assert f"{tmp_path / 'file'}: outdir exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "not a folder"
    # the same checks on the API, where a value can be non-finite and a list empty
    with pytest.raises(DataError, match=r"rewards/ref: values must be finite"):
        KLConfig(rewards=(0.0, float("nan")), ref=(0.5, 0.5)).table()
    with pytest.raises(DataError, match=r"betas: need at least one beta"):
        run_kl_lab(KLConfig(betas=()))
    with pytest.raises(DataError, match=r"candidates: need at least one candidate policy"):
        choose_by_objective({}, R, Q, [1.0])
