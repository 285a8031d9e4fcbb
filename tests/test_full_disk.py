"""A disk that fills up while SQLite itself copies the snapshot file (the backup API).

The I/O-error matrix in test_fault_injection.py injects errors at the project's own
writes, fsyncs and renames; SQLite's writes into the new snapshot file go through none of
them. Here the disk is really full, or the file really cannot grow:

* `tmpfs`: the checkpoint directory is a tmpfs of a few MiB mounted for the test (needs
  root or CAP_SYS_ADMIN), filled with a filler file until the next snapshot no longer
  fits; the write fails with ENOSPC (SQLite: "database or disk is full"). Room comes back
  by deleting the filler.
* `rlimit_fsize`: where no file system can be mounted, the child process lowers
  RLIMIT_FSIZE below the snapshot's size and ignores SIGXFSZ, so SQLite's write past
  the limit fails with EFBIG. Room comes back by raising the limit again.

The publishing process is a real child (`_CHILD`), driven line by line. While the disk
is full it takes one attempt through the Publisher alone (a typed error naming the disk)
and one through the controller's snapshot pump, which records every attempt's outcome
(the Publisher records none). Before room comes back the test checks the disk from
outside: one outcome row per pump attempt, the failed one included (second connection),
the previous snapshot byte-for-byte intact, still the newest
sound snapshot (decided from the manifests, `crash_harness.newest_usable_snapshot`, and
by `select_for_restore`), and no leftover directory counted as a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from crash_harness import newest_usable_snapshot
from rolloutdb.store import scan, select_for_restore

TMPFS_BYTES = 16 << 20
FREE_LEFT = 256 << 10  # what the filler leaves free: far less than the grown store
DEADLINE_S = 120

_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sqlite3, sys, time
    from pathlib import Path
    from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
    from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
    from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
    from rolloutdb.store import FinishedGeneration, PublishError, Publisher, Reservation, Store
    from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots, Retention

    live, ckpt, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    store = Store.create(live, replay_capacity=64)
    pub = Publisher(ckpt, retention=Retention(KeepNewestSnapshots(2)))
    # The controller's snapshot pump on the same store and Publisher; the parts it never
    # touches are None. Its metrics lines are kept in a list and printed with each result.
    lines = []
    parts = RolloutParts(config=None, store=store, order=None, bound=None, engine=None, env=None, trainer=None,
                         dispatcher=None, runtime=RuntimeState(), read_progress=lambda: Progress(0, 0),
                         log_event=lines.append)
    pump = SnapshotPump(parts, pub, interval_s=3600.0, config_text="a: 1\\n", env_checkpoint=NoEnvironmentCheckpoint())

    def fill(seq, tokens):
        (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=1, target_step=1)
        (a,) = store.dispatch([gid], policy_version=0)
        store.finish(a, FinishedGeneration(list(range(tokens)), [-0.5] * tokens, 1.0, [(0, tokens)]))

    def snapshot():  # a caller of its own: the Publisher alone, its typed error
        try:
            p = pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), "a: 1\\n")
            return {"published": p.sequence}
        except Exception as e:
            return {"error": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}

    def pump_attempt():  # the controller's way: the pump decides, publishes and records
        r = pump.attempt(force=True)
        line = lines[-1]
        return {"outcome": r.outcome, "sequence": r.sequence, "error": r.error,
                "line": [line["outcome"], line["sequence"], line["error"]]}

    pub.publish_bootstrap(lambda d: (d / "weights.bin").write_bytes(b"w" * 1000))
    fill(0, 300)
    print(json.dumps(pump_attempt()), flush=True)
    for seq in range(1, 16):  # the store grows to a few MiB
        fill(seq, 40_000)
    with sqlite3.connect(live) as c:  # an empty WAL: the outcome row fits under any limit
        for _ in range(600):  # a reader of the store's own (a pool connection) can keep it busy a moment
            busy, frames, _moved = c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy and frames == 0:
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"the WAL of {live} could not be emptied")
    print(json.dumps({"store_bytes": live.stat().st_size}), flush=True)
    assert sys.stdin.readline().strip() == "attempt"
    if mode == "rlimit_fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        # Half the store's size: neither the segment the pump's attempt seals first (the
        # store's inline payload, nearly all of it) nor the copy (as large as the store)
        # can be written to its end, while the live store's own small writes (the outcome
        # row, in WAL frames far below the limit) still can. Just below the store's size
        # was a coin toss: the segment is a few KiB smaller than the store, and a schema
        # revision that added two pages let it fit, the seal then committed WAL frames up
        # to the limit and the outcome row found no room.
        resource.setrlimit(resource.RLIMIT_FSIZE, (live.stat().st_size // 2, hard))
    print(json.dumps(snapshot()), flush=True)
    print(json.dumps(pump_attempt()), flush=True)
    assert sys.stdin.readline().strip() == "again"
    if mode == "rlimit_fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(json.dumps(pump_attempt()), flush=True)
    store.close()
    """
)


