"""A capture cloned from the previous snapshot's file writes only the blocks that changed
and still leaves one standalone SQLite file, the same as a capture written whole.

The clone is FICLONE (XFS with reflink, btrfs). These machines' ext4 cannot clone, so most
tests give `capture_snapshot` a clone that copies the base's bytes (what a clone holds,
without sharing blocks); `test_a_real_reflink_...` runs FICLONE itself where the test's
directory or ROLLOUTDB_REFLINK_DIR can clone (BENCHMARKS.md says how to make one) and is
skipped elsewhere. Files are read back through their own connections and bytes."""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

import pytest

from conftest import copying_clone
from rolloutdb.store import FinishedGeneration, Reservation, Store
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.checkpoints.publish import Publisher
from rolloutdb.store.fsio import clone_file, write_changed_blocks
from rolloutdb.store.live.capture import capture_snapshot

BLOCK = 4096
# The header's file change counter (24-27) and version-valid-for (92-95): a capture
# written whole counts one more change (its `journal_mode = DELETE`), nothing else differs.
COUNTERS = (slice(24, 28), slice(92, 96))


def cannot_clone(_src_fd: int, _dst_fd: int) -> bool:
    return False


def _masked(data: bytes) -> bytes:
    out = bytearray(data)
    for s in COUNTERS:
        out[s] = b"\0" * (s.stop - s.start)
    return bytes(out)


def _run_groups(store: Store, first: int, count: int, tokens: int = 50) -> None:
    for seq in range(first, first + count):
        (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=2, target_step=1)
        for attempt in store.dispatch([gid], policy_version=0):
            store.finish(attempt, FinishedGeneration(list(range(tokens)), [-0.5] * tokens, 1.0, [(0, tokens)]))


def _read(path: Path) -> tuple[str, int, int]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return (conn.execute("PRAGMA integrity_check").fetchone()[0],
                conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0],
                conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0])


@pytest.fixture
def store(tmp_path):
    with Store.create(tmp_path / "live.sqlite") as s:
        _run_groups(s, 0, 300)
        yield s


def test_a_capture_cloned_from_the_previous_snapshot_holds_what_a_capture_written_whole_holds(store, tmp_path):
    store.capture(tmp_path / "previous.sqlite")
    _run_groups(store, 300, 3)
    cloned = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                              clone=copying_clone)
    whole = capture_snapshot(store.path, tmp_path / "whole.sqlite")
    assert cloned.incremental is not None and whole.incremental is None
    got, want = (tmp_path / "cloned.sqlite").read_bytes(), (tmp_path / "whole.sqlite").read_bytes()
    assert _masked(got) == _masked(want)
    assert got[COUNTERS[0]] == got[COUNTERS[1]], "SQLite trusts the header's page count only when they match"
    assert got[18:20] == b"\x01\x01", "a rollback-journal file, not WAL: it stands alone"
    assert _read(tmp_path / "cloned.sqlite") == ("ok", 303, store.mutation_counter)
    assert sorted(p.name for p in tmp_path.glob("cloned.sqlite*")) == ["cloned.sqlite"]


def test_only_the_blocks_that_changed_since_the_base_are_written(store, tmp_path):
    store.capture(tmp_path / "previous.sqlite")
    _run_groups(store, 300, 1)
    before = (tmp_path / "previous.sqlite").read_bytes()
    cap = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                           clone=copying_clone)
    after = (tmp_path / "cloned.sqlite").read_bytes()
    differ = sum(before[i:i + BLOCK] != after[i:i + BLOCK] for i in range(0, len(after), BLOCK))
    written, blocks = cap.incremental
    assert blocks == len(after) // BLOCK
    # The first block is written as the copy has it (WAL's header) and finished in place
    # (`journal_mode = DELETE`), which can leave it as the base has it: at most one more.
    assert 0 < differ <= written <= differ + 1 and written < blocks // 4
    assert cap.timings["write"] >= 0 and "clone" in cap.timings


