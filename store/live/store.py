"""`Store`: the live rollout state of one run, in one SQLite file.

The pumps change it only through `Store.atomic()` (one ``BEGIN IMMEDIATE`` transaction, a
*mutation*; a snapshot's read transaction is its *cut*) and the transition functions of `ledger` and `pools`, which take the
connection it yields:

    with store.atomic() as tx:
        ids = ledger.reserve_groups(tx, reservations, num_generations=4, target_step=3)
        pools.advance_cursor(tx, next_seq=120, epoch=0)

Reads go through `Store.read()` (a read transaction that takes no write lock) and the
named reads of `queries`. The one-call methods below wrap the common single transitions. Every committed mutation
bumps `run_meta.mutation_counter`, so the snapshot pump can tell that nothing changed.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from sqlalchemy import Connection, delete, func, insert, select, update

from . import ledger, payload, pools
from .capture import Capture, capture_snapshot
from ..sqlite.database import BUSY_TIMEOUT_MS, SECURE_DELETE, Database
from ..errors import NotAStoreError
from .invariants import InvariantReport, check_invariants
from .ledger import FinishedGeneration, Reservation
from ..sqlite.readonly import open_readonly
from ..sqlite.integrity import check_sqlite_file
from ..sqlite.prepared import Prepared
from ..sqlite.revision import create_store_file, file_revision, require_head
from .schema import T

# Compiled once and run on the sqlite3 cursor: it ends every mutation (see ledger.py).
# snapshot_attempts rows kept: about two minutes at the quickstart's 2 s interval.
KEEP_SNAPSHOT_ATTEMPTS = 64
# Pages one `reclaim_free_pages` step gives back (4 MiB at 4 KiB pages); see there.
VACUUM_STEP_PAGES = 1024
_BUMP = Prepared(update(T["run_meta"]).values(mutation_counter=T["run_meta"].c.mutation_counter + 1))


def _incremental_vacuum_mode(path: str | Path) -> None:
    """Make a new store file ``auto_vacuum = INCREMENTAL`` (a VACUUM of the new, empty
    file: ~ms), so that the payload a snapshot seals leaves the file (`reclaim_free_pages`).
    Costs a pointer-map update per page the store allocates."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("VACUUM")


