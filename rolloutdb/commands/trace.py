"""`rolloutdb trace RUN_DIR [RUN_DIR ...] [--baseline RUN_DIR] [--out DIR]`: what the stops
of a run cost and kept, and the batch age of every train step, from the run's trace.

The figures are the named SQL of `rolloutdb.store.trace.queries`, run by DuckDB over the
trace files attached read-only (`rolloutdb.store.trace.analysis`). Each result is printed,
written as CSV and, all together, as JSON, and plotted (matplotlib's Agg canvas, no
display needed). Every file is written beside its target and renamed into place.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutdb.commands._arguments import path_argument
from rolloutdb.commands._tables import format_table
from rolloutdb.timefmt import iso_utc

if TYPE_CHECKING:
    from rolloutdb.store import Table

DESCRIPTION = """\
Report what the stops of a run cost and kept, and the batch age of its train steps, from its trace
(RUN_DIR/logs/rollout_trace.sqlite, recorded with trace.enabled: true).

Pass the run directory (or its logs/ directory). Several RUN_DIRs are read as one job,
for a job resumed into a new directory. --baseline names a run of the same job that never
stopped; lost progress is measured against it. Printed, and written into --out
(default RUN_DIR/plots) as CSV, trace_report.json and PNG plots:

  what a stop kept  per stop: the attempts running at it, the tokens they had decoded,
                    the tokens the resumed run kept (committed turns) and the tokens
                    it generates again
  thrown-away time  per stop: attempts abandoned with reason 'restart', from their last
                    dispatch or committed turn to the restored snapshot's cut time
  lost progress     per stop: how much later the groups running at the stop were sealed
                    than the same prompts in the baseline (downtime removed)
  batch age         per train step: token-weighted policy updates between generating a
                    token and training on it, beside the value the trainer logged
                    (printed as one summary line; --steps prints every step)
  fallbacks         per stop and reason (prefix level): the calls running at the
                    restored cut that it could not save, which restart their turn

docs/trace.md describes the events and the figures.
"""

TABLES = (
    ("kept_per_stop", "What each stop kept"),
    ("kept_by_attempt", "What each stop kept, by attempt"),
    ("thrown_away_per_stop", "Thrown-away time per stop"),
    ("thrown_away_by_attempt", "Thrown-away time by attempt"),
    ("lost_progress_per_stop", "Lost progress per stop"),
    ("lost_progress_by_group", "Lost progress by group"),
    ("batch_age_per_step", "Batch age per train step"),
    ("fallbacks_per_stop", "Calls the restored cut could not save, per stop and reason"),
)
# Printed by default: one row per stop. The per-step batch age with --steps (a line of
# summary without); every table is in the CSV files and the JSON either way.
PRINTED = {"kept_per_stop", "thrown_away_per_stop", "lost_progress_per_stop", "fallbacks_per_stop"}
AGREE_TOLERANCE = 1e-9
# Columns holding a point in time (epoch seconds in the trace): ISO-8601 UTC in the text,
# the CSVs and the JSON alike (milliseconds; the trace file keeps full precision for a
# join). Durations and effective times (seconds since the job started) stay numbers.
TIME_COLUMNS = frozenset({"cut_time", "dispatched_at", "committed_at", "t"})


def _shown(column: str, value):
    return iso_utc(value) if column in TIME_COLUMNS and value is not None else value


def _shown_rows(table: Table) -> list[list]:
    """The table's rows as every report shows them (points in time as ISO-8601 UTC)."""
    return [[_shown(c, v) for c, v in zip(table.columns, row)] for row in table.rows]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="what each stop cost and the batch age per step, from a run's trace (DuckDB)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=path_argument, help="run directory or its logs/ directory")
    parser.add_argument("--baseline", metavar="RUN_DIR", type=path_argument, help="a run of the same job that never stopped")
    parser.add_argument("--json", action="store_true",
                        help="print the report document (what trace_report.json holds) instead of text")
    parser.add_argument("--steps", action="store_true",
                        help="also print the batch age of every train step (by default one summary line)")
    parser.add_argument("--out", metavar="DIR", type=path_argument, help="where to write CSV, JSON and plots (default RUN_DIR/plots)")
    parser.set_defaults(func=run)


