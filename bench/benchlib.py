"""Small helpers shared by the store benchmarks: latency summaries, the machine line,
and a raw sqlite3 connection with the store's own pragmas (the floor every store figure
is divided by, measured in the same run)."""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import sys
from pathlib import Path

from rolloutdb.store.sqlite.database import BUSY_TIMEOUT_MS, JOURNAL_SIZE_LIMIT


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


# Nearest-rank p99 of fewer than 100 samples is the largest sample: calling it a p99
# would claim a tail the run never measured. Below this count it is reported as max only.
P99_MIN_SAMPLES = 100


def latency_summary(seconds: list[float]) -> dict[str, float | None]:
    """p50/p99/max in milliseconds, plus the count. p99_ms is None (and only the max is
    reported) with fewer than P99_MIN_SAMPLES samples."""
    s = sorted(seconds)
    return {
        "n": len(s),
        "p50_ms": percentile(s, 50) * 1e3,
        "p99_ms": percentile(s, 99) * 1e3 if len(s) >= P99_MIN_SAMPLES else None,
        "max_ms": (s[-1] if s else float("nan")) * 1e3,
    }


def tail_ms(summary: dict) -> tuple[str, float]:
    """("p99", value) when the summary has a meaningful p99, else ("max", the maximum)."""
    if summary.get("p99_ms") is not None:
        return "p99", summary["p99_ms"]
    return "max", summary["max_ms"]


def fmt_tail(summary: dict, digits: int = 3) -> str:
    """'p99 X ms', or 'max X ms (n=N)' when there are too few samples for a p99."""
    label, value = tail_ms(summary)
    return f"p99 {value:.{digits}f} ms" if label == "p99" else f"max {value:.{digits}f} ms (n={summary['n']})"


def fmt_latency(summary: dict) -> str:
    p99 = f"p99 {summary['p99_ms']:.3f} ms  " if summary.get("p99_ms") is not None else ""
    return f"p50 {summary['p50_ms']:.3f} ms  {p99}max {summary['max_ms']:.2f} ms  (n={summary['n']})"


def machine_line() -> str:
    return (
        f"{os.cpu_count()} cpu(s) visible, load {os.getloadavg()[0]:.2f}, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}"
    )


def raw_connection(path: str | Path, *, synchronous: str = "NORMAL", writer: bool = True) -> sqlite3.Connection:
    """A plain sqlite3 connection set up like the store's writer: WAL, the same
    synchronous level, foreign keys, busy timeout, explicit transactions."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    if writer:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
    return conn


class RunQueueClock:
    """How long the calling thread has waited for a CPU (Linux schedstat), in seconds.

    On a shared machine a transaction's wall time includes time spent runnable but not
    running because other people's processes held the cores. Subtracting this wait
    separates that from time the transaction itself spent (CPU, I/O, SQLite locks).
    Create it in the thread it measures; reads 0 where schedstat is unavailable."""

    def __init__(self):
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2, sort_keys=True))


def say(*parts) -> None:
    print(*parts, flush=True)
    sys.stdout.flush()
