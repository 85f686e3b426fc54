"""Embedded numpy policy: train-step time, batched generation throughput, torch CPU comparison.

    python benchmarks/embedded_policy.py [--quick] [--threads N] [--json]

* Train step: batch 256 x 24 tokens (ids of 25 tokens), forward + hand-written backward + Adam (clip 1.0) of the
  shipped architecture (d64 L2 H4 ReLU, vocab 106), as the trainer runs it (logprobs and entropies).
* Same step in torch CPU when torch is importable (not a palaestra dependency): nn.Linear/LayerNorm blocks with
  ``scaled_dot_product_attention(is_causal=True)``, log-softmax + gather, entropy without grad,
  ``clip_grad_norm_``, ``torch.optim.Adam``. Steps are interleaved numpy/torch in one process (same malloc
  settings) and the ratio numpy/torch of the medians is printed for each thread count (numpy: worker threads
  with one BLAS thread each; torch: ``torch.set_num_threads``).
* Generation: 256 rows through :func:`palaestra.models.sampling.generate` (KV cache, temperature 1, per-row
  seeds): the shipped ``arith-base`` on validation prompts (short answers) and a random model decoding up to 32
  tokens.
* Wall times are medians (and minima) of interleaved steps; the CPU time per step is printed too, which at
  threads=1 stays meaningful on a machine shared with other processes.
* Server chat-completions throughput: ``benchmarks/server_throughput.py`` when present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from palaestra.models import _runtime  # noqa: E402
from palaestra.models.optim import Adam  # noqa: E402
from palaestra.models.sampling import generate  # noqa: E402
from palaestra.models.tinygpt import GPTConfig, TinyGPT  # noqa: E402
from palaestra.models.tokenizer import Tokenizer  # noqa: E402

WEIGHTS = ROOT / "palaestra" / "models" / "weights" / "arith-base.npz"
VAL = ROOT / "palaestra" / "envs" / "data" / "arithmetic" / "val.jsonl"


def machine() -> dict[str, Any]:
    blas = "unknown"
    try:
        cfg = np.show_config(mode="dicts")  # type: ignore[func-returns-value]
        blas = str(cfg["Build Dependencies"]["blas"].get("name"))
    except Exception:
        pass
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _timed_cpu(fn: Callable[[], Any], out: list[float]) -> float:
    """Wall seconds of ``fn()``; appends the process CPU seconds it used to ``out``."""
    c, t = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    out.append(time.process_time() - c)
    return wall


def numpy_step_fn(batch: int, seq: int) -> Callable[[], Any]:
    tok = Tokenizer.default()
    model = TinyGPT(GPTConfig(vocab_size=tok.vocab_size), tokenizer=tok, seed=0)
    opt = Adam(model.params, lr=1e-4)
    rng = np.random.default_rng(0)
    ids = rng.integers(7, tok.vocab_size, size=(batch, seq + 1))
    dlogp = (rng.normal(size=(batch, seq)) / (batch * seq)).astype(np.float32)

    def step() -> None:
        res = model.forward_logprobs(ids)
        opt.step(model.backward_logprobs(res.cache, dlogp))

    return step


def torch_step_fn(batch: int, seq: int) -> Callable[[], Any] | None:
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn
    except ImportError:
        return None

    class Block(nn.Module):
        def __init__(self, d: int, h: int, f: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.w1, self.w2 = nn.Linear(d, f), nn.Linear(f, d)
            self.h = h

        def forward(self, x: Any) -> Any:
            B, T, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
            x = x + self.o(y)
            return x + self.w2(F.relu(self.w1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, V: int = 106, block: int = 64, d: int = 64, L: int = 2, h: int = 4, f: int = 256):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(block, d)
            self.blocks = nn.ModuleList([Block(d, h, f) for _ in range(L)])
            self.lnf, self.head = nn.LayerNorm(d), nn.Linear(d, V)

        def forward(self, ids: Any) -> Any:
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            for b in self.blocks:
                x = b(x)
            return self.head(self.lnf(x))

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(7, 106, size=(batch, seq + 1)))
    dlogp = torch.from_numpy((rng.normal(size=(batch, seq)) / (batch * seq)).astype(np.float32))

    def step() -> None:
        logits = model(ids[:, :-1])
        lp_all = F.log_softmax(logits, -1)
        logp = lp_all.gather(-1, ids[:, 1:, None])[..., 0]
        with torch.no_grad():
            _entropy = -(lp_all.exp() * lp_all).sum(-1)
        opt.zero_grad(set_to_none=True)
        (logp * dlogp).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def train_step(batch: int, seq: int, reps: int, threads: list[int]) -> list[dict[str, Any]]:
    np_step, th_step = numpy_step_fn(batch, seq), torch_step_fn(batch, seq)
    rows = []
    for n in threads:
        _runtime.set_num_workers(n)
        if th_step is not None:
            import torch

            torch.set_num_threads(n)
        np_t: list[float] = []
        th_t: list[float] = []
        np_c: list[float] = []
        th_c: list[float] = []
        for _ in range(2):  # warm-up
            np_step()
            if th_step is not None:
                th_step()
        for _ in range(reps):  # interleaved, so that machine noise hits both alike
            np_t.append(_timed_cpu(np_step, np_c))
            if th_step is not None:
                th_t.append(_timed_cpu(th_step, th_c))
        row: dict[str, Any] = {
            "threads": n,
            "numpy_ms": 1e3 * statistics.median(np_t),
            "numpy_min_ms": 1e3 * min(np_t),
            "numpy_cpu_ms": 1e3 * statistics.median(np_c),
        }
        if th_t:
            row["torch_ms"] = 1e3 * statistics.median(th_t)
            row["torch_min_ms"] = 1e3 * min(th_t)
            row["ratio_numpy_over_torch"] = row["numpy_ms"] / row["torch_ms"]
            row["ratio_of_min"] = row["numpy_min_ms"] / row["torch_min_ms"]
            row["torch_cpu_ms"] = 1e3 * statistics.median(th_c)
            row["cpu_ratio"] = row["numpy_cpu_ms"] / row["torch_cpu_ms"]
        rows.append(row)
    _runtime.set_num_workers(None)
    return rows


def generation(reps: int, threads: list[int], batch: int = 256) -> list[dict[str, Any]]:
    workloads = []
    if WEIGHTS.is_file() and VAL.is_file():
        base = TinyGPT.load(WEIGHTS)
        rows = [json.loads(line) for line in VAL.read_text().splitlines()][:batch]
        prompts = [base.tokenizer.render([{"role": "user", "content": r["prompt"]}]).ids for r in rows]
        workloads.append(("arith-base val prompts, max 16", base, prompts, 16))
        grouped = [p for p in prompts[: batch // 8] for _ in range(8)]
        workloads.append(("arith-base 32 prompts x 8, max 16", base, grouped, 16))
    tok = Tokenizer.default()
    rand = TinyGPT(GPTConfig(vocab_size=tok.vocab_size), tokenizer=tok, seed=0)
    rng = np.random.default_rng(0)
    rprompts = [rng.integers(7, tok.vocab_size, int(n)).tolist() for n in rng.integers(8, 16, batch)]
    workloads.append(("random model, max 32", rand, rprompts, 32))
    out = []
    for n in threads:
        _runtime.set_num_workers(n)
        for name, model, prompts, max_new in workloads:
            rates, ntok = [], 0
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                gens = generate(
                    model, prompts, max_new_tokens=max_new, temperature=1.0, seeds=list(range(batch))
                )
                secs = time.perf_counter() - t0
                ntok = sum(len(g.token_ids) for g in gens)
                if rep:  # first call warms up
                    rates.append(ntok / secs)
            out.append(
                {
                    "threads": n,
                    "workload": name,
                    "rows": batch,
                    "tokens": ntok,
                    "tok_per_s": statistics.median(rates),
                    "best_tok_per_s": max(rates),
                }
            )
    _runtime.set_num_workers(None)
    return out


def server(quick: bool) -> dict[str, Any] | None:
    try:
        from server_throughput import server_throughput  # type: ignore[import-not-found]
    except ImportError:
        return None
    result: dict[str, Any] = server_throughput(quick=quick)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few repetitions at one thread (seconds)")
    ap.add_argument(
        "--threads", type=int, default=None, help="thread count to compare (default: cores, <= 4)"
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=24)
    ap.add_argument("--no-server", action="store_true", help="skip the server throughput part")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()
    top = args.threads or max(1, min(os.cpu_count() or 1, 4))
    threads = [1] if args.quick or top == 1 else [1, top]
    report: dict[str, Any] = {"machine": machine()}
    report["train_step"] = train_step(args.batch, args.seq, 3 if args.quick else 30, threads)
    report["generation"] = generation(1 if args.quick else 5, threads)
    report["server"] = None if args.no_server else server(args.quick)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["machine"]
    print(
        f"embedded policy benchmark  {m['date']}  {m['cpu']} x{m['cores']}  numpy {m['numpy']} ({m['blas']})"
    )
    print(f"load average at start: {m['load_avg_1m']}")
    print(f"\ntrain step (fwd+bwd+Adam), batch {args.batch} x {args.seq} tokens, d64 L2 H4:")
    for r in report["train_step"]:
        line = f"  threads={r['threads']}: numpy {r['numpy_ms']:.1f} ms (min {r['numpy_min_ms']:.1f})"
        if "torch_ms" in r:
            line += (
                f"   torch {r['torch_ms']:.1f} ms (min {r['torch_min_ms']:.1f})"
                f"   ratio numpy/torch {r['ratio_numpy_over_torch']:.2f} (of mins {r['ratio_of_min']:.2f})"
                f"\n             CPU time per step: numpy {r['numpy_cpu_ms']:.1f} ms, torch {r['torch_cpu_ms']:.1f} ms"
                f" (ratio {r['cpu_ratio']:.2f})"
            )
            if r["threads"] == 1:
                line += "  <- load-robust comparison"
        else:
            line += "   (torch not importable: no comparison)"
        print(line)
    print("\nbatched generation (KV cache, temperature 1):")
    for r in report["generation"]:
        print(
            f"  threads={r['threads']}: {r['workload']:<32} {r['rows']} rows, {r['tokens']} tokens: "
            f"{r['tok_per_s']:,.0f} tok/s (best {r['best_tok_per_s']:,.0f})"
        )
    if report["server"] is None:
        print("\nserver throughput: skipped (benchmarks/server_throughput.py not available or --no-server)")
    else:
        print("\nserver throughput:")
        print(json.dumps(report["server"], indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
