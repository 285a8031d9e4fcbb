"""`rolloutdb verify PATH`: check a store or snapshot file, a snapshot directory, a
trainer checkpoint, or a whole checkpoint directory. Exit 0 when sound; otherwise exit 1
and one line per problem, each starting with `error:`. Read-only throughout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rolloutdb.commands._arguments import path_argument
from rolloutdb.migrations import head_of_revision_files

EXIT_PROBLEMS = 1

DESCRIPTION = """\
Verify what PATH is:
  a store or snapshot file   PRAGMA integrity_check, exactly one alembic_version row
                             naming a revision this rolloutdb knows, whose schema the
                             file has (older is fine and said so; unknown is an error;
                             head: {head}), the four invariants, and the checksums of
                             every file when a manifest.json sits beside it;
  a snapshot directory       every file against its manifest.json, then the file checks,
                             every payload segment it lists (size, checksum), and every
                             sample's payload in the segment its store file names;
  a trainer checkpoint       (bootstrap/, step_<N>/) its files against its manifest, and
                             every snapshot under it;
  a checkpoint directory     every trainer checkpoint and snapshot in it;
  a run directory            (holding rollout_state.sqlite and config.yaml) exactly-once
                             over every stop: prints trained=N discarded=M duplicated=D lost=L;
                             and every payload segment the live store references, against
                             the size and BLAKE3 it recorded when sealing it, each sample's
                             payload in the segment named. A segment (or payload_segments/)
                             resolving outside the checkpoint directory is refused, as a
                             manifest's file is.
Exit 0 when sound. Otherwise exit 1 and print one line per problem starting with
"error:" (exit 2 when PATH itself is unusable). Nothing on disk is changed: files are
opened read-only and no -wal/-shm files are created.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check a store file, a snapshot or a checkpoint directory",
        description=DESCRIPTION.format(head=head_of_revision_files()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", type=path_argument, help="a .sqlite file, a snapshot directory or a checkpoint directory")
    parser.add_argument("-q", "--quiet", action="store_true", help="print problems only")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (ok, problems, notes, checked; for a run directory also "
                             "trained, discarded, duplicated, lost) instead of text; exit codes are the same")
    parser.set_defaults(func=run)


MAX_LINE = 2000  # a forged value (a 4 MB anchor) must not make a 4 MB line


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


# --- run directories (controller/recovery/run_audit.py) ---------------------------------------------
# RUN_DIR holding rollout_state.sqlite and config.yaml: exactly-once over every stop.


def run_run_dir(args: argparse.Namespace) -> int:
    from rolloutdb.controller.recovery.run_audit import verify_run

    verdict = verify_run(args.path)
    for problem in verdict.problems:
        print(f"error: {_one_line(problem)}", file=sys.stderr)
    if args.json:
        counts = {k: getattr(verdict, k) for k in ("trained", "discarded", "duplicated", "lost", "pending",
                                                   "discarded_not_owned", "spare", "cursor", "steps")}
        _print_json(verdict.ok, verdict.problems, verdict.notes, [str(Path(args.path) / "rollout_state.sqlite")],
                    kind="run_dir", **counts)
        return 0 if verdict.ok else EXIT_PROBLEMS
    if not args.quiet:
        for note in verdict.notes:
            print(f"note: {_one_line(note)}")
    print(verdict.line())
    return 0 if verdict.ok else EXIT_PROBLEMS


# ------------------------------------------------------------------------------------------


def _print_json(ok: bool, problems: list[str], notes: list[str], checked: list[str], **extra) -> None:
    """--json: the same verdict as the text, one object on stdout (problems also stay on
    stderr as `error:` lines, so a script reading only the exit code and stderr sees no change)."""
    doc = {"ok": ok, "problems": [_one_line(p) for p in problems], "notes": [_one_line(n) for n in notes],
           "checked": [str(c) for c in checked], **extra}
    print(json.dumps(doc, indent=2))


def run(args: argparse.Namespace) -> int:
    from rolloutdb.controller.run.run_dir import RunDir
    from rolloutdb.store import verify_path

    if RunDir(Path(args.path)).is_run_dir():
        return run_run_dir(args)
    report = verify_path(args.path)
    for problem in report.problems:
        print(f"error: {_one_line(problem)}", file=sys.stderr)
    if args.json:
        _print_json(report.ok, report.problems, report.notes, report.checked, kind="checkpoint")
        return 0 if report.ok else EXIT_PROBLEMS
    if not args.quiet:
        for note in report.notes:
            print(f"note: {_one_line(note)}")
    if report.problems:
        return EXIT_PROBLEMS
    if not args.quiet:
        print(f"ok: {args.path} ({len(report.checked)} checked)")
    return 0
