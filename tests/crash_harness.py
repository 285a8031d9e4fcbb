"""The crash harness: run the main job as a real subprocess, SIGKILL it (at a named fault
point or at a random moment), resume, and repeat until the run ends; then check the
whole chain of stops.

Three configurations (`HarnessConfig`, a parameter of `run_chain`): GROUP_LEVEL, the
single-turn digit task recovered at group level, TURN_LEVEL, the multi-turn long-tail
task recovered at turn level, whose saved episodes and restores are checked by
tests/crash_episodes.py after every kill and every resume, and PREFIX_LEVEL, the same at
prefix level (running calls continue from their saved prefixes).

Used by tests/test_crash_resume.py (quick tiers in CI, a long tier behind `slow`) and
runnable by hand:  python tests/crash_harness.py RUN_DIR --kills 20 --seed 1 --config turn

The harness decides what the resume should have done without the code the resume runs:
the snapshot it must restore is read from the manifests on disk with `json` and
`hashlib` (`newest_usable_snapshot`) and checked against the kill log (every snapshot a
killed process logged as published); the prompts trained are compared with those of a
never-killed twin of the same seed and config (`compare_with_twin`, with the other
reads of a run's ledger in tests/crash_ledger.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import settled
from crash_ledger import compare_with_twin, handed_out_problems
from crash_episodes import kept_per_stop, last_trace_run, restore_problems, set_aside, transcript_problems

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class HarnessConfig:
    """One configuration the harness runs a chain of: the example it starts from, the
    shape of the run (what the end-of-chain checks count on) and its own overrides."""

    name: str
    example: Path
    steps: int
    groups: int
    group_size: int
    dataset: int
    seed: int
    extra: tuple[str, ...]
    random_kill_s: tuple[float, float]  # a random moment: this many seconds after the process touches the run
    turns: int | None = None  # multi-turn at turn level: saved episodes are checked against it

    @property
    def overrides(self) -> list[str]:
        return [
            f"run.seed={self.seed}",
            f"algorithm.total_steps={self.steps}",
            f"algorithm.groups_per_step={self.groups}",
            f"algorithm.group_size={self.group_size}",
            f"environment.dataset_size={self.dataset}",
            *self.extra,
            *([f"environment.turns={self.turns}"] if self.turns else []),
            "checkpointing.interval_steps=1",
            "rollout_checkpointing.enabled=true",
            "rollout_checkpointing.interval_s=0.1",
            "trace.enabled=true",
            "logging.progress=false",
            "logging.plot=false",
        ]


# Single-turn digits, group-level recovery: the W1-D configuration.
GROUP_LEVEL = HarnessConfig(
    "group", REPO / "examples" / "quickstart.yaml", steps=5, groups=3, group_size=4, dataset=64, seed=7,
    extra=("generation.max_tokens=4", "generation.max_batch_size=12", "environment.n_digits=2"),
    random_kill_s=(0.0, 3.0))
# Multi-turn long-tail digits, turn-level recovery: 3 turns of 1-8 digit targets (max_tokens
# = max_digits + 1). 8 steps took ~1.5 s of rollouts on 2 cores, about 60 commit batches
# with turn progress and 8 snapshots, most of them holding saved episodes (measured); 24
# steps leave room for a dozen kills in a chain before it ends.
TURN_LEVEL = HarnessConfig(
    "turn", REPO / "examples" / "multiturn.yaml", steps=24, groups=3, group_size=4, dataset=64, seed=7,
    extra=("environment.task=digits_longtail", "environment.max_digits=8", "generation.max_tokens=9",
           "rollout_recovery.target_level=turn"),
    random_kill_s=(0.3, 1.5), turns=3)
# The same at prefix level: every snapshot also saves the running calls' prefixes, and a
# resume continues each from them (besides its episode's committed turns).
PREFIX_LEVEL = HarnessConfig(
    "prefix", REPO / "examples" / "multiturn.yaml", steps=24, groups=3, group_size=4, dataset=64, seed=9,
    extra=("environment.task=digits_longtail", "environment.max_digits=8", "generation.max_tokens=9",
           "rollout_recovery.target_level=prefix"),
    random_kill_s=(0.3, 1.5), turns=3)
CONFIGS = {c.name: c for c in (GROUP_LEVEL, TURN_LEVEL, PREFIX_LEVEL)}
# The group-level configuration under its W1-D names (tests/test_trace_real_run.py and
# tests/train_cli.py use them).
EXAMPLE, OVERRIDES = GROUP_LEVEL.example, GROUP_LEVEL.overrides
STEPS, GROUPS = GROUP_LEVEL.steps, GROUP_LEVEL.groups


@dataclass
class ChainResult:
    kills: int = 0
    runs: int = 0
    finished: bool = False
    killed_at: list[str] = field(default_factory=list)
    restores: list[tuple[str | None, str | None]] = field(default_factory=list)  # (expected, used)
    problems: list[str] = field(default_factory=list)
    twin_dir: Path | None = None
    config: HarnessConfig = GROUP_LEVEL
    overrides: list[str] = field(default_factory=list)  # on top of the config's (e.g. checkpointing.async=true)
    episodes_restored: int = 0  # episode_restored events checked against their snapshot
    tokens_restored: int = 0  # policy tokens those events kept
    kept_per_stop: list[int] = field(default_factory=list)  # `rolloutdb trace`: kept tokens per stop


def _command(run_dir: Path, resume: bool, config: HarnessConfig = GROUP_LEVEL, overrides: list[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(config.example), "--run-dir", str(run_dir)]
    return cmd + (["--resume"] if resume else []) + config.overrides + list(overrides)


def train_env(fault: str | None = None) -> dict:
    """A `rolloutdb train` subprocess's environment: this one's, a fault point only if asked."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTDB_FAULT"}
    env["RAY_AUTH_MODE"] = "disabled"
    if fault:
        env["ROLLOUTDB_FAULT"] = fault
    return env



