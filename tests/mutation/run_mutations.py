"""A small mutation run: plant one bug at a time against a promise the README makes, in a
temporary copy of the repository, run the tests that exist to catch it, and report
which were caught.

    python tests/mutation/run_mutations.py [--only NAME ...] [--keep] [--markdown]

Never edits the tree it is run from: the working tree (tracked and untracked files, not
the ignored ones such as .venv) is copied to a temporary directory, and the copy is made
importable as `rolloutdb` by symlinks inside its rolloutdb/ (store -> ../store, ...,
as pyproject's package-dir maps them) and PYTHONPATH: a package found on sys.path comes
before the editable install's finder, so the copy wins (checked before any mutant runs). Each mutant edits the copy, runs its test files one by one (`-x`, so a
catch stops early) and is undone before the next. A mutant whose text no longer matches
the code is reported as `stale`, never silently skipped. Not collected by pytest (the
file name does not start with test_); it takes about 12 minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"store": "store", "controller": "controller", "migrations": "migrations", "gpu_capture": "gpu_capture"}
TEST_TIMEOUT_S = 900


@dataclass
class Mutant:
    name: str
    promise: str  # what the README promises, which the bug breaks
    path: str
    edits: list[tuple[str, str]]  # (text that must occur exactly once, replacement)
    tests: list[str]  # test files (or file::test ids), each run on its own
    results: dict[str, str] = field(default_factory=dict)


MUTANTS = [
    Mutant(
        "drop_restored_groups",
        "exactly once across stops: a resume redoes the groups in flight",
        "controller/rollout_pump.py",
        [("""            self.p.dispatcher.redispatch(tx, group, generations, policy_version=policy_version)
            run = self._groups.setdefault(group.group_id, _GroupRun(group))
            run.outstanding.update(generations)
            started += [self._live(group, i) for i in generations]""",
          """            self.p.dispatcher.discard(tx, [group], reason="restart")  # MUTANT: drop it, refill its step
            pools.add_shortfall(tx, group.target_step, 1)
            self._open_shortfall = True""")],
        ["tests/test_crash_resume.py"],
    ),
    Mutant(
        "drop_restored_groups_as_zero_variance",
        "exactly once across stops (the same bug, disguised with the algorithm's reason)",
        "controller/rollout_pump.py",
        [("""            self.p.dispatcher.redispatch(tx, group, generations, policy_version=policy_version)
            run = self._groups.setdefault(group.group_id, _GroupRun(group))
            run.outstanding.update(generations)
            started += [self._live(group, i) for i in generations]""",
          """            self.p.dispatcher.discard(tx, [group], reason=ZERO_VARIANCE)  # MUTANT: the algorithm's reason
            pools.add_shortfall(tx, group.target_step, 1)
            self._open_shortfall = True""")],
        ["tests/test_crash_resume.py"],
    ),
    Mutant(
        "batch_age_returns_logged_value",
        "trace: batch age recomputed from the tokens each policy version produced",
        "store/trace/queries.py",
        [("CASE WHEN w.tokens > 0 THEN w.weighted_age * 1.0 / w.tokens END AS batch_age,",
          "s.logged_batch_age AS batch_age,")],
        ["tests/test_trace_analysis.py", "tests/test_trace_real_run.py"],
    ),
    Mutant(
        "restart_episodes_saved_at_a_turn",
        "turn-level recovery: an episode running at a stop continues from its last committed turn",
        "controller/rollout_pump.py",
        [("        self._saved = dict(saved_episodes or {}) if self.turn_level else {}",
          "        self._saved = {}  # MUTANT: every restored episode starts over")],
        ["tests/test_streaming_pump.py", "tests/test_turn_recovery_real_run.py"],
    ),
    Mutant(
        "selection_picks_an_older_snapshot",
        "resume restores the newest complete snapshot with a durable anchor",
        "store/restore/selection.py",
        [("    for snap in reversed(candidates):  # newest first",
          "    for snap in reversed(candidates[:-1] or candidates):  # MUTANT: skips the newest")],
        ["tests/test_publish.py", "tests/test_crash_resume.py"],
    ),
    Mutant(
        "restore_skips_integrity_check",
        "restore checks PRAGMA integrity_check before replacing the live store",
        "store/restore/plan.py",
        [('    if rows:\n        first = ', '    if False:  # MUTANT\n        first = ')],
        ["tests/test_restore.py", "tests/test_restore_integrity.py"],
    ),
    Mutant(
        "publish_skips_the_parent_fsync",
        "a published snapshot is durable: rename, then fsync of the parent",
        "store/checkpoints/publish.py",
        [("    rename_dir(tmp, target)\n    faults.point(\"publish.renamed\")\n    fsync_dir(target.parent)\n",
          "    rename_dir(tmp, target)\n    faults.point(\"publish.renamed\")\n")],
        ["tests/test_publish.py", "tests/test_fault_injection.py"],
    ),
    Mutant(
        "manifest_written_before_the_files_are_durable",
        "manifest.json is written last, after every file is fsynced",
        "store/checkpoints/publish.py",
        [("                pending.append(fsyncer.submit(fsync_file, p))", "                pending.append(p)"),
         ("        for done in pending:\n            done.result()  # re-raises an fsync error here\n", ""),
         ("    fsync_file(tmp / MANIFEST_NAME)\n", "    fsync_file(tmp / MANIFEST_NAME)\n    for p in pending:\n        fsync_file(p)\n")],
        ["tests/test_publish.py", "tests/test_fault_injection.py"],
    ),
    Mutant(
        "verify_run_ignores_duplicates",
        "verify RUN_DIR: duplicated=0 means no prompt was handed out twice",
        "store/restore/choice.py",
        [("        v.duplicated = sum(n - 1 for _, _, n in dupes)\n        if dupes:",
          "        v.duplicated = 0  # MUTANT\n        if False:")],
        ["tests/test_verify_run_lost_work.py", "tests/test_restore.py"],
    ),
    Mutant(
        "verify_run_accepts_any_discard_reason",
        "verify RUN_DIR: a group discarded for anything but zero reward variance is lost",
        "store/restore/choice.py",
        [("    if not rows:\n        return\n    v.discarded_not_owned", "    if True:  # MUTANT\n        return\n    v.discarded_not_owned")],
        ["tests/test_verify_run_lost_work.py", "tests/test_crash_resume.py"],
    ),
    Mutant(
        "invariant_2_not_checked",
        "invariant 2: a group is in the replay buffer or in flight, never both",
        "store/live/invariants.py",
        [("           WHERE g.state IS NOT 'published'\"\"\",", "           WHERE g.state IS NOT 'published' AND 0\"\"\","),
         ("           WHERE g.state = 'published' AND g.group_id NOT IN (SELECT group_id FROM replay_groups)\"\"\",",
          "           WHERE g.state = 'published' AND g.group_id NOT IN (SELECT group_id FROM replay_groups) AND 0\"\"\","),
         ("           JOIN rollouts a ON a.group_id = r.group_id WHERE a.state = 'running'\"\"\",",
          "           JOIN rollouts a ON a.group_id = r.group_id WHERE a.state = 'running' AND 0\"\"\",")],
        ["tests/test_store_core.py", "tests/test_restore.py"],
    ),
    Mutant(
        "sequence_number_reuse",
        "snapshot sequence numbers are never reused, after deletes or crashes",
        "store/checkpoints/publish.py",
        [("            sequence = max(inv.max_sequence(), self._last_sequence) + 1",
          "            sequence = max((s.sequence for s in inv.complete_snapshots()), default=0) + 1  # MUTANT")],
        ["tests/test_publish.py", "tests/test_fault_injection.py"],
    ),
    Mutant(
        "full_disk_capture_not_typed",
        "a failed snapshot attempt is a typed error with a failed outcome row",
        "store/checkpoints/publish.py",
        [("        except (OSError, sqlite3.OperationalError) as e:\n            cause = _as_os_error(e)",
          "        except OSError as e:  # MUTANT: SQLite's own write errors escape untyped\n            cause = _as_os_error(e)")],
        ["tests/test_full_disk.py", "tests/test_fault_injection.py"],
    ),
    # ---- the rollout pump's and the prefix cut's promises (tests/test_hostile_proofs_pump.py)
    Mutant(
        "cut_drops_the_last_decoded_token",
        "prefix level: a cut saves exactly what the engine decoded",
        "controller/snapshot_pump.py",
        [("""            at.prefixes.append(CallPrefix(attempt_id, call.token_ids, call.logprobs if complete else None,
                                          call.token_versions, call.max_tokens, call.min_tokens))""",
          """            keep = max(1, len(call.token_ids) - 1)  # MUTANT: the newest token is lost
            at.prefixes.append(CallPrefix(attempt_id, call.token_ids[:keep], call.logprobs[:keep] if complete else None,
                                          call.token_versions[:keep], call.max_tokens, call.min_tokens))""")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_a_cut_saves_exactly_the_tokens_logprobs_and_versions_the_engine_had_decoded_for_each_call"],
    ),
    Mutant(
        "trace_skips_the_last_finish_of_a_batch",
        "trace: the trace holds every committed finish",
        "controller/rollout_pump.py",
        [("        trace.finished([(live.group, live.index) for live, _ in pending.finished],",
          "        trace.finished([(live.group, live.index) for live, _ in pending.finished][:-1],  # MUTANT")],
        ["tests/test_hostile_proofs_pump.py::test_the_trace_holds_exactly_the_finishes_and_seals_a_real_pump_committed"],
    ),
    Mutant(
        "cut_saves_prefixes_of_ended_attempts",
        "prefix level: a cut saves prefixes only of attempts the ledger runs at the cut",
        "controller/snapshot_pump.py",
        [("""        running = {key: attempt_id for key, (attempt_id, state) in known.items() if state == "running"}""",
          """        running = {key: attempt_id for key, (attempt_id, state) in known.items()}  # MUTANT: no filter""")],
        ["tests/test_hostile_proofs_pump.py::test_a_cut_saves_no_prefix_of_a_call_the_engine_still_runs_whose_"
         "attempt_the_ledger_finished_or_abandoned"],
    ),
    Mutant(
        "restored_groups_ignore_max_inflight_calls",
        "a resume hands out the restored groups first and within generation.max_inflight_calls",
        "controller/rollout_pump.py",
        [("        room = self._room()\n        while self._restored:",
          "        room = 10**9  # MUTANT: every restored group at once\n        while self._restored:")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_a_resume_hands_out_the_restored_groups_first_and_never_more_calls_than_max_inflight_calls"],
    ),
    Mutant(
        "trace_skips_the_finish_of_a_restored_generation",
        "trace: a finish event for every generation of every sealed group",
        "controller/tracing.py",
        [("        for (g, i), res in zip(owners, results):\n            counts: dict[int, int] = {}",
          "        for (g, i), res in zip(owners, results):\n            if g.attempt_numbers.get(i, 0) > 0:\n"
          "                continue  # MUTANT: a redone generation's finish is not traced\n"
          "            counts: dict[int, int] = {}")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_the_trace_holds_a_finish_event_for_every_generation_of_every_sealed_group_across_a_resume"],
    ),
]


def copy_tree(dst: Path) -> None:
    """The working tree as `git ls-files` sees it (tracked + untracked, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    # pyproject maps top-level folders into the package (rolloutdb.store = store/ ...):
    # the same, in the copy, by symlinks inside its rolloutdb/.
    for name, folder in PACKAGE_DIRS.items():
        (dst / "rolloutdb" / name).symlink_to(dst / folder, target_is_directory=True)


def env_for(dst: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUTDB_FAULT", "PYTHONPATH")}
    env["PYTHONPATH"] = str(dst)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def check_import(dst: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import rolloutdb.store, rolloutdb.controller.rollout_pump as p; "
                          "print(rolloutdb.store.__file__); print(p.__file__)"],
                         cwd=dst, env=env_for(dst), capture_output=True, text=True, timeout=120)
    paths = out.stdout.split()
    if out.returncode != 0 or len(paths) != 2 or not all(p.startswith(str(dst)) for p in paths):
        raise SystemExit(f"the copy does not import as rolloutdb: {out.stdout} {out.stderr[-1000:]}")


def run_tests(dst: Path, test: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=dst, env=env_for(dst), capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"caught (timed out after {TEST_TIMEOUT_S} s)"
    took = time.monotonic() - t0
    if out.returncode == 0:
        return f"NOT CAUGHT ({took:.0f} s)"
    if out.returncode == 1:
        failed = re.findall(r"^FAILED (\S+)", out.stdout, re.M)
        return f"caught by {failed[0].split('::', 1)[-1] if failed else '?'} ({took:.0f} s)"
    return f"error rc={out.returncode}: {(out.stdout + out.stderr).strip().splitlines()[-1:]}"


def apply(dst: Path, m: Mutant) -> str | None:
    path = dst / m.path
    text = path.read_text()
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            return f"stale: the text to replace occurs {n} times in {m.path}"
        text = text.replace(old, new)
    path.write_text(text)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--markdown", action="store_true", help="print the result as a markdown table")
    a = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not a.only or m.name in a.only]
    dst = Path(tempfile.mkdtemp(prefix="rolloutdb-mutants-"))
    try:
        copy_tree(dst)
        check_import(dst)
        for m in mutants:
            original = (dst / m.path).read_text()
            stale = apply(dst, m)
            try:
                for test in m.tests:
                    m.results[test] = stale or run_tests(dst, test)
                    print(f"{m.name}: {test}: {m.results[test]}", file=sys.stderr, flush=True)
            finally:
                (dst / m.path).write_text(original)
    finally:
        if a.keep:
            print(f"copy kept at {dst}", file=sys.stderr)
        else:
            shutil.rmtree(dst, ignore_errors=True)
    caught = sum(any(r.startswith("caught") for r in m.results.values()) for m in mutants)
    if a.markdown:
        print("| planted bug | promise | test file | result |\n|---|---|---|---|")
        for m in mutants:
            for test, r in m.results.items():
                print(f"| `{m.name}` | {m.promise} | `{test.removeprefix('tests/')}` | {r} |")
    else:
        for m in mutants:
            for test, r in m.results.items():
                print(f"{m.name:48} {test:40} {r}")
    print(f"\n{caught} of {len(mutants)} planted bugs caught")
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
