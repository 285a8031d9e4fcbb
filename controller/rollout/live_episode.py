"""What the rollout pump tracks for each episode it runs, between the engine and the store.

An episode in flight has one model call at a time; the pump keeps the call's limits and
the engine's cut verdict beside it, because a prefix-level cut may have to save that call
(running, in transit, or finished but not yet committed) and a resumed call must be
started with the same limits to be the same call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.rollout.episodes import Episode
from rolloutdb.gpu_capture.protocol import GenerationResult, RunningCall
from rolloutdb.store import CallPrefix, EpisodeProgress


@dataclass(eq=False)
class LiveEpisode:
    """An episode the pump runs, with the group and generation it belongs to."""

    group: GroupHandle
    index: int
    attempt_id: int | None
    attempt: int
    episode: Episode
    from_attempt: int | None = None  # the abandoned attempt whose saved turns it continues
    continue_from: str | None = None  # on an agent server: the installed agent it continues
    prefix: CallPrefix | None = None  # prefix level: the restored call's output so far
    prefix_len: int = 0  # tokens the current call was resumed with (not decoded by it)
    limits: tuple[int, int] = (0, 0)  # the current call's (max_tokens, min_tokens)
    cut_refused: str | None = None  # the engine's cut_support verdict on the current call (kept till it commits)
    # (attempt id, transcript tokens) its last committed save wrote: the next save of the
    # same attempt appends only what came after (pools.put_episodes); another attempt
    # (a retry, a resumed episode) writes its transcript whole once.
    saved: tuple[int | None, int] = (None, 0)

    def progress(self) -> EpisodeProgress:
        e = self.episode
        assert self.attempt_id is not None, "turn-level recovery needs ledger dispatch"
        return EpisodeProgress(attempt_id=self.attempt_id, group_id=self.group.group_id,
                               generation_index=self.index, attempt=self.attempt, turn=e.turn,
                               state=e.state, token_ids=e.token_ids, logprobs=e.logprobs,
                               token_versions=e.token_versions,
                               saved_tokens=self.saved[1] if self.saved[0] == self.attempt_id else 0)

    def saved_by(self, row: EpisodeProgress) -> None:
        """Record what a committed save (`row`, from `progress`) wrote."""
        self.saved = (row.attempt_id, len(row.token_ids) if row.token_ids is not None else 0)


@dataclass
class GroupRun:
    handle: GroupHandle
    outstanding: set[int] = field(default_factory=set)  # generation indices still running


def whole_call(result: GenerationResult, live: LiveEpisode) -> RunningCall:
    """A finished call as a complete prefix: resumed, it ends at once with this output.
    Its sampler is the one its engine reported (`extra["sampler"]`), so the resumed call
    is reported bitwise where the engine that decoded it resumes it."""
    return RunningCall(list(result.token_ids), list(result.logprobs), list(result.token_versions), *live.limits,
                       live.cut_refused, sampler=(result.extra or {}).get("sampler"))
