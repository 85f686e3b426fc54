"""HF backend throughput: tokens/s of one LoRA training step (and of batched generation) for the tiny model.

    python benchmarks/hf_step.py            # tiny-random-llama on CPU (and on CUDA too when available)
    python benchmarks/hf_step.py --quick    # a few seconds (CI smoke run)
    python benchmarks/hf_step.py --model /path/to/local/model --device cuda --dtype bfloat16

A batch is ``--groups`` x ``--group-size`` single-turn arithmetic trajectories sampled through the model's
OpenAI-compatible app (``logprobs=True``), so the step sees exactly what a real run sees. Reported per device:
the step time (median over ``--steps`` steps after one warm-up), train tokens/s (padded tokens through forward +
backward per second), trainable tokens/s (sampled tokens only) and generation tokens/s of the sampling pass.

Then the cost of choosing the next tokens of ``--pick-rows`` rows at a real model's vocabulary (151,936 ids, as
Qwen2's) in one decoding step, at temperature 1 with top_p 1 and 0.9: the logits copied to the host and picked
there in numpy (``pick_tokens``, the sampler's rule) against ``HFRowCache.pick`` on the model's device (the same
rule in torch: only ids and logprobs come back). On a CPU-only machine both run on the CPU.

Then the cost of the reply text that stop strings are searched in, per decoding step, for 64 rows of 128, 512
and 1024 tokens with the tiny character-level tokenizer (one token per character, CPU): a full decode of each
reply (the rule before) against the offsets method the sampler uses (``new_text``: the last tokens only).

Last, the memory of the output layer in training at that vocabulary (CPU): the peak resident memory that the
token logprobs (with their graph), their entropies and the backward of 8 rows x 256 tokens add, through
``token_logprobs`` and through the plain formula it replaced (the model's output kept alive, the entropies of
the whole batch at once); each is measured in a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | {gpu} | "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads) | {dt.datetime.now().isoformat(timespec='seconds')}"
    )


async def sample_batch(
    model: Any, groups: int, group_size: int, max_tokens: int
) -> tuple[list[Any], float, int]:
    from palaestra.envs.arithmetic_data import load_split
    from palaestra.trajectories.types import Trajectory

    client = model.openai_client()
    examples = load_split("dev")[:groups]
    t0 = time.perf_counter()

    async def one(g: int, ex: dict[str, Any]) -> list[Trajectory]:
        msgs = [{"role": "user", "content": ex["prompt"]}]
        resp = await client.chat.completions.create(
            model=model.name, messages=msgs, n=group_size, max_tokens=max_tokens, logprobs=True, seed=g
        )
        return [
            Trajectory(messages_and_choices=[*msgs, c], reward=float(i % 2))
            for i, c in enumerate(resp.choices)
        ]

    nested = await asyncio.gather(*(one(g, ex) for g, ex in enumerate(examples)))
    seconds = time.perf_counter() - t0
    trajs = [t for group in nested for t in group]
    tokens = sum(len(t.messages_and_choices[-1].logprobs.content) for t in trajs)
    return trajs, seconds, tokens


def bench(args: argparse.Namespace, device: str) -> None:
    import numpy as np
    import torch

    from palaestra.models.hf import HFModel
    from palaestra.trainer.backend import TrainBatch
    from palaestra.trainer.config import TrainConfig
    from palaestra.trainer.hf_backend import HFBackend

    if args.model:
        model = HFModel.from_pretrained(args.model, device=device, dtype=args.dtype, lora={"r": args.rank})
    else:
        model = HFModel.tiny(args.tiny, device=device, dtype=args.dtype, lora={"r": args.rank})
    model.micro_batch_size = args.micro_batch

    async def sample_twice() -> tuple[list[Any], float, int]:  # the first pass starts the app: not timed
        await sample_batch(model, args.groups, args.group_size, args.max_tokens)
        return await sample_batch(model, args.groups, args.group_size, args.max_tokens)

    trajs, gen_s, gen_tokens = asyncio.run(sample_twice())
    rewards = np.array([t.reward for t in trajs])
    batch = TrainBatch(trajs, rewards - rewards.mean())
    cfg = TrainConfig(lr=1e-4)
    backend = HFBackend(model, cfg)
    backend.train_step(batch, cfg)  # warm-up
    times, out = [], {}
    for _ in range(args.steps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = backend.train_step(batch, cfg)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    padded = out["packed_rows"] * out["seq_len"]
    print(
        f"[{device}] {model.name} ({args.dtype}, LoRA r={args.rank}, {model.n_trainable} trainable params): "
        f"batch {len(trajs)} rows x {int(out['seq_len'])} tokens, {int(out['tokens'])} trainable\n"
        f"  train step   {step * 1e3:8.1f} ms  (median of {len(times)}; min {min(times) * 1e3:.1f})\n"
        f"  train        {padded / step:10.0f} tokens/s (padded rows through forward+backward)\n"
        f"  trainable    {out['tokens'] / step:10.0f} tokens/s\n"
        f"  generation   {gen_tokens / gen_s:10.0f} tokens/s ({gen_tokens} tokens, {len(trajs)} rows in "
        f"{args.groups} concurrent requests through the in-process OpenAI-compatible app, warm)"
    )


def pick_cost(device: str, rows: int, vocab: int = 151_936, repeats: int = 5) -> None:
    """Milliseconds to pick the next token of ``rows`` rows from (rows, ``vocab``) logits: on the host (numpy,
    after a copy) and on ``device`` (HFRowCache.pick)."""
    import numpy as np
    import torch

    from palaestra.models.hf import HFModel
    from palaestra.models.sampling import Picking, pick_tokens

    model = HFModel.tiny("tiny-random-llama", device=device)
    cache = model.row_cache()
    gen = torch.Generator(device=device).manual_seed(0)
    cache.logits = 3 * torch.randn((rows, vocab), generator=gen, device=device)
    idx = np.arange(rows)
    u = np.random.default_rng(0).random(rows)
    temps, top_k = np.ones(rows), np.zeros(rows, dtype=np.intp)

    def timed(fn: Any, *args: Any) -> float:
        fn(*args)  # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(*args)  # its results are on the host: a device is synchronised by the copy
        return (time.perf_counter() - t0) / repeats * 1e3

    for top_p in (1.0, 0.9):
        how = Picking(temps, np.full(rows, top_p), u, top_k)
        host = timed(lambda: pick_tokens(cache.logits.cpu().numpy(), how))  # noqa: B023
        dev = timed(cache.pick, idx, how)
        print(
            f"  pick at vocab {vocab:,} (random logits), {rows} rows, top_p {top_p}: host numpy {host:7.1f} ms, "
            f"{device} torch {dev:7.1f} ms per decoding step ({host / dev:.2f}x)"
        )


def stop_text_cost(rows: int, lengths: tuple[int, ...] = (128, 512, 1024), repeats: int = 3) -> None:
    """Milliseconds per decoding step to bring the reply texts of ``rows`` rows with stop strings up to date at
    each reply length, with the tiny char-level tokenizer: a full decode of every reply against ``new_text``."""
    import numpy as np

    from palaestra.models.hf.tiny import build_char_tokenizer
    from palaestra.models.hf.tokenize import ChatTokenizer
    from palaestra.models.sampling import new_text

    tok = ChatTokenizer(build_char_tokenizer())
    printable = [tok.id_of(c) for c in "abcdefghij klmnopqrstuvwxyz.,"]
    replies = np.random.default_rng(0).choice(printable, (rows, max(lengths)))

    def timed(fn: Any) -> float:
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1e3

    for n in lengths:
        ids = replies[:, :n]
        prefix, read = 0, 0  # the offsets the sampler holds when the n-th token comes (the same for each row)
        for t in range(1, n):
            if new_text(tok.decode, ids[0, :t], prefix, read)[1]:
                prefix, read = read, t
        full = timed(lambda: [tok.decode(row.tolist()) for row in ids])  # noqa: B023
        inc = timed(lambda: [new_text(tok.decode, row, prefix, read) for row in ids])  # noqa: B023
        print(
            f"  stop-string text, {rows} rows at reply length {n:4d} (tiny char-level tokenizer): full decode "
            f"{full:6.2f} ms, incremental {inc:5.2f} ms per decoding step ({full / inc:.1f}x)"
        )


def _head_memory_child(how: str, rows: int, tokens: int, vocab: int) -> None:
    """Print the MB of peak resident memory one logprobs + entropies + backward pass adds in this process."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from palaestra.models.hf.model import token_logprobs
    from palaestra.models.hf.tiny import tiny_config

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(tiny_config("tiny-random-llama", vocab)).eval()
    ids = torch.randint(3, vocab, (rows, tokens))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if how == "plain":
        out = net(input_ids=ids, use_cache=False)
        lsm = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        logp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            -(lsm.exp() * lsm).sum(-1)
    else:
        logp = token_logprobs(net, ids, grad=True)[0]
    logp.sum().backward()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)


