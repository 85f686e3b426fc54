"""``palaestra.Experiment``: a whole Loop C run from a config. It builds the parts of
:func:`palaestra.trainer.loop.train` and is its :class:`~palaestra.trainer.loop.RunHooks` (run folder, checkpoints,
resume: docs/reliability.md)."""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs.registry import get_env, load_callable
from palaestra.trainer.builders import (
    build_model,
    build_reward,
    judge_cache_path,
    locked_room,
    resolve_backend,
    reward_info,
    with_quantize,
)
from palaestra.trainer.checkpoints import save_checkpoint
from palaestra.trainer.expconfig import ExperimentConfig, accepted_kwargs, check_env_options, config_from_dict
from palaestra.trainer.loop import Call, GRPOTrainer, Loop, new_counters, rollout_calls, train
from palaestra.trainer.pipeline import RolloutPipeline
from palaestra.trainer.runfolder import RunFolder, plot_curves, progress_line
from palaestra.trainer.stopping import StopDecision, ValidationStopping
from palaestra.trainer.validation import validate
from palaestra.trajectories.executors import frozen_heap
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
from palaestra.trajectories.seeds import derive_seed
from palaestra.trajectories.types import TrajectoryGroup


class Experiment:
    """A configured experiment. ``await exp.run()`` (or ``exp.run_sync()``) returns the summary dict; ``model``,
    ``rollout`` and ``reward`` objects override what the config names (the manifest records the config)."""

    def __init__(
        self,
        config: ExperimentConfig | Mapping[str, Any],
        *,
        model: Any = None,
        rollout: Callable[..., Any] | None = None,
        reward: Any = None,
        printer: Callable[[str], None] | None = print,
        yes: bool = False,
    ) -> None:
        self.config = config if isinstance(config, ExperimentConfig) else config_from_dict(dict(config))
        train = self.config.train
        if train.lr_schedule != "constant" and "decay_steps" not in train.model_fields_set:
            # anneal over this run; resolved here so config.json (and so a resume) records the value
            self.config.train = train.model_copy(update={"decay_steps": self.config.run.max_steps})
        cfg = self.config
        self.folder = RunFolder(cfg.output_path())
        self.env = env = get_env(cfg.env.name)
        self._model = model
        self._reward = reward
        self.printer = printer
        self.yes = yes  # confirmed: may make more judge calls than reward.max_judge_calls
        self.train_examples = env.load_split(cfg.env.train_split)
        self.val_examples = env.load_split(cfg.env.val_split)[: cfg.validation.max_examples or None]
        if not self.train_examples:
            raise DataError(f"split {cfg.env.train_split!r} of {env.name!r} is empty")
        # the env's group rollout (a whole group per call) unless another rollout is named, else one per call
        self._grouped = bool(
            rollout is None and cfg.env.rollout is None and cfg.env.group_rollout and env.group_rollout
        )
        if self._grouped:
            self._rollout = load_callable(str(env.group_rollout))
        else:
            self._rollout = rollout or load_callable(cfg.env.rollout or env.rollout)
        # env.options go to the rollout (both of the env's rollouts when grouped) and the env's validation
        takers = [self._rollout, *([load_callable(env.rollout)] if self._grouped else [])]
        check_env_options(cfg, takers + ([load_callable(env.validate)] if env.validate else []))
        self._resuming = False
        self._max_steps_override: int | None = None
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        self._pipe: RolloutPipeline | None = None
        self._loop: Loop | None = None

    @classmethod
    def resume(cls, run_dir: str | Path, *, max_steps: int | None = None, **kwargs: Any) -> Experiment:
        """Continue the run in ``run_dir`` from its latest checkpoint (``max_steps``: a new step budget)."""
        source = str(Path(run_dir) / "config.json")
        data = read_json(source)
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

    def say(self, text: str) -> None:
        if self.printer is not None and self.config.run.progress:
            self.printer(text)

    def examples_for_step(self, step: int) -> list[dict[str, Any]]:
        """The scenarios of step ``step`` (1-based): a seeded permutation per epoch, walked in order."""
        n, p = len(self.train_examples), self.config.run.groups_per_step
        out = []
        for pos in range((step - 1) * p, step * p):
            epoch, i = divmod(pos, n)
            if self._epoch_order[0] != epoch:  # one permutation per epoch, kept while the epoch lasts
                rng = np.random.default_rng(derive_seed(self.config.run.seed, "data", epoch))
                self._epoch_order = (epoch, [int(k) for k in rng.permutation(n)])
            out.append(self.train_examples[self._epoch_order[1][i]])
        return out

    def rollout_calls(self, step: int, fn: Callable[..., Any]) -> list[list[Call]]:
        """The rollout calls of step ``step`` made with ``fn`` (:func:`palaestra.trainer.loop.rollout_calls`)."""
        return rollout_calls(self.config, step, self.examples_for_step(step), fn, self._grouped)

    def _manifest(self, model: Any, reward: Any) -> dict[str, Any]:
        cfg = self.config
        data_dir = getattr(importlib.import_module(self.env.splits_module), "DATA_DIR", None)
        splits = sorted({cfg.env.train_split, cfg.env.val_split})
        paths = {s: Path(data_dir) / f"{s}.jsonl" for s in splits} if data_dir is not None else {}
        fingerprints = {s: sha256_file(p) for s, p in paths.items() if p.exists()}
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
                "train_reward": reward_info(cfg, reward),
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

    def run_sync(self) -> dict[str, Any]:
        """Run to the end in a fresh event loop."""
        return asyncio.run(self.run())

    async def run(self) -> dict[str, Any]:
        """Run (or resume) the experiment in its locked run folder; returns the summary (summary.json)."""
        self.check_judge_budget()
        if not self._resuming and self.folder.holds_run():
            self.folder.check_same_config(self.config.model_dump(mode="json"))
        self.folder.acquire()
        try:
            if self._model is None:
                self._model = build_model(self.config)
            # the model, data and config live for the whole run: frozen, the cyclic collector's full passes skip
            # them, which otherwise stall a step every few steps (trl_compare)
            with frozen_heap():
                return await self._run_loop(self._model)
        finally:
            if self._pipe is not None:
                await self._pipe.aclose()  # prefetched rollouts, Ray, the endpoint server
            self.folder.release()

    def check_judge_budget(self) -> None:
        """For a judge over HTTP, print the judge calls the rest of the run plans; refuse (:class:`DataError`)
        more than ``reward.max_judge_calls`` unless confirmed (``yes=True``, ``--yes``)."""
        cfg = self.config
        if self._reward is None:
            paid = cfg.reward.kind == "judge"
        else:
            paid = getattr(self._reward, "kind", "") == "ruler"
        if not paid:
            return
        done = max((int(r.get("step", 0)) for r in self.folder.read_history()), default=0)
        steps = max(0, cfg.run.max_steps - done)
        planned, limit = steps * cfg.run.groups_per_step, cfg.reward.max_judge_calls
        cache = judge_cache_path(cfg, self.folder.root) if self._reward is None else None
        where = f": cache {cache}" if cache is not None else ""
        if self.printer is not None:
            self.printer(
                f"judge: this run plans {planned:,} judge calls ({steps:,} steps x {cfg.run.groups_per_step} "
                f"groups, one call per group; retries add, cache hits save{where})"
            )
        if limit is not None and planned > limit and not self.yes:
            raise DataError(
                f"refusing to start: {planned:,} planned judge calls ({steps:,} steps x {cfg.run.groups_per_step} "
                f"groups) exceed reward.max_judge_calls = {limit:,}; confirm with --yes (Experiment(yes=True)) or "
                "lower run.max_steps / run.groups_per_step",
                path=self.folder.root,
            )

    def _reconcile_max_steps(self, stopper: ValidationStopping, step: int) -> None:
        """On resume: a run that stopped on its step budget goes on when ``run.max_steps`` is now larger (a new
        budget is recorded in config.json first); one a stopping rule ended, or below the steps done, is refused."""
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

    async def _run_loop(self, model: Any) -> dict[str, Any]:
        cfg, folder = self.config, self.folder
        self._pipe = pipe = RolloutPipeline(self, model, self._rollout)  # [run] executor, max_staleness
        if self._reward is not None:  # reward.quantize applies to any reward (build_reward applies it itself)
            reward = with_quantize(self._reward, cfg.reward.quantize)
        else:
            reward = build_reward(cfg, folder.root)
        stopper = ValidationStopping(
            metric=cfg.validation.metric,
            mode="max",
            every=cfg.validation.every,
            val_size=len(self.val_examples),
            **cfg.stopping.model_dump(exclude={"restore_best"}),
        )
        trainer = GRPOTrainer(model, cfg.train)
        counters = new_counters()
        state = folder.load_resume_state()  # checks history.jsonl against it; falls back to previous.npz
        if state is not None:
            trainer.load_state_dict(state["trainer"])
            stopper.load_state_dict(state["stopper"])
            pipe.load_state_dict(state.get("pipeline"))
            counters = state["counters"]
            folder.load_best_trainer()  # a damaged best.npz: reported and set aside now, not at the end
            if stopper.reopen():  # it stopped because no group could be scored: try again
                self.say("the run had stopped on judge_unavailable; resuming with the judge")
            self._reconcile_max_steps(stopper, int(counters["step"]))
            self.say(
                f"resumed {folder.root} at step {counters['step']} "
                f"({folder.history_dropped} unsaved history line(s) dropped)"
            )
        else:
            write_json(folder.root / "config.json", cfg.model_dump(mode="json"))
            write_json(folder.root / "manifest.json", self._manifest(model, reward))
            folder.history.unlink(missing_ok=True)  # a fresh run: no rows of an earlier start
        loop = Loop(cfg, model, pipe.rollout, self._grouped, reward, trainer, stopper, pipe, counters)
        self._loop = loop
        decision = await train(loop, self)
        closer = getattr(reward, "aclose", None)
        if closer is not None and self._reward is None:  # a judge this run built: close its HTTP client
            await closer()
        best_state = folder.load_best_trainer() if cfg.stopping.restore_best else None
        if best_state is not None:  # a damaged best.npz is reported and moved aside: the final weights stay
            loop.trainer.load_state_dict(best_state, weights_only=True)
        if hasattr(model, "save") and getattr(model, "backend_kind", "embedded") == "embedded":
            model.save(folder.root / "model.npz")  # the run's policy: palaestra eval --model RUN/model.npz
        return self._finish(decision, loop, restored_best=best_state is not None)

    async def validation(self, step: int) -> dict[str, Any]:
        """Validate the current policy (with the env's own validation when it has one); rows go to ``val/``."""
        cfg, t0 = self.config, time.monotonic()
        fn = load_callable(self.env.validate) if self.env.validate else validate  # the env's own: multi-turn
        wanted = {
            "seed": derive_seed(cfg.run.seed, "val", step),
            "greedy": cfg.validation.greedy,
            "sampled": cfg.validation.sampled,
            "max_tokens": cfg.env.max_tokens,
            "verifier": cfg.validation.verifier,
            **cfg.env.options,
        }
        result: dict[str, Any] = await fn(self._model, self.val_examples, **accepted_kwargs(fn, wanted))
        self.folder.write_val(step, result.pop("rows", []))
        result["seconds"] = time.monotonic() - t0
        return result

    def save_best(self, step: int) -> None:
        """Save the best validated policy to ``checkpoints/best.npz``."""
        assert self._loop is not None
        save_checkpoint(self.folder.best, {"trainer": self._loop.trainer.state_dict(), "step": step})

    def log_step(self, row: dict[str, Any], groups: Sequence[TrajectoryGroup]) -> None:
        """Append the history row, save the step's sampled groups (capped), print the progress line."""
        step = int(row["step"])
        if step > 0:
            self.folder.write_samples(step, groups, self.config.run.samples_per_step)
        self.folder.append_history(row)
        if step == 0:
            self.say(f"step 0: base val greedy {row.get('val/greedy_accuracy', float('nan')):.3f}")
        else:
            self.say(progress_line(row))

    def checkpoint(self) -> None:
        """Write ``checkpoints/latest.npz``: trainer, stopper, counters and the pipeline's frozen policies."""
        loop = self._loop
        assert loop is not None
        loop.counters["elapsed"] = loop.elapsed()
        state = {
            "trainer": loop.trainer.state_dict(),
            "stopper": loop.stopper.state_dict(),
            "counters": loop.counters,
            "pipeline": loop.pipeline.state_dict(),
        }
        self.folder.save_latest(state)

    def _finish(self, decision: StopDecision, loop: Loop, *, restored_best: bool) -> dict[str, Any]:
        """summary.json, the curves and the run note."""
        cfg, folder, counters, wall = self.config, self.folder, loop.counters, loop.elapsed()
        base, best, totals = counters["base_val"] or {}, counters["best_val"] or {}, counters["totals"]
        groups_total = totals.get("faults/groups_total", 0)
        summary = {
            "run": str(folder.root),
            "steps": counters["step"],
            "wall_seconds": wall,
            "stop": decision.model_dump(mode="json"),
            "base_val": base,
            "best_val": best,
            "metric": cfg.validation.metric,
            "restored_best": restored_best,
            "faults": {k.removeprefix("faults/"): v for k, v in totals.items() if k.startswith("faults/")},
            "judge_usage": {k.removeprefix("judge/"): v for k, v in totals.items() if k.startswith("judge/")},
            "groups_dropped_fraction": totals.get("faults/groups_dropped", 0) / max(groups_total, 1),
        }
        write_json(folder.root / "summary.json", summary)
        curves = plot_curves(folder.read_history(), folder.root / "curves.png", stop=summary["stop"])
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