def test_whatever_the_base_holds_the_clone_ends_as_the_copy_cut_to_its_length(store, tmp_path):
    # A base larger than the copy and of other bytes entirely: every block differs and
    # the tail past the copy's end is cut off (the base is never trusted to match).
    whole = capture_snapshot(store.path, tmp_path / "whole.sqlite")
    size = whole.path.stat().st_size
    (tmp_path / "noise").write_bytes(os.urandom(size + 5 * BLOCK + 123))
    cap = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "noise", clone=copying_clone)
    assert cap.incremental == (size // BLOCK, size // BLOCK)
    assert _masked((tmp_path / "cloned.sqlite").read_bytes()) == _masked(whole.path.read_bytes())


def test_a_base_written_to_after_the_clone_leaves_a_capture_written_whole(store, tmp_path):
    # The blocks are compared with the base (its pages are cached), not the clone: were
    # the base written to after the clone (a user's sqlite3 on a published snapshot), a
    # block equal to its new bytes but not the clone's would be left stale. Here the
    # base is overwritten right after the clone with what the new capture holds, so
    # nearly every block compares equal to the base while the clone holds the old state.
    store.capture(tmp_path / "previous.sqlite")
    _run_groups(store, 300, 40)
    capture_snapshot(store.path, tmp_path / "newer.sqlite")

    def clone_then_write_the_base(base_fd: int, dst_fd: int) -> bool:
        copying_clone(base_fd, dst_fd)
        (tmp_path / "previous.sqlite").write_bytes((tmp_path / "newer.sqlite").read_bytes())
        return True

    cap = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                           clone=clone_then_write_the_base)
    written, blocks = cap.incremental
    assert written == blocks
    assert _read(cap.path) == ("ok", 340, store.mutation_counter)
    assert _masked(cap.path.read_bytes()) == _masked((tmp_path / "newer.sqlite").read_bytes())


def test_a_base_that_is_gone_or_cannot_be_cloned_leaves_a_capture_written_whole(store, tmp_path):
    gone = capture_snapshot(store.path, tmp_path / "a.sqlite", base=tmp_path / "removed-by-retention.sqlite")
    store.capture(tmp_path / "previous.sqlite")
    refused = capture_snapshot(store.path, tmp_path / "b.sqlite", base=tmp_path / "previous.sqlite", clone=cannot_clone)
    assert gone.incremental is None and refused.incremental is None
    assert "clone" not in refused.timings
    assert _read(gone.path)[0] == _read(refused.path)[0] == "ok"


def test_a_live_store_is_measured_by_its_main_file_not_its_wal(store, tmp_path, monkeypatch):
    # The -wal file keeps the most it ever grew (up to 64 MiB after a restart, more while
    # a capture pins it): a store is not too large to clone because its WAL file is large.
    store.capture(tmp_path / "previous.sqlite")
    _run_groups(store, 300, 1)
    main, wal = store.path.stat().st_size, Path(f"{store.path}-wal").stat().st_size
    assert wal > BLOCK
    monkeypatch.setattr("rolloutdb.store.live.capture.INCREMENTAL_MAX_BYTES", main)
    cap = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                           clone=copying_clone)
    assert cap.incremental is not None
    monkeypatch.setattr("rolloutdb.store.live.capture.INCREMENTAL_MAX_BYTES", main - 1)
    whole = capture_snapshot(store.path, tmp_path / "whole.sqlite", base=tmp_path / "previous.sqlite",
                             clone=copying_clone)
    assert whole.incremental is None and _read(whole.path)[0] == "ok"


def test_a_capture_that_fails_after_cloning_leaves_no_file(store, tmp_path):
    store.capture(tmp_path / "previous.sqlite")

    def refuse(_conn):
        raise RuntimeError("the trainer moved")

    with pytest.raises(RuntimeError, match="the trainer moved"):
        capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                         at_cut=refuse, clone=copying_clone)
    assert not (tmp_path / "cloned.sqlite").exists()


def test_write_changed_blocks_writes_runs_and_counts_blocks(tmp_path):
    base = bytes(range(256)) * 64  # 4 blocks
    image = bytearray(base)
    image[BLOCK + 5] ^= 1  # block 1
    image[3 * BLOCK] ^= 1  # block 3
    image += b"tail"  # a fifth, partial block
    (tmp_path / "base").write_bytes(base)
    (tmp_path / "clone").write_bytes(base)
    with open(tmp_path / "base", "rb") as b, open(tmp_path / "clone", "r+b") as c:
        assert write_changed_blocks(c.fileno(), bytes(image), b.fileno()) == 3
    assert (tmp_path / "clone").read_bytes() == bytes(image)


