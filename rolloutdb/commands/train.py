"""`rolloutdb train`: run asynchronous GRPO from a config file."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


AUTO = "auto"  # --resume auto: continue the run in --run-dir if it holds one, else start it


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="run asynchronous GRPO from a config file",
        description=(
            "Run asynchronous GRPO: a rollout pump beside a train pump, all in-flight state "
            "in SQLite. The run directory holds the live store, checkpoints, logs and plots."
        ),
        epilog="example: rolloutdb train --config examples/quickstart.yaml algorithm.total_steps=10. "
        "SIGTERM or Ctrl-C stops gracefully within run.shutdown_grace_s (no new work, a final rollout snapshot), "
        "exits 143 or 130 and prints the command that continues the run; a second signal exits at once.",
    )
    p.add_argument("--config", required=True, type=Path, help="YAML config file (see docs/config.md)")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<config name>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="latest|auto|SNAPSHOT_DIR",
        help="continue the run in --run-dir from its newest usable rollout snapshot (or the one given); auto: "
        "continue it if --run-dir holds a run, else start it (for a requeued job script; a run that cannot be "
        "resumed is refused, never started over)",
    )
    p.add_argument(
        "--start-over",
        action="store_true",
        help="train the run in --run-dir again from step 0: its store, checkpoints, config and logs are moved "
        "into RUN_DIR/discarded/<time>/ first (a --resume that finds nothing to restore says when)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. algorithm.total_steps=5")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rolloutdb.config import ConfigError, load_config, snapshot_interval_warning
    from rolloutdb.controller import fault_points  # noqa: F401 - the controller's kill points
    from rolloutdb.controller.run.run_dir import RunDir
    from rolloutdb.store import faults

    faults.check_armed()  # a ROLLOUTDB_FAULT point nobody registered would never fire

    if args.resume and "=" in args.resume and not Path(args.resume).is_dir():
        # `--resume KEY=VALUE ...`: the optional value swallowed the first override.
        args.overrides.insert(0, args.resume)
        args.resume = "latest"
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    from rolloutdb.controller.run.metrics_backends import check_backends
    from rolloutdb.controller.tasks.plugins import check_config

    # Bad import paths, dataset files (a prompt too long for the policy's context too), a
    # reward that cannot score the first record, a model directory transformers cannot
    # build and missing backend packages refuse the run here, before the lock file or the
    # run directory exists.
    check_backends(config.logging.backends)
    plugins = check_config(config)
    run_dir = args.run_dir or Path("runs") / config.run.name
    resume = args.resume or config.checkpointing.resume or ("latest" if args.start_over else None)
    auto = resume == AUTO
    if auto and args.start_over:
        raise ValueError("--resume auto continues the run and --start-over trains it again from step 0; pass one")
    dirs = RunDir(run_dir)
    # The lock first, so that two processes never both decide; then every check that can
    # refuse, before the controller (and torch) is even imported. A refusal puts the
    # lock file back as it was: a refused command changes nothing on disk.
    lock = dirs.lock(create=not resume or auto)
    try:
        if auto:
            resume = "latest" if dirs.resume_or_start() else None
        dirs.check_for(resume=bool(resume))
        plan = None
        if resume:
            from rolloutdb.controller.recovery.resume import check_packing, check_rewind, plan_resume

            plan = plan_resume(dirs, resume, start_over=args.start_over)
            check_packing(config, plan.selection.snapshot.path if plan.selection else None)
            check_rewind(config, dirs, plan)
    except BaseException:
        lock.undo()
        raise
    from rolloutdb.commands._graceful_stop import GracefulStop
    from rolloutdb.controller.job.controller import Controller

    found = " (--resume auto: a run is here)" if auto and resume else " (--resume auto: no run here yet)" if auto else ""
    print(f"rolloutdb: {'resuming' if resume else 'training'} {config.run.name} in {run_dir}{found}", file=sys.stderr)
    warning = snapshot_interval_warning(config)
    if warning is not None:
        print(f"rolloutdb: warning: {warning}", file=sys.stderr)
    controller = Controller(config, run_dir, resume=resume, start_over=args.start_over, lock=lock, resume_plan=plan,
                            plugins=plugins)
    stop = GracefulStop(config.run.shutdown_grace_s, continue_command(args, run_dir),
                        request=controller.request_shutdown, saved=controller.saved_so_far)
    stop.install()
    try:
        summary = controller.run()
    finally:
        stop.uninstall()
    if summary.plot is not None:
        print(f"reward curve: {summary.plot}", file=sys.stderr)
    print(summary.line)
    if summary.stopped is None:
        return 0
    done = summary.stopped
    print(f"rolloutdb: stopped by {done.reason} at step {done.step}, {done.stop_s:.1f} s after it; saved: {done.saved}",
          file=sys.stderr)
    print(f"rolloutdb: to continue: {stop.continue_with}", file=sys.stderr)
    return stop.exit_code


def continue_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run from wherever it stops: absolute paths (a job
    script may run it from elsewhere), the same overrides (the run's fingerprint holds
    them), and `--resume auto`, which also covers a stop before the run's store existed."""
    words = ["rolloutdb", "train", "--config", str(Path(args.config).absolute()), "--run-dir",
             str(Path(run_dir).absolute()), "--resume", AUTO, *args.overrides]
    return shlex.join(words)
