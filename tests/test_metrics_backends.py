"""Metrics backends (controller/run/metrics_backends.py): the JSONL stays byte-for-byte what
MetricsLog writes, TensorBoard event files are read back with tensorboard's own
EventAccumulator (also after a kill -9), and a backend whose package is missing is
refused naming the pip command, with nothing written."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rolloutdb.controller.run.metrics_backends import (
    MetricsBackend,
    MetricsBackendError,
    RunMetrics,
    TensorBoardBackend,
    event_scalars,
    open_metrics,
)
from rolloutdb.config import LoggingSection
from rolloutdb.controller.run.run_log import MetricsLog

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="pip install tensorboard (in the test extra once W2-H is wired)")

# Events shaped as the pumps write them (training/pump.py, snapshot_pump.py, controller.py).
TRAIN = [
    {"kind": "train_step", "step": s, "t_start": 100.0 + 5 * s, "t_end": 102.0 + 5 * s, "reward_mean": 0.1 * s,
     "staleness_mean": 0.5, "staleness_max": 1, "batch_age": 0.25 * s, "policy_tokens": 40 * s, "groups": 4,
     "loss": 1.0 / s, "entropy": 2.0}
    for s in (1, 2, 3)
]
SNAPSHOT = {"kind": "snapshot", "outcome": "published", "anchor": "step_2", "sequence": 7,
            "timings": {"cut_s": 0.004, "publish_s": 0.03}, "error": None, "t": 113.0}
SKIPPED = {"kind": "snapshot", "outcome": "skipped_unchanged", "anchor": None, "sequence": None, "timings": {},
           "error": None, "t": 113.5}
SHARE = {"kind": "store_share", "t": 120.0, "pumps_wall_s": 20.0,
         "threads": {"rollout-pump": {"transactions": 30, "share": 0.01}}}
EVENTS = [TRAIN[0], TRAIN[1], SNAPSHOT, SKIPPED, TRAIN[2], SHARE]


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class Recorder:
    """A backend of one's own: anything with log(step, scalars) and close()."""

    def __init__(self):
        self.calls = []
        self.closed = False

    def log(self, step, scalars):
        self.calls.append((step, dict(scalars)))

    def close(self):
        self.closed = True


