"""The run directory: everything one run owns, in one place, and the lock that makes it
one process's at a time.

    RUN_DIR/
      run.lock                  held (flock) by the process training the run; holds its pid
      config.yaml               the resolved config (after overrides) the newest start or resume ran with
      rollout_state.sqlite      the live store (WAL)
      policy/                   the initial policy (tiny Llama + tokenizer) when built here
      checkpoints/              bootstrap/, step_<N>/, rollout snapshots under them
      logs/metrics.jsonl        one JSON object per event (train steps, rollout waves), each marked with its attempt
      logs/configs/attempt_<N>.yaml  the config of each start (1) and resume (2, 3, ...)
      logs/tensorboard/, logs/wandb/  the dashboards' files, when logging.backends names them
      logs/rollout_trace.sqlite trace events, when trace.enabled is on
      agent_server.token        the bearer token of the run's agent servers (mode 0600, new at every start)
      plots/                    reward_curve.png and the trace report's plots
      discarded/<time>/         what `train --start-over` moved aside (store, checkpoints, config, logs, plots)
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.store import write_file_atomic

LOCK_NAME = "run.lock"


class RunDirInUse(ValueError):
    """Another process holds the run directory's lock."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def store(self) -> Path:
        return self.root / "rollout_state.sqlite"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"

    @property
    def trace(self) -> Path:
        return self.logs / "rollout_trace.sqlite"

    @property
    def agent_token(self) -> Path:
        return self.root / "agent_server.token"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def discarded(self) -> Path:
        return self.root / "discarded"

    def has_run(self) -> bool:
        return self.store.exists()

    def is_run_dir(self) -> bool:
        """Whether root is a run directory, as the CLI's `verify`, `snapshots` and `trace`
        take it: a directory holding rollout_state.sqlite and config.yaml. A snapshot
        directory holds the same two files; it has a manifest (or lies under
        rollout_snapshots/ when its manifest is missing), a run directory never."""
        root = self.root
        if not (root.is_dir() and self.store.is_file() and self.config.is_file()):
            return False
        return not ((root / "manifest.json").exists() or root.parent.name == "rollout_snapshots"
                    or root.name.startswith("snapshot_"))

    def check_for(self, *, resume: bool) -> None:
        """A resume needs a run here; a new run needs none (checked under the lock)."""
        if resume and not self.has_run():
            raise ValueError(f"{self.root} holds no run to resume; drop --resume to start one there")
        if not resume and self.has_run():
            raise ValueError(f"{self.root} already holds a run; pass --resume to continue it, or choose another --run-dir")

    def resume_or_start(self) -> bool:
        """`--resume auto`, decided under the run lock: True to resume (the live store is
        here; a refusal of that resume stays a refusal), False to start (nothing of a run is
        here: the directory is missing or holds only what a run makes before its store, like
        a config written by a start killed at once). A run's checkpoints or store side files
        without the live store are refused: neither resumable nor safe to start over."""
        if self.has_run():
            return True
        found = [p.name for p in (self.store, *(self.store.with_name(self.store.name + s)
                                                for s in ("-wal", "-shm", "-journal"))) if os.path.lexists(p)]
        if self.checkpoints.is_dir() and any(self.checkpoints.iterdir()):
            found.append(f"{self.checkpoints.name}/")
        if found:
            raise ValueError(f"{self.root}: --resume auto found a run's files ({', '.join(found)}) but no live store "
                             f"{self.store.name}, so it can neither resume nor start over; nothing was changed: put "
                             "the store back, or move the directory aside and start the run in an empty --run-dir")
        return False

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.logs, self.plots):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def attempt_configs(self) -> Path:
        return self.logs / "configs"

    def write_config(self, config: Config) -> None:
        write_file_atomic(self.config, config.to_yaml())

    def record_attempt(self, config: Config) -> int:
        """Number this process's attempt at the run (1 for the start, one more for each
        resume) and record the config it runs with: as config.yaml (what the run runs
        with now; `verify` and the agent servers read it) and as
        logs/configs/attempt_<N>.yaml (one per attempt, kept)."""
        numbers = [int(m.group(1)) for path in self.attempt_configs.glob("attempt_*.yaml")
                   if (m := re.fullmatch(r"attempt_(\d+)\.yaml", path.name))]
        attempt = max(numbers, default=0) + 1
        self.attempt_configs.mkdir(parents=True, exist_ok=True)
        text = config.to_yaml()
        write_file_atomic(self.attempt_configs / f"attempt_{attempt}.yaml", text)
        write_file_atomic(self.config, text)
        return attempt

    def lock(self, *, create: bool) -> RunLock:
        """Take the run directory for this process (see `RunLock`). `create`: make the
        directory if it does not exist (a new run); otherwise a missing directory is
        refused without creating anything."""
        if not self.root.is_dir():
            if os.path.lexists(self.root):  # a file, a FIFO, a dangling or looping link
                raise ValueError(f"{self.root}: exists and is not a directory; pass a directory as --run-dir")
            if not create:
                raise ValueError(f"{self.root} holds no run to resume; drop --resume to start one there")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a parent that is a file, a read-only file system
                raise ValueError(f"{self.root}: cannot create the run directory ({e.strerror or e}); "
                                 "pass another --run-dir") from None
        return RunLock.acquire(self.lock_file)


