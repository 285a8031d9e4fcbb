"""Asynchronous trainer checkpoints (`checkpointing.async`): the state copied at a step
boundary, written off the train pump, published at a later boundary through the one
commit protocol; a snapshot anchored to a checkpoint only once that checkpoint is
published. Real torch trainers, real Publisher directories, real Controller runs; the
kills are in tests/test_crash_resume.py."""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
import settled
import torch

from rolloutdb.config import config_from_dict, load_config
from rolloutdb.controller.job.controller import Controller
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.controller.protocols import Completion, TrainGroup
from rolloutdb.controller.recovery.run_audit import verify_run
from rolloutdb.controller.run.run_log import read_metrics
from rolloutdb.controller.tasks.digits import TASK_ALPHABET
from rolloutdb.controller.training.checkpoints import TrainerCheckpoints, write_checkpoint_state
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy
from rolloutdb.store import AnchorNotDurable, Publisher, PublishError, begin_trainer_checkpoint, faults, scan

SMALL = {
    "run": {"name": "t", "seed": 3},
    "algorithm": {"total_steps": 4, "groups_per_step": 3, "group_size": 4, "max_staleness": 1},
    "generation": {"max_tokens": 4, "max_batch_size": 12},
    "environment": {"dataset_size": 64, "n_digits": 2},
    "checkpointing": {"interval_steps": 1, "async": True, "keep_last": 10},
    "rollout_checkpointing": {"enabled": True, "interval_s": 30.0, "keep_last": 10},
    "logging": {"progress": False, "plot": False},
}


def _config(**sections):
    data = {k: dict(v) for k, v in SMALL.items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=0, hidden_size=32, num_layers=1,
                             num_heads=4, intermediate_size=64, alphabet=TASK_ALPHABET)


def _batch(tr: GRPOTrainer) -> list[TrainGroup]:
    prompt, good, bad = [1, 5, 6], [5, 6, 2], [7, 7, 2]
    return [TrainGroup(0, 0, [Completion(prompt, t, tr.logprobs_of(prompt, t), [0] * 3, r)
                              for t, r in ((good, 1.0), (bad, 0.0))])]


def _bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ the trainer's copy


def test_a_checkpoint_written_from_the_copy_is_byte_identical_to_one_saved_at_the_same_boundary(policy_dir, tmp_path):
    tr = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2))
    batch = _batch(tr)
    tr.train_step(batch)
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir(), async_dir.mkdir()
    tr.save_checkpoint(sync_dir)
    state = tr.checkpoint_state()
    tr.train_step(batch)  # training goes on before the copy is written
    tr.train_step(batch)
    write_checkpoint_state(state, async_dir)
    assert _bytes(async_dir) == _bytes(sync_dir)
    assert json.loads((async_dir / "trainer_state.json").read_text())["step"] == 1
    # ... and it resumes: a fresh trainer loaded from it is at step 1 with step 1's weights.
    fresh = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2))
    fresh.load_checkpoint(async_dir)
    assert fresh.step == 1
    other = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2))
    other.load_checkpoint(sync_dir)
    for (name, a), (_, b) in zip(fresh.model.state_dict().items(), other.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_state_file_name_that_is_a_path_is_refused_before_anything_is_written(policy_dir, tmp_path):
    tr = GRPOTrainer(policy_dir, GRPOConfig())
    state = tr.checkpoint_state()
    state.documents["../escape.json"] = {}
    with pytest.raises(ValueError, match="plain file name"):
        write_checkpoint_state(state, tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ publication


def test_a_snapshot_held_under_a_pending_checkpoint_is_refused_until_the_checkpoint_is_published(tmp_path):
    pub = Publisher(tmp_path)
    pub.publish_bootstrap(lambda d: (d / "w.bin").write_bytes(b"boot"))
    gate = threading.Event()

    def slow_write(d: Path) -> None:
        gate.wait(30)
        (d / "w.bin").write_bytes(b"step one")

    stage = begin_trainer_checkpoint(pub, 1, slow_write)
    held = pub.begin_snapshot("step_1", pending=stage)
    sqlite3.connect(held.db_path).executescript("CREATE TABLE t(x); INSERT INTO t VALUES (1);")
    with pytest.raises(AnchorNotDurable, match="not published yet"):
        held.publish()
    inv = scan(tmp_path)
    assert inv.durable_anchor_names() == {"bootstrap"} and not inv.complete_snapshots()
    gate.set()
    assert stage.publish() is not None
    published = held.publish()
    inv = scan(tmp_path)
    assert inv.durable_anchor_names() == {"step_1"}  # retention pruned bootstrap once step_1 had a snapshot
    assert [(s.anchor, s.sequence) for s in inv.complete_snapshots()] == [("step_1", published.sequence)]
    assert (tmp_path / "step_1" / "w.bin").read_bytes() == b"step one"
    assert not inv.leftovers()
    pub.close()


def test_a_failed_background_write_raises_at_publication_and_leaves_the_previous_anchor_and_no_directory(tmp_path):
    pub = Publisher(tmp_path)
    pub.publish_bootstrap(lambda d: (d / "w.bin").write_bytes(b"boot"))
    with faults.inject_io("fsync", errno.ENOSPC, match="w.bin"):
        stage = begin_trainer_checkpoint(pub, 1, lambda d: (d / "w.bin").write_bytes(b"x" * 1000))
        held = pub.begin_snapshot("step_1", pending=stage)
        stage.wait(30)
    with pytest.raises(PublishError, match="ENOSPC"):
        stage.publish()
    inv = scan(tmp_path)
    assert inv.durable_anchor_names() == {"bootstrap"}
    assert not inv.leftovers() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    assert held.done  # its held snapshot went with it
    pub.close()


class _GatedCheckpoints(TrainerCheckpoints):
    """The real TrainerCheckpoints whose background write waits for a gate, so the test
    decides when a write is still running."""

    gate = threading.Event()

    @staticmethod
    def _write_state(state, tmp):
        _GatedCheckpoints.gate.wait(30)
        TrainerCheckpoints._write_state(state, tmp)


def test_a_checkpoint_due_while_the_previous_is_written_is_skipped_and_the_last_step_waits(policy_dir, tmp_path):
    cfg = _config(algorithm={"total_steps": 3})
    tr = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2))
    events: list[dict] = []
    _GatedCheckpoints.gate.clear()
    batch = _batch(tr)
    tr.train_step(batch)
    reference = tmp_path / "reference_step_1"  # what a sync save at boundary 1 writes
    reference.mkdir()
    tr.save_checkpoint(reference)
    pub = Publisher(tmp_path / "ckpt")
    ckpts = _GatedCheckpoints(cfg, tr, pub, log_event=events.append)
    assert ckpts.maybe_publish(1)
    tr.train_step(batch)
    ckpts.poll()  # the write of step_1 is still running: nothing to publish
    assert not ckpts.maybe_publish(2)  # skipped, not waited for
    assert [e["outcome"] for e in events] == ["begun", "skipped_busy"]
    assert scan(pub.root).durable_anchor_names() == set()
    tr.train_step(batch)
    threading.Timer(0.3, _GatedCheckpoints.gate.set).start()
    assert ckpts.maybe_publish(3)  # the last step: waits for step_1, publishes it, begins step_3
    ckpts.finish()
    assert [(e["step"], e["outcome"]) for e in events] == [
        (1, "begun"), (2, "skipped_busy"), (1, "published"), (3, "begun"), (3, "published")]
    inv = scan(pub.root)
    assert inv.durable_anchor_names() == {"step_1", "step_3"} and not inv.leftovers()
    assert json.loads((pub.root / "step_3" / "trainer_state.json").read_text())["step"] == 3
    # step_1 holds step 1's state, though it was written after steps 2 and 3 trained
    # (and the trainer's copy buffers were reused for step 3 only after it was written).
    written = _bytes(pub.root / "step_1")
    assert {k: v for k, v in written.items() if k != "manifest.json"} == _bytes(reference)
    pub.close()


