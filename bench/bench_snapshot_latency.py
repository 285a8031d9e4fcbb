"""The writer's latency while snapshots of a large live store are captured, next to the
design we replace (the pumps held for the whole copy), measured in the same run.

For each ledger size (default 100k, then 1M groups), a store is built with that many
ledger rows plus `--payload-gb` of sample payload (token ids and logprobs BLOBs of
finished generations of sealed groups). A writer thread then runs pump-like small
transactions through `Store.atomic()` (one group at a time through reserve -> dispatch
-> finish -> seal -> publish -> trained, one transition per transaction, paced at
`--rate`), while the main thread captures snapshots repeatedly:

* ours: `store.capture(dst)`: a read transaction and the backup API; the writer goes on;
* held: the same capture inside `store.atomic()`, i.e. with the write lock held for the
  whole copy, which is what the reference design's exclusive hold amounts to.

Reported per phase: the writer's per-transaction latency (p50/p99/max), its longest gap
between two commits, its achieved rate, the capture times, and the largest WAL seen.
A phase with no snapshot at all is the reference for the machine's own noise.

    python bench/bench_snapshot_latency.py                       # full size (minutes)
    python bench/bench_snapshot_latency.py --groups 100000 --payload-gb 0.2
    python bench/bench_snapshot_latency.py --quick               # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import benchlib
from benchlib import fmt_latency, fmt_tail, latency_summary, say, tail_ms

from rolloutdb.store import FinishedGeneration, Reservation, Store, capture_snapshot
from rolloutdb.store.sqlite.database import JOURNAL_SIZE_LIMIT
from rolloutdb.store.fsio import fsync_file

P99_GOAL_MS = 5.0
MAX_GOAL_MS = 20.0
GENERATIONS = 4


# ---------------------------------------------------------------------- building a big store


def build_store(path: Path, groups: int, payload_bytes: int, tokens: int) -> dict:
    """A head store with `groups` ledger rows; the first groups are `sealed` with
    GENERATIONS finished attempts and samples holding `payload_bytes` in all, the rest
    `trained`. Loaded with raw sqlite3 in large transactions (this is set-up, not
    what is measured), then folded into the main file."""
    t0 = time.perf_counter()
    Store.create(path, replay_capacity=1024).close()
    row_bytes = tokens * 8  # int32 token ids + float32 logprobs
    payload_groups = min(groups, max(1, payload_bytes // (row_bytes * GENERATIONS)))
    # SQLite stores every row, so a few distinct random blobs make realistic pages.
    blobs = [(os.urandom(tokens * 4), os.urandom(tokens * 4)) for _ in range(16)]
    now = time.time()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        chunk = 20_000
        for start in range(0, groups, chunk):
            stop = min(groups, start + chunk)
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO prompt_groups (group_id, sample_seq, epoch, prompt_id, num_generations, target_step,"
                " state, policy_version, trained_step, created_at, updated_at) VALUES (?, ?, 0, ?, ?, 0, ?, 0, ?, ?, ?)",
                (
                    (g + 1, g, g, GENERATIONS, "sealed" if g < payload_groups else "trained",
                     None if g < payload_groups else 0, now, now)
                    for g in range(start, stop)
                ),
            )
            with_payload = range(start, min(stop, payload_groups))
            conn.executemany(
                "INSERT INTO rollouts (group_id, generation_index, attempt, state, policy_version, dispatched_at,"
                " ended_at) VALUES (?, ?, 0, 'finished', 0, ?, ?)",
                ((g + 1, i, now, now) for g in with_payload for i in range(GENERATIONS)),
            )
            conn.executemany(
                "INSERT INTO samples (group_id, generation_index, prompt_id, num_tokens, token_ids, logprobs, reward,"
                " policy_version, version_token_counts, created_at) VALUES (?, ?, ?, ?, ?, ?, 1.0, 0, ?, ?)",
                (
                    (g + 1, i, g, tokens, *blobs[(g * GENERATIONS + i) % len(blobs)], f"[[0,{tokens}]]", now)
                    for g in with_payload
                    for i in range(GENERATIONS)
                ),
            )
            conn.execute("COMMIT")
        conn.execute("UPDATE sampler_state SET next_seq = ?", (groups,))
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    # Loaded with synchronous=OFF: flush it now, or the store's first checkpoint fsync
    # pays for 1 GB of set-up writes inside the measured phases (seen: a 350-490 ms stall).
    fsync_file(path)
    return {
        "groups": groups,
        "payload_groups": payload_groups,
        "file_mb": path.stat().st_size / 2**20,
        "build_s": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------------- the writer


class PumpWriter(threading.Thread):
    """One group at a time through its life cycle, one transition per transaction,
    paced at `rate` transactions per second (0: as fast as it goes)."""

    def __init__(self, store: Store, first_seq: int, rate: float, tokens: int):
        super().__init__(name="bench-pump-writer", daemon=True)
        self.store = store
        self.seq = first_seq
        self.period = 1.0 / rate if rate > 0 else 0.0
        self.gen = FinishedGeneration(list(range(tokens)), [-0.5] * tokens, 1.0, [(0, tokens)])
        self.records: list[tuple[float, float, float]] = []  # (commit time, latency, run-queue wait)
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def _transactions(self):
        s = self.store
        while True:
            box = {}
            yield lambda: box.update(gid=s.reserve([Reservation(self.seq, 0, self.seq)], num_generations=1, target_step=1)[0])
            self.seq += 1
            yield lambda: box.update(aid=s.dispatch([box["gid"]], policy_version=0)[0])
            yield lambda: s.finish(box["aid"], self.gen)
            yield lambda: s.seal([box["gid"]])
            yield lambda: s.enter_replay([box["gid"]])
            yield lambda: s.mark_trained([box["gid"]], step=1)

    def run(self) -> None:
        clock = time.perf_counter
        runq = benchlib.RunQueueClock()
        due = clock()
        try:
            for tx in self._transactions():
                if self._stop_event.is_set():
                    return
                if self.period:
                    now = clock()
                    if now < due:
                        time.sleep(due - now)
                    due = max(due + self.period, clock() - 0.05)  # no unbounded catch-up burst
                q0, t0 = runq(), clock()
                tx()
                t1, q1 = clock(), runq()
                self.records.append((t1, t1 - t0, q1 - q0))
        except BaseException as e:  # surfaced by the main thread
            self.error = e
        finally:
            runq.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        if self.error is not None:
            raise self.error


def _writer_process(path: str, first_seq: int, rate: float, tokens: int, ready, stop, out) -> None:
    """`--writer process`: the pump and its checkpointer in a process of their own, so
    the capture shares no interpreter lock with it (the real controller is one process;
    this isolates what SQLite and the disk cost from what the GIL costs)."""
    # Long enough to wait out the held baseline's whole copy instead of failing.
    store = Store.open(path, busy_timeout_ms=600_000)
    writer = PumpWriter(store, first_seq, rate, tokens)
    try:
        writer.start()
        ready.set()
        stop.wait()
        writer.stop()
    finally:
        store.close()
        out.send(writer.records)
        out.close()


class WriterProcess:
    """A PumpWriter in a child process; `records` arrive when it stops (the clocks
    agree: perf_counter is CLOCK_MONOTONIC, system-wide)."""

    def __init__(self, path: Path, first_seq: int, rate: float, tokens: int):
        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_writer_process, args=(str(path), first_seq, rate, tokens, self._ready, self._stop, send), daemon=True
        )
        self.records: list[tuple[float, float, float]] = []

    def start(self) -> None:
        self._proc.start()
        if not self._ready.wait(120):
            raise RuntimeError("the writer process did not start")

    def stop(self) -> None:
        self._stop.set()
        self.records = self._recv.recv()
        self._proc.join(30)
        if self._proc.exitcode != 0:
            raise RuntimeError(f"the writer process failed (exit code {self._proc.exitcode})")


def writer_window(records: list[tuple[float, float, float]], t_from: float, t_to: float) -> dict:
    """Latency, longest gap between commits and rate within [t_from, t_to]; also the
    latency less the time the writer waited for a CPU (`cpu_free_*`)."""
    recs = [r for r in records if t_from <= r[0] <= t_to]
    summary = latency_summary([lat for _, lat, _ in recs])
    free = latency_summary([max(0.0, lat - q) for _, lat, q in recs])
    summary.update({f"cpu_free_{k}": v for k, v in free.items() if k != "n"})
    ends = [t for t, _, _ in recs]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    summary["longest_gap_ms"] = max(gaps) * 1e3 if gaps else float("nan")
    summary["tx_per_s"] = len(recs) / (t_to - t_from) if t_to > t_from else float("nan")
    return summary


class WalWatcher(threading.Thread):
    """Samples the WAL file's size, to show whether it stays bounded."""

    def __init__(self, path: Path, interval: float = 0.02):
        super().__init__(name="bench-wal-watcher", daemon=True)
        self.wal = Path(f"{path}-wal")
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            with contextlib.suppress(FileNotFoundError):
                self.samples.append((time.perf_counter(), self.wal.stat().st_size))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def max_mb(self, t_from: float, t_to: float) -> float:
        sizes = [s for t, s in self.samples if t_from <= t <= t_to]
        return max(sizes, default=0) / 2**20