def _run_dir_of(trace: Path) -> Path:
    return trace.parent.parent if trace.parent.name == "logs" else trace.parent


def run(args: argparse.Namespace) -> int:
    from rolloutdb.commands._stop_signals import stop_signal_received
    from rolloutdb.store import TraceAnalysis, TraceError, trace_file_for

    traces = [trace_file_for(d) for d in args.run_dirs]
    baseline = [trace_file_for(args.baseline)] if args.baseline else []
    out = Path(args.out) if args.out else _run_dir_of(traces[0]) / "plots"
    if out.exists() and not out.is_dir():
        raise TraceError(f"{out}: is a file; pass a directory with --out")
    with TraceAnalysis(traces, baseline, stop=stop_signal_received) as analysis:
        report = {name: analysis.query(name) for name, _ in TABLES}
    document = _document(report, traces, baseline)
    # The files first, then stdout: a reader that leaves early (`| head -1`) must not
    # cost the report its files.
    try:
        written = _write_outputs(out, report, document, bool(baseline))
    except OSError as e:
        raise TraceError(f"{out}: cannot write the report there ({e.strerror or e}); pass another --out") from e
    if args.json:
        print(json.dumps(document, indent=1))
        return 0
    print(f"trace: {', '.join(map(str, traces))}" + (f"; baseline: {baseline[0]}" if baseline else ""))
    for name, title in TABLES:
        if name not in PRINTED and not (args.steps and name == "batch_age_per_step"):
            continue
        print(f"\n{title}")
        if name.startswith("lost_progress") and not baseline:
            print("  (pass --baseline RUN_DIR, a run that never stopped, to measure lost progress)")
        print(_format(report[name]))
    if not args.steps:
        print("\n" + _batch_age_summary(report["batch_age_per_step"]))
    print("\n" + _agreement(report["batch_age_per_step"]))
    print(f"\nwrote {len(written)} files to {out}")
    return 0


# --------------------------------------------------------------------------- text


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, str) and len(value) == 32:
        return value[:8]  # a run id: its first 8 hex digits are enough to tell runs apart
    return str(value)


def _format(table: Table) -> str:
    return format_table(table.columns, _shown_rows(table), cell=_cell)


def _batch_age_summary(batch_age: Table) -> str:
    ages = [r["batch_age"] for r in batch_age.as_dicts() if r["batch_age"] is not None]
    if not ages:
        return "Batch age: no train step with token counts in this trace"
    return (f"Batch age: {len(ages)} train steps, mean {sum(ages) / len(ages):.3f}, min {min(ages):.3f}, "
            f"max {max(ages):.3f} (--steps prints every step)")


def _agreement(batch_age: Table) -> str:
    rows = batch_age.as_dicts()
    logged = [r for r in rows if r["logged_batch_age"] is not None and r["batch_age"] is not None]
    if not logged:
        return "batch age: no logged value to compare with"
    bad = [r for r in logged if abs(r["batch_age"] - r["logged_batch_age"]) > AGREE_TOLERANCE]
    if not bad:
        return f"batch age: recomputed from the trace, equal to the logged value at all {len(logged)} steps"
    steps = ", ".join(str(r["step"]) for r in bad[:10])
    return f"batch age: recomputed value differs from the logged one at {len(bad)} of {len(logged)} steps (steps {steps})"


# --------------------------------------------------------------------------- files


def _csv_bytes(table: Table) -> bytes:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.columns)
    writer.writerows(_shown_rows(table))
    return buf.getvalue().encode()


