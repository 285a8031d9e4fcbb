"""GRPO trainer: the numbers by hand, the loss mask, a behaviour test that can fail, and
checkpoints that resume bit-exactly with no pickle anywhere."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rolloutdb.controller.training.grpo import (
    GRPOConfig,
    GRPOTrainer,
    PreparedStep,
    aggregate,
    clipped_token_losses,
    config_from_dict,
    group_advantages,
)
from rolloutdb.controller.protocols import Completion, NonFiniteTraining, StagedTrainer, TrainGroup, Trainer
from rolloutdb.controller.tasks.digits import TASK_ALPHABET
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy

EPS = 0.2


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    # Smaller than the default policy: these tests check arithmetic, not learning speed.
    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=0, hidden_size=32, num_layers=1,
                             num_heads=4, intermediate_size=64, alphabet=TASK_ALPHABET)


def trainer(policy_dir, **overrides) -> GRPOTrainer:
    return GRPOTrainer(policy_dir, GRPOConfig(**{"lr": 1e-2, "clip_eps": EPS, **overrides}))


def on_policy(tr: GRPOTrainer, prompt, tokens, reward, mask=None) -> Completion:
    """A completion whose old logprobs are the current policy's (ratio 1)."""
    return Completion(list(prompt), list(tokens), tr.logprobs_of(prompt, tokens), [0] * len(tokens),
                      reward, mask)


def fixed_batch(tr: GRPOTrainer) -> list[TrainGroup]:
    """Two groups of different replies (equal replies with different rewards would
    cancel), one with an environment token inside."""
    a = [on_policy(tr, [3, 4, 5], [6, 7, 8], 1.0), on_policy(tr, [3, 4, 5], [9, 9, 3], 0.0),
         on_policy(tr, [3, 4, 5], [8, 7], 0.5)]
    b = [on_policy(tr, [9, 10], [11, 12, 13, 14], 0.3, [1, 1, 0, 1]),
         on_policy(tr, [9, 10], [4, 12, 13, 5], 0.9, [1, 1, 0, 1])]
    return [TrainGroup(0, 0, a), TrainGroup(1, 1, b)]


def weights(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------ by hand


def test_group_advantages_match_a_hand_computation():
    # mean 0.5, population std sqrt((0.09 + 0 + 0.09) / 3) = sqrt(0.06)
    adv = group_advantages([0.2, 0.5, 0.8], eps=0.0)
    s = math.sqrt(0.06)
    assert adv == pytest.approx([-0.3 / s, 0.0, 0.3 / s])
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0) == pytest.approx([1, -1, -1, 1])
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]  # nothing to learn
    assert group_advantages([1.0, 0.0], scale=False) == [0.5, -0.5]
    # eps keeps a near-constant group from exploding
    assert abs(group_advantages([0.5, 0.5 + 1e-9], eps=1e-6)[1]) < 1e-2


def test_the_clipped_loss_equals_a_hand_computed_value():
    ratios = torch.tensor([[1.5, 0.5, 3.0], [1.5, 0.5, 1.1]])
    old = torch.zeros_like(ratios)
    new = torch.log(ratios)
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    losses, clipped = clipped_token_losses(new, old, adv, EPS, EPS)
    # A=+1: -min(r, clip(r)) -> 1.5 -> -1.2 (clipped), 0.5 -> -0.5 (not: the min keeps r)
    # A=-1: -min(-r, -clip(r)) = max(r, clip(r)) -> 1.5 -> 1.5, 0.5 -> 0.8 (clipped), 1.1 -> 1.1
    assert losses[0, :2].tolist() == pytest.approx([-1.2, -0.5])
    assert losses[1].tolist() == pytest.approx([1.5, 0.8, 1.1])
    assert clipped.tolist() == [[True, False, True], [False, True, False]]
    token_mean = (-1.2 - 0.5 + 1.5 + 0.8 + 1.1) / 5
    sequence_mean = ((-1.2 - 0.5) / 2 + (1.5 + 0.8 + 1.1) / 3) / 2
    assert float(aggregate(losses, mask, "token_mean")) == pytest.approx(token_mean)
    assert float(aggregate(losses, mask, "sequence_mean")) == pytest.approx(sequence_mean)
    # asymmetric clipping (clip-higher): the upper bound moves, the lower does not
    losses_hi, _ = clipped_token_losses(new, old, adv, EPS, 0.6)
    assert losses_hi[0, :2].tolist() == pytest.approx([-1.5, -0.5])