_ANCHOR = re.compile(r"^(bootstrap|step_\d+)$")
_SNAPSHOT = re.compile(r"^snapshot_(\d+)$")


def _hash_name(m: dict) -> str:
    """The hash a manifest lists (format 1: sha256; format 2 names it: blake3)."""
    return "sha256" if m.get("format_version") == 1 else m["hash"]


def _digest(m: dict, data: bytes) -> str:
    import blake3  # the documented format-2 hash, computed here independently

    name = _hash_name(m)
    return hashlib.sha256(data).hexdigest() if name == "sha256" else blake3.blake3(data).hexdigest() if name == "blake3" else ""


def _sound(directory: Path, kind: str, anchor: str, sequence: int | None) -> bool:
    """A checkpoint directory whose manifest.json (plain JSON, read here) is of `kind`,
    names this anchor (and sequence), and lists files that all exist with their size and
    checksum (sha256 or blake3, as the format names): what a resume may trust. The project's manifest reader is not used."""
    try:
        m = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(m, dict) or m.get("kind") != kind or m.get("anchor") != anchor:
        return False
    if sequence is not None and m.get("sequence") != sequence:
        return False
    try:
        for f in m["files"]:
            data = (directory / f["path"]).read_bytes()
            if len(data) != f["size"] or _digest(m, data) != f[_hash_name(m)]:
                return False
    except (OSError, KeyError, TypeError):
        return False
    return True


def newest_usable_snapshot(checkpoint_dir: Path) -> tuple[int, str] | None:
    """(sequence, path) of the newest snapshot a resume must restore, decided from the
    disk alone: the highest-numbered `snapshot_<N>` whose manifest and files are sound
    and whose anchor directory is a sound trainer checkpoint. Dot-named leftovers
    (`.x.tmp`, `.x.trash`) never match the name patterns."""
    best = None
    if not checkpoint_dir.is_dir():
        return None
    for anchor_dir in checkpoint_dir.iterdir():
        if not (_ANCHOR.match(anchor_dir.name) and anchor_dir.is_dir()):
            continue
        snaps = anchor_dir / "rollout_snapshots"
        if not snaps.is_dir() or not _sound(anchor_dir, "trainer_checkpoint", anchor_dir.name, None):
            continue
        for snap in snaps.iterdir():
            m = _SNAPSHOT.match(snap.name)
            if m and (best is None or int(m.group(1)) > best[0]) \
                    and _sound(snap, "rollout_snapshot", anchor_dir.name, int(m.group(1))):
                best = (int(m.group(1)), str(snap))
    return best


def _logged_published(run_dir: Path) -> list[int]:
    """The kill log: sequences every process so far logged as published."""
    return [e["sequence"] for e in metrics(run_dir) if e.get("kind") == "snapshot"
            and e.get("outcome") == "published" and isinstance(e.get("sequence"), int)]


