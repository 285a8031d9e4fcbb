"""Hostile anchors: trainer checkpoints that a trainer wrote bad, and a disk that fills
while one is written.

* An anchor whose files match their manifest but that the trainer cannot load (a
  truncated `model.safetensors` sealed as it was, weights renamed or of another shape)
  is forged the way a buggy trainer factory publishes it: the file is damaged, then the
  manifest's entry is rewritten to its size and BLAKE3 (computed here with the `blake3`
  package, not with the code under test), so every checksum matches. `--resume latest`
  passes over it, says so in one line, falls back to the previous (anchor, snapshot)
  pair and finishes the run with `verify` clean; a snapshot named with `--resume
  SNAPSHOT_DIR` whose anchor cannot be loaded is refused in one line, changing nothing.
* A full disk while the trainer's own files are written (safetensors raises its own
  `SafetensorError`, not OSError) is one line naming the disk's errno and the checkpoint,
  sync and async, and the data is held: a resume once there is room again finishes the
  run with `verify` clean. The real `rolloutdb train` runs under RLIMIT_FSIZE (the
  checkpoint's optimizer file cannot grow past the limit, the run's other files can);
  ENOSPC itself on a small tmpfs (needs root), with the real GRPO trainer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import shutil
import subprocess
import uuid
from pathlib import Path

import blake3
import pytest
from safetensors.torch import load_file, save_file

from test_full_disk import _mount_tmpfs, _umount
from train_cli import (
    GROUPS, STEPS, TIMEOUT, command, digest, env, metrics, trained_groups, train, verify,
)

from rolloutdb.config import config_from_dict
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.controller.protocols import Completion, TrainGroup
from rolloutdb.controller.tasks.digits import TASK_ALPHABET
from rolloutdb.controller.training.checkpoints import TrainerCheckpoints
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy
from rolloutdb.store import Publisher, PublishError, scan, select_for_restore
from rolloutdb.store.restore.selection import anchor_problem

NEWEST, PREVIOUS = f"step_{STEPS}", f"step_{STEPS - 1}"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / NEWEST).is_dir() and (run_dir / "checkpoints" / PREVIOUS).is_dir()
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


def _reseal(anchor: Path, name: str) -> None:
    """Rewrite the manifest entry of `name` to the file as it now is, as a trainer that
    wrote the file bad and then had it sealed would leave it."""
    manifest = json.loads((anchor / "manifest.json").read_text())
    data = (anchor / name).read_bytes()
    (entry,) = [f for f in manifest["files"] if f["path"] == name]
    entry["size"], entry["blake3"] = len(data), blake3.blake3(data).hexdigest()
    (anchor / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _renamed(path: Path) -> None:
    tensors = load_file(path)
    tensors["model.norm.weight_renamed"] = tensors.pop("model.norm.weight")
    save_file(tensors, path, metadata={"format": "pt"})


def _broadcastable_shape(path: Path) -> None:
    """A (64,) tensor where the model has a (64, 64) weight: `copy_` broadcasts it."""
    tensors = load_file(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][0].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _forge(run_dir: Path, anchor: str, damage) -> Path:
    path = run_dir / "checkpoints" / anchor
    damage(path / "model.safetensors")
    _reseal(path, "model.safetensors")
    assert anchor_problem(_anchor(run_dir / "checkpoints", anchor)) is None  # checksums match
    return path


def _anchor(checkpoints: Path, name: str):
    (entry,) = [a for a in scan(checkpoints).complete_anchors() if a.anchor == name]
    return entry


def _one_refusal(result, *needles: str) -> str:
    """Refused: exit 2, one `error:` line; the only other line the command may print is
    its `rolloutdb: resuming ...` banner (the trainer loads an anchor after it)."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, (result.returncode, result.stderr[-3000:])
    assert all(line.startswith("rolloutdb: resuming ") for line in lines if line not in errors), result.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _assert_finished_healthy(run_dir: Path) -> None:
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, STEPS + 1)}
    result = verify(run_dir)
    assert result.returncode == 0 and "duplicated=0 lost=0" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------------ an anchor that cannot be loaded


