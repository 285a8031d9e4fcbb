"""The crash harness's checks of turn-level recovery, decided from the files alone (plain
`sqlite3`, `json`, `struct`), never with the code a resume runs.

- `transcript_problems`: after any kill, every `env_episodes` row of the live store (or of
  a snapshot file) belongs to a running attempt, and its transcript (the pieces of
  `episode_tokens`, joined by tests/transcripts.py) lines up: its pieces contiguous; as many
  int32 token ids as float32 logprobs as the version runs add up to; one environment
  observation (a run under version -1, logprob 0.0) after each of its `turn` finished
  turns; key and turn as the pump writes them.
- `set_aside` + `restore_problems`: before a resume, the rollout snapshots are copied
  aside (retention, or a restore that drops newer anchors, may delete the one the resume
  uses); afterwards the resumed run's trace names the snapshot it restored
  (`restore_done.snapshot`), and every `episode_restored` event of that run must match the
  snapshot's row for the abandoned attempt (turn, policy tokens), every running episode
  row of the snapshot must have been restored (none silently restarted), and the new
  attempt's calls must start at the restored turn (no earlier turn generated again).
- `kept_per_stop`: what `rolloutdb trace` reports each stop kept, from its JSON report.

Reading a trace: a killed run leaves the file in WAL mode with its `-wal`; the harness
reads a private copy of both, so it never writes beside a run it checks.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from transcripts import saved_transcripts

ENV_VERSION = -1  # the version tag of environment tokens (docs: env_episodes, version runs)
TRACE = Path("logs") / "rollout_trace.sqlite"
SNAPSHOT_DB = "rollout_state.sqlite"


@dataclass
class RestoreCheck:
    problems: list[str] = field(default_factory=list)
    restored: int = 0  # episode_restored events matched against their snapshot row
    tokens: int = 0  # policy tokens those events kept
    snapshot: str | None = None  # the snapshot the resumed run restored (restore_done)


# ------------------------------------------------------------------ transcripts


def _runs(text: str | None) -> list[tuple[int, int]] | None:
    try:
        runs = json.loads(text) if text is not None else None
        return None if runs is None else [(int(v), int(n)) for v, n in runs]
    except (ValueError, TypeError):
        return None


def policy_tokens(version_runs: str) -> int:
    """Policy tokens of a saved transcript: every run not under the environment's tag."""
    return sum(n for v, n in (_runs(version_runs) or []) if v != ENV_VERSION)


def transcript_problems(conn: sqlite3.Connection, where: str, *, max_turns: int | None) -> list[str]:
    """What is wrong with the env_episodes rows of one store file (see the module)."""
    if not conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'env_episodes'").fetchone()[0]:
        return []
    problems = []
    transcripts = saved_transcripts(conn)
    rows = conn.execute(
        "SELECT e.episode_key, e.turn, e.attempt_id, a.state, a.group_id, "
        "a.generation_index, a.attempt FROM env_episodes e LEFT JOIN rollouts a ON a.attempt_id = e.attempt_id")
    for key, turn, attempt_id, state, g, i, a in rows:
        bad = []
        if state != "running":
            bad.append(f"its attempt is {state or 'missing'}, not running")
        elif key != f"{g}.{i}-a{a}":
            bad.append(f"key of attempt ({g}, {i}, {a})")
        saved = transcripts[attempt_id]
        tokens, logprobs, runs_text = saved.token_ids, saved.logprobs, saved.version_token_counts
        if saved.problem:
            bad.append(f"its transcript's pieces (episode_tokens): {saved.problem}")
        elif tokens is None and logprobs is None and runs_text is None:
            if max_turns is not None:  # turn level: the pump always saves the transcript
                bad.append("no transcript")
        else:
            runs = _runs(runs_text)
            if tokens is None or logprobs is None or runs is None or len(tokens) % 4 or len(logprobs) % 4:
                bad.append("a transcript part missing or not whole int32/float32 values")
            else:
                n, versions = len(tokens) // 4, [v for v, c in runs for _ in range(c)]
                lps = struct.unpack(f"<{len(logprobs) // 4}f", logprobs)
                if not n == len(lps) == len(versions):
                    bad.append(f"{n} tokens, {len(lps)} logprobs, {len(versions)} versions")
                else:
                    observations = sum(1 for v, _ in runs if v == ENV_VERSION)
                    if observations != turn or (runs and runs[-1][0] != ENV_VERSION):
                        bad.append(f"{observations} environment observations after {turn} finished turns")
                    if any(lp != 0.0 for lp, v in zip(lps, versions) if v == ENV_VERSION):
                        bad.append("an environment token with a nonzero logprob")
        if not 1 <= turn < (max_turns or turn + 1):
            bad.append(f"turn {turn}: saved progress is between the first and the last turn")
        if bad:
            problems.append(f"{where}: env_episodes row {key}: {'; '.join(bad)}")
    return problems


# ------------------------------------------------------------------ reading a trace


@contextlib.contextmanager
def trace_copy(run_dir: Path) -> Iterator[sqlite3.Connection | None]:
    """A connection to a private copy of the run's trace (with its -wal), or None."""
    src = run_dir / TRACE
    if not src.exists():
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="crash-trace-") as tmp:
        for suffix in ("", "-wal"):
            if Path(f"{src}{suffix}").exists():
                shutil.copyfile(f"{src}{suffix}", Path(tmp) / f"trace.sqlite{suffix}")
        conn = sqlite3.connect(Path(tmp) / "trace.sqlite")
        try:
            yield conn
        finally:
            conn.close()