# ------------------------------------------------------------------ real runs


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("async") / "run"
    Controller(_config(), run_dir).run()
    return run_dir


def test_every_published_checkpoint_of_an_async_run_has_a_snapshot_cut_at_its_own_step(async_run):
    inv = scan(async_run / "checkpoints")
    steps = {a.anchor for a in inv.complete_anchors() if a.anchor != "bootstrap"}
    assert "step_4" in steps and not inv.leftovers()
    events = read_metrics(async_run / "logs" / "metrics.jsonl", "checkpoint")
    begun = {e["step"] for e in events if e["outcome"] == "begun"}
    published = {e["step"] for e in events if e["outcome"] == "published"}
    assert begun == published == {int(a.split("_")[1]) for a in steps}
    for snap in inv.complete_snapshots():
        if snap.anchor == "bootstrap":
            continue
        conn = sqlite3.connect(snap.path / "rollout_state.sqlite")
        try:  # the cut was taken while the trainer was at the anchor's step, not later
            last = max(settled.trained_per_step(conn), default=None)
        finally:
            conn.close()
        assert last == snap.step, (snap.anchor, last)
    assert steps <= {s.anchor for s in inv.complete_snapshots()}
    outcomes = {e["outcome"] for e in read_metrics(async_run / "logs" / "metrics.jsonl", "snapshot")}
    # Whatever the timing (an attempt woken when a write ends may meet an optimizer commit:
    # skipped_commit, aborted_commit), no attempt failed.
    assert "published" in outcomes and "failed" not in outcomes, outcomes


def test_an_async_run_resumes_from_its_last_checkpoint_and_trains_every_group_once(async_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(async_run, run_dir)
    summary = Controller(_config(algorithm={"total_steps": 6}), run_dir, resume="latest").run()
    assert summary.steps == 6
    restores = read_metrics(run_dir / "logs" / "metrics.jsonl", "restore")
    assert restores and "step_4" in restores[-1]["snapshot"]
    verdict = verify_run(run_dir)
    assert verdict.ok, verdict.line()
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    per_step = settled.trained_per_step(conn)
    conn.close()
    assert per_step == {s: 3 for s in range(1, 7)}
    assert "step_6" in scan(run_dir / "checkpoints").durable_anchor_names()


# ------------------------------------------------------------------ config


def test_the_async_key_is_spelled_async_in_the_yaml_and_in_the_resolved_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpointing:\n  async: true\n")
    cfg = load_config(path)
    assert cfg.checkpointing.async_ is True
    assert "  async: true\n" in cfg.to_yaml()
    assert load_config(path, ["checkpointing.async=false"]).checkpointing.async_ is False


def test_async_checkpointing_with_a_trainer_that_can_only_save_is_refused_naming_the_key(policy_dir, tmp_path):
    class SaveOnly:
        step = 0

        def save_checkpoint(self, directory):
            return []

    with pytest.raises(ValueError, match="checkpointing.async: true needs a trainer with checkpoint_state"):
        TrainerCheckpoints(_config(), SaveOnly(), Publisher(tmp_path))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
