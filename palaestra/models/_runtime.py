"""Process-level runtime of the numpy policy: worker threads, one BLAS thread each, malloc tuning.

Large passes are split by rows over a small thread pool, each worker pinned to one BLAS thread where OpenBLAS
allows it: this parallelises the element-wise work as well as the GEMMs. Results are deterministic for a given
worker count (the chunking depends only on it and the batch shape; partial sums run in a fixed order).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path
from typing import TypeVar

import numpy  # noqa: F401  (BLAS must be loaded before the workers look it up)

T = TypeVar("T")
R = TypeVar("R")

MIN_ROWS_PER_CHUNK = 1024  # tokens; below this a chunk is not worth a thread hop

_lock = threading.Lock()
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_workers: int | None = None


def num_workers() -> int:
    """Threads for large passes: :func:`set_num_workers`, else ``PALAESTRA_NUM_THREADS``, ``OMP_NUM_THREADS``,
    ``OPENBLAS_NUM_THREADS``, else ``min(cpu_count, 4)``."""
    if _workers is not None:
        return _workers
    for name in ("PALAESTRA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        with suppress(ValueError):  # unset or not an int: try the next one
            return max(1, int(os.environ.get(name, "")))
    return max(1, min(os.cpu_count() or 1, 4))


def set_num_workers(n: int | None) -> None:
    """Set the worker count for this process (None: back to the environment/default)."""
    global _workers
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"num workers must be a positive int or None, got {n!r}")
    _workers = n


def chunk_slices(n_rows: int, row_len: int) -> list[slice]:
    """Contiguous row chunks of ``n_rows`` rows of ``row_len`` tokens (one chunk if not worth splitting)."""
    if n_rows <= 0:
        return []
    n = min(num_workers(), n_rows, max(1, (n_rows * row_len) // MIN_ROWS_PER_CHUNK))
    bounds = [round(i * n_rows / n) for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


@cache
def _find_blas_local() -> Callable[[int], int] | None:
    """OpenBLAS's per-thread thread-count setter, if the BLAS loaded by numpy has one (looked up once; Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and line.endswith(".so")}
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    return None


def one_blas_thread(n: int = 1) -> int | None:
    """Give the calling thread ``n`` BLAS threads where OpenBLAS allows it; return its previous count (or None)."""
    fn = _find_blas_local()
    return fn(n) if fn is not None else None


def _init_worker() -> None:
    _local.pinned = True
    one_blas_thread()


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < size:
            old = _pool
            _pool = ThreadPoolExecutor(size, thread_name_prefix="palaestra-np", initializer=_init_worker)
            _pool_size = size
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run_pinned(fn: Callable[[], R]) -> R:
    """Run ``fn`` on a pool worker (one BLAS thread: multi-threaded BLAS on small matrices stalls on shared
    cores, and the numerics stay independent of the BLAS thread settings), or inline when already on one."""
    return parallel_map(lambda _: fn(), [None])[0]


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the body with one worker (process-wide while it runs) and one BLAS thread in the calling thread:
    no pass is split into chunks, so results do not depend on the core count (building shipped weights)."""
    global _workers
    prev_workers = _workers
    prev_blas = one_blas_thread()
    _workers = 1
    try:
        yield
    finally:
        _workers = prev_workers
        if prev_blas is not None:
            one_blas_thread(prev_blas)


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on pool workers (in parallel when there are several items)."""
    if getattr(_local, "pinned", False) or not items:
        return [fn(x) for x in items]
    return list(_get_pool(max(num_workers(), len(items))).map(fn, items))


@cache
def tune_malloc() -> None:
    """Keep freed large numpy buffers in the process heap (glibc; ``PALAESTRA_NO_MALLOPT=1`` skips this): by
    default allocations above 128 kB get fresh ``mmap`` pages, page-faulted anew (a third of a train step)."""
    if os.environ.get("PALAESTRA_NO_MALLOPT"):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's mallopt parameter numbers
    with suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 512 << 20)
        libc.mallopt(m_top_pad, 64 << 20)
