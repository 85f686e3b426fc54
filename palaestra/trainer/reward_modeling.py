"""Reward modelling (``palaestra rm pairs|train|eval|make``; docs/guide.md, "A learned judge"): preference pairs,
training and evaluation of a Bradley-Terry reward model, and :func:`make_arith_rm`, the shipped ``arith-rm``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from palaestra.envs import arithmetic_data
from palaestra.envs.annotator import Annotator, show_work_variant
from palaestra.envs.verifier import get_verifier
from palaestra.models._runtime import single_thread
from palaestra.models.registry import WEIGHTS_DIR, load
from palaestra.models.reward_model import (
    Pair,
    RewardModel,
    load_reward_model,
    read_pairs,
    train_reward_model,
    write_pairs,
)
from palaestra.models.sampling import generate
from palaestra.trainer.advantages import ranking_to_pairs
from palaestra.trainer.pretrain import ARITH, build_base
from palaestra.trajectories.io import DataError, read_groups, sha256_file
from palaestra.trajectories.runs import code_version, command_line, utc_now, write_json
from palaestra.trajectories.seeds import derive_seed

SHIPPED_PAIRS = arithmetic_data.DATA_DIR / "rm_pairs.jsonl.gz"


def sample_policy(
    policy: str, examples: Sequence[Mapping[str, Any]], *, n: int, seed: int
) -> list[list[str]]:
    """``n`` completions at temperature 1 of the embedded ``policy`` (name or .npz) for every example's prompt."""
    model = load(policy)
    prompts = [model.render([{"role": "user", "content": str(ex["prompt"])}]) for ex in examples]
    seeds = [derive_seed(seed, "rm-sample", i, k) for i in range(len(examples)) for k in range(n)]
    gens = generate(
        model.gpt, [p for p in prompts for _ in range(n)], max_new_tokens=12, temperature=1.0, seeds=seeds
    )
    texts = [g.text for g in gens]
    return [texts[i * n : (i + 1) * n] for i in range(len(examples))]


def annotate_pairs(
    examples: Sequence[Mapping[str, Any]],
    completions: Sequence[Sequence[str]],
    annotator: Annotator,
    *,
    augment: float = 0.5,
    max_pairs_per_prompt: int = 6,
    reference: bool = False,
    seed: int = 0,
) -> list[Pair]:
    """At most ``max_pairs_per_prompt`` pairs of distinct completions of each example, labelled by ``annotator``;
    ``augment``: the chance of adding a completion's show-your-work variant; ``reference``: the right answer."""
    out: list[Pair] = []
    for ex, comps in zip(examples, completions):
        ex_id = str(ex.get("id", ""))
        rng = random.Random(derive_seed(seed, "rm-pairs", ex_id))
        cands = list(dict.fromkeys(c.strip() for c in comps))
        if reference and f"Final: {ex.get('expected_answer')}" not in cands:
            cands.append(f"Final: {ex.get('expected_answer')}")
        for c in list(cands):
            if rng.random() < augment:
                variant = show_work_variant(ex, c)
                if variant is not None and variant not in cands:
                    cands.append(variant)
        labels = [(a, b, annotator.prefer(ex, a, b, key=ex_id)) for a, b in itertools.combinations(cands, 2)]
        labelled = [(a, b) if label == 0 else (b, a) for a, b, label in labels if label is not None]
        rng.shuffle(labelled)
        extra = {"example_id": ex_id, "source": annotator.name}
        out += [Pair(str(ex["prompt"]), c, r, dict(extra)) for c, r in labelled[:max_pairs_per_prompt]]
    return out


