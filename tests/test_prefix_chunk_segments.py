"""Incremental prefix cuts (revision v1_8_a): a running call's tokens are written once,
into the segment of the cut that first saw them, and every later snapshot references
them; a call that is no longer running is referenced by no later snapshot, and its
segment goes once retention drops the snapshots that needed it; a resume continues the
call from exactly the prefix the chunks add up to; old snapshots with inline chunks
restore. Real parts: the reference engine on the tiny policy, a real store, Publisher and
snapshot pump, real segment files; everything is read back through second connections
(sqlite3 and numpy), never through the code under test."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import threading
from pathlib import Path

import numpy as np

from test_hostile_proofs_pump import DEADLINE_S, Weights, _rows
from test_streaming_pump import LengthEnv, make_parts, policy_dir  # noqa: F401 - fixture

from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.gpu_capture import ReferenceEngine
from rolloutdb.gpu_capture.protocol import GenerationRequest
from rolloutdb.store import CallPrefix, FinishedGeneration, KeepNewestSnapshots, Publisher, Retention, Store, codec, pools
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.restore.apply import restore_snapshot
from rolloutdb.store.sqlite.upgrade import upgrade_file

FIXTURES = Path(__file__).parent / "fixtures"


class Gates:
    """Holds the engine's worker after each step in `at` until `go()` (outside the
    engine lock: cuts read the engine meanwhile, nothing is decoded)."""

    def __init__(self, engine: ReferenceEngine, at: list[int]):
        self.at, self.reached, self.release = list(at), threading.Event(), threading.Event()
        self.closed = False
        engine.step_callback = self._callback

    def _callback(self, step: int) -> None:
        if self.at and step == self.at[0] and not self.closed:
            self.at.pop(0)
            self.reached.set()
            self.release.wait(DEADLINE_S)
            self.release.clear()

    def wait(self) -> None:
        assert self.reached.wait(DEADLINE_S), "the engine did not reach its step"
        self.reached.clear()

    def go(self) -> None:
        self.release.set()


class RequestsEngine(ReferenceEngine):
    """Remembers each request it was given, to run it again uninterrupted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests: dict[str, GenerationRequest] = {}

    def submit(self, request):
        self.requests[request.request_id] = request
        return super().submit(request)


def _segment_rows(checkpoints: Path, name: str) -> dict[int, tuple[list[int], list[float]]]:
    with contextlib.closing(sqlite3.connect(f"file:{checkpoints / 'payload_segments' / name}?mode=ro&immutable=1",
                                            uri=True)) as seg:
        return {r: (np.frombuffer(t, "<i4").tolist(), np.frombuffer(lp, "<f4").tolist())
                for r, t, lp in seg.execute("SELECT sample_id, token_ids, logprobs FROM payload")}


def _chunk_refs(snap: Path) -> list[tuple[int, int, int, str, int]]:
    """(attempt, chunk index, prefix count, segment file, row) of every chunk, by hand."""
    return _rows(snap, "SELECT c.attempt_id, c.chunk_index, c.prefix_count, p.file_name, c.segment_row "
                       "FROM token_chunks c JOIN payload_segments p ON p.segment_id = c.segment_id "
                       "ORDER BY c.attempt_id, c.chunk_index")


def _prefix(checkpoints: Path, snap: Path, attempt_id: int) -> list[int]:
    tokens: list[int] = []
    for a, _, count, name, row in _chunk_refs(snap):
        if a == attempt_id:
            assert count == len(tokens), "chunks with a gap"
            tokens += _segment_rows(checkpoints, name)[row][0]
    return tokens