@needs_tensorboard
def test_the_jsonl_lines_are_byte_for_byte_those_metrics_log_writes(tmp_path):
    plain = MetricsLog(tmp_path / "plain.jsonl")
    fanned = open_metrics(tmp_path / "fanned.jsonl", ["jsonl", "tensorboard"], log_dir=tmp_path / "logs", run_name="r")
    for event in EVENTS:
        plain.write(event)
        fanned.write(event)
    plain.close()
    fanned.close()
    assert (tmp_path / "fanned.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


@needs_tensorboard
def test_tensorboard_shows_reward_loss_staleness_batch_age_throughput_and_snapshots(tmp_path):
    metrics = open_metrics(tmp_path / "m.jsonl", ["tensorboard"], log_dir=tmp_path / "logs", run_name="r")
    for event in EVENTS:
        metrics.write(event)
    metrics.close()
    scalars = read_events(tmp_path / "logs" / "tensorboard")
    approx = lambda pairs: [(s, pytest.approx(v, rel=1e-6)) for s, v in pairs]  # noqa: E731 - float32 on disk
    assert scalars["train/reward_mean"] == approx([(1, 0.1), (2, 0.2), (3, 0.3)])
    assert scalars["train/loss"] == approx([(1, 1.0), (2, 0.5), (3, 1 / 3)])
    assert scalars["train/staleness_mean"] == approx([(1, 0.5), (2, 0.5), (3, 0.5)])
    assert scalars["train/batch_age"] == approx([(1, 0.25), (2, 0.5), (3, 0.75)])
    assert scalars["train/step_s"] == approx([(1, 2.0), (2, 2.0), (3, 2.0)])
    # 40 tokens in the first step's 2 s; then 80 and 120 tokens in the 5 s between step ends
    assert scalars["train/tokens_per_s"] == approx([(1, 20.0), (2, 16.0), (3, 24.0)])
    # snapshots are logged at the last train step, with a running count per outcome
    assert scalars["snapshot/outcome/published"] == approx([(2, 1.0)])
    assert scalars["snapshot/outcome/skipped_unchanged"] == approx([(2, 1.0)])
    assert scalars["snapshot/timings/cut_s"] == approx([(2, 0.004)])
    assert scalars["store_share/threads/rollout-pump/share"] == approx([(3, 0.01)])
    assert not any(tag.endswith(("/t", "/t_start", "/t_end", "/sequence")) for tag in scalars)


@needs_tensorboard
def test_tensorboard_keeps_what_a_run_logged_before_it_was_killed(tmp_path):
    # The child kills itself with SIGKILL right after its last write: torch's writer
    # hands events to a thread that writes them when it gets to them (and flushes every
    # 120 s), so only the flush after each event puts the last step on disk in time.
    log_dir = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from rolloutdb.controller.run.metrics_backends import open_metrics
        metrics = open_metrics(Path({str(tmp_path / 'm.jsonl')!r}), ["tensorboard"], log_dir=Path({str(log_dir)!r}),
                               run_name="killed")
        metrics.write({{"kind": "train_step", "step": 1, "t_start": 0.0, "t_end": 1.0, "reward_mean": 0.1}})
        time.sleep(0.5)  # the writer thread's first (immediate) flush is behind us
        metrics.write({{"kind": "train_step", "step": 2, "t_start": 1.0, "t_end": 2.0, "reward_mean": 0.2}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert read_events(log_dir / "tensorboard")["train/reward_mean"] == [(1, pytest.approx(0.1)),
                                                                         (2, pytest.approx(0.2))]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_when_not_installed_is_refused_naming_pip_install_and_nothing_is_written(tmp_path):
    with pytest.raises(MetricsBackendError) as e:
        open_metrics(tmp_path / "m.jsonl", ["jsonl", "tensorboard", "wandb"], log_dir=tmp_path / "logs", run_name="r")
    message = str(e.value)
    assert "\n" not in message and message.startswith("logging.backends: wandb is not installed; pip install wandb")
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_when_its_package_is_missing_is_refused_naming_pip_install(tmp_path):
    # A child where `import tensorboard` fails as it does when the package is absent.
    child = textwrap.dedent(f"""
        import sys
        sys.modules["tensorboard"] = None
        from pathlib import Path
        from rolloutdb.controller.run.metrics_backends import MetricsBackendError, open_metrics
        try:
            open_metrics(Path({str(tmp_path / 'm.jsonl')!r}), ["tensorboard"], log_dir=Path({str(tmp_path)!r}),
                         run_name="r")
        except MetricsBackendError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert done.stdout.strip() == ("logging.backends: tensorboard needs the tensorboard package; pip install "
                                   "tensorboard (or pip install 'rolloutdb[tensorboard]')"), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_checking_the_backends_imports_neither_torch_nor_tensorboard():
    # `rolloutdb train` refuses bad input before it imports torch (seconds on a busy machine).
    child = ("import sys\n"
             "from rolloutdb.controller.run.metrics_backends import check_backends\n"
             "check_backends(['jsonl', 'tensorboard'])\n"
             "print(sorted(m for m in ('torch', 'tensorboard') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert done.stdout.strip() == "[]", done.stderr


def test_a_backend_of_ones_own_gets_every_event_at_the_last_train_step_and_is_closed(tmp_path):
    recorder = Recorder()
    assert isinstance(recorder, MetricsBackend)
    metrics = RunMetrics(tmp_path / "m.jsonl", [recorder])
    metrics.write(SKIPPED)  # before any train step: step 0
    for event in EVENTS:
        metrics.write(event)
    metrics.close()
    assert [step for step, _ in recorder.calls] == [0, 1, 2, 2, 2, 3, 3]
    assert recorder.calls[0][1] == {"snapshot/outcome/skipped_unchanged": 1.0}
    assert recorder.calls[4][1]["snapshot/outcome/skipped_unchanged"] == 2.0
    assert recorder.closed


def test_event_scalars_keep_numbers_under_the_kind_and_leave_text_and_times_out():
    assert event_scalars(SNAPSHOT) == {"snapshot/timings/cut_s": 0.004, "snapshot/timings/publish_s": 0.03}
    assert event_scalars({"kind": "restore", "t": 1.0, "snapshot": "/x", "step": 4, "groups": 3,
                          "bad": float("nan"), "flag": True}) == {"restore/groups": 3.0, "restore/flag": 1.0}


@needs_tensorboard
def test_a_tensorboard_backend_alone_writes_event_files_a_reader_finds(tmp_path):
    backend = TensorBoardBackend(tmp_path / "tb")
    backend.log(5, {"custom/x": 2.5})
    backend.close()
    assert read_events(tmp_path / "tb") == {"custom/x": [(5, 2.5)]}


def test_the_proposed_backends_key_defaults_to_jsonl_and_refuses_unknown_or_repeated_names():
    assert LoggingSection().backends == ["jsonl"]
    assert LoggingSection.model_validate({"backends": ["jsonl", "tensorboard", "wandb"]}).backends[-1] == "wandb"
    with pytest.raises(ValueError, match="tensorbord"):
        LoggingSection.model_validate({"backends": ["tensorbord"]})
    with pytest.raises(ValueError, match="names a backend twice"):
        LoggingSection.model_validate({"backends": ["jsonl", "jsonl"]})


def _steps(first: int, last: int, reward: float) -> list[dict]:
    return [{"kind": "train_step", "step": s, "t_start": 100.0 + 5 * s, "t_end": 102.0 + 5 * s,
             "reward_mean": reward + s, "policy_tokens": 10} for s in range(first, last + 1)]


@needs_tensorboard
def test_a_resume_leaves_tensorboard_one_value_per_step_the_retrained_one_and_marks_each_jsonl_line(tmp_path):
    logs, jsonl = tmp_path / "logs", tmp_path / "logs" / "metrics.jsonl"
    first = open_metrics(jsonl, ["tensorboard"], log_dir=logs, run_name="r", attempt=1)
    for event in _steps(1, 5, 0.0):
        first.write(event)
    first.close()
    # The resume restored step 3: steps 4 and 5 are trained again, then step 6.
    second = open_metrics(jsonl, ["tensorboard"], log_dir=logs, run_name="r", attempt=2, resumed_at=3)
    second.write({"kind": "restore", "t": 130.0, "groups": 2})
    for event in _steps(4, 6, 100.0):
        second.write(event)
    second.close()
    rewards = read_events(logs / "tensorboard")["train/reward_mean"]
    assert rewards == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert read_events(logs / "tensorboard")["restore/groups"] == [(3, 2.0)]  # at the step restored
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(e["attempt"], e.get("step")) for e in lines] == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, None),
                                                             (2, 4), (2, 5), (2, 6)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="pip install wandb")
def test_a_resume_logs_into_the_runs_own_offline_wandb_run_with_the_configured_project_and_tags(tmp_path):
    logs = tmp_path / "logs"
    config = {"logging": {"wandb_project": "digits", "wandb_entity": None, "wandb_tags": ["cpu", "tiny"]}}
    runs = []
    for attempt, resumed_at, event in ((1, None, TRAIN[0]), (2, 1, TRAIN[1])):
        metrics = open_metrics(logs / "m.jsonl", ["wandb"], log_dir=logs, run_name="r", config=config,
                               attempt=attempt, resumed_at=resumed_at)
        run = metrics.backends[0]._run
        runs.append((run.id, run.project, tuple(run.tags)))
        metrics.write(event)
        metrics.close()
    assert runs[0] == runs[1] and runs[0][1:] == ("digits", ("cpu", "tiny"))
    assert (logs / "wandb" / "run_id").read_text().strip() == runs[0][0]
    offline = sorted(p.name for p in (logs / "wandb" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(f"-{runs[0][0]}" in name for name in offline)