def pairs_from_rankings(
    groups_path: str | Path, *, min_margin: float = 0.0, max_pairs_per_group: int | None = None
) -> list[Pair]:
    """Pairs from a JSONL of groups scored by a judge: each group's last user message as prompt, (chosen,
    rejected) from :func:`~palaestra.trainer.advantages.ranking_to_pairs` (ties and equal texts give none)."""
    out: list[Pair] = []
    for g, group in enumerate(read_groups(groups_path)):
        trajs = group.trajectories  # every trajectory carries a reward (a float, 0.0 by default)
        lasts = [[m.get("content") for m in t.messages() if m.get("role") == "user"][-1:] for t in trajs]
        prompt = next((c[0] for c in lasts if c and isinstance(c[0], str) and c[0]), "")
        texts = [t.last_assistant_text() or "" for t in trajs]
        rewards = [float(t.reward) for t in trajs]
        if len(texts) < 2:
            continue
        source = str(group.metadata.get("judge", "rankings"))
        for i, j in ranking_to_pairs(rewards, min_margin=min_margin, max_pairs=max_pairs_per_group):
            if texts[i] != texts[j]:
                extra = {"group": g, "source": source, "margin": rewards[i] - rewards[j]}
                out.append(Pair(prompt, texts[i], texts[j], extra))
    if not out:
        raise DataError(f"{groups_path}: no group has two differently scored trajectories")
    return out