def test_the_trainers_loss_is_the_hand_computed_surrogate_over_policy_tokens(policy_dir):
    tr = trainer(policy_dir)
    assert isinstance(tr, Trainer)
    prompt, tokens = [3, 4], [5, 6, 7]
    current = tr.logprobs_of(prompt, tokens)
    # old logprobs chosen so the ratios are 1.5, 0.5 and (on an environment token) 9
    old = [current[0] - math.log(1.5), current[1] - math.log(0.5), current[2] - math.log(9.0)]
    good = Completion(prompt, tokens, old, [0, 0, 0], 1.0, [1, 1, 0])
    bad = Completion(prompt, tokens, old, [0, 0, 0], 0.0, [1, 1, 0])
    metrics = tr.train_step([TrainGroup(0, 0, [good, bad])])
    a = 0.5 / (0.5 + 1e-6)  # advantages +-a: rewards 1 and 0, mean 0.5, std 0.5
    # A=+a: -a*min(r, clip r) -> -1.2a, -0.5a;  A=-a: a*max(r, clip r) -> 1.5a, 0.8a
    assert metrics["loss"] == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) * a / 4, rel=1e-5)
    assert metrics["policy_tokens"] == 4
    assert metrics["clip_fraction"] == pytest.approx(2 / 4)
    assert tr.step == 1


# --------------------------------------------------------------------- loss mask


def test_environment_tokens_are_context_only_and_never_trained(policy_dir):
    """Environment tokens at the end of a reply: with loss_mask 0, dropping them or
    giving them absurd old logprobs leaves the step unchanged; marking the same tokens
    as policy tokens changes it (so the comparison can fail)."""
    def step_with(tokens, logprobs, mask):
        tr = trainer(policy_dir)
        hi = Completion([3, 4], tokens, logprobs, [0] * len(tokens), 1.0, mask)
        lo = Completion([3, 4], [9, 8], [-3.0, -3.0], [0, 0], 0.0, [1, 1])
        tr.train_step([TrainGroup(0, 0, [hi, lo])])
        return weights(tr)

    lp = [-2.0, -2.5]
    masked = step_with([5, 6, 10, 11], lp + [-1e6, float("nan")], [1, 1, 0, 0])
    trimmed = step_with([5, 6], lp, [1, 1])
    assert_same_weights(masked, trimmed)
    trained = step_with([5, 6, 10, 11], lp + [-2.0, -2.0], [1, 1, 1, 1])
    assert any(not torch.equal(masked[k], trained[k]) for k in masked)


# ---------------------------------------------------------------------- behaviour


def test_a_few_steps_on_a_fixed_batch_raise_the_probability_of_the_better_completion(policy_dir):
    tr = trainer(policy_dir, lr=3e-3)
    prompt, good, bad = [3, 4, 5, 13], [6, 7, 8], [8, 7, 6]
    start_good = sum(tr.logprobs_of(prompt, good))
    start_bad = sum(tr.logprobs_of(prompt, bad))
    group = TrainGroup(0, 0, [on_policy(tr, prompt, good, 1.0), on_policy(tr, prompt, bad, 0.0),
                              on_policy(tr, prompt, good, 1.0), on_policy(tr, prompt, bad, 0.0)])
    for _ in range(5):  # the old logprobs stay those of step 0: later steps are off-policy
        metrics = tr.train_step([group])
    end_good = sum(tr.logprobs_of(prompt, good))
    end_bad = sum(tr.logprobs_of(prompt, bad))
    assert end_good > start_good + 0.5
    assert end_bad < start_bad - 0.5
    assert metrics["ratio_mean"] != pytest.approx(1.0)  # the ratio did see the drift


# ------------------------------------------------------------ prepare, then commit


def test_a_prepared_step_changes_nothing_a_cut_or_checkpoint_sees_and_its_commit_is_the_whole_step(policy_dir):
    """prepare_step leaves the weights, the optimizer's moments and `step` as they were
    (what a snapshot cut during it relies on); its commit then makes the same weights
    and metrics as one train_step, bit for bit."""
    staged, whole = trainer(policy_dir), trainer(policy_dir)
    assert isinstance(staged, StagedTrainer)
    batch = fixed_batch(staged)
    whole.train_step(batch)
    staged.train_step(batch)  # moments exist now: the next prepare must not touch them either
    before, moments = weights(staged), {i: {k: v.clone() for k, v in e.items()}
                                        for i, e in staged.optimizer.state_dict()["state"].items()}
    prepared = staged.prepare_step(batch)
    assert prepared.step == 2 and staged.step == 1
    assert_same_weights(before, weights(staged))
    for i, entry in staged.optimizer.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, moments[i][k]), (i, k)
    committed = staged.commit_step(prepared)
    assert committed == whole.train_step(batch) and staged.step == whole.step == 2
    assert_same_weights(weights(staged), weights(whole))