def _expected_snapshot(run_dir: Path, result: ChainResult) -> str | None:
    expected = newest_usable_snapshot(run_dir / "checkpoints")
    logged = _logged_published(run_dir)
    # Sequence numbers only grow and retention never deletes the newest snapshot, so the
    # newest snapshot a process logged as published must still be there, or a newer one.
    if logged and (expected is None or expected[0] < max(logged)):
        result.problems.append(f"snapshot_{max(logged)} was logged as published before the kill, but the newest "
                               f"sound snapshot on disk is {expected}")
    return None if expected is None else expected[1]


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The run's metrics log (of one `kind`, or all), skipping a line cut by a kill."""
    path = run_dir / "logs" / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out if kind is None else [e for e in out if e.get("kind") == kind]



def check_after_kill(run_dir: Path, result: ChainResult) -> None:
    """What must hold at any moment a kill can leave behind."""
    from rolloutdb.store.live.invariants import check_invariants
    from rolloutdb.store.checkpoints.layout import scan
    from rolloutdb.store.restore.verification import verify_path

    ckpt = run_dir / "checkpoints"
    if ckpt.exists():
        for entry in scan(ckpt).entries:
            if entry.complete:
                report = verify_path(entry.path)
                if not report.ok:
                    result.problems.append(f"published {entry.path.name} fails verification: {report.problems[:2]}")
    store = run_dir / "rollout_state.sqlite"
    if store.exists():
        conn = sqlite3.connect(store)
        try:
            if conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'run_meta'").fetchone()[0]:
                if conn.execute("SELECT count(*) FROM run_meta").fetchone()[0]:
                    report = check_invariants(conn)
                    if not report.ok:
                        result.problems.append(f"live store after a kill: {report.problems[:2]}")
                    result.problems += transcript_problems(conn, "live store after a kill",
                                                           max_turns=result.config.turns)
        finally:
            conn.close()