class RunLock:
    """An exclusive `flock` on RUN_DIR/run.lock, held for the life of the process.

    The kernel drops a flock when the last descriptor of the open file goes, so a process
    killed with SIGKILL never leaves a stale lock and nothing needs cleaning up after a
    crash. The descriptor is close-on-exec, so a child process never inherits the lock.
    The holder writes its pid into the file after locking, for the refusal message of
    whoever comes next; the file itself is never removed while a run uses the
    directory (a path removed and recreated would let two processes lock two files).
    A refusal after the lock was taken (`undo`) puts the file back as it was, so a
    refused command leaves the run directory byte for byte unchanged."""

    PID_WAIT_S = 1.0  # a holder that has just locked may not have written its pid yet

    def __init__(self, path: Path, fd: int, previous: bytes | None):
        self.path = path
        self._fd: int | None = fd
        self._previous = previous  # the file's bytes before we took it; None: we created it

    @classmethod
    def acquire(cls, path: Path, *, then: str = "resume") -> RunLock:
        """`then`: what the refusal tells the user to do once the holder is gone."""
        try:
            return cls._acquire(path, then)
        except OSError as e:  # a directory, a special file or no permission under the name
            raise ValueError(f"{path}: cannot take the run lock ({e.strerror or e}); "
                             f"{path.name} must be a regular file this user can write") from None

    @classmethod
    def _acquire(cls, path: Path, then: str) -> RunLock:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW  # never hang on a FIFO, never follow a link
        for _ in range(3):
            try:
                fd, created = os.open(path, flags), False
            except FileNotFoundError:
                try:
                    fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    continue  # another process created it between our two opens
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd, cls.PID_WAIT_S)
                os.close(fd)
                who = f"pid {holder}" if holder else "pid unknown"
                raise RunDirInUse(f"{path.parent}: another rolloutdb process ({who}) is using this run directory; "
                                  f"wait for it to finish or stop it, then {then}") from None
            # Locked, but maybe a file that an `undo` unlinked after we opened it: only the
            # file at the path counts.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = None if created else _read_all(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return cls(path, fd, previous)
        raise RunDirInUse(f"{path.parent}: could not take {path.name} (it keeps changing); is another process "
                          "starting in this run directory?")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def undo(self) -> None:
        """Release after a refusal that wrote nothing else: the lock file is left as it
        was before `acquire` (removed if `acquire` created it)."""
        if self._fd is None:
            return
        try:
            if self._previous is None:
                self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._previous, 0)
        finally:
            self.release()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def _read_all(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _read_pid(fd: int, wait_s: float) -> int | None:
    deadline = time.monotonic() + wait_s
    while True:
        text = _read_all(fd).decode("ascii", "replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
