"""Episodes on agent servers (`environment.servers`), as the rollout pump runs them: each
attempt's episode runs whole on its prompt's server, and the pump sees one future per
episode, of its `EpisodeOutcome` (`AgentServerEpisodes`, the other implementation of
`EpisodesInFlight` beside controller/rollout/calls.py's `EngineCalls`).

The pool that runs them (`AgentPool`, controller/agent_server/client.py) sits on a floor
above the pump: the pump names only the narrow protocol it uses of it (`AgentEpisodes`),
and the run hands it the pool (tests/test_package_floors.py). `EpisodeOutcome` is declared
here because the pump reads it and the client builds it.

An episode the server lost (it died, or the deadline passed) is abandoned with that
reason and started again in the same batch; a server that loses every episode it is
given stops the run (`MAX_LOST_IN_A_ROW`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from rolloutdb.controller.rollout.calls import end_episode
from rolloutdb.controller.rollout.episodes import Episode
from rolloutdb.controller.rollout.group_commit import CommitBatch, RolloutMeter
from rolloutdb.controller.rollout.live_episode import GroupRun, LiveEpisode
from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import GenerationResult, RunningCall, SamplingParams
from rolloutdb.store import CallPrefix, SavedEpisode, pools

# Episodes an agent server may lose in a row (every one since its last finished episode)
# before the run stops: a server that comes back and fails every episode is broken.
MAX_LOST_IN_A_ROW = 1000


@dataclass
class EpisodeOutcome:
    status: str  # "finished", or an abandon reason: "error", "deadline"
    server: str
    turn: int = 0
    reward: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    restarted: bool = False  # asked to continue an installed agent the server no longer had


# (the episode that made the call, its turn, the call's result, the restored prefix's tokens in it)
ServedCall = Callable[[LiveEpisode, int, GenerationResult, int], None]


class AgentEpisodes(Protocol):
    """Episodes run on agent servers, keyed by the ledger's episode key."""

    # Told of every model call a server's agent made through the policy endpoint (on the
    # HTTP loop's thread).
    on_call: ServedCall | None

    def run(self, owner: LiveEpisode, *, key: str, prompt_id: int, seed: int, params: SamplingParams,
            continue_from: str | None = None, prefix: CallPrefix | None = None,
            prefix_turn: int = 0) -> Future[EpisodeOutcome]:
        """Run one attempt's episode on its prompt's server; `owner` comes back with each
        of its calls (`on_call`). `continue_from`: the installed agent it continues;
        `prefix`: the output its call of turn `prefix_turn` had decoded at the restored cut."""
        ...

    def exports(self, prompt_id: int) -> bool:
        """Whether this prompt's server exports its agents at a cut (so a restore continues them)."""
        ...

    def continues_prefix(self, prompt_id: int, continued: bool) -> bool:
        """Whether a restored call's prefix applies to this prompt's new attempt."""
        ...


class AgentServerEpisodes:
    """The rollout pump's episodes in flight on agent servers: each future in `running` is
    a whole episode. `groups`: the pump's map of the groups it runs, as `EngineCalls`'s."""

    def __init__(self, *, agents: AgentEpisodes, params: SamplingParams, batch: CommitBatch, meter: RolloutMeter,
                 trace: RolloutTrace, stop: threading.Event, groups: dict[int, GroupRun],
                 done: queue.SimpleQueue[Future]):
        self.agents = agents
        self.params = params
        self.batch = batch
        self.meter = meter
        self.trace = trace
        self.stop = stop
        self.groups = groups
        self.done = done
        self.running: dict[Future[EpisodeOutcome], LiveEpisode] = {}
        self._lost_in_a_row: dict[str, int] = {}
        agents.on_call = self._served_call

    def episode(self, group: GroupHandle, index: int, attempt_id: int | None, attempt: int, seed: int,
                saved: SavedEpisode | None, prefix: CallPrefix | None) -> LiveEpisode:
        """An episode an agent server runs, keyed by the ledger's episode key. The Episode
        only carries what the pump reports (the server holds the real one); a restored one
        continues the agent its server exported (installed), and its cut call from its prefix."""
        key = pools.episode_key(group.group_id, index, attempt)
        episode = Episode(key=key, prompt_ids=[], state={}, seed=seed, max_turns=0)
        live = LiveEpisode(group, index, attempt_id, attempt, episode)
        if saved is not None and saved.token_ids is not None and self.agents.exports(group.reservation.prompt_id):
            live.continue_from, live.from_attempt = saved.key, saved.attempt
            episode.turn, episode.token_ids = saved.turn, list(saved.token_ids)
            episode.logprobs, episode.token_versions = list(saved.logprobs or []), list(saved.token_versions or [])
        if prefix is not None and self.agents.continues_prefix(group.reservation.prompt_id, live.continue_from is not None):
            live.prefix = prefix
        return live

    def submit(self, live: LiveEpisode) -> None:
        future = self.agents.run(live, key=live.episode.key, prompt_id=live.group.reservation.prompt_id,
                                 seed=live.episode.seed, params=self.params, continue_from=live.continue_from,
                                 prefix=live.prefix, prefix_turn=live.episode.turn)
        self.running[future] = live
        future.add_done_callback(self.done.put)

    def in_flight(self) -> int:
        return len(self.running)

    # An agent's model calls reach the engine through the policy endpoint, never through
    # this pump: it holds no finished call a cut would have to save.
    def take_batch_calls(self) -> list[str]:
        return []

    def committed(self, request_ids: list[str]) -> None:
        pass

    def uncommitted_calls(self) -> dict[str, RunningCall]:
        return {}

    def abort_running(self) -> None:
        pass  # the episodes end when the controller closes its policy endpoint (their calls fail)

    def _served_call(self, live: LiveEpisode, turn: int, result: GenerationResult, prefix_tokens: int = 0) -> None:
        """An agent server's model call for `live` (HTTP loop's thread), less its restored prefix."""
        self.meter.call()
        self.trace.call_finished(live.group, live.index, turn=turn, tokens=len(result.token_ids) - prefix_tokens,
                                 finish_reason=result.finish_reason,
                                 prefix_exactness=(result.extra or {}).get("prefix_exactness"))

    def on_done(self, future: Future) -> None:
        """An agent server's episode ended: its sample goes in the batch; an episode the
        server lost is abandoned with that reason and started again in the same batch."""
        live = self.running.pop(future)
        outcome = future.result()  # a protocol error fails the pump, and the run
        if outcome.status != "finished":
            if self.stop.is_set():
                return  # the controller is stopping: a resume redoes it
            lost = self._lost_in_a_row[outcome.server] = self._lost_in_a_row.get(outcome.server, 0) + 1
            if lost > MAX_LOST_IN_A_ROW:
                raise RuntimeError(f"agent server {outcome.server} lost {lost} episodes in a row; the last: "
                                   f"{outcome.error} (see logs/agent_server_{outcome.server}.log)")
            self.batch.add_retry(live, outcome.status)
            return
        self._lost_in_a_row[outcome.server] = 0
        e = live.episode
        e.turn, e.reward, e.done = outcome.turn, outcome.reward, True
        e.token_ids, e.logprobs, e.token_versions = outcome.token_ids, outcome.logprobs, outcome.token_versions
        e.finish_reasons = outcome.finish_reasons
        end_episode(live, self.batch, self.groups)