def run_once(run_dir: Path, result: ChainResult, *, fault: str | None = None, kill_after: float | None = None,
             timeout: float = 300) -> int:
    """One process of the chain; returns its exit code (-9 when killed)."""
    resume = (run_dir / "rollout_state.sqlite").exists()
    expected = _expected_snapshot(run_dir, result) if resume else None
    seen = len(metrics(run_dir))
    # The restored snapshot is checked against the resumed run's trace afterwards, from a
    # copy: retention (or a restore dropping newer anchors) may delete it meanwhile.
    aside = run_dir.with_name(run_dir.name + ".aside")
    after_run = last_trace_run(run_dir) if resume else 0
    if resume:
        set_aside(run_dir, aside)
    proc = subprocess.Popen(_command(run_dir, resume, result.config, result.overrides), env=train_env(fault),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        deadline = time.monotonic() + timeout
        # A random moment of *this* process's work: count from when it touches the run (a
        # fresh run creates its store; a resume writes its `restore` record).
        while proc.poll() is None and len(metrics(run_dir)) <= seen and not _touched(run_dir, resume):
            if time.monotonic() > deadline:
                result.problems.append(f"a run did not touch its run directory within {timeout} s")
                break
            time.sleep(0.05)
        time.sleep(kill_after)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        result.problems.append(f"a run hung for {timeout} s")
    result.runs += 1
    if proc.returncode == -signal.SIGKILL:
        result.kills += 1
        result.killed_at.append(fault or f"random+{kill_after:.2f}s")
    elif proc.returncode != 0:
        result.problems.append(f"run exited {proc.returncode}: {err.strip().splitlines()[-1:] if err else ''}")
    if resume:
        restores = [e for e in metrics(run_dir)[seen:] if e.get("kind") == "restore"]
        if restores:
            result.restores.append((expected, restores[0].get("snapshot")))
            # What it said on stderr too (a kill may land between the record and the line).
            said = re.search(r"resumed from (\S+)/snapshot_(\d+) ", err or "")
            if expected is not None and (said is not None or proc.returncode == 0) and (
                    said is None or f"{said[1]}/rollout_snapshots/snapshot_{said[2]}"
                    != str(Path(expected).relative_to(run_dir / "checkpoints"))):
                result.problems.append(f"the resume said {said and said[0]!r}; the newest sound snapshot was {expected}")
        check = restore_problems(run_dir, aside, after_run, finished=proc.returncode == 0,
                                 max_turns=result.config.turns)
        result.problems += check.problems
        result.episodes_restored += check.restored
        result.tokens_restored += check.tokens
        shutil.rmtree(aside, ignore_errors=True)
    check_after_kill(run_dir, result)
    return proc.returncode


def _touched(run_dir: Path, resume: bool) -> bool:
    return not resume and (run_dir / "rollout_state.sqlite").exists()


def finish(run_dir: Path, result: ChainResult, attempts: int = 3) -> None:
    for _ in range(attempts):
        if run_once(run_dir, result) == 0:
            result.finished = True
            return


def check_chain(run_dir: Path, result: ChainResult) -> None:
    """Exactly-once and the other promises, over the whole chain of stops."""
    from rolloutdb.controller.run.sampler import PromptOrder
    from rolloutdb.controller.recovery.run_audit import verify_run

    c = result.config
    verdict = verify_run(run_dir)
    if not verdict.ok:
        result.problems.append(f"verify_run: {verdict.line()} {verdict.problems[:3]}")
    if verdict.trained != c.steps * c.groups:
        result.problems.append(f"trained {verdict.trained} groups, expected {c.steps * c.groups}")
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    try:
        result.problems += handed_out_problems(conn, PromptOrder(c.dataset, c.seed))
        per_step = settled.trained_per_step(conn)
        if per_step != {s: c.groups for s in range(1, c.steps + 1)}:
            result.problems.append(f"groups per trained step {per_step}")
    finally:
        conn.close()
    result.problems += restored_work_redone(run_dir)
    kept, failed = kept_per_stop(run_dir, run_dir.with_name(run_dir.name + ".report"))
    result.kept_per_stop = kept
    if failed:
        result.problems.append(failed)
    elif c.turns is None and any(kept):
        result.problems.append(f"a group-level run kept tokens at a stop: {kept}")
    for expected, used in result.restores:
        if expected != used:
            result.problems.append(f"restore used {used}, the newest complete snapshot was {expected}")


TRACE_FILE = "rollout_trace.sqlite"  # the run's trace, read with plain sqlite3


def restored_work_redone(run_dir: Path) -> list[str]:
    """Every generation a restore handed back was generated again before its group was
    discarded. The attempts running at the cut are abandoned (trace event
    `attempt_abandoned`, reason 'restart') by the rollout pump's commit that dispatches a
    newer attempt of the same (group, prompt, generation), so each such event must have
    that dispatch beside it. A group discarded for zero
    variance without that had its variance judged on work that was never done: the
    algorithm's reason used for a drop. (A kill can lose the last milliseconds of a
    trace, but a redispatch the trace missed was either lost with the kill too, or
    abandoned again at the next restore with a newer attempt number, which is then
    dispatched and traced.)"""
    trace = run_dir / "logs" / TRACE_FILE
    if not trace.exists():
        return [f"{trace}: missing; the harness's config turns the trace on"]
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        abandoned = conn.execute("SELECT group_id, prompt_id, generation_index, max(attempt) FROM attempt_abandoned "
                                 "WHERE reason = 'restart' GROUP BY 1, 2, 3").fetchall()
        dispatched = dict(((g, p, i), a) for g, p, i, a in conn.execute(
            "SELECT group_id, prompt_id, generation_index, max(attempt) FROM attempt_dispatched GROUP BY 1, 2, 3"))
        # Discarded groups leave the store's ledger (v1_4_a), so their ids come from the
        # trace's group_discarded events (a kill can lose the last milliseconds of those,
        # as of every event; the dispatches that matter are traced before the discard).
        discarded = set(conn.execute("SELECT group_id, prompt_id FROM group_discarded"))
    with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True)) as conn:
        discarded |= set(conn.execute("SELECT group_id, prompt_id FROM prompt_groups WHERE state = 'discarded'"))
    not_redone = [(g, p, i) for g, p, i, a in abandoned
                  if (g, p) in discarded and dispatched.get((g, p, i), -1) <= a]
    if not_redone:
        return [f"{len(not_redone)} generation(s) a restore handed back were never generated again before their "
                f"group was discarded (group, prompt, generation): {not_redone[:4]}"]
    return []


