"""Before/after in one run: a store benchmark from another git revision next to the working
tree's, alternating, so that a speed-up is judged by a ratio measured side by side under
the same load from other users of a shared machine.

The revision's whole tree is extracted (`git archive`) into a temporary folder and laid out
as an importable `rolloutdb` package (the package-dir mapping of pyproject.toml, as links);
each run of the working tree's benchmark script is a subprocess with that folder first on
PYTHONPATH (it wins over the editable install of the working tree, whose finder comes
after the path finder). Runs alternate
rev, tree, tree, rev, ... and each writes its figures as JSON (`--json`); the report prints
the median of each chosen figure and the ratio tree / rev.

    python bench/bench_ab.py --rev d679d79 --reps 3 bench_transitions.py --blocks 2
    python bench/bench_ab.py --rev d679d79 bench_group_commit.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import io
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (label, path in the JSON, higher is better)
FIGURES = {
    "bench_transitions.py": [
        ("batched group transitions/s", ("batched", "group_transitions_per_s"), True),
        ("batched, less CPU wait", ("batched", "cpu_free_group_transitions_per_s"), True),
        ("single p50 ms", ("single", "store", "p50_ms"), False),
        ("single p99 ms", ("single", "store", "p99_ms"), False),
        ("single p99 ms, less CPU wait", ("single", "store_cpu_free", "p99_ms"), False),
        ("raw floor single p50 ms", ("single", "raw", "p50_ms"), False),
        *((f"batched ms per {step} tx", ("batched", "ms_per_tx_by_step", step), False)
          for step in ("reserve", "dispatch", "finish", "seal", "enter_replay", "trained")),
        *((f"single p50 ms, {step}", ("single", "store_by_step", step, "p50_ms"), False)
          for step in ("reserve", "dispatch", "finish", "seal", "enter_replay", "trained")),
    ],
    "bench_prefix_cut.py": [  # run with --calls 256 (the figures name that size)
        ("whole read: hold p50 ms", ("by", "256_whole", "hold_ms_p50"), False),
        # The default 60 cuts are too few for a p99: the maximum is what a run measures.
        ("whole read: hold max ms", ("by", "256_whole", "hold", "max_ms"), False),
        ("whole read: hold late/early", ("by", "256_whole", "hold_growth"), False),
        ("since read: hold max ms", ("by", "256_since", "hold", "max_ms"), False),
        ("since read: cut wall p50 ms", ("by", "256_since", "cut_wall", "p50_ms"), False),
        ("since read: bytes per cut, late", ("by", "256_since", "late", "bytes_per_cut_mean"), False),
        ("since read: bytes late/early", ("by", "256_since", "bytes_growth"), False),
    ],
    "bench_restore.py": [  # warm cache; in_flight: the restore's work on the running attempts
        ("restore s", ("summary", "warm", "median_s", "restore"), False),
        ("read+blake3 s", ("summary", "warm", "median_s", "read+blake3"), False),
        ("restore / read+blake3", ("summary", "warm", "ratios", "restore/read+blake3"), False),
        ("schema phase s", ("restore_phases_s", "schema"), False),
        ("ledger phase s", ("restore_phases_s", "ledger"), False),
        ("in_flight s (in the ledger phase)", ("restore_phases_s", "in_flight"), False),
        # the pump's restart of every restored group afterwards (the bench of the working tree times both revisions)
        ("restart of the restored groups s", ("restart", "median_s"), False),
        ("restore + restart s", ("restart", "restore_and_restart_median_s"), False),
    ],
    "bench_recovery_scale.py": [  # by running calls: 256 and 1024 the full run, 32 --quick
        *((f"{n}: {label}", ("by", n, key), higher) for n in ("32", "256", "1024") for label, key, higher in (
            ("skipped_commit share", "skipped_commit_share", False),
            ("hold p99 ms", "hold_ms_p99", False),
            ("hold max ms", "hold_ms_max", False),
            ("commit lock per cut p99 ms", "commit_lock_cut_ms_p99", False),
            ("commit lock per cut max ms", "commit_lock_cut_ms_max", False),
            ("bytes per cut / new tokens' B", "bytes_over_new_token_bytes_median", False),
            ("lost generation-s per crash", "lost_generation_s_mean", False),
            ("lost tokens per crash", "lost_tokens_mean", False),
            ("kept / decoded by the cut", "kept_of_by_cut", True),
        )),
    ],
    "bench_turn_saves.py": [
        ("early turn save ms (p50)", ("early_ms_p50",), False),
        ("late turn save ms (p50)", ("late_ms_p50",), False),
        ("late / early time", ("late_over_early_ms",), False),
        ("late bytes per episode save", ("late_bytes_per_save",), False),
        ("late / early bytes", ("late_over_early_bytes",), False),
        ("bytes written / transcript bytes", ("bytes_written_over_transcript",), False),
    ],
    "bench_bounded_store.py": [  # run with --steps 30 3000 --no-baseline
        ("live store largest / smallest", ("live_growth",), False),
        ("snapshot largest / smallest", ("snapshot_growth",), False),
        ("settled_steps rows, largest", ("largest", "settled_rows"), False),
        ("copy check ms, largest", ("largest", "check_ms"), False),
        ("copy check largest / smallest", ("check_growth",), False),
        ("audit ms, largest", ("largest", "audit_ms"), False),
        ("audit largest / smallest", ("audit_growth",), False),
        ("settle p50 ms", ("settle_ms_p50",), False),
        ("settle that folds p50 ms", ("fold_settle_ms_p50",), False),
    ],
    "bench_snapshot_segments.py": [
        ("snapshot s", ("summary", "segments", "wall_s"), False),
        ("seal s", ("summary", "segments", "seal_s"), False),
        *((f"  {part}", ("summary", "segments", f"seal_{part}_s"), False) for part in ("read", "write", "reference", "vacuum")),
        ("publish s", ("summary", "segments", "phases", "publish_publish"), False),
        ("  check of the copy", ("summary", "segments", "phases", "publish_check_copy"), False),
        ("  fsync + hash of the files", ("summary", "segments", "phases", "publish_hash_fsync_files"), False),
        ("live store write bytes", ("summary", "segments", "live_write_bytes"), False),
        ("snapshot / cp time", ("summary", "time_goal", "ratio_to_cp"), False),
        ("bytes per snapshot", ("summary", "segments", "bytes"), False),
        ("metadata file bytes", ("summary", "segments", "store_file_bytes"), False),
        ("  of it written", ("summary", "bytes_goal", "metadata_written_bytes"), False),
        ("capture s", ("summary", "segments", "phases", "capture_total"), False),
        ("bytes / new payload", ("summary", "bytes_goal", "ratio_to_new_payload"), False),
        ("interval disk write bytes", ("summary", "segments", "interval_disk_write_bytes"), False),
    ],
    "bench_trace_analysis.py": [  # run with --events 2000000 --skip-pandas
        ("duckdb s (median)", ("median_s", "duckdb"), False),
        ("sqlite s (median)", ("median_s", "sqlite"), False),
        ("duckdb vs sqlite", ("ratios", "sqlite", "median"), True),
        ("upgrade to head s", ("upgrade_s",), False),
    ],
    "bench_group_commit.py": [
        ("batched calls/s", ("median", "batched", "calls_per_s"), True),
        ("batched window p99 ms", ("median", "batched", "window_p99_ms"), False),
        ("batched commit p99 ms", ("median", "batched", "commit_p99_ms"), False),
        ("batched store share", ("median", "batched", "store_share"), False),
        ("per call calls/s", ("median", "per call", "calls_per_s"), True),
        ("batched pump CPU us/call", ("median", "batched", "pump_cpu_us_per_call"), False),
    ],
}


def tree_at(rev: str, where: Path) -> Path:
    """Extract `rev` into `where/src` and link it up as `where/pkg/rolloutdb/...`; returns
    the folder to put on PYTHONPATH."""
    blob = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    src = where / "src"
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(src, filter="data")
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = where / "pkg"
    # Parents before children: a child link lands inside its parent's linked folder
    # otherwise, so each package becomes its own real folder of links.
    for name in sorted(mapping, key=lambda n: n.count(".")):
        target = pkg.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (src / mapping[name]).iterdir():
            link = target / entry.name
            if not link.exists() and not (entry.is_dir() and any(k.startswith(f"{name}.{entry.name}") for k in mapping)):
                link.symlink_to(entry)
    return pkg


def median_of(runs: list[dict], path: tuple[str, ...]) -> float | None:
    """The median of a figure over runs; None where a run did not measure it (a case
    left out, no stop, a figure the other revision's code does not time) or measured
    None (a p99 from under 100 samples: benchlib stores None)."""
    try:
        return statistics.median(dig(r, path) for r in runs)
    except (KeyError, TypeError):
        return None


def dig(d: dict, path: tuple[str, ...]):
    for k in path:
        d = d[k]
    return d


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the 'before' git revision")
    p.add_argument("--after", default=None, help="the 'after' git revision (default: the working tree)")
    p.add_argument("--reps", type=int, default=3, help="runs of each version")
    p.add_argument("bench", choices=sorted(FIGURES), help="the benchmark script (in bench/)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    a = p.parse_args(argv)
    runs: dict[str, list[dict]] = {a.rev: [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        before = tree_at(a.rev, Path(tmp))
        # The benchmark script is always the working tree's (the instrument); only the
        # store and controller code it imports differs.
        paths = {a.rev: str(before), "tree": str(tree_at(a.after, Path(tmp) / "after")) if a.after else None}
        # A wrong path would silently measure the working tree twice: check what each imports.
        for version, pkg in paths.items():
            env = dict(os.environ, PYTHONPATH=pkg) if pkg else dict(os.environ)
            imported = subprocess.run([sys.executable, "-c", "import rolloutdb.store.live.ledger as m; print(m.__file__)"],
                                      env=env, cwd=tmp, capture_output=True, text=True).stdout.strip()
            expected = Path(pkg) if pkg else REPO  # (a link under pkg/: not resolved)
            if not imported or not Path(imported).is_relative_to(expected):
                sys.exit(f"error: the {version} run would import {imported or 'nothing'}, not the code under {expected}")
        for rep in range(a.reps):
            for version in ((a.rev, "tree") if rep % 2 == 0 else ("tree", a.rev)):
                pkg = paths[version]
                env = dict(os.environ)
                if pkg:
                    env["PYTHONPATH"] = pkg
                out = Path(tmp) / f"{version}-{rep}.json"
                script = REPO / "bench" / a.bench
                proc = subprocess.run([sys.executable, str(script), *a.args, "--json", str(out)], env=env, cwd=tmp,
                                      capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"error: {version} run failed:\n{proc.stderr[-2000:]}")
                runs[version].append(json.loads(out.read_text()))
                print(f"  run {rep} {version} done", flush=True)
    print(f"{a.bench} {' '.join(a.args)}: median of {a.reps} alternating runs each, before = {a.rev}, "
          f"after = {a.after or 'working tree'}")
    print(f"  {'':34s}{'before':>12s}{'after':>12s}   after vs before")
    for label, path, higher in FIGURES[a.bench]:
        b, t = (median_of(runs[v], path) for v in (a.rev, "tree"))
        cells = "".join(f"{_cell(v):>12s}" for v in (b, t))
        if b is None or t is None or not b or not t:  # one side did not measure it, or a 0 share: no ratio
            print(f"  {label:34s}{cells}   -")
            continue
        gain = (t / b) if higher else (b / t)
        print(f"  {label:34s}{cells}   {gain:.2f}x {'better' if gain >= 1 else 'worse'}")


def _cell(value: float | None) -> str:
    """A figure in its 12-character column: a byte count past a million in millions (M),
    so the columns stay apart."""
    if value is None:
        return "-"
    return f"{value / 1e6:.2f}M" if abs(value) >= 1e6 else f"{value:.3f}"


if __name__ == "__main__":
    main()