def _mount_tmpfs(where: Path) -> str | None:
    """Mount a small tmpfs at `where`; None if it worked, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    where.mkdir(parents=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


class Child:
    def __init__(self, live: Path, ckpt: Path, mode: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(live), str(ckpt), mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(self) -> dict:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(DEADLINE_S)
        if not box or not box[0]:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"the child said nothing within {DEADLINE_S} s or died: {err[-3000:]}")
        return json.loads(box[0])

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"the child did not exit within {DEADLINE_S} s") from None


def _fill_until(root: Path, free: int) -> Path:
    filler = root / "filler.bin"
    left = shutil.disk_usage(root).free - free
    with open(filler, "wb") as f:
        while left > 0:
            n = min(left, 1 << 20)
            f.write(b"\0" * n)
            left -= n
    return filler


@pytest.fixture(params=["tmpfs", "rlimit_fsize"])
def small_disk(request, tmp_path):
    """(mode, checkpoint directory, live store path)."""
    live = tmp_path / "live" / "rollout_state.sqlite"
    live.parent.mkdir()
    if request.param == "tmpfs":
        mnt = Path(f"/tmp/rolloutdb-fulldisk-{uuid.uuid4().hex[:8]}")
        why = _mount_tmpfs(mnt)
        if why is not None:
            with contextlib.suppress(OSError):
                mnt.rmdir()
            pytest.skip(f"cannot mount a small tmpfs here ({why}); the rlimit_fsize variant covers this machine")
        try:
            yield "tmpfs", mnt / "ckpt", live
        finally:
            _umount(mnt)
            with contextlib.suppress(OSError):
                mnt.rmdir()
    else:
        yield "rlimit_fsize", tmp_path / "ckpt", live


def test_a_full_disk_during_sqlites_own_snapshot_copy_fails_the_attempt_and_loses_nothing(small_disk):
    mode, ckpt, live = small_disk
    child = Child(live, ckpt, mode)
    try:
        assert child.read() == {"outcome": "published", "sequence": 1, "error": None,
                                "line": ["published", 1, None]}
        first = ckpt / "bootstrap" / "rollout_snapshots" / "snapshot_1"
        first_bytes = {p.name: p.read_bytes() for p in first.iterdir()}
        grown = child.read()["store_bytes"]
        filler = None
        if mode == "tmpfs":
            assert 2 * FREE_LEFT < grown < TMPFS_BYTES // 3, grown  # fits once the filler is gone
            filler = _fill_until(ckpt.parent, FREE_LEFT)
        child.say("attempt")
        failed = child.read()
        pump_failed = child.read()

        # Through the Publisher alone: the attempt failed with a typed error naming the disk.
        assert failed.get("error") == "PublishError", failed
        # ENOSPC when the file system is full; SQLite passes no errno on for EFBIG: EIO.
        assert failed["errno"] == {"tmpfs": errno.ENOSPC, "rlimit_fsize": errno.EIO}[mode], failed
        assert ("ENOSPC" if mode == "tmpfs" else "EIO") in failed["message"]
        assert "snapshot_2" in failed["message"]
        # Through the snapshot pump, as the controller takes it: the pump seals the store's
        # inline payload into a segment before its cut (W2-G), and that write is the first
        # the full disk fails, before a number is handed out. One outcome row per pump
        # attempt in the live store (a second connection), written while the disk is still
        # full, matching the metrics line; the error is one line.
        assert (pump_failed["outcome"], pump_failed["sequence"]) == ("failed", None), pump_failed
        assert pump_failed["line"] == ["failed", None, pump_failed["error"]]
        with contextlib.closing(sqlite3.connect(f"file:{live}?mode=ro", uri=True)) as conn:
            rows = conn.execute("SELECT outcome, snapshot_seq, error FROM snapshot_attempts ORDER BY attempt_seq").fetchall()
        assert rows == [("published", 1, None), ("failed", None, pump_failed["error"])]
        assert pump_failed["error"].startswith("sealing payload: OperationalError: "), pump_failed
        assert "\n" not in pump_failed["error"], pump_failed
        # The previous snapshot is intact and still what a resume restores, decided from
        # the manifests on disk and by the selection code alike.
        assert {p.name: p.read_bytes() for p in first.iterdir()} == first_bytes
        assert newest_usable_snapshot(ckpt) == (1, str(first))
        assert select_for_restore(ckpt).snapshot.path == first
        # Nothing of the failed attempts is listed as a checkpoint; no snapshot_2 or _3 exists.
        inventory = scan(ckpt)
        assert [s.sequence for s in inventory.complete_snapshots()] == [1]
        assert all(e.complete or e.leftover for e in inventory.entries)
        assert not (first.parent / "snapshot_2").exists() and not (first.parent / "snapshot_3").exists()

        # Room again: the next attempt succeeds with a new number and is the restore target.
        if filler is not None:
            filler.unlink()
        child.say("again")
        again = child.read()
        assert again["outcome"] == "published" and again["sequence"] > 2, again
        target = first.parent / f"snapshot_{again['sequence']}"
        assert newest_usable_snapshot(ckpt) == (again["sequence"], str(target))
        assert select_for_restore(ckpt).snapshot.path == target
        assert not scan(ckpt).leftovers()
    except BaseException:
        child.proc.kill()  # a failed check: do not wait for a child that waits for us
        child.proc.wait()
        raise
    child.close()
