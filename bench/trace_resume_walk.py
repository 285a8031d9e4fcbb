"""The resume walk through the store, traced: which store modules a resume enters, in
what order, and how often it reads the same thing again.

    python bench/trace_resume_walk.py              # the summary
    python bench/trace_resume_walk.py --sequence   # and the walk, one module per line

Builds a small real run through the store API (the same parts the controller uses): a
live store with ledger dispatch, a bootstrap anchor and a `step_1` anchor, two rollout
snapshots whose payload was sealed into payload segments first (what the snapshot pump
does), so the restore reads a manifest, a store file and its segments. Then resumes it
the way the controller does, from the store's side: `select_and_restore(CHECKPOINT_DIR,
LIVE, resume="latest", ...)` (choose the snapshot, check its anchor, restore). The walk
is run once untraced on a copy (imports, the schema fingerprints' cache), then traced on
a fresh copy of the same directories.

Traced with `sys.setprofile` (and `threading.setprofile` for the restore's helper
threads). A frame outside `rolloutdb.store` (SQLAlchemy, the standard library) counts as
the store module that called it. What is printed:

* modules entered: distinct store modules the main thread ran code in;
* walk steps: changes of the module the main thread runs in (a call into another module
  or a return to the caller);
* climbs back up: walk steps to a higher floor (floors: tests/test_import_edges.py's
  ALLOWED, a floor above every floor it may import; the facade on top);
* returns to a module already left: walk steps into a module the walk had been in before
  (every return to a caller is one; so is asking a module again);
* asked again: calls into a module that had been entered and left before (not on the
  stack when called again): the count the issue's "flows down once" is about. Listed per
  module with the pair that alternates most;
* reads (every thread): `read_manifest` per directory, `file_revision` per file (the
  snapshot's store file or its restore copy; the live store), the segment-reference
  readers (`sample_references`, `referenced_segments`) per file, and `scan` of the
  checkpoint directory; the restore floor's calls into sqlite/revision.py and
  sqlite/identity.py about the snapshot's revision; and where the segments live:
  calls of `segments_dir_of`/`segment_file_name` from checkpoints/segments.py into
  live/payload.py, and the names of that kind segments.py imports from live/payload.py
  (read from its source: a constant such as `SEGMENTS_DIR` cannot be traced).

Measured 2026-12-02 (the counts are the same on every run; load does not change them).
Before: main at 99227be; after: this branch, where the restore reads the snapshot into a
`SnapshotReading` (restore/plan.py: the manifest the listing read, the file's revision
in one question to sqlite/identity.py, the segment list read once from the copy, and
where the segments live) and passes it to every phase, and checkpoints/layout.py owns
where segments live (checkpoints/segments.py imports nothing of that from live/payload.py):

                                                   latest          newest damaged
                                                before  after     before  after
    modules entered                                 28     28         28     28
    walk steps                                     252    232        410    366
    climbs back up                                  67     56        120    100
    returns to a module already left               225    205        383    339
    asked again                                     99     89        178    156
      of which by the restore floor                 51     47         90     83
    manifest reads (every directory)                 6      4         13      8
      of the snapshot restored                       2      1          4      2
    revision reads of the snapshot's file            1      1          3      2
    revision look-ups by restore                     4      1          6      2
    segment list reads                               2      1          4      2
    segments.py's imports of where segments live     3      0          3      0

"latest": the newest snapshot restores; "newest damaged" (--damaged-newest): it is
refused at restore and the next one is chosen with verification (`verify_snapshot_dir`)
and restored. What stays: the walk is still an orchestrator (restore/apply.py) calling
its phases in plan.py one by one (13 of the 47), the listing's `Entry` properties
(restore/selection.py -> checkpoints/layout.py), and the live store's own calls during
restart normalization (live/queries.py <-> live/compaction.py); the verify path reads
the chosen snapshot's revision and segment list on its own file, and restore again on
its copy (the copy is what is checked and installed). The fallback scans the checkpoint
directory again (the listing may have changed while the first choice was loaded).
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
import inspect
import shutil
import sqlite3
import sys
import tempfile
import threading
from pathlib import Path

from rolloutdb.store import FinishedGeneration, Publisher, Reservation, Store, seal_inline_payload
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots, Retention
from rolloutdb.store.restore.choice import select_and_restore

from rolloutdb.store import segments_dir_of

ROOT = Path(__file__).resolve().parents[1]
C_CALL = object()  # a stack entry: C code (a builtin) running
GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
PACKAGE = "rolloutdb.store"
CFG, DATA, FOREST = "trace-cfg", "trace-data", {"enabled": False}
RUN = dict(config_fingerprint=CFG, dataset_fingerprint=DATA, forest_training=FOREST)


def floors() -> dict[str, int]:
    """Floor height per layer: one above the highest floor it may import."""
    spec = importlib.util.spec_from_file_location("_import_edges", ROOT / "tests" / "test_import_edges.py")
    edges = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edges)
    height: dict[str, int] = {}

    def of(layer: str) -> int:
        if layer not in height:
            below = [of(x) for x in edges.ALLOWED[layer] if x != layer]
            height[layer] = 1 + max(below, default=0)
        return height[layer]

    for layer in edges.ALLOWED:
        of(layer)
    height["facade"] = 1 + max(height.values())
    return height


def layer_of(module: str) -> str:
    if module == PACKAGE:
        return "facade"
    first = module[len(PACKAGE) + 1:].split(".")[0]
    return "foundation" if first in ("errors", "faults", "fsio") else first


def short(module: str) -> str:
    return module[len(PACKAGE) + 1:].replace(".", "/") + ".py" if module != PACKAGE else "store/__init__.py"


# --------------------------------------------------------------------------- the run


def gen(reward: float) -> FinishedGeneration:
    return FinishedGeneration([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], reward, [(0, 4)])


def build(root: Path) -> tuple[Path, Path]:
    """A run with two anchors and two snapshots, payload in segments. Returns (checkpoint
    directory, live store path)."""
    live, ckpt = root / "run" / "rollout_state.sqlite", root / "run" / "checkpoints"
    store = Store.create(live, ledger_dispatch=True, replay_capacity=16, **RUN)
    store.segments_dir = segments_dir_of(ckpt)
    pub = Publisher(ckpt, retention=Retention(KeepNewestSnapshots(10)))  # both anchors stay
    pub.publish_trainer_checkpoint(None, lambda d: (d / "weights.bin").write_bytes(b"w0"))

    def groups(first: int, n: int, step: int) -> list[int]:
        ids = store.reserve([Reservation(s, 0, 100 + s) for s in range(first, first + n)], num_generations=2,
                            target_step=step)
        for g in ids:
            for a in store.dispatch([g], policy_version=step - 1):
                store.finish(a, gen(float(a % 3)))
        return ids

    def snap(anchor: str) -> None:
        with pub.lock:
            seal_inline_payload(store, ckpt)
        pub.publish_rollout_snapshot(anchor, lambda p: store.capture(p), config_text="algorithm: {}\n")

    first = groups(0, 2, 1)
    store.seal(first)
    store.enter_replay(first)
    snap("bootstrap")
    store.mark_trained(first, step=1)
    pub.publish_trainer_checkpoint(1, lambda d: (d / "weights.bin").write_bytes(b"w1"))
    sealed = groups(2, 2, 2)
    store.seal(sealed[:1])
    store.enter_replay(sealed[:1])
    running = store.reserve([Reservation(4, 0, 104)], num_generations=2, target_step=2)
    (a0, _a1) = store.dispatch(running, policy_version=1)
    store.finish(a0, gen(1.0))
    with store.atomic() as tx:
        from rolloutdb.store import pools
        pools.advance_cursor(tx, 5, 0)
    snap("step_1")
    store.close()
    pub.close()
    return ckpt, live


def resume(ckpt: Path, live: Path):
    return select_and_restore(ckpt, live, resume="latest", run_id=None, before_restore=lambda selection: None,
                              groups_per_step=2, ledger_dispatch=True, **RUN)


# --------------------------------------------------------------------------- the trace


class Trace:
    """Per thread: a stack of the store module each frame counts as. The main thread's
    module changes form the walk; reads are counted on every thread."""

    READERS = {
        ("checkpoints.manifest", "read_manifest"): "directory",
        ("sqlite.revision", "file_revision"): "conn",
        ("live.payload", "sample_references"): "conn",
        ("live.payload", "referenced_segments"): "conn",
        ("checkpoints.layout", "scan"): "checkpoint_dir",
    }
    # What a restore asks the sqlite floor about the snapshot file's revision.
    REVISION = {("sqlite.revision", n) for n in ("file_revision", "known_revisions", "head_revision", "classify_revision")} \
        | {("sqlite.identity", n) for n in ("identify", "check_schema", "read_revision")}
    LOCATION = {"segments_dir_of", "segment_file_name"}

    def __init__(self, paths: dict[str, Path]):
        self.paths = {k: str(v) for k, v in paths.items()}
        self.main = threading.get_ident()
        self.stacks: dict[int, list] = collections.defaultdict(list)
        self.walk: list[tuple[str, str]] = []  # (module, "call" | "return")
        self.entered_before: set[str] = set()
        self.active: collections.Counter[str] = collections.Counter()
        self.asked_again: collections.Counter[str] = collections.Counter()
        self.asked_by: collections.Counter[tuple[str, str]] = collections.Counter()
        self.reads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.location_asks: collections.Counter[tuple[str, str]] = collections.Counter()
        self.revision_asks: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def where(self, value) -> str:
        """Which file or directory a reader was given, in words."""
        if isinstance(value, sqlite3.Connection):
            try:
                value = value.execute("PRAGMA database_list").fetchone()[2]
            except sqlite3.Error:
                return "?"
        elif hasattr(value, "exec_driver_sql"):  # a SQLAlchemy connection
            try:
                value = value.exec_driver_sql("PRAGMA database_list").fetchone()[2]
            except Exception:  # noqa: BLE001 - a name for a report, nothing more
                return "?"
        text = str(value)
        for name, path in sorted(self.paths.items(), key=lambda kv: -len(kv[1])):
            if text.startswith(path):
                return name + text[len(path):]
        if ".restore" in text:
            return "the restore copy"
        return text

    def profile(self, frame, event, arg) -> None:
        tid = threading.get_ident()
        stack = self.stacks[tid]  # entries: C_CALL, or (module the frame counts as, counted in the walk)
        if event == "c_call":
            stack.append(C_CALL)
            return
        if event in ("c_return", "c_exception"):
            if stack and stack[-1] is C_CALL:
                stack.pop()
            return
        if event not in ("call", "return"):
            return
        main = tid == self.main
        if event == "call":
            caller = next((e[0] for e in reversed(stack) if e is not C_CALL), None)
            name = frame.f_globals.get("__name__", "")
            inside = name == PACKAGE or name.startswith(PACKAGE + ".")
            if inside:
                self.count(name, frame, caller)
            if stack and stack[-1] is C_CALL and not frame.f_code.co_flags & GENERATOR:
                # A callback from C (SQLite's authorizer, a sort key): part of the
                # caller's step, not a step of the walk.
                stack.append((caller, False))
                return
            current = name if inside else caller
            stack.append((current, True))
            if main and current is not None:
                if current != caller:
                    if current not in self.active and current in self.entered_before:
                        self.asked_again[current] += 1
                        if caller is not None:
                            self.asked_by[(caller, current)] += 1
                    self.entered_before.add(current)
                    self.walk.append((current, "call"))
                self.active[current] += 1
            return
        while stack and stack[-1] is C_CALL:  # a C call left by an exception
            stack.pop()
        if not stack:
            return
        left, counted = stack.pop()
        if not (main and counted and left is not None):
            return
        self.active[left] -= 1
        if self.active[left] == 0:
            del self.active[left]
        back = next((e[0] for e in reversed(stack) if e is not C_CALL), None)
        if back is not None and back != left:
            self.walk.append((back, "return"))

    def count(self, module: str, frame, caller: str | None) -> None:
        rel = module[len(PACKAGE) + 1:]
        arg = self.READERS.get((rel, frame.f_code.co_name))
        if arg is not None:
            with self.lock:
                self.reads[(f"{short(module)}:{frame.f_code.co_name}", self.where(frame.f_locals.get(arg)))] += 1
        if (rel, frame.f_code.co_name) in self.REVISION and caller is not None and layer_of(caller) == "restore":
            with self.lock:
                self.revision_asks[f"{short(module)}:{frame.f_code.co_name}"] += 1
        if rel == "live.payload" and frame.f_code.co_name in self.LOCATION and caller is not None:
            with self.lock:
                self.location_asks[(short(caller), f"{short(module)}:{frame.f_code.co_name}")] += 1

    def run(self, fn):
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


LOCATION_NAMES = {"SEGMENTS_DIR", "segments_dir_of", "segment_file_name"}


def location_imports() -> list[str]:
    """The names of where segments live (directory, file names) that checkpoints/segments.py
    imports from live/payload.py (read from its source: a constant cannot be traced)."""
    tree = ast.parse((ROOT / "store" / "checkpoints" / "segments.py").read_text())
    return sorted(a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").endswith("live.payload") for a in node.names if a.name in LOCATION_NAMES)


def report(trace: Trace, plan, damaged_newest: bool, sequence: bool) -> dict[str, int]:
    height = floors()
    modules = [m for m, _ in trace.walk]
    entered = sorted(set(modules))
    climbs = sum(1 for a, b in zip(modules, modules[1:]) if height[layer_of(b)] > height[layer_of(a)])
    seen: set[str] = set()
    returns_to_left = 0
    for m in modules:
        if m in seen:
            returns_to_left += 1
        seen.add(m)
    pairs = collections.Counter(frozenset((a, b)) for a, b in zip(modules, modules[1:]))
    numbers = {"modules entered": len(entered), "walk steps": max(0, len(modules) - 1), "climbs back up": climbs,
               "returns to a module already left": returns_to_left,
               "asked again": sum(trace.asked_again.values()),
               "asked again by the restore floor": sum(n for (a, _), n in trace.asked_by.items()
                                                       if layer_of(a) == "restore")}
    print("resume walk: select_and_restore(CHECKPOINT_DIR, resume='latest'), main thread")
    for k, v in numbers.items():
        print(f"  {k:56s} {v}")
    print("  modules:", ", ".join(short(m) for m in entered))
    if trace.asked_again:
        print("  asked again (module: times; by whom):")
        for m, n in trace.asked_again.most_common():
            who = ", ".join(f"{short(a)} x{k}" for (a, b), k in trace.asked_by.most_common() if b == m)
            print(f"    {short(m)}: {n} ({who})")
    print("  pairs that alternate most (walk steps between the two):")
    for pair, n in pairs.most_common(5):
        a, b = sorted(pair)
        print(f"    {short(a)} <-> {short(b)}: {n}")
    print("reads (every thread):")
    for (fn, where), n in sorted(trace.reads.items()):
        print(f"  {fn} of {where}: {n}")
    manifest_reads = collections.Counter()
    for (fn, where), n in trace.reads.items():
        if fn.endswith("read_manifest"):
            manifest_reads[where] += n
    revision = sum(n for (fn, where), n in trace.reads.items()
                   if fn.endswith("file_revision") and "live store" not in where)
    segment_lists = sum(n for (fn, where), n in trace.reads.items()
                        if fn.endswith(("sample_references", "referenced_segments")))
    numbers.update({"manifest reads (all directories)": sum(manifest_reads.values()),
                    "manifest reads (the restored snapshot)": sum(
                        n for w, n in manifest_reads.items() if w.endswith(plan.snapshot_dir.name)
                        and w.startswith("older" if damaged_newest else "snapshot")),
                    "snapshot file revision reads": revision, "segment list reads": segment_lists,
                    "revision look-ups by restore (sqlite/revision.py, identity.py)": sum(trace.revision_asks.values()),
                    "segments.py asking live/payload.py where segments live (calls)": sum(
                        n for (c, _), n in trace.location_asks.items() if c == "checkpoints/segments.py"),
                    "segments.py importing where segments live from live/payload.py": len(location_imports())})
    for k in list(numbers)[6:]:
        print(f"  {k:56s} {numbers[k]}")
    if trace.revision_asks:
        print("  revision look-ups:", ", ".join(f"{f} x{n}" for f, n in sorted(trace.revision_asks.items())))
    if location_imports():
        print("  segments.py imports from live/payload.py:", ", ".join(location_imports()))
    if trace.location_asks:
        print("  location helpers called:", ", ".join(f"{c} -> {f} x{n}" for (c, f), n in trace.location_asks.items()))
    if sequence:
        print("walk:")
        for m, how in trace.walk:
            print(f"  {'->' if how == 'call' else '<-'} {short(m)}")
    return numbers


def measure(damaged_newest: bool = False, sequence: bool = False) -> dict[str, int]:
    """Build the run, resume it once untraced and once traced; print the report and
    return its numbers (tests/test_restore_walk.py holds the restore to them)."""
    with tempfile.TemporaryDirectory(prefix="rolloutdb-walk-") as tmp:
        base = Path(tmp) / "base"
        ckpt, live = build(base)
        warm = Path(tmp) / "warm"
        shutil.copytree(base, warm)
        resume(warm / ckpt.relative_to(base), warm / live.relative_to(base))
        traced = Path(tmp) / "traced"
        shutil.copytree(base, traced)
        t_ckpt, t_live = traced / ckpt.relative_to(base), traced / live.relative_to(base)
        if damaged_newest:
            (t_ckpt / "step_1" / "rollout_snapshots" / "snapshot_2" / "config.yaml").write_bytes(b"changed\n")
        trace = Trace({"snapshot": t_ckpt / "step_1" / "rollout_snapshots",
                       "older snapshot": t_ckpt / "bootstrap" / "rollout_snapshots", "the live store": t_live,
                       "checkpoint dir": t_ckpt})
        plan = trace.run(lambda: resume(t_ckpt, t_live))
        print(f"restored {plan.snapshot_dir.relative_to(t_ckpt)} (anchor {plan.anchor}, revision {plan.schema_revision}): "
              f"{len(plan.redispatch)} to redispatch, {len(plan.to_finalize)} to finalize")
        return report(trace, plan, damaged_newest, sequence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence", action="store_true", help="print the walk, one module per line")
    parser.add_argument("--damaged-newest", action="store_true",
                        help="change a file of the newest snapshot: the restore refuses it and falls back to the "
                             "older one, which is chosen with verification (the verify path's reads)")
    args = parser.parse_args()
    measure(args.damaged_newest, args.sequence)


if __name__ == "__main__":
    main()