def _json_safe(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _document(report: dict[str, Table], traces: list[Path], baseline: list[Path]) -> dict:
    """The report as one JSON document: trace_report.json, and stdout with --json."""
    return {
        "traces": [str(p) for p in traces],
        "baseline": [str(p) for p in baseline],
        **{name: [{c: _json_safe(v) for c, v in zip(t.columns, row)} for row in _shown_rows(t)]
           for name, t in report.items()},
    }


def _write_outputs(out: Path, report: dict[str, Table], document: dict, has_baseline: bool) -> list[Path]:
    from rolloutdb.store import write_file_atomic

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, table in report.items():
        written.append(out / f"{name}.csv")
        write_file_atomic(written[-1], _csv_bytes(table))
    written.append(out / "trace_report.json")
    write_file_atomic(written[-1], json.dumps(document, indent=1).encode())
    for filename, plot in (
        ("kept.png", _plot_kept),
        ("thrown_away.png", _plot_thrown_away),
        ("lost_progress.png", _plot_lost_progress),
        ("batch_age.png", _plot_batch_age),
    ):
        written.append(out / filename)
        write_file_atomic(written[-1], _png(plot, report, has_baseline))
    return written


def _png(plot, report: dict[str, Table], has_baseline: bool) -> bytes:
    from matplotlib.figure import Figure  # Agg canvas by default: no display, no pyplot state

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    plot(fig.subplots(), report, has_baseline)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_kept(ax, report, _has_baseline) -> None:
    rows = report["kept_per_stop"].as_dicts()
    ax.set_title("What each stop kept of the attempts running at it")
    if not rows:
        return _empty(ax, "no stops in this trace")
    x = [r["stop_no"] for r in rows]
    width = 0.27
    for offset, column, colour in ((-width, "decoded_tokens", "tab:blue"), (0.0, "kept_tokens", "tab:green"),
                                   (width, "redone_tokens", "tab:red")):
        bars = ax.bar([i + offset for i in x], [r[column] for r in rows], width, color=colour,
                      label=column.replace("_", " "))
        ax.bar_label(bars)
    ax.set_xticks(x)
    ax.set_xlabel("stop")
    ax.set_ylabel("policy tokens")
    ax.legend()


def _plot_thrown_away(ax, report, _has_baseline) -> None:
    rows = report["thrown_away_per_stop"].as_dicts()
    ax.set_title("Thrown-away time per stop (attempts abandoned with reason restart)")
    if not rows:
        return _empty(ax, "no stops in this trace")
    x = [r["stop_no"] for r in rows]
    bars = ax.bar(x, [r["thrown_away_s"] for r in rows], color="tab:red")
    ax.bar_label(bars, labels=[f"{r['attempts']} attempts" for r in rows])
    ax.set_xticks(x)
    ax.set_xlabel("stop")
    ax.set_ylabel("thrown-away time (s, summed over attempts)")


def _plot_lost_progress(ax, report, has_baseline) -> None:
    ax.set_title("Lost progress of the groups running at each stop, vs the baseline")
    if not has_baseline:
        return _empty(ax, "no baseline given (--baseline RUN_DIR)")
    rows = [r for r in report["lost_progress_by_group"].as_dicts() if r["lost_s"] is not None]
    if not rows:
        return _empty(ax, "no group running at a stop was sealed in both runs")
    ax.scatter([r["stop_no"] for r in rows], [r["lost_s"] for r in rows], alpha=0.6, label="group")
    per_stop = [r for r in report["lost_progress_per_stop"].as_dicts() if r["lost_s_mean"] is not None]
    ax.scatter([r["stop_no"] for r in per_stop], [r["lost_s_mean"] for r in per_stop], marker="_", s=400,
               color="black", label="mean")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({r["stop_no"] for r in rows}))
    ax.set_xlabel("stop")
    ax.set_ylabel("sealed later than baseline (s, effective time)")
    ax.legend()


def _plot_batch_age(ax, report, _has_baseline) -> None:
    rows = [r for r in report["batch_age_per_step"].as_dicts() if r["batch_age"] is not None]
    ax.set_title("Batch age per train step")
    if not rows:
        return _empty(ax, "no train step with token counts in this trace")
    for run_no in sorted({r["run_no"] for r in rows}):
        mine = [r for r in rows if r["run_no"] == run_no]
        ax.plot([r["step"] for r in mine], [r["batch_age"] for r in mine], marker="o", label=f"run {run_no} (trace)")
    logged = [r for r in rows if r["logged_batch_age"] is not None]
    if logged:
        ax.scatter([r["step"] for r in logged], [r["logged_batch_age"] for r in logged], marker="x", color="black",
                   label="logged by trainer", zorder=3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("token-weighted policy updates")
    ax.legend()