def head_memory(rows: int = 8, tokens: int = 256, vocab: int = 151_936) -> None:
    """The output layer's training memory at a real vocabulary (module docstring)."""
    import subprocess
    import sys

    mb = {}
    for how in ("plain", "token_logprobs"):
        cmd = [sys.executable, __file__, "--head-memory", how, str(rows), str(tokens), str(vocab)]
        mb[how] = float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
    print(
        f"  head memory at vocab {vocab:,} (tiny random Llama body), {rows}x{tokens} tokens (logprobs, entropies, "
        "backward): "
        f"+{mb['token_logprobs']:,.0f} MB through token_logprobs, +{mb['plain']:,.0f} MB with the plain "
        f"formula ({mb['token_logprobs'] / mb['plain']:.2f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batch, 2 steps (a few seconds)")
    ap.add_argument("--tiny", default="tiny-random-llama", help="shipped tiny model name")
    ap.add_argument("--model", default=None, help="local model folder (instead of a tiny model)")
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cpu, plus cuda if available)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (accumulation)")
    ap.add_argument("--pick-rows", type=int, default=64, help="rows of the next-token pick measurement")
    ap.add_argument("--head-memory", nargs=4, default=None, help=argparse.SUPPRESS)  # a child of head_memory
    args = ap.parse_args()
    if args.head_memory:
        how, *sizes = args.head_memory
        _head_memory_child(how, *map(int, sizes))
        return
    if args.quick:
        args.groups, args.group_size, args.steps, args.pick_rows = 4, 4, 2, 8
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine())
    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        bench(args, device)
        pick_cost(device, args.pick_rows)
    stop_text_cost(8 if args.quick else 64)
    head_memory(*((2, 64) if args.quick else ()))


if __name__ == "__main__":
    main()