@pytest.mark.parametrize("damage", [_truncated, _renamed, _broadcastable_shape],
                         ids=["truncated", "renamed weight", "weight of a broadcastable shape"])
def test_an_anchor_the_trainer_cannot_load_is_passed_over_and_the_run_finishes_from_the_previous_pair(run_copy, damage):
    _forge(run_copy, NEWEST, damage)
    assert select_for_restore(run_copy / "checkpoints").anchor.anchor == NEWEST  # every checksum verifies
    result = train(run_copy, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {NEWEST}/" not in result.stderr
    assert f"resumed from {PREVIOUS}/" in result.stderr, result.stderr
    announced = [line for line in result.stderr.splitlines() if "passed over" in line and NEWEST in line]
    assert len(announced) == 1 and "cannot load" in announced[0], result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("error:")], result.stderr
    (restore,) = metrics(run_copy, "restore")
    assert restore["anchor"] == PREVIOUS
    assert any(NEWEST in p and "cannot load" in p for p in restore["passed_over"]), restore["passed_over"]
    _assert_finished_healthy(run_copy)


def test_a_snapshot_named_whose_anchor_cannot_be_loaded_is_refused_in_one_line_and_changes_nothing(run_copy):
    path = _forge(run_copy, NEWEST, _truncated)
    snapshot = max((path / "rollout_snapshots").glob("snapshot_*"), key=lambda p: int(p.name.split("_")[1]))
    before = digest(run_copy)
    result = train(run_copy, "--resume", str(snapshot))
    line = _one_refusal(result, NEWEST, "cannot load", "SafetensorError")
    assert "--resume latest" in line
    assert digest(run_copy) == before


def test_when_no_anchor_can_be_loaded_the_resume_is_refused_in_one_line_naming_each_and_changes_nothing(run_copy):
    anchors = [a.anchor for a in scan(run_copy / "checkpoints").complete_anchors()]
    for anchor in anchors:
        _forge(run_copy, anchor, _truncated)
    before = digest(run_copy)
    result = train(run_copy, "--resume")
    line = _one_refusal(result, "cannot load", "--start-over", *anchors)
    assert "unexpected" not in line
    assert digest(run_copy) == before


# ------------------------------------------------------------------ a full disk under the trainer's writes

# policy.hidden_size=256: the step checkpoint's optimizer file is ~10.6 MB and its weights
# ~5.3 MB, while the store, the trace and their WALs stay far below 8 MB (WAL checkpoints
# at ~4 MB). Under an 8 MB RLIMIT_FSIZE the bootstrap (weights, no optimizer moments yet)
# is written and step_1's optimizer file is not.
BIG_POLICY = ["policy.hidden_size=256"]
FILE_LIMIT = 8 << 20


def _limit_file_size() -> None:  # in the child, before exec; Python ignores SIGXFSZ: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, resource.RLIM_INFINITY))


