"""Shared-prefix ("forest") packing: a group's completions behind one copy of the prompt
train exactly as one row per completion would.

The oracle for per-token logprobs is the model run on each completion alone (one
unpadded sequence, batch of one), computed here with log_softmax; the oracle for the loss
and the gradients is the plain layout's `train_step` (tests/test_grpo.py checks that one
against numbers computed by hand). Everything runs in fp32.

Tolerances: both layouts compute the same function, but not the same sums: a packed row
is longer, so every attention softmax and score-times-value product adds more (exactly
zero) terms, in another order, and SDPA may pick another kernel for the 4-D mask.
Measured here (/tmp runs of this file's cases, 2026-12-01): logprobs (of size ~3) differ
by at most 2.4e-7 (2 ulp), gradients by at most 6e-8 absolute with the largest element
~0.3, the loss by at most 8e-9. The tolerances are ~8x those: logprobs atol 2e-6,
gradients atol 5e-7 + rtol 1e-4. Weights after AdamW steps differ more, 1.7e-5 at lr
1e-2: Adam's first update is lr * g / (|g| + eps), which turns the 6e-8 difference of a
gradient element that is itself ~1e-7 into a visible part of lr; weights get atol 1e-4
(lr / 100). The planted bugs move logprobs by 6e-4 (positions not restarted after the
prompt) and 9e-2 (siblings in view), 300x the tolerance and more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from crash_harness import metrics, train_env
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.controller.training.packing import micro_batches, pack_shared_prefix, shared_prefix_length
from rolloutdb.controller.protocols import Completion, TrainGroup
from rolloutdb.controller.tasks.digits import TASK_ALPHABET
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy

LOGP_TOL = dict(rtol=0, atol=2e-6)
GRAD_TOL = dict(rtol=1e-4, atol=5e-7)
WEIGHT_TOL = dict(rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    # Two layers, so the second layer's attention reads hidden states that a sibling
    # would already have leaked into in the first.
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=3, hidden_size=32, num_layers=2,
                             num_heads=4, intermediate_size=64, alphabet=TASK_ALPHABET)


def trainer(policy_dir: Path, **overrides) -> GRPOTrainer:
    return GRPOTrainer(policy_dir, GRPOConfig(**{"lr": 1e-2, "max_grad_norm": None, **overrides}))


def alone(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probabilities of `tokens` after `prompt`, one unpadded sequence on its own."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens)]


def completion(model, prompt, tokens, reward, mask=None, skew=0.0, rng=None) -> Completion:
    """A completion whose old logprobs are the policy's, moved by up to `skew` (so some
    ratios leave the clip range and both branches of the PPO min are exercised)."""
    lp = alone(model, list(prompt), list(tokens))
    if skew:
        lp = [x + rng.uniform(-skew, skew) for x in lp]
    return Completion(list(prompt), list(tokens), lp, [0] * len(tokens), reward, mask)


def group_of_four(model, rng) -> TrainGroup:
    prompt = [1, 5, 6, 7, 3]
    replies = [[8, 9, 10, 2], [4], [11, 12, 13, 14, 15, 6, 2], [9, 9]]  # lengths 4, 1, 7, 2
    return TrainGroup(0, 0, [completion(model, prompt, r, rew, skew=0.5, rng=rng)
                             for r, rew in zip(replies, [1.0, 0.0, 0.25, 0.75])])


def several_groups(model, rng) -> list[TrainGroup]:
    """Three groups: prompts of other lengths, other sizes, and a multi-turn group whose
    prompts differ after a common part and whose replies hold environment tokens."""
    g0 = group_of_four(model, rng)
    g1 = TrainGroup(1, 1, [completion(model, [1, 4, 4, 4, 4, 4, 4, 4, 4, 3], r, rew, skew=0.5, rng=rng)
                           for r, rew in [([5, 6], 0.0), ([7, 8, 9], 1.0)]])
    multi = [([1, 6, 7, 3], [8, 2, 5, 5, 9, 2], [1, 1, 0, 0, 1, 1], 0.3),
             ([1, 6, 7, 3, 12], [8, 2, 5, 5, 10], [1, 1, 0, 0, 1], 0.9),  # prompt longer: a branch of its own
             ([1, 6, 9], [4, 4, 4], None, 0.1)]  # prompts share only [1, 6]
    g2 = TrainGroup(2, 2, [completion(model, p, t, rew, m, skew=0.5, rng=rng) for p, t, m, rew in multi])
    return [g0, g1, g2]


def grads(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}


def assert_close_dicts(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], **tol), f"{k}: max diff {float((a[k] - b[k]).abs().max()):.3g}"


def packed_logprobs(tr: GRPOTrainer, groups: list[TrainGroup]) -> list[list[float]]:
    from rolloutdb.controller.training.grpo import token_logprobs

    comps = [c for g in groups for c in g.completions]
    batch = pack_shared_prefix([g.completions for g in groups], [0.0] * len(comps), tr.pad_id)
    with torch.no_grad():
        logp = token_logprobs(tr.model, batch)
    return [logp[b, : len(c.token_ids)].tolist() for b, c in enumerate(comps)]


# --------------------------------------------------------------------------- layout


def test_the_shared_prompt_is_the_longest_common_prefix_of_the_groups_prompts():
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 3
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 3
    assert shared_prefix_length([[1, 2, 3], [1, 5, 3]]) == 1
    assert shared_prefix_length([[7], [1]]) == 0


def test_a_packed_group_holds_its_prompt_once_with_positions_restarting_after_it():
    a = Completion([1, 5, 6], [7, 8], [0.0, 0.0], [0, 0], 0.0)
    b = Completion([1, 5, 6], [9], [0.0], [0], 0.0)
    batch = pack_shared_prefix([[a, b]], [0.0, 0.0])
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    # a's tokens are predicted at the prompt's last token and at its own 7; b's at the prompt's last
    assert batch.gather_positions.tolist() == [[2, 3], [2, 0]]
    visible = batch.attention_mask[0].int().tolist()
    assert visible[5] == [1, 1, 1, 0, 0, 1]  # b's 9 sees the prompt and itself, not a's 7 and 8
    assert visible[4] == [1, 1, 1, 1, 1, 0]


def test_micro_batches_take_whole_groups():
    comps = [Completion([1], [2], [0.0], [0], 0.0)]
    batch = pack_shared_prefix([comps * 3, comps * 2, comps * 2], [0.0] * 7)
    assert micro_batches(batch, 4) == [(slice(0, 1), slice(0, 3)), (slice(1, 3), slice(3, 7))]
    assert micro_batches(batch, 2) == [(slice(0, 1), slice(0, 3)), (slice(1, 2), slice(3, 5)),
                                       (slice(2, 3), slice(5, 7))]


# ------------------------------------------------------------------- equal numbers


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_equal_each_completion_run_alone(policy_dir, attention):
    # Both of the installed transformers' attention paths take the 4-D additive mask as
    # is (masking_utils returns a 4-D mask unchanged; eager adds it to the scores, SDPA
    # passes it as attn_mask); the trainer loads the model with SDPA, the default.
    tr = trainer(policy_dir)
    tr.model.set_attn_implementation(attention)
    assert tr.model.config._attn_implementation == attention
    rng = random.Random(0)
    groups = several_groups(tr.model, rng)
    got = packed_logprobs(tr, groups)
    for g in groups:
        for c in g.completions:
            want = alone(tr.model, c.prompt_ids, c.token_ids)
            have = got.pop(0)
            assert torch.allclose(torch.tensor(have), torch.tensor(want), **LOGP_TOL), (c.prompt_ids, c.token_ids,
                                                                                        have, want)


CASES = {
    "a group of four": dict(groups=lambda m, rng: [group_of_four(m, rng)], config={}),
    "several groups": dict(groups=several_groups, config={}),
    "micro-batches": dict(groups=several_groups, config={"micro_batch_size": 3}),
    "entropy and kl": dict(groups=several_groups, config={"entropy_coef": 0.05, "kl_coef": 0.2}),
    "sequence mean": dict(groups=several_groups, config={"loss_aggregation": "sequence_mean",
                                                         "micro_batch_size": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_and_every_gradient_under_packing_equal_the_unpacked_ones(policy_dir, case):
    spec = CASES[case]
    plain = trainer(policy_dir, **spec["config"])
    packed = trainer(policy_dir, shared_prefix_packing=True, **spec["config"])
    if plain.reference is not None:  # a reference away from the policy, or the KL term is 0 with 0 gradient
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p, q in zip(plain.reference.parameters(), packed.reference.parameters()):
                noise = 0.05 * torch.randn(p.shape, generator=gen)
                p.add_(noise)
                q.add_(noise)
    groups = spec["groups"](plain.model, random.Random(7))
    m_plain, m_packed = plain.train_step(groups), packed.train_step(groups)
    assert m_plain["loss"] != 0.0
    assert m_packed["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-8)
    for key in ("clip_fraction", "ratio_mean", "kl", "entropy", "policy_tokens", "sequences"):
        assert m_packed[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-8), key
    if spec["config"].get("kl_coef"):
        assert m_plain["kl"] > 1e-4
    assert 0 < m_plain["clip_fraction"] < 1  # both sides of the clip are in the batch
    g_plain, g_packed = grads(plain), grads(packed)
    assert max(float(g.abs().max()) for g in g_plain.values()) > 1e-4
    assert_close_dicts(g_packed, g_plain, **GRAD_TOL)


def test_a_train_step_with_packing_on_or_off_leaves_the_same_weights(policy_dir):
    plain = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2, entropy_coef=0.02))
    packed = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2, entropy_coef=0.02, shared_prefix_packing=True))
    before = {k: v.clone() for k, v in plain.model.state_dict().items()}
    for step in range(2):  # the second step runs on Adam moments the first left
        groups = several_groups(plain.model, random.Random(step))
        plain.train_step(groups)
        packed.train_step(groups)
    after_plain, after_packed = plain.model.state_dict(), packed.model.state_dict()
    assert any(not torch.equal(before[k], after_plain[k]) for k in before)
    assert_close_dicts(dict(after_packed), dict(after_plain), **WEIGHT_TOL)


# ------------------------------------------------------------------ real runs (CLI)

REPO = Path(__file__).resolve().parents[1]
QUICK = [
    "algorithm.total_steps=4",
    "checkpointing.interval_steps=1",
    "rollout_recovery.target_level=prefix",
    "logging.progress=false",
    "logging.plot=false",
]


def _cli(run_dir: Path, *extra: str, resume: bool = False, config: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(config or REPO / "examples" / "quickstart.yaml"),
           "--run-dir", str(run_dir), *(["--resume"] if resume else [])]
    return subprocess.run(cmd + QUICK + list(extra), env=train_env(), capture_output=True, text=True, timeout=300)


def _files(root: Path) -> dict[str, tuple]:
    """Every file and directory under `root`: size, modification time and content hash.
    The lock file's content is put back after a refusal (RunLock.undo), not its time."""
    out: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            out[rel] = ("dir",)
        else:
            st = path.stat()
            mtime = None if rel == "run.lock" else st.st_mtime_ns
            out[rel] = (st.st_size, mtime, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


@pytest.mark.parametrize("then,now", [(True, False), pytest.param(False, True, marks=pytest.mark.slow)])
def test_a_resume_with_the_other_packing_setting_is_refused_and_changes_nothing(tmp_path, then, now):
    word = {True: "true", False: "false"}
    run_dir = tmp_path / "run"
    done = _cli(run_dir, f"algorithm.shared_prefix_packing={word[then]}")
    assert done.returncode == 0, done.stderr[-2000:]
    before = _files(run_dir)
    refused = _cli(run_dir, f"algorithm.shared_prefix_packing={word[now]}", resume=True)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), refused.stderr[-2000:]
    assert re.search(rf"algorithm.shared_prefix_packing is {word[then]} in step_\d+/snapshot_\d+ but {word[now]} now",
                     lines[0]), lines[0]
    assert f"resume with algorithm.shared_prefix_packing={word[then]}" in lines[0]
    assert _files(run_dir) == before


