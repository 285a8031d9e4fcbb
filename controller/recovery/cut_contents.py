"""What a rollout snapshot's cut adds to the snapshot's file besides the store's rows, read
at the cut (snapshot_pump.py, step 4; the running calls are read just before it): the environment's export
checked against the ledger as of the cut (the copy's `env_episodes`), and at prefix level
the running calls' prefixes (its `token_chunks`), with the reason for each call that
cannot be saved (the trace's `call_fallback`)."""

from __future__ import annotations

import bisect
import dataclasses
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rolloutdb.config import EnvironmentServerSection
from rolloutdb.gpu_capture.protocol import PrefixCapture, RunningCall
from rolloutdb.controller.recovery.prefix_chunks import CutChunks, PrefixChunks, SavedCall
from rolloutdb.store import EpisodeProgress, pools, queries


# The `call_fallback` reason of a saved call's tail decoded by weights newer than the
# cut's trainer step: the call continues from the tokens before it.
NEWER_POLICY_VERSION = "newer_policy_version"


class ExportMismatch(RuntimeError):
    """The environment's export disagrees with the ledger at the cut."""


@dataclass
class EngineRead:
    """The running calls read before a cut (`CutContents.read_engine`): the engine's,
    and the rollout pump's finished but uncommitted ones, by request id."""

    calls: dict[str, RunningCall]
    hold_s: float  # how long the read held the engine's output step
    decoded: int  # the engine's decode count at the read
    # Wall-clock time of the engine read: the cut's decode point. What a call decoded
    # after it is not the cut's to keep; the snapshot's manifest and the trace's
    # `restore_done` carry it so `rolloutdb trace` counts "decoded by the cut" up to here.
    decoded_at: float = 0.0


def up_to_version(call: RunningCall, version: int) -> RunningCall:
    """The call without its tokens of a policy version newer than `version`."""
    versions = call.token_versions
    if not versions or versions[-1] <= version:
        return call
    keep = bisect.bisect_right(versions, version)  # versions only grow along a call
    return dataclasses.replace(call, token_ids=call.token_ids[:keep], logprobs=call.logprobs[:keep],
                               token_versions=versions[:keep])


@dataclass
class AtCut:
    """What the cut adds to the snapshot's file, and the engine's decode count at it."""

    episodes: list[EpisodeProgress] = field(default_factory=list)
    prefixes: list[SavedCall] = field(default_factory=list)
    chunks: CutChunks | None = None  # the prefixes' chunks, once written (`PrefixChunks.cut`)
    decoded: int | None = None
    hold_s: float | None = None  # how long the prefix read held the engine's output step
    cut_calls: list[dict] = field(default_factory=list)  # the trace's call_cut events, once published
    fallbacks: list[dict] = field(default_factory=list)  # the trace's call_fallback events, once published


def into_copy(out: sqlite3.Connection, at: AtCut) -> dict[str, int]:
    """The checked export into the snapshot's own `env_episodes`, the references to the
    running calls' chunks into its `token_chunks` (capture's `into_copy`)."""
    if at.episodes:
        pools.put_episodes(out, at.episodes)
    chunks = pools.put_chunk_references(out, at.chunks.references) if at.chunks is not None else 0
    return {"env_episodes": len(at.episodes), "token_chunks": chunks}


# The engine request id of an in-process episode's call: `g<group>.<generation>-a<attempt>-t<turn>`
# (controller/rollout/pump.py `_live`, episodes.Episode.request), and of an agent server's
# call (`<group>.<generation>-a<attempt>-t<turn>`, no `g`: the policy endpoint's `<key>-t<turn>`).
_IN_PROCESS_CALL = re.compile(r"^g([0-9]+)\.([0-9]+)-a([0-9]+)-t([0-9]+)$")
_AGENT_CALL = re.compile(r"^([0-9]+)\.([0-9]+)-a([0-9]+)-t([0-9]+)$")


def _fallback(who: dict, turn: int, call: RunningCall, reason: str, tokens: int | None = None) -> dict:
    """A `call_fallback` event: the call's attempt (`who`), its turn, why the cut did not
    keep it, and how many of its tokens (all it had at the read, or `tokens`) that cost."""
    return {**who, "turn": turn, "reason": reason,
            "policy_version": call.token_versions[-1] if call.token_versions else None,
            "tokens": call.end if tokens is None else tokens}


