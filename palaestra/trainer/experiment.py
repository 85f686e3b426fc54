"""``palaestra.Experiment``: a whole Loop C run from a config, with artifacts that prove what changed.

Each step: take ``groups_per_step`` scenarios (a seeded order that depends only on the run seed and the step),
run ``group_size`` rollouts of each concurrently (sampling seeds derived from run seed, step, group and rollout
index), score each group as it finishes (a verifier, a RULER judge or a simulated judge), update the policy,
and every ``validation.every`` steps measure verifier accuracy on the validation split; stopping watches that
metric. After every step the history line is appended and then ``checkpoints/latest.npz`` is written, so a run
killed at any moment resumes (``Experiment.resume``) with no lost and no repeated step, and ends with the same
weights as an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from palaestra.envs.registry import EnvSpec, get_env, load_callable
from palaestra.trainer.builders import (
    RolloutReward,
    build_model,
    build_reward,
    derive_seed,
    judge_cache_path,
    locked_room,
    resolve_backend,
    reward_info,
    with_quantize,
)
from palaestra.trainer.checkpoints import save_checkpoint
from palaestra.trainer.expconfig import ExperimentConfig, check_env_options, config_from_dict, load_config
from palaestra.trainer.grpo import GRPOTrainer
from palaestra.trainer.pipeline import RolloutPipeline
from palaestra.trainer.runfolder import (
    RunFolder,
    accumulate_totals,
    judge_usage,
    plot_curves,
    prefixed,
    progress_line,
)
from palaestra.trainer.stopping import StopDecision, ValidationStopping
from palaestra.trainer.validation import validate
from palaestra.trajectories.gather import gather_trajectory_groups
from palaestra.trajectories.io import DataError, sha256_file
from palaestra.trajectories.runs import (
    code_version,
    command_line,
    read_json,
    redact,
    utc_now,
    write_json,
    write_run_note,
)
from palaestra.trajectories.types import TrajectoryGroup

Printer = Callable[[str], None]


class Experiment:
    """A configured experiment. ``await exp.run()`` (or ``exp.run_sync()``) returns the summary dict.

    ``model``, ``rollout`` and ``reward`` may be passed as objects to override what the config names (the
    Python API); the config is still what the manifest records.
    """

    def __init__(
        self,
        config: ExperimentConfig | Mapping[str, Any],
        *,
        model: Any = None,
        rollout: Callable[..., Any] | None = None,
        reward: Any = None,
        printer: Printer | None = print,
        yes: bool = False,
    ) -> None:
        self.config = config if isinstance(config, ExperimentConfig) else config_from_dict(dict(config))
        train = self.config.train
        if train.lr_schedule != "constant" and "decay_steps" not in train.model_fields_set:
            # anneal over this run; resolved here so config.json (and so a resume) records the value
            self.config.train = train.model_copy(update={"decay_steps": self.config.run.max_steps})
        self.folder = RunFolder(self.config.output_path())
        self.env: EnvSpec = get_env(self.config.env.name)
        self._model = model
        self._rollout = rollout
        self._reward = reward
        self.printer = printer
        self.yes = yes  # confirmed: may make more judge calls than reward.max_judge_calls
        self.train_examples = self.env.load_split(self.config.env.train_split)
        val = self.env.load_split(self.config.env.val_split)
        self.val_examples = (
            val[: self.config.validation.max_examples] if self.config.validation.max_examples else val
        )
        if not self.train_examples:
            raise DataError(f"split {self.config.env.train_split!r} of {self.env.name!r} is empty")
        check_env_options(self.config, self._option_takers())
        self._resuming = False
        self._max_steps_override: int | None = None

    @classmethod
    def from_toml(cls, path: str | Path, **kwargs: Any) -> Experiment:
        """Load a TOML config (errors name file and field) and build the experiment."""
        return cls(load_config(path), **kwargs)

    @classmethod
    def resume(cls, run_dir: str | Path, *, max_steps: int | None = None, **kwargs: Any) -> Experiment:
        """Continue the run in ``run_dir`` from its latest checkpoint (``previous.npz`` if latest is damaged).

        ``max_steps`` raises the step budget: a run that stopped on ``max_steps`` goes on to the new budget; one
        its stopping rule ended is refused (:class:`DataError`), as is a budget below the steps already done."""
        source = str(Path(run_dir) / "config.json")
        data = read_json(Path(run_dir) / "config.json")
        if max_steps is not None:
            run = data.get("run") if isinstance(data, dict) else None
            data = {**data, "run": {**(run if isinstance(run, dict) else {}), "max_steps": max_steps}}
            source = f"{source} with --max-steps {max_steps}"
        cfg = config_from_dict(data, source=source)
        cfg.run.output_dir = str(run_dir)
        exp = cls(cfg, **kwargs)
        exp._resuming = True
        exp._max_steps_override = max_steps
        return exp

    # ---- helpers -------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self.printer is not None and self.config.run.progress:
            self.printer(text)

    def examples_for_step(self, step: int) -> list[dict[str, Any]]:
        """The scenarios of step ``step`` (1-based): a seeded permutation per epoch, walked in order."""
        import numpy as np

        n, p = len(self.train_examples), self.config.run.groups_per_step
        out = []
        for pos in range((step - 1) * p, step * p):
            epoch, i = divmod(pos, n)
            if getattr(self, "_epoch_order", (None,))[0] != epoch:  # one permutation per epoch, kept
                rng = np.random.default_rng(derive_seed(self.config.run.seed, "data", epoch))
                self._epoch_order = (epoch, rng.permutation(n))
            out.append(self.train_examples[int(self._epoch_order[1][i])])
        return out

    def _rollout_kwargs(self, fn: Callable[..., Any], seed: int) -> dict[str, Any]:
        wanted = {
            "seed": seed,
            "temperature": self.config.env.temperature,
            "max_tokens": self.config.env.max_tokens,
            **self.config.env.options,
        }
        params = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return wanted
        return {k: v for k, v in wanted.items() if k in params}

    def _validate_kwargs(self, fn: Callable[..., Any], seed: int) -> dict[str, Any]:
        cfg = self.config
        wanted = {
            "seed": seed,
            "greedy": cfg.validation.greedy,
            "sampled": cfg.validation.sampled,
            "max_tokens": cfg.env.max_tokens,
            "verifier": cfg.validation.verifier,
            **cfg.env.options,
        }
        params = inspect.signature(fn).parameters
        return {k: v for k, v in wanted.items() if k in params}

    def _manifest(self, model: Any, reward: Any) -> dict[str, Any]:
        cfg = self.config
        data_dir = getattr(importlib.import_module(self.env.splits_module), "DATA_DIR", None)
        fingerprints = {}
        for split in sorted({cfg.env.train_split, cfg.env.val_split}):
            path = Path(data_dir or ".") / f"{split}.jsonl"
            if data_dir is not None and path.exists():
                fingerprints[split] = sha256_file(path)
        manifest: dict[str, Any] = redact(
            {
                "kind": "train",
                "loop": "C",
                "created": utc_now(),
                "command": command_line(),
                "code_version": code_version(),
                "seed": cfg.run.seed,
                "environment": {"name": self.env.name, "prompt_template_sha256": self.env.prompt_hash},
                "dataset_fingerprints": fingerprints,
                "model": {
                    "name": getattr(model, "name", cfg.model.name),
                    "backend": resolve_backend(cfg.model.backend, cfg.model.name)[0],
                    "fingerprint": getattr(model, "fingerprint", None),
                },
                "train_reward": (
                    {
                        "kind": "rollout",
                        "environment": self.env.name,
                        "rollout_options": dict(cfg.env.options),
                    }
                    if cfg.reward.kind == "rollout"
                    else reward_info(cfg, reward)
                ),
                "validation_scorer": cfg.validation.verifier,
                "sampling": {
                    "temperature": cfg.env.temperature,
                    "max_tokens": cfg.env.max_tokens,
                    "group_size": cfg.run.group_size,
                    "groups_per_step": cfg.run.groups_per_step,
                },
                "locked_room": locked_room(cfg, self.env, fingerprints.get(cfg.env.val_split)),
                "config": cfg.model_dump(mode="json"),
            }
        )
        return manifest

    # ---- the run ---------------------------------------------------------------------------------------------
    def run_sync(self) -> dict[str, Any]:
        """Run to the end in a fresh event loop."""
        return asyncio.run(self.run())

    async def run(self) -> dict[str, Any]:
        """Run (or resume) the experiment; returns the summary (also written to summary.json).

        The run folder is locked for the whole run (a second process gets a :class:`DataError`) and probed for
        writing before any work; a folder holding a run with another config is refused (``Experiment.resume``
        continues one). See docs/reliability.md, "Run folders"."""
        self.check_judge_budget()
        if not self._resuming and self.folder.holds_run():
            self.folder.check_same_config(self.config.model_dump(mode="json"))
        self.folder.acquire()
        try:
            return await self._run()
        finally:
            if getattr(self, "_pipe", None) is not None:
                await self._pipe.aclose()  # prefetched rollouts, Ray, the endpoint server
            self.folder.release()

    def planned_judge_calls(self) -> int | None:
        """Judge calls the rest of the run will make at most once per group (steps left x groups_per_step;
        retries add to it, cache hits save), or None when the train reward is not a judge over HTTP."""
        cfg = self.config
        paid = (
            cfg.reward.kind == "judge"
            if self._reward is None
            else getattr(self._reward, "kind", "") == "ruler"
        )
        if not paid:
            return None
        done = 0
        if self.folder.holds_run():
            steps = [int(r.get("step", 0)) for r in self.folder.read_history()]
            done = max(steps, default=0)
        return max(0, cfg.run.max_steps - done) * cfg.run.groups_per_step

    def check_judge_budget(self) -> None:
        """Print the planned judge calls; above ``reward.max_judge_calls`` refuse (:class:`DataError`, before
        any file is written) unless the experiment was confirmed (``yes=True``, ``palaestra train --yes``)."""
        cfg = self.config
        planned = self.planned_judge_calls()
        if planned is None:
            return
        limit = cfg.reward.max_judge_calls
        steps = planned // cfg.run.groups_per_step
        cache = judge_cache_path(cfg, self.folder.root) if self._reward is None else None
        line = (
            f"judge: this run plans {planned:,} judge calls ({steps:,} steps x "
            f"{cfg.run.groups_per_step} groups, one call per group; retries add, cache hits save"
            + (f": cache {cache}" if cache is not None else "")
            + ")"
        )
        if self.printer is not None:
            self.printer(line)
        if limit is not None and planned > limit and not self.yes:
            raise DataError(
                f"refusing to start: {planned:,} planned judge calls ({steps:,} steps x {cfg.run.groups_per_step} "
                f"groups) exceed reward.max_judge_calls = {limit:,}; confirm with --yes (Experiment(yes=True)) or "
                "lower run.max_steps / run.groups_per_step",
                path=self.folder.root,
            )

    def _option_takers(self) -> list[Callable[..., Any]]:
        """The functions ``env.options`` are passed to: the rollout (or group rollout) and the env's validation."""
        cfg, env = self.config, self.env
        if self._rollout is not None:
            fns = [self._rollout]
        else:
            fns = [load_callable(cfg.env.rollout or env.rollout)]
            if cfg.env.rollout is None and cfg.env.group_rollout and env.group_rollout:
                fns.append(load_callable(env.group_rollout))
        if env.validate:
            fns.append(load_callable(env.validate))
        return fns

    def _reconcile_max_steps(self, stopper: ValidationStopping, step: int) -> None:
        """On resume: a run that stopped on its step budget goes on when ``run.max_steps`` is now larger
        (``resume(max_steps=N)`` records N in config.json first, so a kill after that keeps the extension);
        a budget a stopping rule ended, or one below the steps already done, is refused."""
        new, decision, where = self._max_steps_override, stopper.decision, self.folder.root
        if new is not None:
            if decision is not None and decision.reason != "max_steps":
                raise DataError(
                    f"the run stopped at step {decision.step} ({decision.reason}); --max-steps cannot extend a "
                    "run its stopping rule ended (start a new run instead)",
                    path=where,
                )
            if new < step or (new == step and decision is not None):
                raise DataError(f"--max-steps {new}: the run already has {step} steps", path=where)
            write_json(where / "config.json", self.config.model_dump(mode="json"))
        if decision is not None and decision.reason == "max_steps" and self.config.run.max_steps > step:
            stopper.load_state_dict({**stopper.state_dict(), "decision": None})  # the budget grew: go on

    async def _run(self) -> dict[str, Any]:
        cfg, folder = self.config, self.folder
        model = self._model if self._model is not None else build_model(cfg)
        self._model = model
        grouped = self._rollout is None and cfg.env.rollout is None and cfg.env.group_rollout
        grouped = grouped and self.env.group_rollout is not None
        if grouped:
            rollout = load_callable(str(self.env.group_rollout))
        else:
            rollout = self._rollout or load_callable(cfg.env.rollout or self.env.rollout)
        self._grouped = grouped
        self._pipe = pipe = RolloutPipeline(self, model, rollout)  # [run] executor, max_staleness
        rollout = pipe.rollout
        if self._reward is not None:  # reward.quantize applies to any reward (build_reward applies it itself)
            reward = with_quantize(self._reward, cfg.reward.quantize)
        elif cfg.reward.kind == "rollout":
            reward = with_quantize(RolloutReward(), cfg.reward.quantize)
        else:
            reward = build_reward(cfg, folder.root)
        trainer = GRPOTrainer(model, cfg.train)
        stopper = ValidationStopping(
            metric=cfg.validation.metric,
            mode="max",
            every=cfg.validation.every,
            val_size=len(self.val_examples),
            **cfg.stopping.model_dump(exclude={"restore_best"}),
        )
        counters: dict[str, Any] = {
            "step": 0,
            "elapsed": 0.0,
            "base_val": None,
            "best_val": None,
            "totals": {},
        }
        state = folder.load_resume_state()  # checks history.jsonl against it; falls back to previous.npz
        resumed = state is not None
        if state is not None:
            trainer.load_state_dict(state["trainer"])
            stopper.load_state_dict(state["stopper"])
            pipe.load_state_dict(state.get("pipeline"))
            counters = state["counters"]
            dropped = folder.history_dropped
            folder.check_best()
            if stopper.reopen():  # it stopped because no group could be scored: try again
                self.say("the run had stopped on judge_unavailable; resuming with the judge")
            self._reconcile_max_steps(stopper, int(counters["step"]))
            self.say(
                f"resumed {folder.root} at step {counters['step']} ({dropped} unsaved history line(s) dropped)"
            )
        else:
            write_json(folder.root / "config.json", cfg.model_dump(mode="json"))
            write_json(folder.root / "manifest.json", self._manifest(model, reward))
            folder.truncate_history(-1)
        t_start = time.monotonic() - float(counters["elapsed"])

        async def run_validation(step: int) -> dict[str, Any]:
            t0 = time.monotonic()
            seed = derive_seed(cfg.run.seed, "val", step)
            if self.env.validate:  # the environment's own (multi-turn) validation
                fn = load_callable(self.env.validate)
                result: dict[str, Any] = await fn(model, self.val_examples, **self._validate_kwargs(fn, seed))
            else:
                result = await validate(model, self.val_examples, cfg, seed=seed)
            folder.write_val(step, result.pop("rows", []))
            result["seconds"] = time.monotonic() - t0
            return result

        def checkpoint() -> None:
            counters["elapsed"] = time.monotonic() - t_start
            folder.save_latest(
                {
                    "trainer": trainer.state_dict(),
                    "stopper": stopper.state_dict(),
                    "counters": counters,
                    "pipeline": pipe.state_dict(),
                }
            )

        if not resumed:
            val = await run_validation(0)
            counters["base_val"] = counters["best_val"] = val | {"step": 0}
            stopper.update_val(0, val[cfg.validation.metric.removeprefix("val_")])
            save_checkpoint(folder.best, {"trainer": trainer.state_dict(), "step": 0})
            folder.append_history({"step": 0, "time": time.monotonic() - t_start, **prefixed("val", val)})
            checkpoint()
            self.say(f"step 0: base val greedy {val.get('greedy_accuracy', float('nan')):.3f}")

        decision: StopDecision | None = stopper.decision
        while decision is None and counters["step"] < cfg.run.max_steps:
            step = counters["step"] + 1
            pipe.begin(step)
            row = await self._one_step(step, model, rollout, reward, trainer, stopper)
            row.update(pipe.end(step))
            if stopper.should_validate(step) or step == cfg.run.max_steps:
                val = await run_validation(step)
                row.update(prefixed("val", val))
                decision = stopper.update_val(step, val[cfg.validation.metric.removeprefix("val_")])
                if stopper.improved:
                    counters["best_val"] = val | {"step": step}
                    save_checkpoint(folder.best, {"trainer": trainer.state_dict(), "step": step})
            decision = decision or stopper.decision
            counters["step"] = step
            row["time"] = time.monotonic() - t_start
            folder.append_history(row)
            accumulate_totals(counters["totals"], row)
            if step % cfg.run.checkpoint_every == 0 or decision is not None or step == cfg.run.max_steps:
                checkpoint()
            self.say(progress_line(row))
        if decision is None:
            decision = stopper.stop_max_steps(counters["step"])
        checkpoint()
        closer = getattr(reward, "aclose", None)
        if closer is not None and self._reward is None:  # a judge this run built: close its HTTP client
            await closer()
        best_state = folder.load_best_trainer() if cfg.stopping.restore_best else None
        self._restored_best = best_state is not None  # False when best.npz was damaged (reported, set aside)
        if best_state is not None:  # a damaged best.npz is reported and moved aside: the final weights stay
            trainer.load_state_dict(best_state, weights_only=True)
        if hasattr(model, "save") and getattr(model, "backend_kind", "embedded") == "embedded":
            model.save(
                folder.root / "model.npz"
            )  # the policy the run leaves: palaestra eval --model RUN/model.npz
        return self._finish(decision, counters, time.monotonic() - t_start)

    async def _one_step(
        self,
        step: int,
        model: Any,
        rollout: Callable[..., Any],
        reward: Any,
        trainer: GRPOTrainer,
        stopper: ValidationStopping,
    ) -> dict[str, Any]:
        cfg = self.config
        examples = self.examples_for_step(step)
        by_index = dict(enumerate(examples))
        dropped: list[TrajectoryGroup] = []
        rollout_failures = 0

        async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
            nonlocal rollout_failures
            rollout_failures += len(group.exceptions)  # counted before a judge adds its own record
            index = group.metadata["group_index"]
            assert isinstance(index, int)
            scored: TrajectoryGroup | None = await reward.score_group(group, by_index[index])
            if scored is None:
                dropped.append(group)  # not trained on, but its judge calls and faults still count
            return scored

        t0 = time.monotonic()

        def calls(g: int, ex: dict[str, Any]) -> list[Any]:
            if self._grouped:  # one call sampling the whole group
                kw = self._rollout_kwargs(rollout, derive_seed(cfg.run.seed, step, g))
                return [rollout(model, ex, cfg.run.group_size, **kw)]
            return [
                rollout(model, ex, **self._rollout_kwargs(rollout, derive_seed(cfg.run.seed, step, g, i)))
                for i in range(cfg.run.group_size)
            ]

        groups = [
            TrajectoryGroup(
                calls(g, ex),
                metadata={
                    "example_id": str(ex.get("id", g)),
                    "group_index": g,
                    "step": step,
                    "judge_salt": f"{cfg.run.seed}:{step}:{g}",
                },
            )
            for g, ex in enumerate(examples)
        ]
        groups = await gather_trajectory_groups(
            groups,
            max_concurrency=cfg.run.max_concurrency,
            max_exceptions=cfg.run.max_exceptions,
            rollout_timeout=cfg.run.rollout_timeout,
            after_each=score,
            progress=False,
        )
        t_rollout = time.monotonic() - t0
        result = await trainer.step(groups)
        # no scored group (every one dropped, e.g. the judge is down): no train reward, never a collapse.
        # A learned judge's rewards are relative within each group; the stopper watches its absolute score.
        usage = judge_usage(groups)
        train_reward = (
            usage["absolute_sum"] / usage["absolute_n"]
            if usage.get("absolute_n")
            else float(result.metrics.get("reward_mean", 0.0))
        )
        stopper.update_train(step, train_reward if groups else None)
        self.folder.write_samples(step, groups, cfg.run.samples_per_step)
        row: dict[str, Any] = {"step": step, "policy_version": getattr(model, "step", None)}
        row.update(prefixed("train", result.metrics))
        codes = Counter(
            str(t.metadata["outcome"]) for g in groups for t in g.trajectories if "outcome" in t.metadata
        )
        row.update({f"train/outcome/{k}": v for k, v in sorted(codes.items())})
        row["train/rollout_seconds"] = t_rollout
        row.update(prefixed("judge", judge_usage([*groups, *dropped])))
        row["faults/rollout_exceptions"] = rollout_failures
        row["faults/groups_dropped"] = len(dropped)
        row["faults/groups_total"] = len(examples)
        return row

    def _finish(self, decision: StopDecision, counters: dict[str, Any], wall: float) -> dict[str, Any]:
        cfg, folder = self.config, self.folder
        base, best = counters.get("base_val") or {}, counters.get("best_val") or {}
        totals = counters.get("totals", {})
        groups_total = totals.get("faults/groups_total", 0)
        summary = {
            "run": str(folder.root),
            "steps": counters["step"],
            "wall_seconds": wall,
            "stop": {
                "reason": decision.reason,
                "step": decision.step,
                "message": decision.message,
                "best_step": decision.best_step,
                "best_value": decision.best_value,
            },
            "base_val": {k: v for k, v in base.items() if k != "rows"},
            "best_val": {k: v for k, v in best.items() if k != "rows"},
            "metric": cfg.validation.metric,
            "restored_best": bool(getattr(self, "_restored_best", cfg.stopping.restore_best)),
            "faults": {k.removeprefix("faults/"): v for k, v in totals.items() if k.startswith("faults/")},
            "judge_usage": {k.removeprefix("judge/"): v for k, v in totals.items() if k.startswith("judge/")},
            "groups_dropped_fraction": (totals.get("faults/groups_dropped", 0) / groups_total)
            if groups_total
            else 0.0,
        }
        write_json(folder.root / "summary.json", summary)
        history = folder.read_history()
        curves = plot_curves(history, folder.root / "curves.png", stop=summary["stop"])
        summary["curves"] = str(curves)
        manifest = read_json(folder.root / "manifest.json")
        write_run_note(
            folder.root,
            loop="C",
            title=f"experiment {cfg.run.name}",
            knob=f"train reward = {manifest['train_reward'].get('kind')}; lr {cfg.train.lr}; "
            f"{cfg.run.groups_per_step}x{cfg.run.group_size} rollouts per step",
            locked_room=manifest["locked_room"],
            numbers={
                "base val (greedy)": base.get("greedy_accuracy"),
                "best val (greedy)": best.get("greedy_accuracy"),
                "best step": best.get("step"),
                "steps": counters["step"],
                "wall seconds": round(wall, 1),
                "stop reason": decision.reason,
                "groups dropped": totals.get("faults/groups_dropped", 0),
            },
            notes=[decision.message, f"curves: {Path(curves).name}"],
        )
        return summary
