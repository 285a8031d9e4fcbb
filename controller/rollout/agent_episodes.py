"""What the rollout pump needs of agent servers (`environment.servers`): an episode run
whole on a server, as a future of its `EpisodeOutcome`, and the few questions the pump
asks about a prompt's server when it restores an attempt.

The pool that implements it (`AgentPool`, controller/agent_server/client.py) sits on a
floor above the pump: the pump names only this protocol, and the run hands it the pool
(tests/test_package_floors.py). The outcome is declared here because the pump reads it
and the client builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rolloutdb.gpu_capture.protocol import GenerationResult, SamplingParams
from rolloutdb.store import CallPrefix

if TYPE_CHECKING:
    from rolloutdb.controller.rollout.live_episode import LiveEpisode


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
ServedCall = Callable[["LiveEpisode", int, GenerationResult, int], None]


class AgentEpisodes(Protocol):
    """Episodes run on agent servers, keyed by the ledger's episode key."""

    # Told of every model call a server's agent made through the policy endpoint (on the
    # HTTP loop's thread): the pump meters and traces it.
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