@dataclass
class CutContents:
    """One attempt's view of what its cut must check and may save: filled by the attempt's
    environment phase before the cut, read inside the cut's read transaction."""

    servers: Sequence[EnvironmentServerSection] = ()  # environment.servers: an agent call's server
    # Prefix level: the rollout pump's `uncommitted_calls` (calls finished but not yet committed).
    uncommitted_calls: Callable[[], dict] | None = None
    retired: set[str] = field(default_factory=set)  # the keys this attempt's retire named
    export: dict[str, dict] = field(default_factory=dict)  # the environment's export, read after drain
    expected: set[str] = field(default_factory=set)  # the attempts the servers acknowledged before it

    def checked_export(self, conn: sqlite3.Connection) -> list[EpisodeProgress]:
        """The environment's export, checked against the ledger as of the cut, as the
        rows the snapshot's `env_episodes` gets (attempts still running at the cut).

        Refused (the attempt fails with this message, nothing is published): a key the
        ledger does not know or that this attempt retired (the server kept an episode it
        was told to forget), and an attempt the server had acknowledged before the
        export, that the ledger still runs at the cut, missing from it (the server lost
        an agent). An exported attempt that finished after the export is dropped: its
        sample is in the cut; so is one whose group settled meanwhile (trained or
        discarded: its rows have left the live store, `queries.settled_episode_keys`)."""
        export, expected = self.export, self.expected
        if not export and not expected:
            return []
        known = queries.attempts_by_key(conn, set(export) | expected)
        settled = queries.settled_episode_keys(conn, [k for k in export if k not in known])
        unknown = sorted(k for k in export if (k not in known and k not in settled) or k in self.retired)
        missing = sorted(k for k in expected if known.get(k, (0, ""))[1] == "running" and k not in export)
        if unknown or missing:
            said = []
            if unknown:
                said.append(f"{len(unknown)} unknown or retired episodes ({', '.join(unknown[:3])})")
            if missing:
                said.append(f"{len(missing)} running attempts missing ({', '.join(missing[:3])})")
            raise ExportMismatch(f"the environment's export disagrees with the ledger at the cut: {'; '.join(said)}; "
                                 "the snapshot was refused")
        rows = []
        for key, agent in sorted(export.items()):
            attempt_id, state = known.get(key, (0, "settled"))
            if state != "running":
                continue
            rollout, attempt = key.rsplit("-a", 1)
            group, generation = rollout.split(".", 1)
            rows.append(EpisodeProgress(
                attempt_id=attempt_id, group_id=int(group), generation_index=int(generation), attempt=int(attempt),
                turn=agent["turn"], state=agent["state"], token_ids=agent.get("token_ids"),
                logprobs=agent.get("logprobs"), token_versions=agent.get("token_versions")))
        return rows

    def read_engine(self, engine: PrefixCapture, since: Mapping[str, int] | None = None) -> EngineRead:
        """The running calls a prefix cut may save, read BEFORE the cut and outside the
        commit lock (snapshot_pump.py `_cut` has the order): the engine's calls from the
        offsets `since` names on, then the rollout pump's uncommitted calls.

        Why reading before the cut is consistent: the engine read is the cut's decode
        point, so what the cut owes is the tokens decoded by then. A call running at
        the read either still runs at the cut (the ledger runs its attempt: its tokens
        are saved), or finished meanwhile: then its result is in the cut's samples (its
        batch committed before the cut: the ledger's attempt is `finished`, nothing to
        save) or not yet committed, and then it is in the pump's uncommitted calls,
        which are read after the engine: the engine finishes a call under the lock its
        read takes, and the pump's `uncommitted_calls` finds it in transit or absorbed
        (`RolloutPump.uncommitted_calls`). A call that starts after the read starts a
        turn the cut's ledger may already show committed: it resumes from that turn's
        start, having decoded nothing the cut owed. Tokens decoded after the read are
        not "decoded by the cut" and are not saved; nor is any token of a policy
        version newer than the cut's trainer step (`prefixes_at_cut`)."""
        decoded_at = time.time()
        calls = dict(engine.running_calls(since))  # ours to extend: the engine's answer stays as it gave it
        read = EngineRead(calls, engine.cut_hold_s, engine.decoded_rows, decoded_at)
        if self.uncommitted_calls is not None:
            # A call in both (it finished between the two reads) is kept whole, from the
            # pump: the longer of the two, and a finished call resumes to its end at once.
            for rid, call in self.uncommitted_calls().items():
                if rid not in calls or call.end >= calls[rid].end:
                    calls[rid] = call
        return read

    def prefixes_at_cut(self, conn: sqlite3.Connection, read: EngineRead, at: AtCut, version: int,
                        durable: PrefixChunks) -> None:
        """The running calls' prefixes that belong to the cut, inside its read
        transaction (the commit lock already released): the calls read before the cut
        (`read_engine`) matched to attempts the ledger runs at the cut whose saved
        episode is at the call's turn (a call whose previous turn is not yet committed
        at the cut would resume into the wrong turn: it restarts its turn). An agent
        server's call is matched the same way against the export checked at this cut
        (`at.episodes`), by its server's mode (`_agent_call`). A call of a turn the cut
        has committed has nothing left to save. Every other token read and not kept is
        a `call_fallback` of the trace with its reason and count (`rolloutdb trace`
        reports the tokens decoded by the cut that were neither kept nor given a reason:
        none, unless this accounting is wrong). No token of a policy version newer than
        `version` (the cut's trainer step) is saved: the anchor's weights did not decode
        it, so a resume could not continue from it (versions only grow along a call, so
        that is a truncation, traced as NEWER_POLICY_VERSION). `durable`: what earlier
        snapshots made durable of each call, which a call read from an offset continues."""
        at.hold_s = read.hold_s  # the output step's wait, not ours for the step in progress
        at.decoded = read.decoded
        calls = read.calls
        # An in-process attempt may have two: a finished turn's call not yet committed and
        # the next turn's call already running; the one at the saved episode's turn is kept.
        wanted: dict[str, dict[int, tuple[str, RunningCall]]] = {}
        remote: set[str] = set()
        servers = self.servers
        for rid, call in calls.items():
            m = _IN_PROCESS_CALL.match(rid)
            if m is not None and call.end:
                wanted.setdefault(f"{m[1]}.{m[2]}-a{m[3]}", {})[int(m[4])] = (rid, call)
            elif servers and (m := _AGENT_CALL.match(rid)) is not None:
                # Empty ones too: a restart_only server's call falls back whatever it decoded.
                wanted.setdefault(f"{m[1]}.{m[2]}-a{m[3]}", {})[int(m[4])] = (rid, call)
                remote.add(f"{m[1]}.{m[2]}-a{m[3]}")
        if not wanted:
            return
        known = queries.attempts_by_key(conn, wanted)
        running = {key: attempt_id for key, (attempt_id, state) in known.items() if state == "running"}
        turns = queries.episode_turns(conn, [a for k, a in running.items() if k not in remote])
        exported = {ep.attempt_id: ep.turn for ep in at.episodes}
        prompts = queries.group_prompts(conn, (int(k.split(".", 1)[0]) for k in running))
        for key, attempt_id in sorted(running.items()):
            by_turn = wanted[key]
            rollout, attempt = key.rsplit("-a", 1)
            group, generation = (int(x) for x in rollout.split(".", 1))
            prompt_id, step = prompts.get(group, (None, None))
            who = {"attempt_id": attempt_id, "group_id": group, "prompt_id": prompt_id, "generation_index": generation,
                   "attempt": int(attempt), "step": step}
            if key in remote:
                turn = max(by_turn)
            else:
                turn = turns.get(attempt_id, 0)  # the saved episode's turn: the call it continues
                for later in sorted(t for t in by_turn if t > turn):
                    # A turn before it was not committed by the cut (the pump's flush after
                    # the read commits it unless the flush timed out): it restarts from `turn`.
                    at.fallbacks.append(_fallback(who, later, by_turn[later][1], "turn_not_committed"))
                if turn not in by_turn:
                    continue  # any earlier call's turn is committed at the cut, whole: nothing more to save
            rid, call = by_turn[turn]
            if call.cut_refused:  # the engine could not continue it exactly (cut_support): its turn restarts
                reason = call.cut_refused
            elif key in remote:
                reason = self._agent_call(servers, prompt_id, attempt_id, turn, exported)
            else:
                reason = None
            if reason is not None:
                at.fallbacks.append(_fallback(who, turn, call, reason))
                continue
            kept = up_to_version(call, version)
            if kept.end < call.end:  # decoded by weights newer than the anchor's: decoded again after a stop
                at.fallbacks.append(_fallback(who, turn, call, NEWER_POLICY_VERSION, call.end - kept.end))
            call = kept
            if not call.end:
                continue  # nothing decoded yet: nothing to keep, nothing lost
            if not durable.can_continue(rid, attempt_id, call):  # not reached: the offsets asked were durable's
                at.fallbacks.append(_fallback(who, turn, call, "prefix_offset_unknown"))
                continue
            at.prefixes.append(SavedCall(rid, attempt_id, turn, call))
            version_at_end = call.token_versions[-1] if call.token_versions else durable.last_version(rid)
            at.cut_calls.append({k: v for k, v in who.items() if k != "attempt_id"}
                                | {"policy_version": version_at_end, "tokens": call.end})

    @staticmethod
    def _agent_call(servers: Sequence[EnvironmentServerSection], prompt_id: int | None, attempt_id: int, turn: int,
                    exported: dict[int, int]) -> str | None:
        """Why an agent server's call running at the cut cannot be saved, or None when it
        can. An `export_restore` agent continues from its exported turn (`turn` finished
        turns: its next call is that turn) and makes that turn's call again with the
        same prompt, seed and limits, so a call of exactly that turn continues from its
        prefix; a call of a later turn started after the export (its turn restarts). A
        `stateless` server's episode has one turn that restarts identically (same prompt,
        same seed): its turn-0 call continues too. A `restart_only` server's agents
        restart from turn 0 with state the store never saw: its calls fall back."""
        if prompt_id is None:
            return "unknown_prompt"
        spec = servers[prompt_id % len(servers)]  # the pool's rule (AgentPool.server_for)
        if spec.mode == "restart_only":
            return f"restart_only_server:{spec.name}"
        if spec.mode == "stateless":
            return None if turn == 0 else f"stateless_server_turn:{spec.name}"
        if attempt_id not in exported:
            return f"not_exported:{spec.name}"
        return None if exported[attempt_id] == turn else f"export_at_other_turn:{spec.name}"