class TransactionClock:
    """Per-thread count, wall seconds and CPU seconds of store transactions; optionally
    every latency (for benchmarks). Cheap: a dict update per transaction. Wall time
    includes waiting for the write lock and for the GIL (other threads' Python);
    CPU time is this thread's own work."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self.samples: list[float] | None = None

    def add(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        entry = self.totals.setdefault(threading.current_thread().name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += cpu_seconds
        if self.samples is not None:
            self.samples.append(seconds)

    def seconds(self, thread_name: str) -> float:
        return self.totals.get(thread_name, [0, 0.0, 0.0])[1]


class Store:
    """A handle on a live store file. Thread-safe: one writer connection under a lock."""

    def __init__(self, db: Database):
        self.db = db
        self.path = db.path
        self.tx_time = TransactionClock()
        # Where the payload segments its samples reference are (CHECKPOINT_DIR/
        # payload_segments, `checkpoints.layout.segments_dir_of`): set by whoever knows the
        # checkpoint directory (the snapshot pump); read by `samples_of`.
        self.segments_dir: Path | None = None

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        path: str | Path,
        *,
        run_id: str | None = None,
        config_fingerprint: str = "",
        dataset_fingerprint: str = "",
        forest_training: dict | None = None,
        ledger_dispatch: bool = True,
        replay_capacity: int = 1024,
        seed: int = 0,
        stamping: str = "target_step",
        synchronous: str = "NORMAL",
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ) -> Store:
        """Create a new store at head by running the migrations, and fill its
        single-row tables. `busy_timeout_ms`: how long a transaction waits for another
        process's write lock before raising `StoreBusyError`."""
        create_store_file(path)
        _incremental_vacuum_mode(path)
        store = cls(Database(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms))
        with store.db.atomic() as tx:
            tx.execute(
                insert(T["run_meta"]).values(
                    id=1,
                    run_id=run_id or uuid.uuid4().hex,
                    created_at=time.time(),
                    config_fingerprint=config_fingerprint,
                    dataset_fingerprint=dataset_fingerprint,
                    forest_training=json.dumps(forest_training or {}, sort_keys=True),
                    ledger_dispatch=int(ledger_dispatch),
                    replay_capacity=replay_capacity,
                    mutation_counter=0,
                )
            )
            tx.execute(insert(T["sampler_state"]).values(id=1, next_seq=0, epoch=0, seed=seed, stamping=stamping))
        return store

    @classmethod
    def open(cls, path: str | Path, *, synchronous: str = "NORMAL", busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Store:
        """Open an existing store; refuses a file that is not at head (old files are
        upgraded with `rolloutdb upgrade`, newer ones need a newer rolloutdb)."""
        path = check_sqlite_file(path)
        # open_readonly: a URI-quoted path (a '#' or '?' in a name), no side files.
        with contextlib.closing(open_readonly(path)) as conn:
            try:
                revision = file_revision(conn)
            except sqlite3.DatabaseError as e:
                raise NotAStoreError(f"{path}: unreadable SQLite file ({e}); restore it from another snapshot") from e
        require_head(path, revision)
        return cls(Database(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ transactions

    @contextlib.contextmanager
    def atomic(self, *, mutation: bool = True) -> Iterator[Connection]:
        """The one way to change the store (a ``BEGIN IMMEDIATE`` transaction on the
        writer). `mutation=False` is for bookkeeping writes that a snapshot need not
        capture (snapshot-attempt outcomes); reads use `read()`. Each outermost
        transaction's wall time, lock wait included, is added to `tx_time` under the
        calling thread's name (what the pumps pay for the store)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self.db.atomic() as tx:
            yield tx
            if mutation:
                _BUMP.run(tx)
        self.tx_time.add(time.perf_counter() - t0, time.thread_time() - c0)

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """The one way to read the store: a read transaction (``BEGIN DEFERRED``) that
        takes no write lock, so it neither waits for writers nor holds them up, and sees
        one consistent state (see `Database.read`). Timed into `tx_time` like `atomic`."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self.db.read() as conn:
            yield conn
        self.tx_time.add(time.perf_counter() - t0, time.thread_time() - c0)

    @property
    def mutation_counter(self) -> int:
        with self.read() as conn:
            return conn.execute(select(T["run_meta"].c.mutation_counter)).scalar_one()

    def run_meta(self) -> dict:
        with self.read() as conn:
            row = conn.execute(select(T["run_meta"])).mappings().one()
        meta = dict(row)
        meta["forest_training"] = json.loads(meta["forest_training"])
        return meta

    # ------------------------------------------------------------ single transitions

    def reserve(self, reservations: Sequence[Reservation], *, num_generations: int, target_step: int | None) -> list[int]:
        with self.atomic() as tx:
            ids = ledger.reserve_groups(tx, reservations, num_generations=num_generations, target_step=target_step)
            pools.cover_cursor(tx, max(r.sample_seq for r in reservations) + 1, reservations[-1].epoch)
            return ids

    def dispatch(self, group_ids: Sequence[int], *, policy_version: int) -> list[int]:
        with self.atomic() as tx:
            return ledger.dispatch_groups(tx, group_ids, policy_version=policy_version)

    def finish(self, attempt_id: int, generation: FinishedGeneration) -> None:
        with self.atomic() as tx:
            ledger.finish_attempts(tx, [(attempt_id, generation)])

    def abandon(self, attempt_ids: Sequence[int], reason: str) -> None:
        with self.atomic() as tx:
            ledger.abandon_attempts(tx, attempt_ids, reason)

    def seal(self, group_ids: Sequence[int]) -> None:
        with self.atomic() as tx:
            ledger.seal_groups(tx, group_ids)

    def enter_replay(self, group_ids: Sequence[int]) -> list[int]:
        with self.atomic() as tx:
            return ledger.enter_replay(tx, group_ids)

    def mark_trained(self, group_ids: Sequence[int], *, step: int, keep_steps: int = ledger.KEEP_STEPS) -> None:
        with self.atomic() as tx:
            ledger.mark_trained(tx, group_ids, step=step, keep_steps=keep_steps)

    def discard(self, group_ids: Sequence[int], *, reason: str) -> None:
        with self.atomic() as tx:
            ledger.discard_groups(tx, group_ids, reason=reason)

    # ------------------------------------------------------------ snapshots and checks

    def record_snapshot_attempt(
        self,
        outcome: str,
        *,
        anchor: str | None = None,
        snapshot_seq: int | None = None,
        mutation_counter: int | None = None,
        timings: dict | None = None,
        error: str | None = None,
    ) -> None:
        """Log a snapshot attempt's outcome, once per attempt, by whoever decided it: the
        controller's snapshot pump; a caller with its own publish loop calls this itself
        (the Publisher records nothing). Not a mutation: recording that a snapshot was
        skipped must not make the next attempt think something changed. The newest
        KEEP_SNAPSHOT_ATTEMPTS rows are kept."""
        with self.atomic(mutation=False) as tx:
            counter = mutation_counter
            if counter is None:
                counter = tx.execute(select(T["run_meta"].c.mutation_counter)).scalar_one()
            tx.execute(
                insert(T["snapshot_attempts"]).values(
                    started_at=time.time(),
                    outcome=outcome,
                    anchor=anchor,
                    snapshot_seq=snapshot_seq,
                    mutation_counter=counter,
                    timings=json.dumps(timings) if timings is not None else None,
                    error=error,
                )
            )
            # Only the newest attempts stay (the store holds what is in flight, not the
            # run's history: metrics.jsonl has a line for every attempt). One snapshot
            # every 2 s kept every attempt added 45 KB per 300 quickstart steps
            # (bench/bench_bounded_store.py).
            attempts = T["snapshot_attempts"]
            newest = select(func.max(attempts.c.attempt_seq)).scalar_subquery()
            tx.execute(delete(attempts).where(attempts.c.attempt_seq <= newest - KEEP_SNAPSHOT_ATTEMPTS))

    def capture(self, dst: str | Path, *, at_cut=None, into_copy=None, base: str | Path | None = None) -> Capture:
        """A consistent copy of the store at one read cut (see `capture.py`); `base`, the
        previous snapshot's file, is cloned and only what changed written, where it can be."""
        return capture_snapshot(self.path, dst, at_cut=at_cut, into_copy=into_copy, base=base)

    def samples_of(self, group_ids: Sequence[int]) -> list[tuple]:
        """The samples of `group_ids` with their payload, inline or from its segment, in
        one read transaction (`payload.read_samples`: the one reader of payload)."""
        with self.read() as conn:
            return payload.read_samples(conn, group_ids, self.segments_dir)

    def segment_references(self) -> set[str]:
        """The file names of the payload segments this store's samples reference."""
        with self.read() as conn:
            return {r.file_name for r in payload.referenced_segments(conn)}

    def reclaim_free_pages(self) -> int:
        """Give the file's free pages back (``PRAGMA incremental_vacuum``) in a store
        created with ``auto_vacuum = INCREMENTAL`` (every store `create` makes); returns
        the pages freed, 0 in a store without it (an upgraded file: the capture's own
        VACUUM of the copy keeps its snapshots small, capture.py). Called after payload
        is sealed into a segment: the backup API copies free pages too, so without this
        every snapshot would copy the sealed payload's old pages again. Its own
        connection and write transaction (``executescript`` steps the pragma to the end;
        sqlite3's ``execute`` frees one page per step). Cost: moving the in-use pages
        that sit after the first free page; sealing frees the interval's payload, which
        was appended last, so few move (measured in bench/bench_snapshot_segments.py)."""
        with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as conn:
            conn.execute(f"PRAGMA busy_timeout = {self.db.busy_timeout_ms}")
            conn.execute(f"PRAGMA secure_delete = {SECURE_DELETE}")  # moved pages' old places are not zeroed
            if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                return 0
            (free,) = conn.execute("PRAGMA freelist_count").fetchone()
            # In steps of VACUUM_STEP_PAGES, each its own write transaction, so the pumps'
            # transactions wait for one step at most, not for the whole interval's pages.
            for _ in range(-(-free // VACUUM_STEP_PAGES)):
                conn.executescript(f"PRAGMA incremental_vacuum({VACUUM_STEP_PAGES})")
            return free

    def check_invariants(self) -> InvariantReport:
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            conn.execute("BEGIN")
            return check_invariants(conn)
