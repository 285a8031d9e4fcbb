"""The seams of the controller: what a trainer, an environment and a dataset must offer.
Small on purpose, so another trainer can implement them. The generation engine's
protocol lives in `rolloutdb.gpu_capture.protocol`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass
class Completion:
    """One finished generation of a group, as the trainer receives it."""

    prompt_ids: list[int]
    token_ids: list[int]  # the policy's output tokens (all turns, concatenated)
    logprobs: list[float]  # generating policy's log-probabilities of token_ids
    token_versions: list[int]  # policy version that produced each token
    reward: float
    # 1 where the policy produced the token, 0 where the environment did (multi-turn).
    loss_mask: list[int] | None = None


@dataclass
class TrainGroup:
    group_id: int
    prompt_id: int
    completions: list[Completion]


class NonFiniteTraining(ValueError):
    """A step met a non-finite number (a sample's logprob, the loss, the gradient, the
    weights an optimizer step made) and stops the run before that step is committed,
    refit or checkpointed. A trainer raises it too; the message is one line."""

    def __init__(self, step: int, what: str, value: float, advice: str):
        super().__init__(f"step {step}: {what} is {value}, so the run stops before that step is committed, "
                         f"refit or checkpointed; {advice}")
        self.step = step
        self.what = what
        self.value = value


@runtime_checkable
class Trainer(Protocol):
    """Trains the policy on batches of finished groups."""

    @property
    def step(self) -> int:
        """Optimizer steps completed so far (0 before the first)."""
        ...

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One optimizer step on these groups, all under the commit lock unless a `StagedTrainer`; returns metrics."""
        ...

    def export_weights(self) -> Mapping[str, Any]:
        """The policy weights to push to the engine at a refit."""
        ...

    def save_checkpoint(self, directory: Path) -> list[Path]:
        """Write the trainer's state (weights in safetensors, the rest as JSON) into an
        existing empty directory; return the files written (publishing is the caller's)."""
        ...

    def load_checkpoint(self, directory: Path) -> None:
        """Restore from a directory written by save_checkpoint. Never unpickles."""
        ...


@runtime_checkable
class StagedTrainer(Protocol):
    """Optional, beside `Trainer`: the train pump runs `prepare_step` holding no lock (snapshots are cut meanwhile)
    and only `commit_step` under the commit lock, never `train_step` (offer it as the two in a row); why a cut
    taken during `prepare_step` is consistent: controller/training/pump.py."""

    def prepare_step(self, groups: Sequence[TrainGroup]) -> Any:
        """Forward, backward, loss and gradient checks, leaving `step`, weights and optimizer state as they were."""
        ...

    def commit_step(self, prepared: Any) -> dict[str, float]:
        """Apply what prepare_step returned: the optimizer step, the weight check, `step` + 1; returns the metrics."""
        ...


@dataclass
class CheckpointState:
    """A trainer's state at a step boundary, its tensors the trainer's own copies, for a writer thread
    (`checkpointing.async`; training/checkpoints.py write_checkpoint_state): per plain file name, `tensors`
    a safetensors file, `documents` a JSON file, `copies` a file that never changes during the run."""

    tensors: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # file -> {name: tensor}
    documents: dict[str, Any] = field(default_factory=dict)  # file -> JSON-able value
    copies: dict[str, Path] = field(default_factory=dict)  # file -> source file
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # safetensors header, per file


@runtime_checkable
class AsyncCheckpointing(Protocol):
    """Optional, beside `Trainer`: what `checkpointing.async: true` needs (without it: synchronous only)."""

    def checkpoint_state(self) -> CheckpointState:
        """Copy the state (to CPU memory) at a step boundary, on the train pump; the
        files `load_checkpoint` reads are written from the copy while training goes on.
        Called again only once the previous state is written: buffers may be reused."""
        ...


@dataclass
class Turn:
    """What the environment says after a policy turn."""

    observation_ids: list[int]  # tokens to append before the policy's next turn
    done: bool
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A (possibly multi-turn) task with a reward computed by code. Episode state is a
    JSON-able dict so it can be exported at a cut and restored."""

    max_turns: int

    def start(self, prompt_id: int) -> tuple[list[int], dict]:
        """Begin an episode for a dataset prompt: (prompt token ids, episode state)."""
        ...

    def step(self, state: dict, reply_ids: Sequence[int]) -> tuple[Turn, dict]:
        """Take the policy's reply; return the environment's turn and the new state."""
        ...

    def score(self, state: dict) -> float:
        """The episode's reward, once done (or at max_turns)."""
        ...


@runtime_checkable
class ReplyLimits(Protocol):
    """Optional, beside `Environment`: an environment that sets the length of each reply
    itself (a task whose answers have a known, varying length). The rollout pump asks
    before every call and uses min(max_tokens, generation.max_tokens) and
    min(min_tokens, that); an environment without it gets generation's limits."""

    def reply_limits(self, state: dict) -> tuple[int, int]:
        """(min_tokens, max_tokens) of the policy's next reply in this episode."""
        ...


@runtime_checkable
class PromptDataset(Protocol):
    """Prompts addressed by dataset index; the sampler decides the order."""

    def __len__(self) -> int: ...

    def fingerprint(self) -> str:
        """A stable hash of the dataset's content; a restore refuses a different one."""
        ...
