"""Helpers of the hostile-input suite (tests/test_hostile_*.py): run the CLI in-process
with a deadline, snapshot a tree, and check a refusal.

Each case asserts: exactly one stderr line, starting `error:` (`verify` finding
problems prints one per problem), the right exit code, no traceback, nothing that only
the CLI's backstop would catch (it re-raises here, with ROLLOUTDB_TRACEBACK=1: a leak is
a cause left unfixed), no file changed (sha256, size, mode and mtime of every entry),
and an end within a deadline. The deadline detects a hang, not slowness: it has headroom for
a loaded machine (a 5000-deep YAML parse takes ~2 s idle, over 20 s at load 12 on 2 cores),
and the command runs on a worker thread so that a hang fails this one test. An alarm signal
(as SIGALRM was used here) raises wherever the main thread is, e.g. 1000 frames deep in a
parser, and pytest once crashed formatting that traceback (INTERNALERROR: the run was lost).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import sys
import threading
import time
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from rolloutdb import cli

DEADLINE_S = 180.0
BACKSTOP_MARK = "unexpected "  # the CLI's catch-all says "error: unexpected TypeError: ..."


# ----------------------------------------------------------------------------- running and checking


@dataclass
class Result:
    argv: list[str]
    code: int
    out: str
    err: str
    seconds: float


def run_cli(*argv: object, deadline: float = DEADLINE_S) -> Result:
    args = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    outcome: dict[str, object] = {}

    def command() -> None:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                outcome["code"] = cli.main(args)
        except BaseException as e:  # re-raised on the test's thread below
            outcome["raised"] = e

    # The backstop re-raises: an exception only it would catch fails the case with its
    # traceback, so a cause left unfixed is seen, not hidden behind a tidy line.
    os.environ["ROLLOUTDB_TRACEBACK"] = "1"
    t0 = time.monotonic()
    worker = threading.Thread(target=command, name="hostile-cli", daemon=True)
    worker.start()
    worker.join(deadline)
    if worker.is_alive():  # a hang: say where it is and fail this test only
        frame = sys._current_frames().get(worker.ident or 0)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no frame)"
        pytest.fail(f"rolloutdb {' '.join(args)} did not finish within {deadline} s (a hang); "
                    f"its thread is at:\n{where}", pytrace=False)
    del os.environ["ROLLOUTDB_TRACEBACK"]
    if "raised" in outcome:
        raise typing.cast(BaseException, outcome["raised"])
    return Result(args, typing.cast(int, outcome["code"]), out.getvalue(), err.getvalue(), time.monotonic() - t0)


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: kind, size, mode, mtime and (regular files) sha256. Never
    opens anything but regular files (opening a FIFO would block)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            state[p] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mode, st.st_mtime_ns, digest)
    return state


def assert_refused(r: Result, codes: typing.Collection[int] = (2,)) -> str:
    """One `error:` line; `verify` finding problems (exit 1) prints one line per problem."""
    lines = r.err.splitlines()
    where = f"rolloutdb {' '.join(r.argv)}"
    assert "Traceback" not in r.err, f"{where}: traceback\n{r.err}"
    one = len(lines) == 1 or (r.argv[0] == "verify" and r.code == 1 and lines)
    assert one and all(x.startswith("error: ") for x in lines), f"{where}: stderr is not one error line:\n{r.err}"
    assert all(len(x) <= 2100 for x in lines), f"{where}: an error line of {max(map(len, lines))} characters"
    assert BACKSTOP_MARK not in lines[0], f"{where}: only the CLI's backstop caught it: {lines[0]}"
    assert r.code in codes, f"{where}: exit {r.code}, expected one of {sorted(codes)}: {lines[0]}"
    return lines[0]


@contextlib.contextmanager
def unchanged(root: Path):
    before = tree(root)
    yield
    after = tree(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"files changed: {changed[:5]}"


# ----------------------------------------------------------------------------- what the commands read


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Sound inputs, built once: a store file, a checkpoint directory with a snapshot,
    a trace, and a config that would train in seconds."""
    from rolloutdb.store import FinishedGeneration, Publisher, Reservation, Retention, Store
    from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots
    from rolloutdb.store.trace.writer import open_tracer

    base = tmp_path_factory.mktemp("world")
    with Store.create(base / "live.sqlite", replay_capacity=8) as store:
        pub = Publisher(base / "ckpt", retention=Retention(KeepNewestSnapshots(10)))
        pub.publish_bootstrap()
        for seq in range(2):
            (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=1, target_step=1)
            (a,) = store.dispatch([gid], policy_version=0)
            store.finish(a, FinishedGeneration([1, 2, 3], [-0.1] * 3, 1.0, [(0, 3)]))
        pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), "model: tiny\n", env_export=b"{}")
    tracer = open_tracer(base / "traced" / "logs")
    tracer.close()
    (base / "cfg.yaml").write_text(
        "algorithm:\n  total_steps: 1\n  groups_per_step: 2\n  group_size: 2\n"
        "generation:\n  max_tokens: 2\n  max_batch_size: 4\n"
        "environment:\n  dataset_size: 8\n  n_digits: 1\n"
        "policy:\n  hidden_size: 16\n  num_layers: 1\n  num_heads: 2\n"
        "logging:\n  progress: false\n  plot: false\n"
    )
    return {"base": base, "store": base / "live.sqlite", "ckpt": base / "ckpt",
            "snapshot": base / "ckpt" / "bootstrap" / "rollout_snapshots" / "snapshot_1",
            "traced": base / "traced", "config": base / "cfg.yaml"}