def test_the_publisher_hands_each_stage_the_newest_published_snapshot_as_its_base(store, tmp_path):
    pub = Publisher(tmp_path / "ckpt")
    pub.publish_bootstrap(lambda d: (d / "w.bin").write_bytes(b"w"))
    assert pub.snapshot_base() is None
    first = pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p, base=pub.snapshot_base()))
    assert pub.snapshot_base() == first.path / SNAPSHOT_DB
    stage = pub.begin_snapshot("bootstrap")
    assert stage.base == first.path / SNAPSHOT_DB
    stage.abort()
    # A new publisher (a restarted run) finds it by scanning.
    again = Publisher(tmp_path / "ckpt")
    stage = again.begin_snapshot("bootstrap")
    assert stage.base == first.path / SNAPSHOT_DB
    stage.abort()
    pub.close()
    again.close()


def _reflink_dir(tmp_path: Path) -> Path | None:
    for d in (os.environ.get("ROLLOUTDB_REFLINK_DIR"), tmp_path):
        if not d:
            continue
        with tempfile.TemporaryDirectory(dir=d) as probe:
            (Path(probe) / "a").write_bytes(b"x" * BLOCK)
            with open(Path(probe) / "a", "rb") as a, open(Path(probe) / "b", "wb") as b:
                if clone_file(a.fileno(), b.fileno()):
                    return Path(d)
    return None


def test_a_real_reflink_shares_the_unchanged_blocks_of_the_base(tmp_path):
    where = _reflink_dir(tmp_path)
    if where is None:
        pytest.skip("no directory here can FICLONE (ext4); set ROLLOUTDB_REFLINK_DIR to an XFS (reflink=1) "
                    "or btrfs directory to run it")
    with tempfile.TemporaryDirectory(dir=where) as d:
        work = Path(d)
        with Store.create(work / "live.sqlite") as s:
            _run_groups(s, 0, 3000, tokens=200)  # a file of some MiB
            s.capture(work / "previous.sqlite")
            os.sync()
            _run_groups(s, 3000, 2, tokens=200)
            free0 = os.statvfs(work).f_bfree * os.statvfs(work).f_frsize
            cap = s.capture(work / "cloned.sqlite", base=work / "previous.sqlite")
            os.sync()
            used = free0 - os.statvfs(work).f_bfree * os.statvfs(work).f_frsize
            whole = capture_snapshot(s.path, work / "whole.sqlite")
        size = cap.path.stat().st_size
        assert size > 2**20 and cap.incremental is not None
        assert cap.incremental[0] < cap.incremental[1] // 10
        assert used < size // 4, f"the clone took {used} bytes of new space for a {size}-byte file"
        assert _masked(cap.path.read_bytes()) == _masked(whole.path.read_bytes())
        assert _read(cap.path)[0] == "ok"


def test_what_into_copy_adds_is_in_the_cloned_file_and_counted(store, tmp_path):
    store.capture(tmp_path / "previous.sqlite")

    def add(out, _check):
        out.execute("INSERT INTO spare_prompts VALUES (9001, 0, 9001, 0.0)")
        return {"spare_prompts": 1}

    before = store.capture(tmp_path / "count.sqlite").row_counts["spare_prompts"]
    cap = capture_snapshot(store.path, tmp_path / "cloned.sqlite", base=tmp_path / "previous.sqlite",
                           into_copy=add, clone=copying_clone)
    assert cap.incremental is not None and cap.row_counts["spare_prompts"] == before + 1
    with sqlite3.connect(f"file:{cap.path}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count(*) FROM spare_prompts WHERE prompt_id = 9001").fetchone() == (1,)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert cap.path.read_bytes()[18:20] == b"\x01\x01"
    assert sorted(p.name for p in tmp_path.glob("cloned.sqlite*")) == ["cloned.sqlite"]