def test_a_step_prepared_at_another_step_is_not_committed(policy_dir):
    tr = trainer(policy_dir)
    batch = fixed_batch(tr)
    stale = tr.prepare_step(batch)
    tr.train_step(batch)
    before = weights(tr)
    with pytest.raises(ValueError, match="prepared as step 1 cannot be committed at step 2"):
        tr.commit_step(stale)
    with pytest.raises(ValueError, match="prepared as step 5"):
        tr.commit_step(PreparedStep(5, {}))
    assert tr.step == 1
    assert_same_weights(before, weights(tr))


def test_a_non_finite_loss_stops_the_prepare_before_anything_is_committed(policy_dir):
    tr = trainer(policy_dir)
    prompt, replies = [3, 4, 5], [[6, 7], [8, 9]]
    group = TrainGroup(0, 0, [Completion(prompt, r, tr.logprobs_of(prompt, r), [0, 0], reward)
                              for r, reward in zip(replies, [math.inf, 0.0])])
    before = weights(tr)
    with pytest.raises(NonFiniteTraining, match=r"^step 1: the loss is nan"):
        tr.prepare_step([group])
    assert tr.step == 0 and not any(tr.optimizer.state.values())
    assert_same_weights(before, weights(tr))


# -------------------------------------------------------------------- checkpoints


def test_a_checkpoint_resumes_to_a_bit_identical_next_step_and_holds_no_pickle(policy_dir, tmp_path):
    a = trainer(policy_dir, weight_decay=0.01)
    batch = fixed_batch(a)
    a.train_step(batch)
    a.train_step(batch)
    ckpt = tmp_path / "step_2"
    ckpt.mkdir()
    written = a.save_checkpoint(ckpt)
    assert sorted(p.name for p in written) == sorted(p.name for p in ckpt.iterdir())
    for f in ckpt.iterdir():
        assert f.suffix in (".json", ".safetensors"), f.name
        assert not f.read_bytes().startswith(b"\x80"), f"{f.name} looks like a pickle"
    next_a = a.train_step(batch)

    b = trainer(policy_dir, weight_decay=0.01)  # fresh: different weights and optimizer
    b.load_checkpoint(ckpt)
    assert b.step == 2
    next_b = b.train_step(batch)
    assert next_a == next_b
    assert_same_weights(weights(a), weights(b))
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for idx in sa:
        for key in sa[idx]:
            assert torch.equal(sa[idx][key], sb[idx][key])


