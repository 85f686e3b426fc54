"""Build the harness data shipped in ``palaestra/evals/data/`` from the arithmetic dev split and arith-base.
``math_dev.jsonl`` (the dev split), ``frozen_rollouts_dev.jsonl`` (one greedy completion per id) and
``selection_pack_dev.jsonl`` (8 samples per id at temperature 1), each sampled file with its ``.meta.json``;
``--check`` rebuilds into a temporary folder and compares (``sum_logprob`` within 1e-3)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.manifest import file_record
from palaestra.evals.sampling import policy_record, sample_completions, sampling_settings, write_samples
from palaestra.models.embedded import EmbeddedModel
from palaestra.models.registry import checkpoint, load
from palaestra.models.tinygpt import GPTConfig, TinyGPT
from palaestra.models.tokenizer import Tokenizer
from palaestra.trajectories.io import PathLike, read_jsonl, sha256_file, write_jsonl

DATA_DIR = Path(__file__).resolve().parent / "data"
FROZEN_SEED = 0
PACK_SEED = 1
PACK_SAMPLES = 8
MAX_TOKENS = 16


def tiny_random_model(path: PathLike, *, seed: int = 0) -> Path:
    """Save an untrained, very small TinyGPT checkpoint (for tests when arith-base is absent)."""
    tok = Tokenizer.default()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=96, d_model=16, n_layer=1, n_head=2, d_ff=32)
    EmbeddedModel(TinyGPT(cfg, seed=seed), name="tiny-random").save(path)
    return Path(path)


def build(
    out: PathLike = DATA_DIR,
    *,
    model: str = "arith-base",
    limit: int | None = None,
    samples: int = PACK_SAMPLES,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Path]:
    """Write the three data files (and two sidecars) into ``out``; returns their paths by key
    (``math_dev``, ``frozen``, ``pack``). ``limit`` keeps only the first dev examples (for tests)."""
    dev = load_split("dev")[:limit]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "math_dev": out / "math_dev.jsonl",
        "frozen": out / "frozen_rollouts_dev.jsonl",
        "pack": out / "selection_pack_dev.jsonl",
    }
    write_jsonl(paths["math_dev"], dev)
    dataset = dict(file_record(paths["math_dev"], len(dev)), path=paths["math_dev"].name)
    chat = load(model)
    policy = policy_record(chat)
    policy["checkpoint_sha256"] = sha256_file(checkpoint(model)[0])
    card = getattr(chat, "card", None)
    if isinstance(card, dict):
        keys = ("val_accuracy_greedy", "val_accuracy_temp1", "seed", "steps", "data_fingerprint")
        policy.update({f"card.{key}": card[key] for key in keys if key in card})
    plans = (("frozen", 1, 0.0, FROZEN_SEED), ("pack", samples, 1.0, PACK_SEED))

    async def sample_all() -> list[list[dict[str, Any]]]:
        return [
            await sample_completions(
                chat, dev, samples=n, temperature=t, max_tokens=max_tokens, seed=s, concurrency=256
            )
            for _, n, t, s in plans
        ]

    built_by = {"built_by": "python -m palaestra.evals.make_data"}
    for (key, n, temperature, seed), rows in zip(plans, asyncio.run(sample_all())):
        sampling = sampling_settings(temperature=temperature, max_tokens=max_tokens, samples_per_id=n)
        write_samples(
            paths[key], rows, sampling=sampling, seed=seed, policy=policy, dataset=dataset, extra=built_by
        )
    return paths


def compare(fresh: Path, shipped: Path, *, tol: float = 1e-3) -> list[str]:
    """Differences between two data files: every field equal except ``sum_logprob`` (within ``tol``)."""
    if not shipped.exists():
        return [f"{shipped}: missing"]
    a, b = read_jsonl(fresh), read_jsonl(shipped)
    if len(a) != len(b):
        return [f"{shipped}: {len(b)} rows, rebuilt {len(a)}"]
    out = []
    for i, (x, y) in enumerate(zip(a, b), start=1):
        lx, ly = x.pop("sum_logprob", None), y.pop("sum_logprob", None)
        same_lp = (lx is None) == (ly is None) and (lx is None or abs(lx - ly) <= tol)
        if x != y or not same_lp:
            out.append(f"{shipped}:{i}: rebuilt row differs")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: build, or with ``--check`` rebuild and compare with the shipped files."""
    parser = argparse.ArgumentParser(
        prog="python -m palaestra.evals.make_data", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="arith-base", help="embedded model name or .npz path")
    parser.add_argument("--out", default=str(DATA_DIR))
    parser.add_argument("--check", action="store_true", help="rebuild in a temp folder and compare bytes")
    args = parser.parse_args(argv)
    if not args.check:
        for key, path in build(args.out, model=args.model).items():
            print(f"{key}: {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(tmp, model=args.model)
        problems = [p for path in fresh.values() for p in compare(path, Path(args.out) / path.name)]
    if problems:
        print("the rebuilt data differs from the shipped data:", file=sys.stderr)
        for p in problems[:20]:
            print(f"  {p}", file=sys.stderr)
        return 1
    print("shipped harness data reproduced (same rows; sum_logprob within 1e-3)")
    return 0


if __name__ == "__main__":  # pragma: no cover - data build script
    raise SystemExit(main())