def _run_cuts(tmp_path, policy_dir, steps, between=None, retention=None):  # noqa: F811
    """A prefix-level pump whose two long calls (40 tokens) decode while the others
    finished at step 1 and wait in transit; the engine is held after each of `steps`
    and a real snapshot attempt cuts there. `between(parts, pump, k)` runs before cut k.
    Returns (snapshot files, the engine's long calls at each cut, engine, checkpoints,
    the segments each snapshot's manifest listed when it was published)."""
    first = [r.prompt_id for r in PromptOrder(64, seed=0).take(0, 4)]
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=40, long_prompt=first[0]),
                          overrides={"algorithm": {"groups_per_step": 4, "group_size": 2},
                                     "rollout_recovery": {"target_level": "prefix"}})
    parts.engine.close()
    eng = parts.engine = RequestsEngine(policy_dir, max_batch_size=16, num_threads=1)
    gates = Gates(eng, steps)
    checkpoints = tmp_path / "checkpoints"
    publisher = Publisher(checkpoints, retention=retention)
    snaps, seen, listed = [], [], []
    try:
        pump = RolloutPump(parts)
        pump._commit()  # dispatches and submits; the pump's loop never runs
        publisher.publish_bootstrap(Weights().save_checkpoint)
        snapshots = SnapshotPump(parts, publisher, interval_s=60.0, config_text="a: 1\n",
                                 env_checkpoint=NoEnvironmentCheckpoint())
        snapshots.uncommitted_calls = pump.uncommitted_calls
        for k in range(len(steps)):
            gates.wait()
            seen.append({rid: c for rid, c in eng.running_calls().items() if len(c.token_ids) > 1})
            if between is not None:
                between(parts, pump, k)
            result = snapshots.attempt(force=True)
            assert result.outcome == "published", result
            snaps.append(checkpoints / "bootstrap" / "rollout_snapshots" / f"snapshot_{result.sequence}" / SNAPSHOT_DB)
            listed.append({e["path"] for e in json.loads((snaps[-1].parent / "manifest.json").read_text())
                           .get("segments", [])})
            gates.go()
    finally:
        gates.closed = True
        gates.go()
        parts.runtime.stop.set()
        parts.engine.close()
        parts.store.close()
        publisher.close()
    return snaps, seen, eng, checkpoints, listed


def _attempts(snap: Path) -> dict[str, int]:
    return {f"g{g}.{i}-a{n}-t0": a for a, g, i, n in _rows(
        snap, "SELECT attempt_id, group_id, generation_index, attempt FROM rollouts")}


def test_a_call_running_across_three_cuts_has_each_token_written_once_and_resumes_from_exactly_its_prefix(
        tmp_path, policy_dir):  # noqa: F811
    snaps, seen, eng, checkpoints, _ = _run_cuts(tmp_path, policy_dir, [6, 10, 14])
    long_calls = sorted(seen[0])
    assert len(long_calls) == 2 and [len(seen[k][long_calls[0]].token_ids) for k in range(3)] == [6, 10, 14]
    attempts = _attempts(snaps[2])
    files = [sorted({name for _, _, _, name, _ in _chunk_refs(s)}) for s in snaps]
    new = [sorted(set(files[k]) - set(files[k - 1] if k else [])) for k in range(3)]
    assert all(len(n) == 1 for n in new), f"each cut writes one new segment: {new}"
    # The second and third cuts' segments hold only what the long calls decoded since the
    # cut before: 4 tokens each, nothing of the short calls (saved whole at the first cut).
    for k in (1, 2):
        rows = _segment_rows(checkpoints, new[k][0])
        assert sorted(len(t) for t, _ in rows.values()) == [4, 4], (k, rows)
    for rid in long_calls:
        refs = [name for a, _, _, name, _ in _chunk_refs(snaps[2]) if a == attempts[rid]]
        assert refs == [new[0][0], new[1][0], new[2][0]], f"{rid}: the third snapshot references {refs}"
    manifest = json.loads((snaps[2].parent / "manifest.json").read_text())
    assert {e["path"] for e in manifest["segments"]} == set(files[2]), "the manifest lists every referenced segment"
    for k, snap in enumerate(snaps):  # what each snapshot adds up to is what the engine had decoded
        for rid in long_calls:
            assert _prefix(checkpoints, snap, attempts[rid]) == seen[k][rid].token_ids, (k, rid)

    live = tmp_path / "restored" / "store.sqlite"
    live.parent.mkdir()
    ((cfg, data, forest),) = _rows(snaps[2], "SELECT config_fingerprint, dataset_fingerprint, forest_training FROM run_meta")
    plan = restore_snapshot(snaps[2].parent, live, config_fingerprint=cfg, dataset_fingerprint=data,
                            forest_training=json.loads(forest), groups_per_step=4)
    keys = {f"g{g}.{i}-a{n}-t0": (g, i) for a, g, i, n in _rows(
        snaps[2], "SELECT attempt_id, group_id, generation_index, attempt FROM rollouts")}
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as fresh:
        for rid in long_calls:
            prefix = CallPrefix.of(plan.saved_prefixes[keys[rid]])
            cut = seen[2][rid]
            assert prefix is not None and list(prefix.token_ids) == cut.token_ids
            assert list(prefix.token_versions) == cut.token_versions
            assert np.array_equal(np.asarray(prefix.logprobs, "<f4"), np.asarray(cut.logprobs, "<f4"))
            request = eng.requests[rid]
            whole = fresh.submit(GenerationRequest(f"{rid}-whole", request.prompt_ids, request.params)).result(DEADLINE_S)
            resumed = fresh.submit(GenerationRequest(
                f"{rid}-resumed", request.prompt_ids, request.params, prefix_ids=list(prefix.token_ids),
                prefix_versions=list(prefix.token_versions), prefix_logprobs=list(prefix.logprobs))).result(DEADLINE_S)
            assert resumed.token_ids == whole.token_ids and resumed.token_versions == whole.token_versions


