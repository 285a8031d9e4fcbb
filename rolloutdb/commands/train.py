"""`rolloutdb train`: run asynchronous GRPO from a config file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="run asynchronous GRPO from a config file",
        description=(
            "Run asynchronous GRPO: a rollout pump beside a train pump, all in-flight state "
            "in SQLite. The run directory holds the live store, checkpoints, logs and plots."
        ),
        epilog="example: rolloutdb train --config examples/quickstart.yaml algorithm.total_steps=10",
    )
    p.add_argument("--config", required=True, type=Path, help="YAML config file (see docs/config.md)")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<config name>)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="latest|SNAPSHOT_DIR",
        help="continue the run in --run-dir from its newest usable rollout snapshot (or the one given)",
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
    dirs = RunDir(run_dir)
    # The lock first, so that two processes never both decide; then every check that can
    # refuse, before the controller (and torch) is even imported. A refusal puts the
    # lock file back as it was: a refused command changes nothing on disk.
    lock = dirs.lock(create=not resume)
    try:
        dirs.check_for(resume=bool(resume))
        plan = None
        if resume:
            from rolloutdb.controller.recovery.resume import check_packing, plan_resume

            plan = plan_resume(dirs, resume, start_over=args.start_over)
            check_packing(config, plan.selection.snapshot.path if plan.selection else None)
    except BaseException:
        lock.undo()
        raise
    from rolloutdb.controller.job.controller import Controller

    print(f"rolloutdb: {'resuming' if resume else 'training'} {config.run.name} in {run_dir}", file=sys.stderr)
    warning = snapshot_interval_warning(config)
    if warning is not None:
        print(f"rolloutdb: warning: {warning}", file=sys.stderr)
    summary = Controller(config, run_dir, resume=resume, start_over=args.start_over, lock=lock, resume_plan=plan,
                         plugins=plugins).run()
    if summary.plot is not None:
        print(f"reward curve: {summary.plot}", file=sys.stderr)
    print(summary.line)
    return 0