def test_a_checkpoint_directory_is_a_loadable_model_directory(policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = trainer(policy_dir)
    tr.train_step(fixed_batch(tr))
    tr.save_checkpoint(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert_same_weights(weights(tr), {k: v for k, v in loaded.state_dict().items()})
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token_id == 2


def test_loading_a_checkpoint_that_lacks_a_file_is_refused_and_changes_nothing(policy_dir, tmp_path):
    tr = trainer(policy_dir)
    tr.save_checkpoint(tmp_path)
    (tmp_path / "trainer_state.safetensors").unlink()
    fresh = trainer(policy_dir)
    before = weights(fresh)
    with pytest.raises(FileNotFoundError, match="trainer_state.safetensors"):
        fresh.load_checkpoint(tmp_path)
    assert_same_weights(before, weights(fresh))
    assert fresh.step == 0


def test_training_is_deterministic_and_export_weights_is_a_detached_copy(policy_dir):
    a, b = trainer(policy_dir), trainer(policy_dir)
    batch = fixed_batch(a)
    a.train_step(batch)
    b.train_step(batch)
    assert_same_weights(weights(a), weights(b))
    exported = a.export_weights()
    assert set(exported) == {n for n, _ in a.model.named_parameters()}  # what engines load
    snapshot = {k: v.clone() for k, v in exported.items()}
    a.train_step(batch)
    assert_same_weights(exported, snapshot)  # training went on; the export did not move


def test_micro_batches_give_the_same_gradient_as_one_batch(policy_dir):
    # Gradients, not weights: Adam's first step is about lr * sign(g), which turns float
    # noise on near-zero gradients into lr-sized differences.
    whole, split = trainer(policy_dir), trainer(policy_dir, micro_batch_size=2)
    batch = fixed_batch(whole)
    mw, ms = whole.train_step(batch), split.train_step(batch)
    assert ms["loss"] == pytest.approx(mw["loss"], rel=1e-5, abs=1e-7)
    grads_split = dict(split.model.named_parameters())
    for name, p in whole.model.named_parameters():
        assert torch.allclose(p.grad, grads_split[name].grad, atol=1e-7), name
    assert max(float(p.grad.abs().max()) for p in whole.model.parameters()) > 1e-3


def test_the_kl_penalty_starts_at_zero_and_its_reference_survives_a_checkpoint(policy_dir, tmp_path):
    tr = trainer(policy_dir, kl_coef=0.1)
    batch = fixed_batch(tr)
    assert tr.train_step(batch)["kl"] == pytest.approx(0.0, abs=1e-9)
    assert tr.train_step(batch)["kl"] > 0
    tr.save_checkpoint(tmp_path)
    other = trainer(policy_dir, kl_coef=0.1)
    other.load_checkpoint(tmp_path)
    assert tr.train_step(batch) == other.train_step(batch)


def test_an_unknown_grpo_setting_is_refused_by_name():
    assert config_from_dict({"lr": 0.1}).lr == 0.1
    with pytest.raises(ValueError, match="clip_epsilon"):
        config_from_dict({"clip_epsilon": 0.2})
    with pytest.raises(ValueError, match="loss_aggregation"):
        GRPOConfig(loss_aggregation="sum")


def test_the_entropy_bonus_alone_raises_the_policys_entropy(policy_dir):
    tr = trainer(policy_dir, entropy_coef=1.0)
    flat = TrainGroup(0, 0, [on_policy(tr, [3, 4], [5, 6, 7], 0.5), on_policy(tr, [3, 4], [8, 9, 5], 0.5)])
    # Equal rewards: zero advantages, so the entropy term is the only gradient.
    first = tr.train_step([flat])["entropy"]
    for _ in range(4):
        last = tr.train_step([flat])["entropy"]
    assert last > first + 1e-3
    assert trainer(policy_dir).train_step([flat])["loss"] == 0.0  # without it: no signal


def test_huge_finite_rewards_give_the_same_advantages_as_the_same_rewards_in_a_smaller_unit():
    # A user's reward of 1e200 is finite (accepted); its square overflowed, and the run
    # ended in the CLI's backstop ("unexpected OverflowError").
    from rolloutdb.controller.training.grpo import group_advantages

    huge = group_advantages([1e300, -1e300, 0.0, 5e299])
    plain = group_advantages([1.0, -1.0, 0.0, 0.5], eps=0.0)  # eps is tiny in the huge unit
    assert all(math.isfinite(a) for a in huge)
    assert huge == pytest.approx(plain, rel=1e-9)
    assert group_advantages([1.0, -1.0, 0.0, 0.5]) == group_advantages([1.0, -1.0, 0.0, 0.5], 1e-6, True)


# ---- the importance ratio at the temperature the engine sampled at -------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_samples_the_reference_engine_drew_at_a_temperature_have_ratio_one_when_trained_at_it(
        policy_dir, temperature):
    """The reference engine reports log-softmax(logits / temperature); a trainer computing
    at temperature 1 (as before) saw on-policy samples as off-policy: ratios away from 1,
    tokens clipped, the PPO objective wrong with no stale weights anywhere."""
    from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams

    prompt = [3, 4, 5, 6]
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as engine:
        results = [engine.submit(GenerationRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=12, min_tokens=12, temperature=temperature, seed=i))).result() for i in range(4)]
    group = [TrainGroup(0, 0, [Completion(prompt, r.token_ids, r.logprobs, [0] * len(r.token_ids), float(i))
                               for i, r in enumerate(results)])]

    metrics = trainer(policy_dir, temperature=temperature).prepare_step(group).metrics
    ratio, clipped = metrics["ratio_mean"], metrics["clip_fraction"]
    assert ratio == pytest.approx(1.0, abs=1e-4) and clipped == 0.0
    for trainer_temperature, agrees in ((temperature, True), (1.0, False)):  # at 1.0: the bug, shown
        tr = trainer(policy_dir, temperature=trainer_temperature)
        gap = max(abs(a - b) for r in results for a, b in zip(tr.logprobs_of(prompt, r.token_ids), r.logprobs))
        assert gap < 1e-4 if agrees else gap > 1e-2, gap


def test_a_temperature_that_is_not_positive_is_refused_naming_the_setting():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a positive number"):
            GRPOConfig(temperature=bad)