# ---------------------------------------------------------------------- phases


@contextlib.contextmanager
def held_writer(store: Store | None, path: Path):
    """The baseline's exclusive hold: the store's own write lock when the writer is a
    thread of this process, else the SQLite write lock (BEGIN IMMEDIATE) on the file."""
    if store is not None:
        with store.atomic(mutation=False):
            yield
        return
    conn = benchlib.raw_connection(path, writer=False)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("COMMIT")
    finally:
        conn.close()


def snapshot_phase(store: Store | None, path: Path, workdir: Path, kind: str, count: int, pause: float):
    """`count` captures of one kind; returns the window to judge the writer in (from the
    first capture's start to `pause` after the last one ends, so a checkpoint stall
    after a capture is counted), the capture times and the files. The files are removed
    only after the writer stops: on these machines (ext4) deleting a fresh 1 GB file
    stalled writers on the same disk, which is retention's cost, not the capture's."""
    times, files = [], []
    t_start = time.perf_counter()
    for n in range(count):
        dst = workdir / f"snap-{kind}-{n}.sqlite"
        t0 = time.perf_counter()
        if kind == "held":
            with held_writer(store, path):
                capture_snapshot(path, dst)
        else:
            capture_snapshot(path, dst)  # what store.capture(dst) runs
        times.append(time.perf_counter() - t0)
        files.append(dst)
        time.sleep(pause)
    return t_start, time.perf_counter(), times, files