def verifier_agreement(
    rm: RewardModel,
    policy: str,
    examples: Sequence[Mapping[str, Any]],
    *,
    verifier: str = "arith-strict",
    n: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """On ``n`` samples of ``policy`` per example: how often ``rm`` ranks a verifier-correct sample above a wrong
    one of the same prompt, and the mean ``sigmoid(score)`` of correct and of wrong samples."""
    v = get_verifier(verifier)
    samples = sample_policy(policy, examples, n=n, seed=seed)
    agree = total = 0
    pos: list[float] = []
    neg: list[float] = []
    for ex, comps in zip(examples, samples):
        scores = rm.score_texts(str(ex["prompt"]), comps)
        ok = [v.score(ex, c).reward >= 1.0 for c in comps]
        for s, good in zip(scores, ok):
            (pos if good else neg).append(1 / (1 + np.exp(-s)))
        for (s1, g1), (s2, g2) in itertools.product(zip(scores, ok), repeat=2):
            if g1 and not g2:
                total += 1
                agree += int(s1 > s2)
    return {
        "verifier": f"{v.name}@{v.version}",
        "policy": policy,
        "examples": len(examples),
        "samples_per_example": n,
        "pairwise_agreement": agree / total if total else float("nan"),
        "pairs_compared": total,
        "mean_score_correct": float(np.mean(pos)) if pos else float("nan"),
        "mean_score_wrong": float(np.mean(neg)) if neg else float("nan"),
    }


#: The reward-model training settings :func:`train_from_pairs` records (defaults as ``palaestra rm train``'s).
TRAIN_DEFAULTS: dict[str, Any] = {"epochs": 2, "batch_size": 64, "lr": 1e-3, "heldout_fraction": 0.1}


def train_from_pairs(
    pairs: Sequence[Pair],
    *,
    init: str = "arith-base",
    name: str = "reward-model",
    seed: int = 0,
    log: Any = None,
    **settings: Any,
) -> tuple[RewardModel, dict[str, Any]]:
    """A new reward model (trunk from policy ``init``) trained on ``pairs`` with :data:`TRAIN_DEFAULTS`
    updated by ``settings``, and its metrics."""
    unknown = set(settings) - set(TRAIN_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown training settings {sorted(unknown)}; known: {', '.join(TRAIN_DEFAULTS)}")
    opts = {k: type(v)(settings.get(k, v)) for k, v in TRAIN_DEFAULTS.items()}
    rm = RewardModel.from_policy(load(init).gpt, seed=seed, name=name)
    result = train_reward_model(rm, pairs, seed=seed, log=log, **opts)
    info = {"init": init, **opts, "seed": seed, **result.to_dict()}
    rm.meta.update(pairs=len(pairs), heldout_pair_accuracy=info["heldout_pair_accuracy"])
    return rm, info


ARITH_RM_RECIPE: dict[str, Any] = {
    "prompts": 12000,
    "samples_per_prompt": 4,
    "augment": 0.3,
    "max_pairs_per_prompt": 5,
    "reference": True,
    "annotator_noise": 0.1,
    "epochs": 4,
    "batch_size": 64,
    "lr": 1e-3,
    "heldout_fraction": 0.1,
    "agreement_examples": 200,
    "seed": 0,
}
JUDGE_TRUNK_SEED = 1  # of the judge trunk of ``palaestra rm make --trunk-steps N`` (:func:`_judge_trunk`)


def make_arith_rm(
    *,
    out_dir: Path = WEIGHTS_DIR,
    pairs_path: Path = SHIPPED_PAIRS,
    recipe: Mapping[str, Any] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Build the shipped pairs and ``arith-rm`` (with its card) from ``arith-base``; returns the card. One
    BLAS thread, so the same recipe gives the same weights on the same machine and BLAS build."""
    rc = {**ARITH_RM_RECIPE, **(recipe or {})}
    seed = int(rc["seed"])
    with single_thread():
        train = arithmetic_data.load_split("train")[: int(rc["prompts"])]
        annotator = Annotator(noise=float(rc["annotator_noise"]), seed=seed)
        samples = sample_policy("arith-base", train, n=int(rc["samples_per_prompt"]), seed=seed)
        pairs = annotate_pairs(
            train,
            samples,
            annotator,
            augment=float(rc["augment"]),
            max_pairs_per_prompt=int(rc["max_pairs_per_prompt"]),
            reference=bool(rc["reference"]),
            seed=seed,
        )
        write_pairs(pairs_path, pairs)
        log(f"{len(pairs)} pairs from {len(train)} arith-base prompts -> {pairs_path}")
        with tempfile.TemporaryDirectory(prefix="palaestra-rm-trunk-") as tmp:
            init, trunk_card = _judge_trunk(rc.get("judge_trunk"), Path(tmp), log)
            settings = {k: rc[k] for k in TRAIN_DEFAULTS}
            rm, info = train_from_pairs(pairs, init=init, name="arith-rm", seed=seed, log=log, **settings)
        if trunk_card is not None:
            info["init"] = trunk_card
        val = arithmetic_data.load_split("val")[: int(rc["agreement_examples"])]
        agreement = verifier_agreement(rm, "arith-base", val, seed=seed)
    card = {
        "name": "arith-rm",
        "kind": "bradley-terry reward model (scalar head on the TinyGPT trunk)",
        "created": _dt.date.today().isoformat(),
        "init": "arith-base" if trunk_card is None else trunk_card,
        "pairs": {
            "file": f"palaestra/envs/data/arithmetic/{pairs_path.name}",
            "count": len(pairs),
            "sha256": sha256_file(pairs_path),
            "from": f"arith-base samples (temperature 1) on the first {len(train)} train prompts",
            "show_your_work_augmentation": rc["augment"],
        },
        "annotator": annotator.info(),
        "recipe": rc,
        "training": info,
        "heldout_pair_accuracy": info["heldout_pair_accuracy"],
        "agreement_with_strict_verifier": agreement,
        "warning": "learned from an imperfect annotator that likes explanations the strict verifier rejects; "
        "a policy optimised against it can be rewarded for what validation counts as wrong",
        "code_version": code_version(),
    }
    rm.meta.update(annotator=annotator.info())
    out_dir.mkdir(parents=True, exist_ok=True)
    rm.save(out_dir / "arith-rm.npz")
    card["fingerprint"] = RewardModel.load(out_dir / "arith-rm.npz").fingerprint
    write_json(out_dir / "arith-rm.json", card)
    log(
        f"arith-rm: held-out pair accuracy {info['heldout_pair_accuracy']:.3f}, agreement with the strict "
        f"verifier {agreement['pairwise_agreement']:.3f} -> {out_dir / 'arith-rm.npz'}"
    )
    return card


def _judge_trunk(spec: Mapping[str, Any] | None, tmp: Path, log: Any) -> tuple[str, dict[str, Any] | None]:
    """The policy the reward model's trunk starts from and its card facts: ``arith-base``, or (``spec``: ``steps``,
    ``seed``) arith-base's SFT recipe run for a fixed number of steps, a judge that knows more arithmetic."""
    if not spec:
        return "arith-base", None
    steps, tseed = int(spec["steps"]), int(spec["seed"])
    card = build_base(ARITH, tmp, seed=tseed, max_steps=steps, target=2.0, name="arith-judge-trunk")
    log(
        f"judge trunk: {card['steps']} SFT steps (seed {tseed}), val greedy accuracy "
        f"{card['val_accuracy_greedy']:.3f} (arith-base's recipe, fixed step count)"
    )
    facts = {
        "trunk": "arith-judge-trunk (arith-base's SFT recipe, fixed step count; not shipped separately)",
        "sft_steps": card["steps"],
        "seed": tseed,
        "val_accuracy_greedy": card["val_accuracy_greedy"],
        "val_accuracy_temp1": card["val_accuracy_temp1"],
    }
    return str(tmp / "arith-judge-trunk.npz"), facts


def register(sub: Any) -> None:
    """Add ``palaestra rm pairs|train|eval|make``."""
    p = sub.add_parser("rm", help="reward models: make preference pairs, train, evaluate")
    rsub = p.add_subparsers(dest="rm_command", required=True)

    pp = rsub.add_parser(
        "pairs", help="preference pairs from a policy's samples (annotator) or judge rankings"
    )
    pp.add_argument("--out", required=True, help="pairs JSONL to write")
    pp.add_argument("--from-rankings", help="JSONL of scored trajectory groups (any judge's rewards)")
    pp.add_argument("--min-margin", type=float, default=0.0, help="--from-rankings: minimum score gap")
    pp.add_argument("--max-pairs-per-group", type=int, default=None)
    pp.add_argument("--policy", default="arith-base", help="policy to sample (name or .npz)")
    pp.add_argument("--augment", type=float, default=0.5, help="chance of adding a show-your-work variant")
    pp.add_argument("--noise", type=float, default=0.1, help="annotator label noise")
    pp.add_argument("--reference", action="store_true", help="add the reference answer to the candidates")
    pp.set_defaults(func=cmd_pairs)

    pt = rsub.add_parser("train", help="train a reward model on pairs")
    pt.add_argument("--pairs", required=True, nargs="+", help="pairs JSONL file(s)")
    pt.add_argument("--outdir", required=True)
    pt.add_argument("--init", default="arith-base", help="policy whose trunk starts the reward model")
    pt.add_argument("--name", default=None, help="model name (default: the outdir's name)")
    pt.add_argument("--epochs", type=int, default=TRAIN_DEFAULTS["epochs"])
    pt.add_argument("--batch-size", type=int, default=TRAIN_DEFAULTS["batch_size"])
    pt.add_argument("--lr", type=float, default=TRAIN_DEFAULTS["lr"])
    pt.add_argument(
        "--heldout", dest="heldout_fraction", type=float, default=0.1, help="fraction of prompts held out"
    )
    pt.set_defaults(func=cmd_train)

    pe = rsub.add_parser("eval", help="pair accuracy and agreement with a verifier")
    pe.add_argument("--model", default="arith-rm", help="reward model: shipped name or .npz path")
    pe.add_argument("--pairs", help="pairs JSONL: report pair accuracy")
    pe.add_argument("--policy", help="policy to sample: report agreement with --verifier")
    pe.add_argument("--verifier", default="arith-strict")
    pe.add_argument("--json", action="store_true", help="print the result as JSON")
    pe.set_defaults(func=cmd_eval)
    for sp, split, limit, samples in ((pp, "train", 500, 4), (pe, "val", 200, 8)):
        sp.add_argument("--split", default=split, choices=arithmetic_data.SPLITS)
        sp.add_argument("--limit", type=int, default=limit, help="number of prompts")
        sp.add_argument("--samples", type=int, default=samples, help="samples per prompt")
    for sp in (pp, pt, pe):
        sp.add_argument("--seed", type=int, default=0)

    pm = rsub.add_parser("make", help="rebuild the shipped pairs and arith-rm (with its card)")
    pm.add_argument("--out-dir", default=str(WEIGHTS_DIR))
    pm.add_argument("--pairs-out", default=str(SHIPPED_PAIRS))
    for flag, kind, what in (
        ("--prompts", int, "train prompts to sample"),
        ("--epochs", int, "reward-model epochs"),
        ("--lr", float, "reward-model learning rate"),
        ("--seed", int, "recipe seed"),
    ):
        pm.add_argument(flag, type=kind, help=f"{what} (default: the recipe's)")
    pm.add_argument(
        "--trunk-steps",
        type=int,
        help="start from a separately pretrained judge trunk: arith-base's SFT recipe run for this many steps "
        "(default 0: start from arith-base, the shipped recipe)",
    )
    pm.set_defaults(func=cmd_make)


def cmd_pairs(args: argparse.Namespace) -> int:
    if args.from_rankings:
        pairs = pairs_from_rankings(
            args.from_rankings, min_margin=args.min_margin, max_pairs_per_group=args.max_pairs_per_group
        )
        what = f"judge rankings in {args.from_rankings}"
    else:
        try:
            annotator = Annotator(noise=args.noise, seed=args.seed)  # checked before the policy is sampled
        except ValueError as exc:
            raise DataError(f"--noise: {exc}") from None
        examples = arithmetic_data.load_split(args.split)[: args.limit]
        samples = sample_policy(args.policy, examples, n=args.samples, seed=args.seed)
        pairs = annotate_pairs(
            examples, samples, annotator, augment=args.augment, reference=args.reference, seed=args.seed
        )
        what = f"{args.policy} samples on {len(examples)} {args.split} prompts, labelled by {annotator.name}"
    write_pairs(args.out, pairs)
    print(f"{len(pairs)} pairs from {what} -> {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    pairs = [p for path in args.pairs for p in read_pairs(path)]
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    name = args.name or outdir.name
    settings = {k: getattr(args, k) for k in TRAIN_DEFAULTS}
    rm, info = train_from_pairs(pairs, init=args.init, name=name, seed=args.seed, log=print, **settings)
    rm.save(outdir / "reward_model.npz")
    manifest = {
        "kind": "reward_model",
        "created": utc_now(),
        "command": command_line(),
        "code_version": code_version(),
        "name": name,
        "fingerprint": rm.fingerprint,
        "pairs": [{"path": str(p), "sha256": sha256_file(p)} for p in args.pairs],
        "seed": args.seed,
        "training": info,
        "heldout_pair_accuracy": info["heldout_pair_accuracy"],
    }
    write_json(outdir / "manifest.json", manifest)
    print(
        f"reward model {name}: held-out pair accuracy {info['heldout_pair_accuracy']:.3f} "
        f"({info['heldout_pairs']} pairs) -> {outdir / 'reward_model.npz'}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if not args.pairs and not args.policy:
        raise DataError("rm eval: give --pairs (pair accuracy) and/or --policy (agreement with a verifier)")
    rm = load_reward_model(args.model)
    out: dict[str, Any] = {"model": rm.name, "fingerprint": rm.fingerprint}
    if args.pairs:
        pairs = read_pairs(args.pairs)
        out["pairs"] = {"path": args.pairs, "count": len(pairs), "pair_accuracy": rm.pair_accuracy(pairs)}
    if args.policy:
        examples = arithmetic_data.load_split(args.split)[: args.limit]
        out["verifier_agreement"] = verifier_agreement(
            rm, args.policy, examples, verifier=args.verifier, n=args.samples, seed=args.seed
        )
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(f"reward model {rm.name} ({rm.fingerprint})")
    if "pairs" in out:
        print(f"  pair accuracy on {args.pairs}: {out['pairs']['pair_accuracy']:.3f} ({len(pairs)} pairs)")
    if "verifier_agreement" in out:
        a = out["verifier_agreement"]
        print(
            f"  agreement with {a['verifier']} on {a['policy']} samples ({a['examples']} x "
            f"{a['samples_per_example']}): {a['pairwise_agreement']:.3f} over {a['pairs_compared']} "
            f"correct-vs-wrong pairs; mean sigmoid(score) correct {a['mean_score_correct']:.3f}, "
            f"wrong {a['mean_score_wrong']:.3f}"
        )
    return 0


def cmd_make(args: argparse.Namespace) -> int:
    keys = ("prompts", "epochs", "lr", "seed")
    recipe: dict[str, Any] = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.trunk_steps:
        recipe["judge_trunk"] = {"steps": args.trunk_steps, "seed": JUDGE_TRUNK_SEED}
    make_arith_rm(out_dir=Path(args.out_dir), pairs_path=Path(args.pairs_out), recipe=recipe)
    return 0