def start_twin(twin_dir: Path, config: HarnessConfig = GROUP_LEVEL, overrides: list[str] = ()) -> subprocess.Popen:
    """The never-killed run, started beside the chain (one extra run per chain)."""
    return subprocess.Popen(_command(twin_dir, False, config, overrides), env=train_env(None), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def run_chain(run_dir: Path, plan: list[tuple[str | None, float | None]], *, config: HarnessConfig = GROUP_LEVEL,
              seed: int = 0, twin: bool = True, timeout: float = 300, overrides: list[str] = ()) -> ChainResult:
    """`plan`: (fault point spec, None) or (None, seconds after start) per kill, on a run
    of `config`. With `twin`, a never-killed run of the same config runs in RUN_DIR.twin
    beside the chain and the trained prompts are compared with it at the end.
    `overrides`: config keys on top of the config's, for every run of the chain and the twin."""
    result = ChainResult(config=config, overrides=list(overrides))
    twin_proc = None
    if twin:
        result.twin_dir = run_dir.with_name(run_dir.name + ".twin")
        twin_proc = start_twin(result.twin_dir, config, result.overrides)
    try:
        for fault, delay in plan:
            run_once(run_dir, result, fault=fault, kill_after=delay)
        finish(run_dir, result)
        if result.finished:
            check_chain(run_dir, result)
        else:
            result.problems.append("the run never finished")
        if twin_proc is not None:
            try:
                _, err = twin_proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                twin_proc.kill()
                _, err = twin_proc.communicate()
                result.problems.append(f"the never-killed twin did not finish within {timeout} s")
            if twin_proc.returncode != 0:
                result.problems.append(f"the never-killed twin exited {twin_proc.returncode}: {err.strip()[-500:]}")
            elif result.finished:
                result.problems += compare_with_twin(run_dir, result.twin_dir, config)
    finally:
        if twin_proc is not None and twin_proc.poll() is None:
            twin_proc.kill()
            twin_proc.wait()
    return result


# ------------------------------------------------------------------ freeze, look, kill (the real-run tests)


def read_sql(path: Path, sql: str, args: tuple = ()) -> list[tuple]:
    """One query through a read-only connection of its own: what another process sees."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute(sql, args).fetchall()


def resumed_events(run_dir: Path, table: str, columns: str) -> list[tuple]:
    """`columns` of the trace's `table` rows written by the run's last process."""
    return read_sql(run_dir / "logs" / TRACE_FILE, f"SELECT {columns} FROM {table} WHERE run = (SELECT max(run) FROM runs)")


SERVER_MODULE = "rolloutdb.controller.agent_server.env_server"


def server_pids(controller_pid: int) -> dict[str, int]:
    """Name -> pid of a controller's agent servers, from their command lines in /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if SERVER_MODULE in argv and "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(controller_pid):
            found[argv[argv.index("--server") + 1]] = int(entry.name)
    return found


def kill_when(proc: subprocess.Popen, look, *, timeout: float = 300, with_servers: bool = False,
              poll_s: float = 0.05):
    """Every `poll_s`, freeze `proc` (SIGSTOP: nothing is published while we look) and call
    `look()`; the first time it returns something other than None, SIGKILL the process
    (and first, `with_servers`, the agent servers it started) and return that. A
    `look` that meets a file being written (sqlite3.Error) looks again next time. None
    when the run ended well before `look` found it (AssertionError if its last 3 or more
    looks all failed: a look that cannot read the files); AssertionError (with its stderr,
    where that is a pipe) when it failed, or ran past `timeout` (then it is killed)."""
    deadline = time.monotonic() + timeout
    failing: list[sqlite3.Error] = []  # look's errors since it last ran clean
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)
        proc.send_signal(signal.SIGSTOP)
        try:
            got = look()
            failing.clear()
            if got is not None:
                for pid in server_pids(proc.pid).values() if with_servers else ():
                    os.kill(pid, signal.SIGKILL)
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return got
        except sqlite3.Error as e:
            failing.append(e)
            continue
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
    hung = proc.poll() is None
    if hung:
        proc.kill()
    proc.wait()
    if hung or proc.returncode != 0:
        # Not bad luck a caller may retry: a defect to show (three retried runs that
        # failed once read as "ended before the snapshot" in CI, their stderr unread).
        err = proc.stderr.read() if proc.stderr else ""
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        what = f"ran past {timeout} s" if hung else f"failed (exit {proc.returncode})"
        raise AssertionError(f"the run {what} before the moment to kill it came: {err[-3000:]}")
    if len(failing) >= 3:
        # Not a file caught mid-write: the look itself is wrong (a column it names is
        # gone), and every run would "end before the snapshot".
        raise AssertionError(f"look() failed its last {len(failing)} times, the run ended meanwhile: {failing[-1]}")
    return None


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", choices=sorted(CONFIGS), default=GROUP_LEVEL.name)
    a = ap.parse_args()
    rng, cfg = random.Random(a.seed), CONFIGS[a.config]
    res = run_chain(a.run_dir, [(None, rng.uniform(*cfg.random_kill_s)) for _ in range(a.kills)], config=cfg)
    print(json.dumps({"kills": res.kills, "runs": res.runs, "finished": res.finished, "killed_at": res.killed_at,
                      "episodes_restored": res.episodes_restored, "tokens_restored": res.tokens_restored,
                      "kept_per_stop": res.kept_per_stop, "problems": res.problems}, indent=1))
