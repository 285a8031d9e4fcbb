"""`rolloutdb train ...` in this process with the engine replaced by
bench/flat_capture_engine.py, for bench/bench_recovery_scale.py. The product is not
changed: `build_local_engine` (controller/job/build.py, the one place the run's engine is
built) is replaced by a factory of the flat engine before the CLI's main runs, and the
run's commit lock is wrapped in one that records how long each holder held it.

    python bench/scale_launcher.py train --config ... (the CLI's arguments)

Settings come from the environment (the CLI's arguments are the product's own):
ROLLOUTDB_FLAT_STEP_S (seconds per decode step), ROLLOUTDB_FLAT_DECODE_LOG (the engine's
decode log, see flat_capture_engine.py), ROLLOUTDB_COMMIT_LOCK_LOG (one line per hold of
the commit lock: "<thread name> <wall time at acquire> <seconds held>", unbuffered).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flat_capture_engine import FlatCaptureEngine  # noqa: E402


def flat_engine(config, policy_dir: Path, work_dir: Path | None = None) -> FlatCaptureEngine:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    digit_ids = tokenizer.convert_tokens_to_ids(list("0123456789"))
    return FlatCaptureEngine(digit_ids, max_batch_size=config.generation.max_batch_size,
                             step_s=float(os.environ.get("ROLLOUTDB_FLAT_STEP_S", "0.005")),
                             decode_log=os.environ.get("ROLLOUTDB_FLAT_DECODE_LOG"))


class TimedLock:
    """A threading.Lock that writes one line per hold (who, when, how long)."""

    def __init__(self, fd: int):
        self._lock = threading.Lock()
        self._fd = fd
        self._since = 0.0
        self._wall = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._since, self._wall = time.perf_counter(), time.time()
        return got

    def release(self) -> None:
        held, wall = time.perf_counter() - self._since, self._wall
        self._lock.release()
        os.write(self._fd, f"{threading.current_thread().name.replace(' ', '_')} {wall:.6f} {held:.9f}\n".encode())

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def main() -> int:
    import rolloutdb.controller.job.build as build
    from rolloutdb.cli import main as cli_main

    build.build_local_engine = flat_engine
    lock_log = os.environ.get("ROLLOUTDB_COMMIT_LOCK_LOG")
    if lock_log:
        import rolloutdb.controller.run.runtime as runtime

        fd = os.open(lock_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        original = runtime.RuntimeState.__init__

        def timed_init(self, *args, **kwargs) -> None:
            original(self, *args, **kwargs)
            self.commit_lock = TimedLock(fd)

        setattr(runtime.RuntimeState, "__init__", timed_init)
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
