"""A persistent judge cache in sqlite (stdlib), keyed by judge, order-independent group content and trajectory
content; safe for concurrent tasks and processes (docs/judges.md, "Cache")."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from palaestra.judges.prompt import Verdict

_SCHEMA = """
CREATE TABLE IF NOT EXISTS judge_scores (
    judge_key TEXT NOT NULL,
    group_key TEXT NOT NULL,
    traj_key TEXT NOT NULL,
    score REAL NOT NULL,
    explanation TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (judge_key, group_key, traj_key)
)
"""


class JudgeCache(contextlib.AbstractContextManager["JudgeCache"]):
    """Persistent scores keyed by judge, order-independent group content and trajectory content."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = sqlite3.connect(  # writes open with BEGIN IMMEDIATE
            self.path, timeout=timeout, check_same_thread=False, isolation_level="IMMEDIATE"
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        self._conn.execute(_SCHEMA)
        self.hits = 0

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"judge cache {self.path} is closed")
        return self._conn

    def get(self, judge_key: str, group_key: str, traj_keys: Sequence[str]) -> dict[str, Verdict] | None:
        """Stored verdicts for every key in ``traj_keys``, or None when any is missing (a miss)."""
        wanted = set(traj_keys)
        sql = "SELECT traj_key, score, explanation FROM judge_scores WHERE judge_key=? AND group_key=?"
        with self._lock:
            rows = self._db().execute(sql, (judge_key, group_key)).fetchall()
        found = {k: Verdict(float(s), e) for k, s, e in rows if k in wanted}
        if len(found) != len(wanted):
            return None
        self.hits += 1
        return found

    def put(self, judge_key: str, group_key: str, verdicts: Mapping[str, Verdict]) -> None:
        """Store the verdicts of one group (one short transaction)."""
        now = time.time()
        rows = [(judge_key, group_key, k, v.score, v.explanation, now) for k, v in verdicts.items()]
        with self._lock, self._db() as db:  # committed, or rolled back on any error
            db.executemany("INSERT OR REPLACE INTO judge_scores VALUES (?, ?, ?, ?, ?, ?)", rows)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db().execute("SELECT COUNT(*) FROM judge_scores").fetchone()[0])

    def close(self) -> None:
        """Close the connection (further use raises)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __exit__(self, *exc: object) -> None:
        self.close()