def last_trace_run(run_dir: Path) -> int:
    """The newest run (process) the trace knows, 0 for none."""
    with trace_copy(run_dir) as conn:
        if conn is None or not conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'runs'").fetchone()[0]:
            return 0
        return conn.execute("SELECT coalesce(max(run), 0) FROM runs").fetchone()[0]


# ------------------------------------------------------------------ restored episodes


def set_aside(run_dir: Path, aside: Path) -> None:
    """Copy every rollout snapshot's store file aside, keyed by its path under checkpoints/."""
    shutil.rmtree(aside, ignore_errors=True)
    ckpt = run_dir / "checkpoints"
    for db in ckpt.glob(f"*/rollout_snapshots/snapshot_*/{SNAPSHOT_DB}"):
        dest = aside / db.relative_to(ckpt)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(db, dest)


def restore_problems(run_dir: Path, aside: Path, after_run: int, *, finished: bool,
                     max_turns: int | None) -> RestoreCheck:
    """Check the first resumed run newer than trace run `after_run` (see the module).
    `finished`: the process exited 0, so its trace is complete."""
    out = RestoreCheck()
    with trace_copy(run_dir) as tr:
        if tr is None:
            return out
        run = tr.execute("SELECT min(run) FROM runs WHERE run > ?", (after_run,)).fetchone()[0]
        done = None if run is None else tr.execute(
            "SELECT snapshot FROM restore_done WHERE run = ? ORDER BY seq LIMIT 1", (run,)).fetchone()
        if done is None or done[0] is None:
            return out  # killed before it restored (or recorded it), or nothing to restore
        out.snapshot = done[0]
        events = tr.execute(
            "SELECT group_id, generation_index, attempt, from_attempt, turn, tokens FROM episode_restored "
            "WHERE run = ?", (run,)).fetchall()
        calls: dict[tuple[int, int, int], list[int]] = {}
        for g, i, a, t in tr.execute("SELECT group_id, generation_index, attempt, turn FROM call_finished "
                                     "WHERE run = ?", (run,)):
            calls.setdefault((g, i, a), []).append(t)
    try:
        rel = Path(out.snapshot).relative_to(run_dir / "checkpoints")
    except ValueError:
        out.problems.append(f"restore_done names {out.snapshot}, outside {run_dir / 'checkpoints'}")
        return out
    db = aside / rel / SNAPSHOT_DB
    if not db.exists():
        out.problems.append(f"the restored snapshot {rel} was not on disk before the resume")
        return out
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)) as snap:
        out.problems += transcript_problems(snap, f"snapshot {rel}", max_turns=max_turns)
        transcripts = saved_transcripts(snap)
        saved = {(g, i, a): (turn, policy_tokens(runs) if (runs := transcripts[e].version_token_counts) is not None
                             else None)
                 for g, i, a, turn, e in snap.execute(
                     "SELECT a.group_id, a.generation_index, a.attempt, e.turn, e.attempt_id "
                     "FROM env_episodes e JOIN rollouts a ON a.attempt_id = e.attempt_id WHERE a.state = 'running'")}
    restored = set()
    for g, i, a, frm, turn, tokens in events:
        row = saved.get((g, i, frm))
        where = f"episode_restored (group {g}, generation {i}, attempt {a} from {frm})"
        if row is None:
            out.problems.append(f"{where}: {rel} holds no running episode of attempt {frm}")
            continue
        restored.add((g, i))
        if row != (turn, tokens):
            out.problems.append(f"{where}: says turn {turn} with {tokens} policy tokens, the snapshot saved "
                                f"turn {row[0]} with {row[1]}")
        turns = calls.get((g, i, a), [])
        if turns and min(turns) != turn:
            out.problems.append(f"{where}: the new attempt's calls start at turn {min(turns)}, not {turn}")
        out.restored += 1
        out.tokens += tokens or 0
    for g, i, a in saved:
        if (g, i) in restored:
            continue
        # Not restored. Decidable when the run finished, or when the new attempt of that
        # generation finished a call: that event comes after the resume's first dispatch,
        # so its episode_restored (emitted before it) would be in the trace too.
        newer = [t for (g2, i2, a2), ts in calls.items() if (g2, i2) == (g, i) and a2 > a for t in ts]
        if finished or newer:
            out.problems.append(f"{rel} saved the episode of (group {g}, generation {i}, attempt {a}) at turn "
                                f"{saved[(g, i, a)][0]}; the resumed run did not restore it"
                                + (f" (its new attempt ran turns {sorted(newer)})" if newer else ""))
    return out


# ------------------------------------------------------------------ what the report says


def kept_per_stop(run_dir: Path, out_dir: Path) -> tuple[list[int], str]:
    """Kept tokens per stop from `rolloutdb trace RUN_DIR --out OUT` (its JSON report), and
    its stderr tail when it failed."""
    proc = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(run_dir), "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return [], f"rolloutdb trace exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    report = json.loads((out_dir / "trace_report.json").read_text(encoding="utf-8"))
    return [int(r["kept_tokens"]) for r in report["kept_per_stop"]], ""
