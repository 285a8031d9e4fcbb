"""The store benchmarks still run: each script in its tiniest mode, as a subprocess, the
way BENCHMARKS.md tells a reader to run it. No timing is asserted, only that the run
completes, reports every figure it promises and leaves the store sound."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def _run_bench(script: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick", "--dir", str(tmp_path), "--json", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The temporary store is gone; only the figures file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]
    return json.loads(out.read_text())


def test_the_transitions_benchmark_runs_and_reports_store_next_to_raw_sqlite(tmp_path):
    r = _run_bench("bench_transitions.py", tmp_path)
    assert r["invariants_ok"] is True
    assert r["batched"]["group_transitions_per_s"] > 0
    assert r["batched"]["raw_single_row_updates_per_s"] > 0
    assert r["batched"]["ratio_store_group_vs_raw"] > 0
    single = r["single"]
    assert single["store"]["n"] == single["raw"]["n"] > 0
    assert {"p50_ms", "p99_ms", "max_ms"} <= single["store"].keys()
    assert set(single["store_by_step"]) == {"reserve", "dispatch", "finish", "seal", "publish", "trained"}


def test_the_snapshot_latency_benchmark_runs_both_captures_beside_a_live_writer(tmp_path):
    r = _run_bench("bench_snapshot_latency.py", tmp_path)
    (size,) = r["sizes"].values()
    phases = size["phases"]
    assert set(phases) == {"no snapshot", "ours", "held"}
    for name in ("ours", "held"):
        assert len(phases[name]["capture_s"]) == r["args"]["snapshots"]
        assert phases[name]["n"] > 0, f"the writer committed nothing during the {name} captures"
        assert {"p50_ms", "p99_ms", "max_ms", "longest_gap_ms", "wal_max_mb"} <= phases[name].keys()
