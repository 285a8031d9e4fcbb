"""The resume's seam: `restore_run` takes the parts it reads (`ResumeParts`: config, run
directory, plan, trainer, engine, dataset), not the controller, and says through
`on_writing` when the run directory starts to change. Real parts: a finished run of the
tiny Llama, its trainer, engine and dataset built as `rolloutdb train` builds them."""

from __future__ import annotations

import shutil

import pytest
from train_cli import digest

from rolloutdb.config import config_from_dict
from rolloutdb.controller.job import build
from rolloutdb.controller.job.controller import Controller
from rolloutdb.controller.recovery import resume
from rolloutdb.controller.run.metrics_backends import open_metrics
from rolloutdb.controller.run.run_dir import RunDir
from rolloutdb.controller.run.run_log import read_metrics
from rolloutdb.controller.tasks import registry
from rolloutdb.store import NullTracer

RUN = {
    "run": {"name": "parts", "seed": 5},
    "algorithm": {"total_steps": 3, "groups_per_step": 2, "group_size": 2, "max_staleness": 1},
    "generation": {"max_tokens": 4, "max_batch_size": 8},
    "environment": {"dataset_size": 32, "n_digits": 2},
    "checkpointing": {"interval_steps": 2},
    "rollout_checkpointing": {"enabled": True, "interval_s": 30.0},
    "logging": {"progress": False, "plot": False},
}


def _config(**algorithm):
    return config_from_dict({**RUN, "algorithm": {**RUN["algorithm"], **algorithm}})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("parts") / "run"
    Controller(_config(), run_dir).run()
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


def _parts(config, run_dir, plan):
    dirs = RunDir(run_dir)
    found = registry.check_plugins(config)
    policy_dir = build.build_policy(config, dirs.policy, found.dataset)
    dataset, _ = registry.build_task(config, policy_dir, found)
    return resume.ResumeParts(config=config, dirs=dirs, resume="latest", plan=plan,
                              trainer=build.build_trainer(config, policy_dir),
                              engine=build.build_engine(config, policy_dir), dataset=dataset)


def test_a_restore_from_its_parts_loads_the_anchor_replaces_the_store_and_says_it_writes_once_after(run_copy):
    plan = resume.plan_resume(RunDir(run_copy), "latest")
    anchor_step = int(plan.selection.anchor.anchor.split("_")[1])
    parts = _parts(_config(), run_copy, plan)
    seen = []  # at each on_writing: the trainer's and the engine's step
    try:
        done = resume.restore_run(parts, on_writing=lambda: seen.append(
            (parts.trainer.step, parts.engine.policy_version)))
        assert seen == [(anchor_step, anchor_step)]  # once, after the weights were loaded and pushed
        assert done.step == anchor_step > 0 and done.store is not None
        metrics = open_metrics(run_copy / "logs" / "metrics.jsonl", log_dir=run_copy / "logs", run_name="parts")
        resume.announce(done, metrics=metrics, tracer=NullTracer())
        metrics.close()
        (line,) = read_metrics(run_copy / "logs" / "metrics.jsonl", "restore")
        assert line["step"] == anchor_step and line["groups_restored"] == len(done.groups)
        done.store.close()
    finally:
        parts.engine.close()


def test_a_restore_refused_from_its_parts_never_says_it_writes_and_changes_nothing(run_copy):
    plan = resume.plan_resume(RunDir(run_copy), "latest")
    parts = _parts(_config(shared_prefix_packing=True), run_copy, plan)  # the snapshot's is false
    before = digest(run_copy)
    seen = []
    try:
        with pytest.raises(resume.ResumeError, match="shared_prefix_packing"):
            resume.restore_run(parts, on_writing=lambda: seen.append("writing"))
    finally:
        parts.engine.close()
    assert seen == [] and parts.trainer.step == 0
    assert digest(run_copy) == before