def _finish_every_saved_attempt(parts, pump, k) -> None:
    """Before the second cut: the ledger finishes every attempt the first cut saved (their
    groups' generations, in one transaction through the pump's own dispatcher), while the
    engine still runs the long calls."""
    if k != 1:
        return
    with parts.store.atomic() as tx:
        for run in pump._groups.values():
            g = run.handle
            gens = {i: FinishedGeneration([5], [-1.0], 1.0, codec.version_runs([0])) for i in range(2)}
            parts.dispatcher.finish(tx, [(g, gens)])


def test_a_finished_calls_chunks_are_not_referenced_by_the_next_snapshot_and_their_segment_goes_with_the_last_snapshot_needing_it(
        tmp_path, policy_dir):  # noqa: F811
    snaps, _, _, checkpoints, listed = _run_cuts(tmp_path, policy_dir, [6, 10], between=_finish_every_saved_attempt,
                                                 retention=Retention(KeepNewestSnapshots(1)))
    first_segments = listed[0]
    assert len(first_segments) == 1, "the first cut wrote its calls' chunks into one segment"
    assert _rows(snaps[1], "SELECT count(*) FROM token_chunks") == [(0,)], "the finished calls' chunks are referenced"
    assert not listed[1] & first_segments, "the second snapshot lists the finished calls' segment"
    assert not snaps[0].parent.exists(), "retention kept the first snapshot"
    (segment,) = first_segments
    assert not (checkpoints / "payload_segments" / segment).exists(), "the segment no kept snapshot needs is still there"


def test_an_old_snapshot_with_inline_chunks_restores_them(tmp_path):
    """The v1_7_a fixture's chunks are inline: upgraded and read through the one chunk
    reader, they are the bytes the file holds."""
    copy = tmp_path / "old.sqlite"
    shutil.copyfile(FIXTURES / "store_v1_7_a.sqlite", copy)
    expected: dict[int, list[int]] = {}
    for a, blob in _rows(copy, "SELECT attempt_id, token_ids FROM token_chunks ORDER BY attempt_id, chunk_index"):
        expected.setdefault(a, []).extend(np.frombuffer(blob, "<i4").tolist())
    assert expected, "the fixture holds prefix chunks"
    upgrade_file(copy)
    store = Store.open(copy)
    try:
        with store.read() as conn:
            chunks = pools.read_chunks_of(conn, sorted(expected))
    finally:
        store.close()
    assert {a: [t for c in cs for t in c.token_ids] for a, cs in chunks.items()} == expected
