"""The sampler: dataloader order, target-step stamping and the staleness bound.

Order: epoch by epoch, each a seeded permutation of the dataset. A prompt's *sample
sequence number* is its position in that endless order, so the cursor is one integer and
"the prompts handed out" are exactly the positions below it (invariant 4 checks that).

Stamping: every group is stamped with the train step that will consume it. Step k trains
on policy version k-1 and produces version k. A group dispatched under version v may
train no later than step v + 1 + max_staleness, so step k may only receive groups once
the engine's version is at least k - 1 - max_staleness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolloutdb.store import Reservation


@dataclass(frozen=True)
class StalenessBound:
    max_staleness: int
    total_steps: int

    def last_admissible_step(self, policy_version: int) -> int:
        """The highest step a group dispatched now may be stamped for."""
        return min(self.total_steps, policy_version + 1 + self.max_staleness)

    def staleness(self, step: int, dispatch_version: int) -> int:
        """Policy updates between dispatching a group and training it."""
        return (step - 1) - dispatch_version


# Permutations kept: the cursor's epoch and the one before (a position handed out late,
# a spare refilled across an epoch's end). Any other is rebuilt (seeded: the same order).
# Keeping every epoch's was 8 bytes per prompt per epoch walked, for the run's life:
# 2.4 MB an epoch at 300k prompts, never freed (BENCHMARKS.md, "Per-event costs against
# the run's length").
KEPT_EPOCHS = 2


class PromptOrder:
    """Maps sampler positions to (epoch, dataset index), deterministically."""

    def __init__(self, dataset_size: int, seed: int):
        if dataset_size < 1:
            raise ValueError("the dataset is empty; nothing to sample")
        self.dataset_size = dataset_size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.pop(epoch, None)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
        self._perms[epoch] = perm  # the most recently used last
        while len(self._perms) > KEPT_EPOCHS:
            del self._perms[next(iter(self._perms))]
        return perm

    def at(self, seq: int) -> Reservation:
        epoch, offset = divmod(seq, self.dataset_size)
        return Reservation(sample_seq=seq, epoch=epoch, prompt_id=int(self._perm(epoch)[offset]))

    def take(self, start_seq: int, n: int) -> list[Reservation]:
        """The `n` prompts from position `start_seq` on, in dataloader order."""
        return [self.at(s) for s in range(start_seq, start_seq + n)]
