"""Best-of-N selection with the harness API (Loop B): sample once, select for several N, read pass@k.

    python examples/best_of_n.py                                   # offline, embedded arith-base
    python examples/best_of_n.py --base-url http://127.0.0.1:8000/v1 --model my-model --api-key-env KEY

1. ``sample_completions`` draws ``--n`` seeded samples per question from the model (any OpenAI-compatible
   endpoint) and ``write_samples`` stores them with a ``.meta.json`` sidecar (sampling settings, seed,
   policy): the file ``palaestra select`` reads.
2. ``select_best`` picks one sample per question for each N in ``--ns`` (the first N samples; the strict
   verifier ranks them, so this is *oracle* best-of-N) and writes a run folder with ``results.jsonl``,
   ``summary.json``, ``manifest.json`` and ``README.md``.

The policy never changes: every number below comes from the same samples. pass@N grows with N because the
decision rule gets to look at more tries, not because the model got better.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from palaestra.envs.arithmetic_data import load_split
from palaestra.evals.evaluate import select_best
from palaestra.evals.sampling import policy_record, sample_completions, sampling_settings, write_samples
from palaestra.trajectories.io import write_jsonl


def load_model(args: argparse.Namespace) -> Any:
    if args.base_url:
        from palaestra.models.remote import RemoteModel

        return RemoteModel(args.model, base_url=args.base_url, api_key_env=args.api_key_env)
    from palaestra.models.registry import load

    return load(args.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: the embedded model)")
    parser.add_argument("--model", default="arith-base", help="model name (embedded name offline)")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var holding the key (if any)")
    parser.add_argument("--split", default="dev", help="questions to sample (default: %(default)s)")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--n", type=int, default=16, help="samples per question")
    parser.add_argument("--ns", default="1,4,16", help="N values to select with (each <= --n)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--outdir", default="runs/best-of-n")
    parser.add_argument("--quick", action="store_true", help="small settings (CI)")
    args = parser.parse_args()
    if args.quick:
        args.examples, args.n, args.ns = 10, 4, "1,2,4"
    ns = sorted({int(x) for x in args.ns.split(",")})
    if ns[-1] > args.n:
        parser.error(f"--ns: N={ns[-1]} is more than the {args.n} samples drawn (--n)")

    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_split(args.split)[: args.examples]
    dataset = out / "dataset.jsonl"
    write_jsonl(dataset, examples)

    model = load_model(args)
    rows = asyncio.run(
        sample_completions(
            model,
            examples,
            samples=args.n,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    )
    samples = out / "samples.jsonl"
    write_samples(
        samples,
        rows,
        sampling=sampling_settings(
            temperature=args.temperature, max_tokens=args.max_tokens, samples_per_id=args.n
        ),
        seed=args.seed,
        policy=policy_record(model, base_url=args.base_url),
        dataset={"split": args.split, "examples": len(examples)},
    )
    print(f"sampled {len(rows)} completions ({len(examples)} questions x {args.n}) from {model.name}")
    print(f"samples: {samples} (sidecar {samples.with_suffix('.meta.json').name})")

    print(f"{'N':>3}  {'pass@1':>7}  {'pass@N':>7}  {'chosen pass rate':>16}  run folder")
    for n in ns:
        run = select_best(dataset, samples, out / f"best-of-{n}", n=n, knob=f"best-of-{n}")
        s = run.summary
        print(f"{n:>3}  {s['pass@1']:7.3f}  {s['pass@N']:7.3f}  {s['pass_rate']:16.3f}  {run.outdir}")
    print(f"inspect one: palaestra inspect {out / f'best-of-{ns[-1]}'}")


if __name__ == "__main__":
    main()
