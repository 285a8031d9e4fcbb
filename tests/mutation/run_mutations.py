"""A small mutation run: plant one bug at a time against a promise the README makes, in a
temporary copy of the repository, run the tests that exist to catch it, and report
which were caught.

    python tests/mutation/run_mutations.py [--only NAME ...] [--list] [--workers N] [--keep] [--markdown]

Never edits the tree it is run from: the working tree (tracked and untracked files, not
the ignored ones such as .venv) is copied to a temporary directory, and the copy is made
importable as `rolloutdb` by symlinks inside its rolloutdb/ (store -> ../store, ...,
as pyproject's package-dir maps them) and PYTHONPATH: a package found on sys.path comes
before the editable install's finder, so the copy wins (checked before any mutant runs). Each mutant edits the copy, runs its test files one by one (`-x`, so a
catch stops early) and is undone before the next. A mutant whose text no longer matches
the code (stale: it would test nothing) fails the run before any test runs, with exit 2;
`--list` lists the mutants and checks them all. Not collected by pytest (the file name
does not start with test_); it takes about 12 minutes on two cores.
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
        "controller/rollout/pump.py",
        [("""        restarted = self.p.dispatcher.restart(tx, taken, policy_version=policy_version)
        started: list[LiveEpisode] = []
        for group, generations in taken:
            run = self._groups.setdefault(group.group_id, GroupRun(group))
            run.outstanding.update(generations)
            started += [self._live(group, i) for i in generations]""",
          """        restarted: list[tuple] = []
        started: list[LiveEpisode] = []
        for group, generations in taken:
            self.p.dispatcher.discard(tx, [group], reason="restart")  # MUTANT: drop it, refill its step
            pools.add_shortfall(tx, group.target_step, 1)
            self._open_shortfall = True""")],
        ["tests/test_crash_resume.py"],
    ),
    Mutant(
        "drop_restored_groups_as_zero_variance",
        "exactly once across stops (the same bug, disguised with the algorithm's reason)",
        "controller/rollout/pump.py",
        [("""        restarted = self.p.dispatcher.restart(tx, taken, policy_version=policy_version)
        started: list[LiveEpisode] = []
        for group, generations in taken:
            run = self._groups.setdefault(group.group_id, GroupRun(group))
            run.outstanding.update(generations)
            started += [self._live(group, i) for i in generations]""",
          """        restarted: list[tuple] = []
        started: list[LiveEpisode] = []
        for group, generations in taken:
            self.p.dispatcher.discard(tx, [group], reason=ZERO_VARIANCE)  # MUTANT: the algorithm's reason
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
        "controller/rollout/pump.py",
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
        [("        v.duplicated = prompts.duplicated\n        if prompts.twice:",
          "        v.duplicated = 0  # MUTANT\n        if False:")],
        ["tests/test_verify_run_lost_work.py", "tests/test_restore.py"],
    ),
    Mutant(
        "verify_run_accepts_any_discard_reason",
        "verify RUN_DIR: a group discarded for anything but zero reward variance is lost",
        "store/restore/choice.py",
        [("    if not total:\n        return\n    v.discarded_not_owned", "    if True:  # MUTANT\n        return\n    v.discarded_not_owned")],
        ["tests/test_verify_run_lost_work.py", "tests/test_crash_resume.py"],
    ),
    Mutant(
        "invariant_2_not_checked",
        "invariant 2: a group is in the replay buffer or in flight, never both",
        "store/live/invariants.py",
        [("           WHERE g.state IS NOT 'published'\"\"\",", "           WHERE g.state IS NOT 'published' AND 0\"\"\","),
         ("           WHERE g.state = 'published' AND g.group_id NOT IN (SELECT group_id FROM replay_groups)\"\"\",",
          "           WHERE g.state = 'published' AND g.group_id NOT IN (SELECT group_id FROM replay_groups) AND 0\"\"\","),
         ("           CROSS JOIN rollouts a ON a.group_id = r.group_id WHERE a.state = 'running'\"\"\",",
          "           CROSS JOIN rollouts a ON a.group_id = r.group_id WHERE a.state = 'running' AND 0\"\"\",")],
        ["tests/test_store_core.py", "tests/test_restore.py"],
    ),
    Mutant(
        "publish_does_not_wait_for_the_copy_check",
        "a snapshot whose captured copy fails its checks is never published",
        "store/checkpoints/publish.py",
        [("manifest, before_manifest=checked.result))",
          "manifest, before_manifest=None))  # MUTANT: the check's verdict is never waited for")],
        ["tests/test_hostile_snapshots.py", "tests/test_publish.py"],
    ),
    Mutant(
        "restore_skips_replay_before_normalization",
        "a restore refuses a snapshot whose replay names an unpublished group before normalization moves it",
        "store/restore/apply.py",
        [('"before restart normalization", only=(2, 3))',
          '"before restart normalization", only=(3,))  # MUTANT: replay not audited before')],
        ["tests/test_restore.py"],
    ),
    Mutant(
        "restore_skips_prompts_after_normalization",
        "a restore refuses a snapshot that hands a settled prompt out again",
        "store/restore/apply.py",
        [('refuse_on_invariants(conn, source, "after restart normalization")',
          'refuse_on_invariants(conn, source, "after restart normalization", only=(2, 3))  # MUTANT')],
        ["tests/test_restore.py"],
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
        "controller/recovery/cut_contents.py",
        [("""            at.prefixes.append(SavedCall(rid, attempt_id, turn, call))""",
          """            keep = max(1, len(call.token_ids) - 1)  # MUTANT: the newest token is lost
            call = dataclasses.replace(call, token_ids=call.token_ids[:keep], logprobs=call.logprobs[:keep],
                                       token_versions=call.token_versions[:keep])
            at.prefixes.append(SavedCall(rid, attempt_id, turn, call))""")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_a_cut_saves_exactly_the_tokens_logprobs_and_versions_the_engine_had_decoded_for_each_call"],
    ),
    Mutant(
        "trace_skips_the_last_finish_of_a_batch",
        "trace: the trace holds every committed finish",
        "controller/rollout/pump.py",
        [("        trace.finished([(live.group, live.index) for live, _ in pending.finished],",
          "        trace.finished([(live.group, live.index) for live, _ in pending.finished][:-1],  # MUTANT")],
        ["tests/test_hostile_proofs_pump.py::test_the_trace_holds_exactly_the_finishes_and_seals_a_real_pump_committed"],
    ),
    Mutant(
        "cut_saves_prefixes_of_ended_attempts",
        "prefix level: a cut saves prefixes only of attempts the ledger runs at the cut",
        "controller/recovery/cut_contents.py",
        [("""        running = {key: attempt_id for key, (attempt_id, state) in known.items() if state == "running"}""",
          """        running = {key: attempt_id for key, (attempt_id, state) in known.items()}  # MUTANT: no filter""")],
        ["tests/test_hostile_proofs_pump.py::test_a_cut_saves_no_prefix_of_a_call_the_engine_still_runs_whose_"
         "attempt_the_ledger_finished_or_abandoned"],
    ),
    Mutant(
        "restored_groups_ignore_max_inflight_calls",
        "a resume hands out the restored groups first and within generation.max_inflight_calls",
        "controller/rollout/pump.py",
        [("        room, n = self._room(), 0\n        while self._restored:",
          "        room, n = 10**9, 0  # MUTANT: every restored group at once\n        while self._restored:")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_a_resume_hands_out_the_restored_groups_first_and_never_more_calls_than_max_inflight_calls"],
    ),
    Mutant(
        "trace_skips_the_finish_of_a_restored_generation",
        "trace: a finish event for every generation of every sealed group",
        "controller/run/tracing.py",
        [("        for (g, i), res in zip(owners, results):\n            counts: dict[int, int] = {}",
          "        for (g, i), res in zip(owners, results):\n            if g.attempt_numbers.get(i, 0) > 0:\n"
          "                continue  # MUTANT: a redone generation's finish is not traced\n"
          "            counts: dict[int, int] = {}")],
        ["tests/test_hostile_proofs_pump.py::"
         "test_the_trace_holds_a_finish_event_for_every_generation_of_every_sealed_group_across_a_resume"],
    ),
    # ---- the commit window (controller/training/pump.py)
    Mutant(
        "commit_lock_around_the_whole_staged_step",
        "snapshots are skipped only during the optimizer commit",
        "controller/training/pump.py",
        [("            prepared = self.staged.prepare_step(groups)  # no lock: snapshots are cut meanwhile\n",
          "            self.p.runtime.commit_lock.acquire()  # MUTANT: the lock around the prepare too\n"
          "            try:\n"
          "                prepared = self.staged.prepare_step(groups)\n"
          "            finally:\n"
          "                self.p.runtime.commit_lock.release()\n")],
        ["tests/test_commit_window.py::"
         "test_snapshots_are_cut_while_a_staged_trainer_prepares_and_skipped_while_a_whole_step_trainer_trains"],
    ),
]


# --------------------------------------------------------------------------- issue 26 item 11 (proofs1)
# A checksum covers the whole file, restore and verify check every segment, every setting
# that changes the rollouts moves the config fingerprint, the run lock is held for the
# whole run on the library path.
PROOFS = "tests/test_hostile_proofs.py::"
FINGERPRINT = "tests/test_hostile_fingerprint.py::"
MUTANTS += [
    Mutant(
        "hash_reads_the_first_chunk_only",
        "a checksum covers the whole file (verify, publish, segments: Hashing.file)",
        "store/checkpoints/hashing.py",
        [("            while n := f.readinto(view):\n                digest.update(view[:n])",
          "            n = f.readinto(view)  # MUTANT: one read\n            digest.update(view[:n])")],
        [PROOFS + "test_a_byte_damaged_past_the_first_read_of_a_snapshot_store_file_fails_verify_and_restore",
         PROOFS + "test_a_byte_damaged_past_the_first_read_of_a_payload_segment_fails_verify_and_restore"],
    ),
    Mutant(
        "hash_skips_the_last_partial_chunk",
        "a checksum covers the whole file, its last partial read too",
        "store/checkpoints/hashing.py",
        [("            while n := f.readinto(view):", "            while (n := f.readinto(view)) == CHUNK:  # MUTANT")],
        [PROOFS + "test_a_byte_damaged_past_the_first_read_of_a_snapshot_store_file_fails_verify_and_restore"],
    ),
    Mutant(
        "restore_copy_hashes_the_first_read_of_each_step_only",
        "a restore's checksum covers the whole store file it copies",
        "store/restore/copying.py",
        [("        digest.update(view[:n])\n        offset += n", "        digest.update(view[:n])\n        offset = end  # MUTANT")],
        [PROOFS + "test_a_byte_damaged_past_the_first_read_of_a_snapshot_store_file_fails_verify_and_restore"],
    ),
    Mutant(
        "restore_copy_hashes_the_first_step_only",
        "a restore's checksum covers a store file longer than one copy step",
        "store/restore/copying.py",
        [("                hashed_step = pool.submit(_hash_range, digest, fout.fileno(), size, n)",
          "                hashed_step = pool.submit(_hash_range, digest, fout.fileno(), size, n) if size == 0 else None")],
        [PROOFS + "test_the_restore_copy_and_the_file_hash_digest_every_byte_of_a_file_longer_than_one_copy_step"],
    ),
    Mutant(
        "segments_check_the_first_one_only",
        "restore and verify check every segment a snapshot (or the live store) lists",
        "store/checkpoints/segments.py",
        [("    problems = []\n    for e in entries:\n", "    problems = []\n    for e in list(entries)[:1]:  # MUTANT\n")],
        [PROOFS + "test_a_damaged_later_segment_of_several_fails_verify_restore_and_the_run_audit"],
    ),
    Mutant(
        "fingerprint_drops_a_key",
        "every setting that changes the rollouts moves the config fingerprint",
        "rolloutdb/config.py",
        [("        if key in RESUMABLE_KEYS:\n            continue\n",
          "        if key in RESUMABLE_KEYS or key == \"generation.top_p\":  # MUTANT\n            continue\n")],
        [FINGERPRINT + "test_every_setting_not_declared_resumable_moves_the_config_fingerprint"],
    ),
    Mutant(
        "fingerprint_ignores_the_plugins",
        "a changed reward function, environment or trainer factory is refused at resume",
        "rolloutdb/config.py",
        [("        if key in RESUMABLE_KEYS:\n",
          "        if key in RESUMABLE_KEYS or key.endswith((\".factory\", \".options\", \".function\")):  # MUTANT\n")],
        [FINGERPRINT + "test_every_setting_not_declared_resumable_moves_the_config_fingerprint"],
    ),
    Mutant(
        "run_lock_released_after_setup",
        "the run lock is held for the whole run on the library path (Controller(...).run())",
        "controller/job/controller.py",
        [("                    self.lock.undo()  # a refusal: leave even the lock file as it was\n                raise\n",
          "                    self.lock.undo()  # a refusal: leave even the lock file as it was\n                raise\n"
          "            if own_lock:\n                self.lock.release()  # MUTANT\n")],
        [PROOFS + "test_a_library_run_holds_the_run_lock_until_it_ends_so_a_second_controller_and_the_cli_are_refused"],
    ),
]
# --------------------------------------------------------------------------- end of proofs1's block


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
    out = subprocess.run([sys.executable, "-c", "import rolloutdb.store, rolloutdb.controller.rollout.pump as p; "
                          "print(rolloutdb.store.__file__); print(p.__file__)"],
                         cwd=dst, env=env_for(dst), capture_output=True, text=True, timeout=120)
    paths = out.stdout.split()
    if out.returncode != 0 or len(paths) != 2 or not all(p.startswith(str(dst)) for p in paths):
        raise SystemExit(f"the copy does not import as rolloutdb: {out.stdout} {out.stderr[-1000:]}")


def run_tests(dst: Path, test: str, workers: str | None = None) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test]
    if workers is not None:
        cmd += ["-n", workers]  # after pyproject's addopts: this one counts
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=dst, env=env_for(dst), capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"caught (timed out after {TEST_TIMEOUT_S} s)"
    took = time.monotonic() - t0
    if out.returncode == 0:
        return f"NOT CAUGHT ({took:.0f} s)"
    failed = re.findall(r"^FAILED (\S+)", out.stdout, re.M)
    # 2 with a failure listed: xdist's workers stopped by -x report "interrupted".
    if out.returncode == 1 or (out.returncode == 2 and failed):
        return f"caught by {failed[0].split('::', 1)[-1] if failed else '?'} ({took:.0f} s)"
    return f"error rc={out.returncode}: {(out.stdout + out.stderr).strip().splitlines()[-1:]}"