def run_size(args, groups: int, workdir: Path) -> dict:
    path = workdir / f"live-{groups}.sqlite"
    built = build_store(path, groups, int(args.payload_gb * 2**30), args.payload_tokens)
    say(f"\n{groups:,} ledger rows, {built['payload_groups'] * GENERATIONS:,} payload rows, "
        f"file {built['file_mb']:,.0f} MB (built in {built['build_s']:.1f} s)")
    if args.writer == "thread":
        store = Store.open(path)
        writer = PumpWriter(store, groups, args.rate, args.writer_tokens)
    else:
        store = None
        writer = WriterProcess(path, groups, args.rate, args.writer_tokens)
    wal = WalWatcher(path)
    phases: dict[str, dict] = {}
    files: list[Path] = []
    try:
        wal.start()
        writer.start()
        time.sleep(args.settle)
        t0 = time.perf_counter()
        time.sleep(args.idle)
        phases["no snapshot"] = {"window": (t0, time.perf_counter()), "capture_s": []}
        for kind in ("ours", "held"):
            t_from, t_to, times, made = snapshot_phase(store, path, workdir, kind, args.snapshots, args.pause)
            phases[kind] = {"window": (t_from, t_to), "capture_s": times}
            files += made
            time.sleep(args.settle)
        t_end = time.perf_counter()
    finally:
        try:
            writer.stop()
        finally:
            wal.stop()
            if store is not None:
                store.close()
            for f in files:
                f.unlink(missing_ok=True)
    result = {"built": built, "writer": args.writer, "phases": {}}
    for name, ph in phases.items():
        w = writer_window(writer.records, *ph["window"])
        w["capture_s"] = ph["capture_s"]
        w["wal_max_mb"] = wal.max_mb(*ph["window"])
        result["phases"][name] = w
    result["wal_at_end_mb"] = wal.max_mb(t_end - 0.5, t_end)
    result["wal_limit_mb"] = JOURNAL_SIZE_LIMIT / 2**20
    path.unlink()
    return result


