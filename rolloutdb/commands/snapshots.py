"""`rolloutdb snapshots CHECKPOINT_DIR|RUN_DIR`: list the anchors and rollout snapshots of a
checkpoint directory, complete or not. Read-only: nothing is opened for writing, and
leftovers are listed (as incomplete), never removed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutdb.commands._arguments import path_argument
from rolloutdb.commands._tables import format_table
from rolloutdb.timefmt import ago, iso_utc

if TYPE_CHECKING:
    from rolloutdb.store import Entry

DESCRIPTION = """\
List a checkpoint directory: one row per anchor (bootstrap/, step_<N>/: trainer
checkpoints) and one per rollout snapshot under it, with sequence number, anchor, kind,
age, size, row counts and whether it is complete. Only complete entries are
checkpoints; temporary or half-deleted directories left by a crash are listed as
incomplete and removed by the next save. Nothing on disk is changed. Given a run
directory (holding rollout_state.sqlite and config.yaml), lists RUN_DIR/checkpoints.
"""

# Row counts shown in the table (all of them are in --json).
_SHOWN_COUNTS = (("prompt_groups", "groups"), ("rollouts", "rollouts"), ("samples", "samples"),
                 ("replay_groups", "replay"), ("spare_prompts", "spare"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "snapshots", help="list the trainer checkpoints and rollout snapshots of a checkpoint directory",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", type=path_argument,
                        help="the run's checkpoint directory, or the run directory holding it")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)


def _row(e: Entry, now: float) -> dict:
    m = e.manifest
    return {
        "sequence": e.sequence,
        "anchor": e.anchor,
        "kind": e.kind,
        "complete": e.complete,
        "status": e.status,
        "problem": e.problem,
        "path": str(e.path),
        "age_s": e.age_s(now),
        "size_bytes": e.size_bytes(),
        "schema_revision": m.schema_revision if m else None,
        "created_at": iso_utc(m.created_at) if m else None,
        "cut_time": iso_utc(m.cut_time) if m else None,
        "mutation_counter": m.mutation_counter if m else None,
        "row_counts": m.row_counts if m else {},
        "group_states": m.group_states if m else {},
        "files": len(m.files) if m else None,
    }



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _counts(row: dict) -> str:
    from rolloutdb.store import KIND_SNAPSHOT

    if row["kind"] != KIND_SNAPSHOT:
        return f"{row['files']} files" if row["files"] is not None else "-"
    c = row["row_counts"]
    if not c:
        return "-"
    return " ".join(f"{label}={c[key]}" for key, label in _SHOWN_COUNTS if key in c)


def run(args: argparse.Namespace) -> int:
    from rolloutdb.controller.run.run_dir import RunDir
    from rolloutdb.store import KIND_SNAPSHOT, NotAStoreError, scan

    root = Path(args.checkpoint_dir)
    run_dir = RunDir(root)
    if run_dir.is_run_dir():
        root = run_dir.checkpoints
        if not root.exists():
            raise NotAStoreError(f"{root}: no such directory; the run has published no checkpoint yet")
    if not root.exists():
        raise NotAStoreError(f"{root}: no such directory; pass the run's checkpoint directory")
    if not root.is_dir():
        raise NotAStoreError(f"{root}: not a directory; pass a checkpoint directory (for a file use `rolloutdb inspect`)")
    inv = scan(root)
    now = time.time()
    # Each anchor followed by its snapshots: the order of the directory tree.
    rows = []
    for a in inv.anchors:
        rows.append(_row(a, now))
        rows += [_row(s, now) for s in inv.snapshots if s.anchor == a.anchor and s.path.parent.parent == a.path]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"{root}: no checkpoints")
        return 0
    header = ["SEQ", "ANCHOR", "KIND", "AGE", "SIZE", "COUNTS", "STATUS"]
    table = [
        (
            str(r["sequence"]) if r["sequence"] is not None else "-",
            r["anchor"],
            "snapshot" if r["kind"] == KIND_SNAPSHOT else "trainer",
            ago(r["age_s"]),
            _size(r["size_bytes"]),
            _counts(r),
            r["status"],
        )
        for r in rows
    ]
    print(format_table(header, table, cell=str))
    return 0
