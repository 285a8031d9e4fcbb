"""The environment side of a rollout snapshot.

A backend whose environment holds rollout state between turns (an agent server) must
stop new work, bring its episodes to a consistent point, and export them at the same cut
as the store. `EnvironmentCheckpoint` is that protocol; the snapshot pump calls its members
in this order:

    retire(abandoned)   forget episodes of attempts the ledger abandoned
    prepare()           close new dispatch, pause deadlines
    commit()            make the prepared state the one to export
    drain()             wait until no turn is half applied
    -- the cut: export() is read and checked against the ledger as of the cut --
    resume()            reopen dispatch, restart deadlines (always called)

A resume runs the rest of its setup inside `restore_scope(episodes)`
(controller/job/controller.py): a context manager that installs the saved episodes (the
restored snapshot's `env_episodes`, keyed by the stopped run's attempts' episode keys) and
removes them again if anything later fails. The agent servers' backend implements it over
HTTP (controller/agent_server/client.py).

`NoEnvironmentCheckpoint` is the backend for environments that keep nothing between
snapshots (the embedded digit task replays its episodes from the ledger).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class EnvironmentCheckpoint(Protocol):
    holds_rollout_state: bool

    def retire(self, abandoned_episode_keys: Sequence[str]) -> None:
        """Forget episodes whose attempts the ledger abandoned."""
        ...

    def prepare(self) -> None:
        """Stop starting new turns and pause deadlines; turns in progress go on."""
        ...

    def commit(self) -> None:
        """Fix the episode state the coming export will return."""
        ...

    def drain(self) -> None:
        """Return once no turn is half applied."""
        ...

    def export(self) -> dict[str, dict]:
        """episode key (`<group>.<generation>-a<attempt>`) -> JSON-able state."""
        ...

    def resume(self) -> None:
        """Reopen dispatch and deadlines. Called after every prepare, even on failure."""
        ...

    def restore_scope(self, episodes: dict[str, dict]) -> contextlib.AbstractContextManager[None]:
        """Install saved episodes; undo the install if the block raises."""
        ...


class NoEnvironmentCheckpoint:
    """An environment that keeps no rollout state between snapshots."""

    holds_rollout_state = False

    def retire(self, abandoned_episode_keys: Sequence[str]) -> None:
        pass

    def prepare(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def export(self) -> dict[str, dict]:
        return {}

    def resume(self) -> None:
        pass

    @contextlib.contextmanager
    def restore_scope(self, episodes: dict[str, dict]) -> Iterator[None]:
        if episodes:
            raise ValueError(
                f"the snapshot holds {len(episodes)} environment episodes but this environment keeps none; "
                "resume with the environment backend the run was started with"
            )
        yield
