"""Loop A (`palaestra eval`): artifacts, Locked-Room facts in the manifest, input errors naming file:line,
live sampling over real HTTP, and the shipped-data builder."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from palaestra.cli import main
from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import evaluate_completions, evaluate_model
from palaestra.evals.inputs import load_dataset
from palaestra.evals.manifest import dataset_fingerprint, prompt_template_hash
from palaestra.testing import ScriptedServer
from palaestra.trajectories.io import DataError, read_jsonl, sha256_file
from palaestra.trajectories.seeds import derive_seed


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def examples() -> list[dict[str, Any]]:
    exs = load_split("dev")[:5]
    return [*exs, {"id": "broken-1", "prompt": "What is 1+1? Reply with one line: Final: <int>"}]


@pytest.fixture
def dataset(tmp_path: Path, examples: list[dict[str, Any]]) -> Path:
    return write(tmp_path / "data.jsonl", examples)


def completions_for(examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    a = [e.get("expected_answer", "0") for e in examples]
    texts = [
        f"Final: {a[0]}",  # ok
        f"Final: {int(a[1]) + 1}",  # wrong_answer -> model_math
        f"Final:  {a[2]}",  # extra_whitespace, naive accepts -> verifier_suspect
        "",  # empty -> model_format
        f"Final: {a[4]}\u200b",  # non_ascii, naive accepts -> verifier_suspect
        "Final: 2",  # broken example -> data_invalid
    ]
    return [{"id": e["id"], "completion": t, "note": i} for i, (e, t) in enumerate(zip(examples, texts))]


def test_eval_artifacts(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]) -> None:
    comp = write(tmp_path / "comp.jsonl", completions_for(examples))
    run = evaluate_completions(dataset, comp, tmp_path / "run")
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "manifest.json",
        "results.jsonl",
        "summary.json",
    ]

    results = read_jsonl(out / "results.jsonl")
    assert [r["id"] for r in results] == [e["id"] for e in examples]
    by = {r["id"]: r for r in results}
    ids = [e["id"] for e in examples]
    assert [by[i]["outcome"] for i in ids] == [
        "ok",
        "wrong_answer",
        "extra_whitespace",
        "empty",
        "non_ascii",
        "invalid_example",
    ]
    assert [by[i]["category"] for i in ids] == [
        "ok",
        "model_math",
        "verifier_suspect",
        "model_format",
        "verifier_suspect",
        "data_invalid",
    ]
    assert by[ids[2]]["table_category"] == "model_format" and by[ids[2]]["suspect"] is True
    assert by[ids[2]]["cross_check"] == {"strict": "extra_whitespace", "lenient": "ok"}
    assert by[ids[0]]["reward"] == 1.0 and by[ids[1]]["reward"] == 0.0
    assert by[ids[1]]["details"]["reason"]
    assert by[ids[4]]["completion_preview"].endswith("\u200b")
    assert by[ids[3]]["extra"] == {"note": 3}

    summary = json.loads((out / "summary.json").read_text())
    assert summary == run.summary
    assert summary["n"] == 6 and summary["pass_rate"] == pytest.approx(1 / 6)
    assert summary["mean_reward"] == pytest.approx(1 / 6)
    assert summary["counts_by_outcome"]["wrong_answer"] == 1
    assert summary["counts_by_category"] == {
        "ok": 1,
        "model_math": 1,
        "model_format": 1,
        "data_invalid": 1,
        "verifier_suspect": 2,
    }

    m = json.loads((out / "manifest.json").read_text())
    assert m["loop"] == "A" and m["command"] == "eval"
    assert m["inputs"]["dataset"]["sha256"] == sha256_file(dataset)
    assert m["inputs"]["completions"]["sha256"] == sha256_file(comp)
    assert m["outputs"]["results.jsonl"] == sha256_file(out / "results.jsonl")
    assert m["scorer"] == {"name": "arith-strict", "version": "1.0.0"}
    assert m["cross_check"]["lenient"]["name"] == "arith-naive-TEACHING-ONLY"
    assert m["dataset_fingerprint"] == dataset_fingerprint(examples)
    assert m["prompt_template_hash"] == prompt_template_hash(examples)
    assert m["sampling"] is None and m["seed"] is None and m["selection_n"] is None
    assert m["samples_per_id"] == 1 and m["n_examples"] == 6
    assert m["code"]["palaestra"] and "git" in m["code"]
    assert isinstance(m["command_line"], list) and re.match(r"\d{4}-\d\d-\d\dT", m["created"])

    note = (out / "README.md").read_text()
    assert "Loop A" in note and m["dataset_fingerprint"] in note and "comp.jsonl" in note
    assert "| pass_rate | 0.1667 |" in note


def test_fingerprints_ignore_formatting_and_order(tmp_path: Path, examples: list[dict[str, Any]]) -> None:
    shuffled = list(reversed(examples))
    pretty = tmp_path / "b.jsonl"
    pretty.write_text("".join(json.dumps(e, indent=None, sort_keys=True) + "\n\n" for e in shuffled))
    assert load_dataset(pretty).examples == shuffled
    assert dataset_fingerprint(shuffled) == dataset_fingerprint(examples)
    changed = [dict(e) for e in examples]
    changed[0]["expected_answer"] = "999"
    assert dataset_fingerprint(changed) != dataset_fingerprint(examples)
    assert prompt_template_hash(changed) == prompt_template_hash(examples)


def bad_case(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], kind: str) -> tuple[Path, str]:
    rows: list[Any] = completions_for(examples)
    comp = tmp_path / "comp.jsonl"
    if kind == "malformed_json":
        write(comp, rows[:2])
        comp.write_text(comp.read_text() + '{"id": "x", "completion": \n' + json.dumps(rows[2]) + "\n")
        return comp, f"{comp}:3: malformed JSON"
    if kind == "not_object":
        write(comp, [*rows[:3], ["list"], *rows[3:]])
        return comp, f"{comp}:4: expected a JSON object"
    if kind == "no_completion":
        rows[1] = {"id": rows[1]["id"]}
        write(comp, rows)
        return comp, f"{comp}:2: field 'completion' is missing"
    if kind == "completion_not_str":
        rows[2]["completion"] = 42
        write(comp, rows)
        return comp, f"{comp}:3: field 'completion' must be a string, got int"
    if kind == "unknown_id":
        rows.insert(1, {"id": "nope", "completion": "Final: 1"})
        write(comp, rows)
        return comp, f"{comp}:2: id 'nope' is not in the dataset"
    if kind == "duplicate_id":
        rows.append(dict(rows[0]))
        write(comp, rows)
        return comp, f"{comp}:7: duplicate id '{rows[0]['id']}' (first at line 1)"
    if kind == "missing_id":
        write(comp, rows[:3] + rows[4:])
        return comp, f"{dataset}:4: id '{examples[3]['id']}' has no completion in {comp} (1 of 6"
    if kind == "bad_logprob":
        rows[0]["sum_logprob"] = "high"
        write(comp, rows)
        return comp, f"{comp}:1: field 'sum_logprob' must be a finite number or null"
    if kind == "mixed_sample":
        rows[3]["sample"] = 0
        write(comp, rows)
        return comp, f"{comp}:4: this row has a 'sample' field, unlike the rows before it"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "malformed_json",
        "not_object",
        "no_completion",
        "completion_not_str",
        "unknown_id",
        "duplicate_id",
        "missing_id",
        "bad_logprob",
        "mixed_sample",
    ],
)
def test_bad_completions_name_file_and_line(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], kind: str
) -> None:
    comp, message = bad_case(tmp_path, dataset, examples, kind)
    with pytest.raises(DataError) as info:
        evaluate_completions(dataset, comp, tmp_path / "run")
    assert message in str(info.value)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_bad_dataset_names_file_and_line(tmp_path: Path, examples: list[dict[str, Any]]) -> None:
    dup = write(tmp_path / "dup.jsonl", [*examples, examples[2]])
    with pytest.raises(
        DataError, match=re.escape(f"{dup}:7: duplicate id '{examples[2]['id']}' (first at line 3)")
    ):
        load_dataset(dup)
    no_id = write(tmp_path / "noid.jsonl", [examples[0], {"prompt": "x"}])
    with pytest.raises(DataError, match=re.escape(f"{no_id}:2: field 'id' must be a non-empty string")):
        load_dataset(no_id)


def test_cli_exit_codes(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], capsys: Any) -> None:
    comp = write(tmp_path / "comp.jsonl", completions_for(examples))
    assert (
        main(["eval", "--dataset", str(dataset), "--completions", str(comp), "--outdir", str(tmp_path / "r")])
        == 0
    )
    assert "pass_rate=0.1667" in capsys.readouterr().out
    assert (
        main(
            [
                "eval",
                "--dataset",
                str(dataset),
                "--scorer",
                "no-such",
                "--completions",
                str(comp),
                "--outdir",
                str(tmp_path / "u"),
            ]
        )
        == 2
    )
    assert "unknown scorer 'no-such'" in capsys.readouterr().err
    assert main(["eval", "--dataset", str(dataset), "--outdir", str(tmp_path / "t")]) == 2
    assert "give exactly one of --completions" in capsys.readouterr().err
    bad, message = bad_case(tmp_path, dataset, examples, "unknown_id")
    assert (
        main(["eval", "--dataset", str(dataset), "--completions", str(bad), "--outdir", str(tmp_path / "s")])
        == 2
    )
    assert message in capsys.readouterr().err


def test_several_samples_and_sidecar(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]) -> None:
    rows = [dict(r, sample=j) for j in (1, 0) for r in completions_for(examples)]
    comp = write(tmp_path / "multi.jsonl", rows)
    meta = {"sampling": {"temperature": 0.7, "max_tokens": 16}, "seed": 11, "policy": {"model": "m"}}
    (tmp_path / "multi.meta.json").write_text(json.dumps(meta))
    run = evaluate_completions(dataset, comp, tmp_path / "run", scorer="arith-naive-TEACHING-ONLY")
    assert run.summary["n"] == 12 and run.summary["samples_per_id"] == 2
    # both samples of an id are the same text here: pass@1 = pass_rate, pass@2 = fraction of ids solved
    assert run.summary["pass@1"] == pytest.approx(run.summary["pass_rate"])
    assert run.summary["pass@2"] == pytest.approx(run.summary["pass_rate"])
    assert [(r["id"], r["sample"]) for r in run.results[:2]] == [
        (examples[0]["id"], 0),
        (examples[0]["id"], 1),
    ]
    assert run.manifest["sampling"] == meta["sampling"] and run.manifest["seed"] == 11
    assert run.manifest["policy"] == {"model": "m"}
    assert run.manifest["inputs"]["completions_meta"]["sha256"] == sha256_file(tmp_path / "multi.meta.json")
    # naive scorer: accepted exploits are ok by its table but flagged suspect by the strict cross-check
    assert run.summary["counts_by_category"]["verifier_suspect"] == 4
    uneven = write(tmp_path / "uneven.jsonl", rows[:-1])
    with pytest.raises(DataError, match="has 1 completions but"):
        evaluate_completions(dataset, uneven, tmp_path / "run2")


class EndpointModel:
    """A ChatModel bound to an OpenAI-compatible URL (the real openai client over HTTP)."""

    def __init__(self, name: str, base_url: str) -> None:
        self.name = name
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key="test", max_retries=0)

    def openai_client(self) -> openai.AsyncOpenAI:
        return self._client


def test_live_eval_over_http(tmp_path: Path, dataset: Path, examples: list[dict[str, Any]]) -> None:
    answers = {e["prompt"]: e.get("expected_answer", "0") for e in examples}

    def script(request: dict[str, Any], n: int) -> str:
        gold = answers[request["messages"][-1]["content"]]
        return f"Final: {gold}" if request["seed"] % 2 == 0 else "Final: 1000"

    with ScriptedServer(script, model="scripted") as server:
        model = EndpointModel("scripted", server.base_url)
        run = asyncio.run(
            evaluate_model(
                dataset,
                model,
                tmp_path / "live",
                samples=3,
                temperature=0.5,
                max_tokens=8,
                seed=7,
                concurrency=4,
            )
        )
        seeds = sorted(r["seed"] for r in server.requests)
        assert all(r["temperature"] == 0.5 and r["max_tokens"] == 8 for r in server.requests)
    assert server.calls == 18
    expected = sorted(derive_seed(7, e["id"], j) for e in examples for j in range(3))
    assert seeds == expected
    out = tmp_path / "live"
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 18 and {s["seed"] for s in samples} == set(expected)
    meta = json.loads((out / "samples.meta.json").read_text())
    m = run.manifest
    assert (
        m["sampling"]
        == meta["sampling"]
        == {
            "rollout": "palaestra.envs.rollouts.single_turn_rollout",
            "temperature": 0.5,
            "top_p": 1.0,
            "max_tokens": 8,
            "samples_per_id": 3,
            "system_prompt": None,
        }
    )
    assert m["seed"] == 7 and m["policy"]["model"] == "scripted" and m["samples_per_id"] == 3
    wins = sum(1 for e in examples[:5] for j in range(3) if derive_seed(7, e["id"], j) % 2 == 0)
    assert run.summary["counts_by_outcome"].get("ok", 0) == wins
    assert "sampled live" in (out / "README.md").read_text()


def test_make_data_with_a_tiny_random_model(tmp_path: Path) -> None:
    from palaestra.evals import make_data

    tiny = make_data.tiny_random_model(tmp_path / "tiny.npz", seed=1)
    paths = make_data.build(tmp_path / "data", model=str(tiny), limit=4, samples=3, max_tokens=6)
    dev = read_jsonl(paths["math_dev"])
    frozen = read_jsonl(paths["frozen"])
    pack = read_jsonl(paths["pack"])
    assert [r["id"] for r in frozen] == [e["id"] for e in dev] and len(dev) == 4
    assert len(pack) == 12 and all(isinstance(r["sum_logprob"], float) for r in pack)
    meta = json.loads(Path(paths["frozen"]).with_suffix(".meta.json").read_text())
    assert meta["sampling"]["temperature"] == 0.0 and meta["sampling"]["samples_per_id"] == 1
    # same seed, same model: the builder reproduces its rows (sum_logprob up to float32 batch noise)
    again = make_data.build(tmp_path / "again", model=str(tiny), limit=4, samples=3, max_tokens=6)
    for key in ("math_dev", "frozen", "pack"):
        assert make_data.compare(Path(again[key]), Path(paths[key])) == []
    assert Path(again["math_dev"]).read_bytes() == Path(paths["math_dev"]).read_bytes()
    # the shipped-data format round-trips through the harness
    run = evaluate_completions(paths["math_dev"], paths["frozen"], tmp_path / "run")
    assert run.manifest["sampling"] == meta["sampling"]


def test_cli_live_eval_against_a_remote_endpoint(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], capsys: Any
) -> None:
    answers = {e["prompt"]: e.get("expected_answer", "0") for e in examples}
    with ScriptedServer(
        lambda req, n: f"Final: {answers[req['messages'][-1]['content']]}", model="far"
    ) as server:
        code = main(
            [
                "eval",
                "--dataset",
                str(dataset),
                "--model",
                "far",
                "--base-url",
                server.base_url,
                "--samples",
                "2",
                "--temperature",
                "0",
                "--max-tokens",
                "12",
                "--seed",
                "3",
                "--concurrency",
                "4",
                "--outdir",
                str(tmp_path / "run"),
            ]
        )
        url = server.base_url
    assert code == 0, capsys.readouterr().err
    assert server.calls == 12 and all(r["model"] == "far" for r in server.requests)
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["policy"] == {"model": "far", "backend": "remote", "base_url": url}
    assert m["sampling"]["temperature"] == 0.0 and m["sampling"]["samples_per_id"] == 2 and m["seed"] == 3
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["counts_by_outcome"] == {"invalid_example": 2, "ok": 10}
    assert "pass_rate=0.8333" in capsys.readouterr().out


def test_policy_record_keeps_secrets_out() -> None:
    from palaestra.evals.sampling import policy_record

    model = EndpointModel("m", "http://127.0.0.1:9/v1")
    record = policy_record(model, base_url="https://user:sk-secret@api.example.com:8443/v1?key=sk-2")
    assert record["base_url"] == "https://api.example.com:8443/v1" and "sk-" not in json.dumps(record)


SHIPPED = Path(__file__).resolve().parents[1] / "palaestra" / "evals" / "data"


def test_shipped_harness_data_is_consistent(tmp_path: Path) -> None:
    from palaestra.models.registry import path_of

    dev = read_jsonl(SHIPPED / "math_dev.jsonl")
    assert dev == load_split("dev")
    frozen = read_jsonl(SHIPPED / "frozen_rollouts_dev.jsonl")
    pack = read_jsonl(SHIPPED / "selection_pack_dev.jsonl")
    assert [(r["id"], r["sample"]) for r in frozen] == [(e["id"], 0) for e in dev]
    assert [(r["id"], r["sample"]) for r in pack] == [(e["id"], j) for e in dev for j in range(8)]
    assert all(isinstance(r["sum_logprob"], float) and r["sum_logprob"] <= 0 for r in frozen + pack)
    for name, temperature, k in (("frozen_rollouts_dev", 0.0, 1), ("selection_pack_dev", 1.0, 8)):
        meta = json.loads((SHIPPED / f"{name}.meta.json").read_text())
        assert meta["sampling"]["temperature"] == temperature and meta["sampling"]["samples_per_id"] == k
        assert meta["dataset"]["sha256"] == sha256_file(SHIPPED / "math_dev.jsonl")
        assert meta["policy"]["model"] == "arith-base"
        assert meta["policy"]["checkpoint_sha256"] == sha256_file(path_of("arith-base")), (
            "arith-base changed since the harness data was built: run python -m palaestra.evals.make_data"
        )
    run = evaluate_completions(
        SHIPPED / "math_dev.jsonl", SHIPPED / "frozen_rollouts_dev.jsonl", tmp_path / "r"
    )
    card = json.loads(path_of("arith-base").with_suffix(".json").read_text())
    # dev is 200 of the 1000 val examples the card's greedy accuracy was measured on
    assert abs(run.summary["pass_rate"] - card["val_accuracy_greedy"]) < 0.1
    assert run.manifest["sampling"]["temperature"] == 0.0


@pytest.mark.slow
def test_shipped_harness_data_rebuilds() -> None:
    from palaestra.evals import make_data

    assert make_data.main(["--check"]) == 0


def test_unusable_eval_input_is_named(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], capsys: Any
) -> None:
    def eval_cli(*flags: str) -> tuple[int, str]:
        code = main(["eval", "--dataset", str(dataset), "--outdir", str(tmp_path / "run"), *flags])
        return code, capsys.readouterr().err

    empty = write(tmp_path / "empty.jsonl", [])
    code = main(
        ["eval", "--dataset", str(empty), "--completions", str(empty), "--outdir", str(tmp_path / "e")]
    )
    assert code == 2 and f"{empty}: dataset is empty" in capsys.readouterr().err
    rows = [{"id": e["id"], "completion": "Final: 1", "sample": 0} for e in examples]
    rows[2]["sample"] = -1
    comp = write(tmp_path / "comp.jsonl", rows)
    code, err = eval_cli("--completions", str(comp))
    assert code == 2 and f"{comp}:3: field 'sample' must be an int >= 0, got -1" in err
    rows[2]["sample"] = 0
    write(comp, rows)
    side = tmp_path / "comp.meta.json"
    side.write_text("[]")
    code, err = eval_cli("--completions", str(comp))
    assert code == 2 and f"{side}: sidecar must be a JSON object" in err
    side.write_text(json.dumps({"sampling": "greedy"}))
    code, err = eval_cli("--completions", str(comp))
    assert code == 2 and f"{side}: field 'sampling' must be an object or null" in err
    code, err = eval_cli("--model", "arith-base", "--samples", "0")
    assert code == 2 and "error: samples must be >= 1, got 0" in err
    assert not (tmp_path / "run").exists()


def test_scorer_specs_that_are_not_verifiers_are_named(
    tmp_path: Path, dataset: Path, examples: list[dict[str, Any]], capsys: Any
) -> None:
    from palaestra.envs.arithmetic import StrictFinalVerifier
    from palaestra.evals.inputs import NAIVE, STRICT, cross_check_for, register_scorer

    comp = write(tmp_path / "comp.jsonl", [{"id": "broken-1", "completion": "Final: 2"}])
    for spec, want in [
        ("no_such_module_xyz:Scorer", "cannot import (No module named 'no_such_module_xyz')"),
        ("json:no_such_attr", "cannot import (module 'json' has no attribute 'no_such_attr')"),
        ("math:pi", "3.141592653589793 lacks name/version/score(example, completion)"),
        ("collections:OrderedDict", "OrderedDict() lacks name/version/score(example, completion)"),
        ("json:dumps", "dumps cannot be called with no arguments"),  # a function that needs arguments
    ]:
        flags = ["--completions", str(comp), "--outdir", str(tmp_path / "run"), "--scorer", spec]
        assert main(["eval", "--dataset", str(dataset), *flags]) == 2, spec
        err = capsys.readouterr().err
        assert err.startswith(f"palaestra eval: error: scorer {spec!r}: {want}"), err
        assert "Traceback" not in err
    with pytest.raises(ValueError, match="scorer name must be non-empty and contain no ':', got 'a:b'"):
        register_scorer("a:b", StrictFinalVerifier)
    with pytest.raises(ValueError, match="got ''"):
        register_scorer("", StrictFinalVerifier)
    # a registered scorer with a cross-check pair: what the lenient one accepts and it rejects is suspect
    register_scorer("strict-checked-test", StrictFinalVerifier, cross_check=(STRICT, NAIVE))
    pair = cross_check_for("strict-checked-test")
    assert pair is not None and (pair.strict.name, pair.lenient.name) == (STRICT, NAIVE)
    register_scorer("strict-unchecked-test", StrictFinalVerifier)
    assert cross_check_for("strict-unchecked-test") is None
    comp = write(tmp_path / "all.jsonl", completions_for(examples))
    checked = evaluate_completions(dataset, comp, tmp_path / "checked", scorer="strict-checked-test")
    unchecked = evaluate_completions(dataset, comp, tmp_path / "unchecked", scorer="strict-unchecked-test")
    assert checked.summary["suspect"] == 2 and unchecked.summary["suspect"] == 0
    assert checked.manifest["cross_check"]["lenient"]["name"] == NAIVE


def test_cli_live_eval_reports_a_failed_request_in_one_line(
    tmp_path: Path, dataset: Path, capsys: Any
) -> None:
    from palaestra.testing import Reply

    with ScriptedServer(
        lambda req, n: Reply(status=400, content="model 'far' does not exist"), model="far"
    ) as s:
        flags = ["--model", "far", "--base-url", s.base_url, "--concurrency", "1"]
        code = main(["eval", "--dataset", str(dataset), "--outdir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and s.calls >= 1
    # the gather error's first line (which request failed and why), not its traceback
    assert err.splitlines() == [err.rstrip("\n")] and err.startswith("palaestra eval: error: 1 of 6 rollouts")
    assert "BadRequestError: Error code: 400 - model 'far' does not exist" in err
    assert not (tmp_path / "run").exists()  # a half-sampled eval is not a result


def test_make_data_compare_lists_each_difference(tmp_path: Path) -> None:
    from palaestra.evals.make_data import compare

    rows = [{"id": "a", "completion": "Final: 1", "sum_logprob": -1.0}, {"id": "b", "completion": "x"}]
    fresh = write(tmp_path / "fresh.jsonl", rows)
    assert compare(fresh, tmp_path / "gone.jsonl") == [f"{tmp_path / 'gone.jsonl'}: missing"]
    short = write(tmp_path / "short.jsonl", rows[:1])
    assert compare(fresh, short) == [f"{short}: 1 rows, rebuilt 2"]
    near = write(tmp_path / "near.jsonl", [dict(rows[0], sum_logprob=-1.0005), rows[1]])
    assert compare(fresh, near) == []  # sum_logprob within the tolerance
    other = write(tmp_path / "other.jsonl", [dict(rows[0], sum_logprob=-1.01), dict(rows[1], completion="y")])
    assert compare(fresh, other) == [f"{other}:1: rebuilt row differs", f"{other}:2: rebuilt row differs"]