@pytest.mark.parametrize("asynchronous", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"])
def test_a_disk_that_cannot_take_the_trainer_checkpoint_ends_the_run_in_one_line_and_holds_the_data(tmp_path,
                                                                                                    asynchronous):
    run_dir = tmp_path / "run"
    overrides = [*BIG_POLICY, f"checkpointing.async={str(asynchronous).lower()}"]
    full = subprocess.run(command(run_dir, overrides=overrides), env=env(), preexec_fn=_limit_file_size,
                          capture_output=True, text=True, timeout=TIMEOUT)
    lines = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert full.returncode == 2 and len(lines) == 1, full.stderr[-3000:]
    assert f"{run_dir / 'checkpoints' / 'step_1'}: publishing failed at trainer checkpoint" in lines[0], lines[0]
    assert "File too large" in lines[0] and "[EFBIG]" in lines[0] and "unexpected" not in lines[0], lines[0]
    inventory = scan(run_dir / "checkpoints")
    assert inventory.durable_anchor_names() == {"bootstrap"} and not inventory.leftovers()
    assert anchor_problem(_anchor(run_dir / "checkpoints", "bootstrap")) is None

    # Room again: the run resumes from what it held and finishes.
    resumed = train(run_dir, "--resume", overrides=overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from bootstrap/" in resumed.stderr, resumed.stderr
    _assert_finished_healthy(run_dir)


TMPFS_BYTES = 16 << 20


@pytest.fixture
def small_tmpfs():
    mnt = Path(f"/tmp/rolloutdb-anchors-{uuid.uuid4().hex[:8]}")
    why = _mount_tmpfs(mnt)
    if why is not None:
        with contextlib.suppress(OSError):
            mnt.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here ({why}); the RLIMIT_FSIZE runs cover this machine")
    try:
        yield mnt
    finally:
        _umount(mnt)
        with contextlib.suppress(OSError):
            mnt.rmdir()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_under_safetensors_is_a_publish_error_naming_enospc_and_the_checkpoint(small_tmpfs, tmp_path,
                                                                                          asynchronous):
    # The bootstrap (~5.3 MB of weights) fits the 16 MiB tmpfs; step_1 (weights and the
    # optimizer's two moments, ~16 MB) does not.
    policy = build_tiny_policy(tmp_path / "policy", seed=0, hidden_size=256, num_layers=2, num_heads=4,
                               intermediate_size=512, alphabet=TASK_ALPHABET)
    trainer = GRPOTrainer(policy, GRPOConfig(seed=0))
    config = config_from_dict({"algorithm": {"total_steps": 2, "groups_per_step": 1, "group_size": 2},
                               "checkpointing": {"interval_steps": 1, "async": asynchronous}})
    ckpt = small_tmpfs / "checkpoints"
    checkpoints = TrainerCheckpoints(config, trainer, Publisher(ckpt))
    checkpoints.publish_bootstrap()
    bootstrap = {p.name: p.read_bytes() for p in (ckpt / "bootstrap").iterdir()}
    prompt = [1, 5, 6]
    trainer.train_step([TrainGroup(0, 0, [Completion(prompt, t, trainer.logprobs_of(prompt, t), [0] * 3, r)
                                          for t, r in (([5, 6, 2], 1.0), ([7, 7, 2], 0.0))])])
    with pytest.raises(PublishError) as failed:
        checkpoints.maybe_publish(1)
        checkpoints.finish()
    assert failed.value.errno == errno.ENOSPC
    message = str(failed.value)
    assert message.startswith(f"{ckpt / 'step_1'}: publishing failed at trainer checkpoint"), message
    assert "No space left on device" in message and "[ENOSPC]" in message and "\n" not in message, message
    inventory = scan(ckpt)
    assert inventory.durable_anchor_names() == {"bootstrap"} and not inventory.leftovers()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # the temporary directory is gone
    assert {p.name: p.read_bytes() for p in (ckpt / "bootstrap").iterdir()} == bootstrap


def test_optimizer_moments_of_another_shape_are_refused_at_load_not_at_the_first_step(tmp_path):
    """torch's Optimizer.load_state_dict takes moments of any shape; the trainer checks
    them against their parameters, so such an anchor fails at load (and is passed over)."""
    policy = build_tiny_policy(tmp_path / "policy", seed=0, hidden_size=32, num_layers=1, num_heads=4,
                               intermediate_size=64, alphabet=TASK_ALPHABET)
    trainer = GRPOTrainer(policy, GRPOConfig(seed=0))
    prompt = [1, 5, 6]
    trainer.train_step([TrainGroup(0, 0, [Completion(prompt, t, trainer.logprobs_of(prompt, t), [0] * 3, r)
                                          for t, r in (([5, 6, 2], 1.0), ([7, 7, 2], 0.0))])])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    trainer.save_checkpoint(ckpt)
    tensors = load_file(ckpt / "trainer_state.safetensors")
    name = next(k for k in tensors if k.endswith(".exp_avg") and tensors[k].dim() == 2)
    tensors[name] = tensors[name][0].clone()  # broadcastable: the first step would not even notice at once
    save_file(tensors, ckpt / "trainer_state.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"optimizer state {name.split('.')[2]}\.exp_avg has shape"):
        GRPOTrainer(policy, GRPOConfig(seed=0)).load_checkpoint(ckpt)
