"""The one bundle of parts both pumps share, the runtime state they coordinate by, and the
map of every thread and lock of a run.

The pumps never read each other's (or the controller's) fields: they see the trainer's
live counters only through `read_progress`, and signal each other only through
`RuntimeState` (a condition variable, a stop flag and the first error).

Threads of `rolloutdb train` (by the name `threading.enumerate()` shows; the store's
`store_share` metrics are keyed by these names too). tests/test_threads_documented.py
fails on any thread the code starts that this list does not name, and on any name here
no code starts:

- `MainThread`: the train pump (`TrainPump.run`, called by `Controller.run`). Owns the
  trainer and the optimizer commit (holds the commit lock from the optimizer step until
  its groups are marked trained; a trainer with `train_step` alone, no `StagedTrainer`:
  across its whole step), the refit of the engine, trainer checkpoints
  (`TrainerCheckpoints`; with `checkpointing.async` it copies the state at the step
  boundary, and renames the written checkpoint into place at a later one unless the
  snapshot pump did it first, under the save lock, trying it without waiting), and waits in `SnapshotPump.anchor_new_checkpoint`
  for the cut of the snapshot anchored to each new checkpoint. Also setup, restore and
  shutdown, and the signal handlers of `rolloutdb train`
  (`rolloutdb/commands/_graceful_stop.py`): Python runs them on this thread between
  bytecodes, so they only set `RuntimeState.shutdown` (no lock, no I/O); at the end of
  the step in progress this thread takes the final checkpoint and snapshot.
- `rollout-pump`: the rollout pump (`RolloutPump.run`). Owns the sampler, dispatch and
  every running episode: submits model calls to the engine (never holding a lock of the
  list below), steps the environment, and commits what finished in group-commit batches,
  one `atomic()` transaction per window: finishes, turn progress, seals, replay entries
  and new dispatches.
- `snapshot-pump`: the snapshot pump (`SnapshotPump.run`). Owns rollout snapshots: one
  attempt at a time under the save lock (snapshot_pump.py has the order of work). With
  `checkpointing.async`, before each attempt it publishes the pending trainer checkpoint
  whose write has ended (`TrainerCheckpoints.publish_if_written`, holding no lock).
- `rolloutdb-checkpointer:<file name>`: a WAL checkpointer (`store/sqlite/database.py`),
  one per open `Database`: one for the live store (`store.sqlite`) and, with tracing on,
  one for the trace file. Owns the PASSIVE checkpoints of its file's WAL; takes that
  file's database write lock only for the one pass that lets the WAL restart.
- `rolloutdb-trace:<run id>`: the trace writer (`store/trace/writer.py`), with tracing
  on. Owns the trace file: commits the events `emit` queued, in batches.
- `reference-engine`: the engine worker (`gpu_capture/reference_engine.py`). Owns the
  running generation calls; a decode step holds the engine lock.
- `rolloutdb-fsync`: the fsync helper (`store/checkpoints/publish.py`,
  `commit_directory`), a one-thread pool for the length of one publication: fsyncs each
  file while the publishing thread hashes it.
- `rolloutdb-copy-check`: a rollout snapshot's copy check (`store/checkpoints/publish.py`,
  `Publisher._check_copy`), a one-thread pool for the length of one publication: checks
  the captured copy as verify would and records the sequence high water while the
  publishing thread fsyncs and hashes the files; the manifest waits for it.
- `rolloutdb-publish`: the Publisher's background pool (`publish_deferred`, background
  retention, and the writer of asynchronous trainer checkpoints,
  `store/checkpoints/staged.py`). `rolloutdb train` starts it only with
  `checkpointing.async: true`: it writes and seals the copy of the trainer's state taken
  at a step boundary holding no lock (the temporary directory is in the Publisher's busy
  set, so no save removes it), then runs retention under the save lock once the train
  pump has published the checkpoint.
- `rolloutdb-restore-integrity`: during a restore (main thread, before the pumps
  start), `PRAGMA integrity_check` of the snapshot's file while it is copied
  (`store/restore/copying.py`, `SourceIntegrityCheck`).
- `rolloutdb-http`: with agent servers (`environment.servers`), the asyncio loop of
  `controller/agent_server/http_loop.py`: serves the policy endpoint (each call handed
  to the engine's `submit`, holding no lock) and runs every HTTP client call to the
  servers. The pumps reach it only through futures.
- `vllm-engine`: with `generation.backend: vllm`, the asyncio loop that drives vLLM's
  `AsyncLLM` (`gpu_capture/vllm_engine.py`): `submit` hands each call to it and returns a
  future; `running_calls` runs its read there, so it sees no output step half applied.
- `ray-engine-pool`: with `cluster.backend: ray`, completes the callers' futures from the
  engine workers' answers, replaces a lost worker and routes to a replacement once it is
  placed (`gpu_capture/ray_workers.py`, `gpu_capture/ray_slots.py`); Ray's own threads
  only queue the answers for it. Takes only the pool's lock (a leaf).
- `ray-env-pool`: with `cluster.environment_workers` > 0, the same for the environment
  workers' step answers (`controller/rollout/ray_environments.py`): completes the steps' futures
  (the rollout pump takes them from its completion queue) and replaces a lost worker.
  Takes only its pool's lock (a leaf).
- `rolloutdb-agent-start_<n>`: at setup, starts the agent server processes the
  controller owns, in parallel (a pool that ends with setup).
- `rolloutdb-restore-hash`: during a restore, a one-thread pool that hashes each copied
  range while the next one is read (`copy_hashing`).
- `rolloutdb-restore-segments`: during a restore, hashes the payload segments the snapshot
  lists, in place (never copied), while the store file is restored; the restore waits for
  its verdict before it replaces the live store (`store/restore/plan.py`).
- `rolloutdb-duckdb-interrupt`: not a thread of a run: while `rolloutdb sql` or
  `rolloutdb trace` runs a DuckDB call, it interrupts the call at the query's --timeout
  or on SIGINT/SIGTERM, whose handler only records the signal
  (`store/trace/interrupts.py`).
- `conformance-policy`: not a thread of a run: `rolloutdb conformance` serves its fixed
  policy endpoint on it (`controller/agent_server/conformance_policy.py`); its
  http.server answers each call on a thread of its own, and a held call waits there.

Lock order (a thread holding one may take only those to its right; nobody takes one to
the left of a lock it holds):

    checkpoints lock -> save lock -> commit lock (tried, never waited for) -> database write lock
    commit lock -> database write lock

- The save lock is the `Publisher`'s own lock (`Publisher.lock`, re-entrant): one save at
  a time per checkpoint directory. Trainer checkpoints take it through the Publisher's
  calls; a snapshot attempt holds it from its skip checks to the end of its publication,
  so no trainer checkpoint (and no retention) runs between `begin_snapshot` and
  `stage.publish` and removes the anchor the snapshot is being written under. There is
  no second save lock in the controller: one lock serializes saves.
- The checkpoints lock (`TrainerCheckpoints._lock`): the pending asynchronous trainer
  checkpoint, begun and published by the train pump, published by the snapshot pump
  (which only tries it, never waits for it). Taken before the save lock, never inside it.
- The commit lock (`RuntimeState.commit_lock`): held by the train pump from the optimizer
  step until its groups are marked trained (a `StagedTrainer` prepares its step, forward
  and backward, outside it; a trainer with `train_step` alone holds it for the whole step), so a snapshot's cut falls entirely before or
  after an optimizer commit. The snapshot pump only tries it (`acquire(blocking=False)`)
  and skips or aborts when it is held, so it never waits for the train pump.
- The database write lock (`Database._write_lock`, per file): every `atomic()`
  transaction, and the checkpointer's one held pass. A snapshot's cut is a read
  transaction and takes no write lock.
- Leaves (held briefly, nothing taken inside): the `RuntimeState` condition, the
  snapshot pump's waiter list, the metrics log's lock, the engine lock (the pumps call
  the engine holding no lock of the list above), the fault-point registry's lock.
- Waits between pumps: at turn and prefix level a snapshot attempt, holding the save
  lock, waits at most 0.1 s for the rollout pump to commit what finished before its cut
  (`RolloutPump.flush`); the rollout pump never takes the save lock, so it always
  answers (or the wait times out and the cut goes ahead). At prefix level the cut reads
  the engine's running calls (the engine lock, a leaf, for O(calls)) before it tries the
  commit lock, holding only the save lock (`SnapshotPump._cut`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutdb.config import Config
from rolloutdb.controller.protocols import Environment, Trainer
from rolloutdb.controller.run.dispatch import Dispatcher
from rolloutdb.controller.run.sampler import PromptOrder, StalenessBound
from rolloutdb.gpu_capture.protocol import GenerationEngine
from rolloutdb.store import NullTracer, Store, Tracer


@dataclass(frozen=True)
class Progress:
    """The trainer's live counters."""

    step: int  # optimizer steps done
    policy_version: int  # version the engine generates with


