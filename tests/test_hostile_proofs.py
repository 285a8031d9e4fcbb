"""Proofs that can fail: promises whose earlier tests a small planted bug passed.

- A checksum covers the whole file: every earlier damaged-file test had a file smaller
  than one read of the hashing code (4 MiB), so a hash of the first read only passed
  them. Here the damaged byte is past the first read, or in the last, partial read.
- Restore and verify check every segment: every earlier damaged-segment test had one
  segment, so a check of the first segment only passed them. Here a snapshot lists
  three and only a later one is damaged.
- The run lock is held for the whole run on the library path (`Controller(...).run()`,
  no CLI): a second controller or `rolloutdb train` is refused while it trains.

Real store files, real segments, real publication and restore, a real training process.
Damage goes into payload bytes (found by their fill value), where SQLite's own
integrity check cannot see it: only the checksum can.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np
import pytest
from test_payload_segments import RUN, Run
from train_cli import EXAMPLE, OVERRIDES, assert_one_error_line, metrics, train, wait_for

from rolloutdb.store import FinishedGeneration, Reservation, verify_path
from rolloutdb.store.checkpoints.hashing import BLAKE3, CHUNK
from rolloutdb.store.errors import SnapshotDamaged
from rolloutdb.store.restore.apply import restore_snapshot
from rolloutdb.store.restore.copying import COPY_STEP, HASH_CHUNK, copy_hashing

# Payload whose every byte is known: int32 tokens of 0x15151515 and float32 logprobs of
# bytes 0x95 (a tiny negative number, exact in float32). A run of these bytes in a file is
# payload, not a page header SQLite's integrity check would read.
TOKEN = 0x15151515
LOGPROB = float(np.frombuffer(b"\x95" * 4, "<f4")[0])
FILLS = (b"\x15" * 64, b"\x95" * 64)


def finish_filled(run: Run, groups: int, tokens: int) -> None:
    """`groups` sealed groups in replay, each sample `tokens` of the known fill."""
    for _ in range(groups):
        (g,) = run.store.reserve([Reservation(run.seq, 0, run.seq)], num_generations=2, target_step=1)
        run.seq += 1
        for a in run.store.dispatch([g], policy_version=0):
            run.store.finish(a, FinishedGeneration([TOKEN] * tokens, [LOGPROB] * tokens, 1.0, [(0, tokens)]))
        run.store.seal([g])
        run.store.enter_replay([g])


def payload_byte(data: bytes, lo: int, hi: int) -> int:
    """The offset of a payload byte in data[lo:hi] (the middle of a run of fill bytes)."""
    found = [i for i in (data.find(fill, lo, hi) for fill in FILLS) if i >= 0]
    assert found, f"no payload bytes in [{lo}, {hi}): the test's file does not have the layout it needs"
    return min(found) + 32


def damage(path: Path, where: str) -> int:
    """Flip one payload byte of `path`: in its second read chunk (past the first), or in
    its last, partial chunk. Returns the offset."""
    data = bytearray(path.read_bytes())
    size = len(data)
    # The file must span more than two reads and end in a partial one, or the test
    # could not tell a hash of the first read (or of whole reads only) from a full one.
    assert size > 2 * CHUNK and size % CHUNK > 4096, size
    lo, hi = (CHUNK, 2 * CHUNK) if where == "second_chunk" else (size - size % CHUNK, size)
    at = payload_byte(bytes(data), lo, hi)
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return at


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def restore_elsewhere(tmp_path: Path, snapshot: Path, name: str = "elsewhere") -> Path:
    target = tmp_path / name / "rollout_state.sqlite"
    target.parent.mkdir()
    restore_snapshot(snapshot, target, groups_per_step=1, **RUN)
    return target


# --------------------------------------------------------------------------- the whole file


@pytest.mark.parametrize("where", ["second_chunk", "last_partial_chunk"])
def test_a_byte_damaged_past_the_first_read_of_a_snapshot_store_file_fails_verify_and_restore(run, tmp_path, where):
    # 2 groups x 2 samples x 330k tokens x 8 bytes: a 10.6 MB store file, inline payload
    # (no seal), so restore hashes it while copying it (copy_hashing) and verify reads it
    # with Hashing.file.
    finish_filled(run, 2, 330_000)
    _, published = run.snapshot(seal=False)
    db = published.path / "rollout_state.sqlite"
    # Intact, it verifies and restores: a hash that covered less than the file would
    # refuse every large snapshot, a bug no small-file test sees.
    assert verify_path(published.path).ok
    restore_elsewhere(tmp_path, published.path, "intact")
    damage(db, where)
    problems = verify_path(published.path).problems
    assert any(str(db) in p and "differs" in p for p in problems), problems
    with pytest.raises(SnapshotDamaged, match="rollout_state.sqlite: blake3 differs"):
        restore_elsewhere(tmp_path, published.path)
    assert not (tmp_path / "elsewhere" / "rollout_state.sqlite").exists()


@pytest.mark.parametrize("where", ["second_chunk", "last_partial_chunk"])
def test_a_byte_damaged_past_the_first_read_of_a_payload_segment_fails_verify_and_restore(run, tmp_path, where):
    finish_filled(run, 2, 330_000)
    sealed, published = run.snapshot()
    damage(sealed.path, where)
    problems = verify_path(published.path).problems
    assert any(sealed.file_name in p and "differs" in p for p in problems), problems
    with pytest.raises(SnapshotDamaged, match=sealed.file_name):
        restore_elsewhere(tmp_path, published.path)
    assert not (tmp_path / "elsewhere" / "rollout_state.sqlite").exists()


def test_the_restore_copy_and_the_file_hash_digest_every_byte_of_a_file_longer_than_one_copy_step(tmp_path):
    """copy_hashing hands the copy to its hash in COPY_STEP (64 MiB) steps and each step
    in HASH_CHUNK reads: a file of one step, one more chunk and a partial one, compared
    with BLAKE3 of the bytes computed here in one call."""
    size = COPY_STEP + HASH_CHUNK + 12_345
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    expected = blake3.blake3(data).hexdigest()
    assert copy_hashing(src, tmp_path / "copy.bin", BLAKE3) == (size, expected)
    assert (tmp_path / "copy.bin").read_bytes() == data
    assert BLAKE3.file(src) == (size, expected)


# --------------------------------------------------------------------------- every segment


@pytest.fixture
def three_segments(run):
    """A snapshot whose manifest lists three segments (three seals), all intact."""
    sealed = []
    for _ in range(3):
        finish_filled(run, 2, 50)
        s, published = run.snapshot()
        sealed.append(s)
    listed = [e.path for e in published.manifest.segments]
    assert listed == [s.file_name for s in sealed], listed
    assert verify_path(published.path).ok
    return sealed, published


@pytest.mark.parametrize("which", [1, 2], ids=["middle", "last"])
def test_a_damaged_later_segment_of_several_fails_verify_restore_and_the_run_audit(run, tmp_path, three_segments,
                                                                                 which):
    from rolloutdb.controller.recovery.run_audit import verify_run

    sealed, published = three_segments
    target = sealed[which]
    data = bytearray(target.path.read_bytes())
    data[payload_byte(bytes(data), 0, len(data))] ^= 0x01
    target.path.chmod(0o644)
    target.path.write_bytes(bytes(data))
    for path in (published.path, run.ckpt):  # the snapshot, and the checkpoint directory holding it
        problems = verify_path(path).problems
        damaged = [p for p in problems if "differs" in p]
        assert damaged and all(target.file_name in p for p in damaged), problems
    run.close()
    (run.live.parent / "config.yaml").write_text("algorithm:\n  groups_per_step: 2\n")
    audit = verify_run(run.live.parent)  # `rolloutdb verify RUN_DIR`: the live store's segments
    assert any(target.file_name in p and "differs" in p for p in audit.problems), audit.problems
    with pytest.raises(SnapshotDamaged, match=target.file_name):
        restore_elsewhere(tmp_path, published.path)
    assert not (tmp_path / "elsewhere" / "rollout_state.sqlite").exists()
    run.store = type(run.store).open(run.live)  # for the fixture's close


# --------------------------------------------------------------------------- the run lock, library path

LIBRARY_RUN = """
import sys
from pathlib import Path
from rolloutdb.config import load_config
from rolloutdb.controller.job.controller import Controller
Controller(load_config(sys.argv[1], sys.argv[3:]), Path(sys.argv[2])).run()
"""
LONG = ["algorithm.total_steps=60"]  # trains long enough that the others are tried meanwhile


def test_a_library_run_holds_the_run_lock_until_it_ends_so_a_second_controller_and_the_cli_are_refused(tmp_path):
    from rolloutdb.config import load_config
    from rolloutdb.controller.job.controller import Controller
    from rolloutdb.controller.run.run_dir import RunDirInUse

    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("ROLLOUTDB_FAULT", None)
    first = subprocess.Popen([sys.executable, "-c", LIBRARY_RUN, str(EXAMPLE), str(run_dir), *OVERRIDES, *LONG],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Past setup and into training: the pumps run, snapshots and checkpoints are taken.
        wait_for(lambda: len(metrics(run_dir, "train_step")) >= 2, deadline_s=600, what="two train steps",
                 proc=first)
        config = load_config(EXAMPLE, OVERRIDES + LONG)
        with pytest.raises(RunDirInUse, match=f"pid {first.pid}"):
            Controller(config, run_dir, resume="latest").run()
        with pytest.raises(RunDirInUse, match=f"pid {first.pid}"):
            Controller(config, run_dir).run()
        refused = train(run_dir, "--resume", overrides=LONG)
        assert first.poll() is None, "the library run ended before the others were tried; the test proved nothing"
        assert_one_error_line(refused, f"pid {first.pid}")
        steps = [e["step"] for e in metrics(run_dir, "train_step")]
        assert steps == sorted(set(steps)), steps  # one process trains: no step twice
        assert not metrics(run_dir, "restore"), "a refused controller restored something"
    finally:
        first.kill()
        first.communicate(timeout=60)


# --------------------------------------------------------------------------- the mutation script


def test_the_mutation_script_carries_no_stale_mutant_and_fails_loudly_on_one(capsys, monkeypatch):
    """tests/mutation/run_mutations.py: a mutant whose text to replace is no longer in the
    code tests nothing. The suite checks every mutant against the code as it is (so a
    change that makes one stale fails here), and the script refuses to run a stale one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_mutations", Path(__file__).parent / "mutation" / "run_mutations.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)
    assert script.main(["--list"]) == 0, capsys.readouterr().err
    script.MUTANTS.append(script.Mutant("moved_on", "a promise", "store/checkpoints/hashing.py",
                                        [("text the code no longer holds", "")], ["tests/test_publish.py"]))
    assert script.main(["--only", "moved_on"]) == 2
    assert "stale mutant moved_on: its text to replace occurs 0 times in store/checkpoints/hashing.py" \
        in capsys.readouterr().err