def _prefixes_of_running_calls(snapshot_db: Path) -> dict[tuple[int, int], tuple[int, list[int], np.ndarray]]:
    """(group id, generation) -> (prompt id, tokens, float32 logprobs) of every running
    call whose prefix a snapshot saved (its chunks in order), decoded here with SQL and
    numpy."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        rows = conn.execute(
            "SELECT r.group_id, r.generation_index, g.prompt_id, c.token_ids, c.logprobs FROM token_chunks c "
            "JOIN rollouts r ON r.attempt_id = c.attempt_id JOIN prompt_groups g ON g.group_id = r.group_id "
            "WHERE r.state = 'running' ORDER BY c.attempt_id, c.chunk_index").fetchall()
    out: dict[tuple[int, int], tuple[int, list[int], np.ndarray]] = {}
    for group, gen, prompt, tokens, logprobs in rows:
        _, t, lp = out.get((group, gen), (prompt, [], np.zeros(0, np.float32)))
        if logprobs is None:
            continue
        out[(group, gen)] = (prompt, t + np.frombuffer(tokens, "<i4").tolist(),
                             np.concatenate([lp, np.frombuffer(logprobs, "<f4")]))
    return {k: v for k, v in out.items() if v[1]}


def _policy_run_at(packed: list, tokens: list[int], logprobs: np.ndarray) -> int | None:
    """If one generation's packed (targets, old logprobs, loss mask) hold `tokens` as
    the start of a run of policy tokens (loss mask 1: one call's reply), with exactly
    these float32 logprobs: that run's length (the whole call's output). Else None."""
    targets, old, mask = packed
    n = len(tokens)
    for i in range(len(targets) - n + 1):
        if (i == 0 or mask[i - 1] == 0.0) and targets[i:i + n] == tokens and all(m == 1.0 for m in mask[i:i + n]) \
                and np.array_equal(np.asarray(old[i:i + n], dtype=np.float32), logprobs):
            end = i + n
            while end < len(mask) and mask[end] == 1.0:
                end += 1
            return end - i
    return None


def _resumed_calls(trace_db: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """(group id, generation) -> (prefix tokens, tokens decoded by its first call) of every
    attempt the last run dispatched with a prefix, read from the trace with SQL."""
    with contextlib.closing(sqlite3.connect(f"file:{trace_db}?mode=ro", uri=True)) as conn:
        rows = conn.execute(
            "SELECT d.group_id, d.generation_index, d.prefix_tokens, "
            "(SELECT f.tokens FROM call_finished f WHERE f.run = d.run AND f.group_id = d.group_id "
            " AND f.generation_index = d.generation_index AND f.attempt = d.attempt ORDER BY f.seq LIMIT 1) "
            "FROM attempt_dispatched d WHERE d.run = (SELECT max(run) FROM runs) AND d.prefix_tokens > 0").fetchall()
    return {(g, i): (p, n) for g, i, p, n in rows}


def test_a_killed_prefix_level_run_with_packing_trains_every_restored_prefix(seeded_prefix_run):
    """The multi-turn example at prefix level with packing on (the seeded twin run of
    tests/test_prefix_recovery_real_run.py, shared through conftest.py), SIGKILLed while
    its newest snapshot holds prefixes of running calls, then resumed to the end. Every
    call the last restored snapshot held a prefix of was continued from it (the trace: it
    decoded only the rest of its output), and its output, prefix first, reached the packed
    batch as policy tokens with the logprobs the snapshot saved. The policy is fixed (lr 0)
    and sampling seeded, so a call redone from scratch would produce the same tokens: the
    decoded count is what tells a kept prefix from a dropped one."""
    job = seeded_prefix_run
    run_dir, record, cut, calls = job["run_dir"], job["root"] / "run.jsonl", job["cut"], job["kills"][-1]
    # The metrics log rolls back with each restore to its anchor: the last resume's line is
    # last, an earlier one survives when the later snapshot's anchor is past it.
    restores = [r["calls"] for r in metrics(run_dir, "prefix_restore")]
    assert restores == job["kills"][-len(restores):] and restores[-1] == calls
    saved = _prefixes_of_running_calls(cut)
    continued = _resumed_calls(run_dir / "logs" / "rollout_trace.sqlite")
    assert len(saved) == calls and continued.keys() == saved.keys()
    trained = [json.loads(line) for line in record.read_text().splitlines()]
    assert all("packed" in row for row in trained)
    for key, (prompt, tokens, logprobs) in saved.items():
        group, gen = key  # completions come in generation order (controller/training/pump.py)
        lengths = {_policy_run_at(row["packed"][gen], tokens, logprobs) for row in trained if row["group_id"] == group}
        assert len(lengths) == 1 and None not in lengths, f"{key}: its saved prefix is not in its packed batch: {lengths}"
        prefix, decoded = continued[key]
        assert prefix == len(tokens)
        assert decoded == lengths.pop() - len(tokens), f"{key}: decoded {decoded} tokens after a prefix of {prefix}"