class RuntimeState:
    """How the pumps wait for each other. `notify()` after anything another pump may be
    waiting for (groups entering the replay buffer, a train step, a refit)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        # Why a graceful stop was asked for (a signal's name), or None. A plain attribute,
        # not an Event: it is set from a signal handler on the main thread, which may have
        # interrupted that very thread inside an Event's (non-reentrant) lock. The pumps
        # poll it: the rollout pump hands out no new group once it is set, the train pump
        # ends after the step in progress (`Controller.request_shutdown`).
        self.shutdown: str | None = None
        # Held by the train pump from the optimizer step until its groups are marked
        # trained: a snapshot cut must fall entirely before or after a commit. (The save
        # lock is the Publisher's: see the lock order above.)
        self.commit_lock = threading.Lock()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self._changed:
            if not self.stop.is_set():
                self._changed.wait(timeout)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.stop.set()
        self.notify()


@dataclass
class RolloutParts:
    """What the pumps share. Parts only the rollout pump uses (where the environment
    steps, the agent servers) are its constructor's (controller/rollout/pump.py)."""

    config: Config
    store: Store
    order: PromptOrder
    bound: StalenessBound
    engine: GenerationEngine
    env: Environment
    trainer: Trainer
    dispatcher: Dispatcher
    runtime: RuntimeState
    read_progress: Callable[[], Progress]
    log_event: Callable[[dict], None]
    # Tracing off is a NullTracer (every call does nothing), never None: no code path
    # asks whether there is a tracer (tests/test_tracing_off.py).
    tracer: Tracer | NullTracer = field(default_factory=NullTracer)