def print_size(r: dict) -> None:
    for name, w in r["phases"].items():
        caps = ", ".join(f"{c:.2f}" for c in w["capture_s"]) or "-"
        say(f"  {name:<12} writer {fmt_latency(w)}  longest gap {w['longest_gap_ms']:.1f} ms  "
            f"{w['tx_per_s']:,.0f} tx/s | captures (s): {caps} | WAL max {w['wal_max_mb']:.0f} MB")
        free = {"n": w["n"], **{k[len("cpu_free_"):]: v for k, v in w.items() if k.startswith("cpu_free_")}}
        say(f"  {'':<12}   less run-queue wait: p50 {w['cpu_free_p50_ms']:.3f} ms  {fmt_tail(free)}"
            f"  max {w['cpu_free_max_ms']:.2f} ms")
    ours, held, idle = r["phases"]["ours"], r["phases"]["held"], r["phases"]["no snapshot"]
    # With fewer than 100 commits in a phase its p99 is its maximum: tail_ms says which.
    label, ours_tail = tail_ms(ours)
    ours_free_tail = ours["cpu_free_p99_ms"] if ours["cpu_free_p99_ms"] is not None else ours["cpu_free_max_ms"]
    say(f"  ours/no snapshot: {label} {ours_tail / tail_ms(idle)[1]:.1f}x, max {ours['max_ms'] / idle['max_ms']:.1f}x;"
        f" held/ours: {label} {tail_ms(held)[1] / ours_tail:.1f}x, max {held['max_ms'] / ours['max_ms']:.0f}x")
    say(f"  ours less run-queue wait: {label} <= {P99_GOAL_MS} ms "
        f"{'met' if ours_free_tail <= P99_GOAL_MS else 'MISSED'}, max <= {MAX_GOAL_MS} ms "
        f"{'met' if ours['cpu_free_max_ms'] <= MAX_GOAL_MS else 'MISSED'}")
    say(f"  wall clock:"
        f" goals for ours {label} <= {P99_GOAL_MS} ms: {'met' if ours_tail <= P99_GOAL_MS else 'MISSED'},"
        f" max <= {MAX_GOAL_MS} ms: {'met' if ours['max_ms'] <= MAX_GOAL_MS else 'MISSED'}"
        f"; WAL at the end {r['wal_at_end_mb']:.0f} MB (limit {r['wal_limit_mb']:.0f} MB)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="100000,1000000", help="ledger sizes, comma-separated")
    p.add_argument("--payload-gb", type=float, default=1.0, help="sample payload in each store")
    p.add_argument("--payload-tokens", type=int, default=1024, help="tokens per payload sample row")
    p.add_argument("--writer-tokens", type=int, default=256, help="tokens per sample the writer finishes")
    p.add_argument("--rate", type=float, default=1000, help="writer transactions per second (0: flat out)")
    p.add_argument(
        "--writer", choices=("thread", "process"), default="thread",
        help="the pump as a thread beside the captures (as in the controller) or in its own process",
    )
    p.add_argument("--snapshots", type=int, default=3, help="captures per kind and size")
    p.add_argument("--pause", type=float, default=1.0, help="seconds after each capture")
    p.add_argument("--idle", type=float, default=3.0, help="seconds of the no-snapshot reference phase")
    p.add_argument("--settle", type=float, default=1.0, help="seconds between phases")
    p.add_argument("--dir", default=None, help="where the stores go (default: system temp)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.payload_gb, args.snapshots = "2000", 0.002, 1
        args.pause, args.idle, args.settle = 0.05, 0.1, 0.05
    say(f"machine: {benchlib.machine_line()}; writer ({args.writer}) at {args.rate or 'max'} tx/s")
    results = {"machine": benchlib.machine_line(), "args": vars(args), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-", dir=args.dir) as tmp:
        for groups in (int(g) for g in args.groups.split(",")):
            r = run_size(args, groups, Path(tmp))
            print_size(r)
            results["sizes"][str(groups)] = r
    benchlib.write_json(args.json, results)


if __name__ == "__main__":
    main()