class StaleMutant(Exception):
    pass


def mutated(root: Path, m: Mutant) -> str:
    """The text of `m.path` under `root` with the mutant's edits; StaleMutant when a
    text to replace does not occur exactly once (the code moved on: the mutant would
    test nothing)."""
    text = (root / m.path).read_text()
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise StaleMutant(f"stale mutant {m.name}: its text to replace occurs {n} times in {m.path} "
                              f"(expected once): {old.strip().splitlines()[0][:80]!r}")
        text = text.replace(old, new)
    return text


def stale_mutants(mutants: list[Mutant], root: Path = REPO) -> list[str]:
    problems = []
    for m in mutants:
        try:
            mutated(root, m)
        except StaleMutant as e:
            problems.append(str(e))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--markdown", action="store_true", help="print the result as a markdown table")
    ap.add_argument("--workers", help="pytest-xdist workers per test run, 0 for none (default: pyproject's addopts)")
    ap.add_argument("--list", action="store_true", help="list the mutants (and check that none is stale), run nothing")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.only or ()) - {m.name for m in MUTANTS})
    if unknown:
        print(f"error: no mutant named {', '.join(unknown)} (--list lists them)", file=sys.stderr)
        return 2
    mutants = [m for m in MUTANTS if not a.only or m.name in a.only]
    # A stale mutant tests nothing: every one is checked before anything runs, and any
    # stale one fails the whole run (exit 2), never a silent skip.
    stale = stale_mutants(MUTANTS if a.list else mutants)
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:52} {m.path:36} {' '.join(t.removeprefix('tests/') for t in m.tests)}")
    if stale:
        for line in stale:
            print(f"error: {line}", file=sys.stderr)
        print(f"error: {len(stale)} stale mutant(s): update their search text to the code as it is now",
              file=sys.stderr)
        return 2
    if a.list:
        return 0
    dst = Path(tempfile.mkdtemp(prefix="rolloutdb-mutants-"))
    try:
        copy_tree(dst)
        check_import(dst)
        for m in mutants:
            original = (dst / m.path).read_text()
            (dst / m.path).write_text(mutated(dst, m))  # not stale: checked above
            try:
                for test in m.tests:
                    m.results[test] = run_tests(dst, test, a.workers)
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
