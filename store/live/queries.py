"""Every read the controller's pumps make, by name, so no pump builds SQL.

Each function takes a connection with an open transaction: `Store.read()` for a read on
its own, or the `Store.atomic()` connection when the read decides what the same write
transaction does next (which groups of a wave to discard, the tokens of the groups
being published). A few take either a SQLAlchemy connection or the raw `sqlite3`
connection of a snapshot cut (`capture_snapshot(at_cut=...)`).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from ..sqlite.prepared import Prepared, _driver, in_json, json_ids
from . import codec, payload
from .compaction import OPEN, STAMP_COLUMNS, TRAINED, Prefix, check_types, decode_row, read_prefix
from .pools import episode_key
from .schema import ROLLOUT_STATES, T

_samples = T["samples"]
_replay = T["replay_groups"]
_groups = T["prompt_groups"]
_rollouts = T["rollouts"]
_shortfall = T["step_shortfall"]
_settled = T["settled_steps"]

# The reads a group-commit batch makes, compiled once (`Prepared`, see ledger.py).
_REPLAY_ROOM = Prepared(
    select(T["run_meta"].c.replay_capacity - select(func.count()).select_from(_replay).scalar_subquery())
)
_ATTEMPT_NUMBERS = Prepared(select(_rollouts.c.attempt_id, _rollouts.c.attempt).where(in_json(_rollouts.c.attempt_id)))
_SAMPLE_TOKENS = Prepared(
    select(_samples.c.group_id, func.sum(_samples.c.num_tokens)).where(in_json(_samples.c.group_id)).group_by(_samples.c.group_id)
)
_SAMPLE_REWARDS = Prepared(select(_samples.c.group_id, _samples.c.reward).where(in_json(_samples.c.group_id)))
_VERSION_TOKEN_COUNTS = Prepared(
    select(_samples.c.group_id, _samples.c.version_token_counts).where(in_json(_samples.c.group_id))
)


def highest_stamped_step(conn: Connection) -> int | None:
    """The highest train step any prompt was stamped for (shortfall, ledger, settled
    steps or replay): a resumed rollout pump continues after it. None in a store that
    stamped nothing."""
    tops = [
        conn.execute(select(func.max(_shortfall.c.step))).scalar(),
        conn.execute(select(func.max(_replay.c.target_step))).scalar(),
        conn.execute(select(func.max(_groups.c.target_step))).scalar(),
        # Settled groups (compaction.py): the stamped step of the trained ones. A discarded
        # group's stamp is not kept, and need not be: its step's refill carries the same
        # stamp (a live row) or the step's shortfall row does until one is reserved.
        conn.execute(select(func.max(_settled.c.target_step))).scalar(),
    ]
    found = [t for t in tops if t is not None]
    return max(found) if found else None


def replay_room(conn: Connection) -> int:
    """Free replay permits: how many sealed groups may enter the replay buffer now."""
    (room,) = _REPLAY_ROOM.run(conn).fetchone()
    return max(0, room)


def highest_group_id(conn: Connection) -> int:
    """The highest group id in the replay buffer or the samples (0 if none): without the
    ledger the controller mints group ids above it."""
    return max(
        conn.execute(select(func.max(_replay.c.group_id))).scalar() or 0,
        conn.execute(select(func.max(_samples.c.group_id))).scalar() or 0,
    )


def attempt_numbers(conn: Connection, attempt_ids: Sequence[int]) -> dict[int, int]:
    """attempt id -> its attempt number within its generation (0, 1, ...)."""
    return dict(_ATTEMPT_NUMBERS.run(conn, {"ids": json_ids(attempt_ids)}).fetchall())


def sample_tokens(conn: Connection, group_ids: Sequence[int]) -> dict[int, int]:
    """group id -> tokens over its samples (groups without samples are absent)."""
    return dict(_SAMPLE_TOKENS.run(conn, {"ids": json_ids(group_ids)}).fetchall())


def sample_rewards(conn: Connection, group_ids: Sequence[int]) -> dict[int, list[float]]:
    """group id -> the rewards of its samples (a restored group's earlier ones too)."""
    rewards: dict[int, list[float]] = {}
    for gid, reward in _SAMPLE_REWARDS.run(conn, {"ids": json_ids(group_ids)}).fetchall():
        rewards.setdefault(gid, []).append(reward)
    return rewards


def version_token_counts(conn: Connection, group_ids: Sequence[int]) -> dict[int, dict[int, int]]:
    """group id -> {policy version: tokens it produced}, over all the group's samples."""
    out: dict[int, dict[int, int]] = {}
    rows = _VERSION_TOKEN_COUNTS.run(conn, {"ids": json_ids(group_ids)}).fetchall()
    for gid, text in rows:
        counts = out.setdefault(gid, {})
        for v, n in codec.decode_version_counts(text):
            counts[v] = counts.get(v, 0) + n
    return out


def replay_groups_for_step(conn: Connection, step: int) -> list[int]:
    """Ids of the groups in the replay buffer stamped for `step`, oldest first."""
    return list(
        conn.execute(select(_replay.c.group_id).where(_replay.c.target_step == step).order_by(_replay.c.group_id)).scalars()
    )


def samples_of(conn: Connection, group_ids: Sequence[int], segments_dir: Any = None) -> list[Any]:
    """The samples of `group_ids` as rows (group_id, generation_index, prompt_id,
    token_ids, logprobs, reward, version_token_counts), by group then generation; the
    payload columns are still encoded (`codec`), taken inline or from the payload
    segment each sample references under `segments_dir` (`payload.read_samples`, the
    one reader of payload; `Store.samples_of` passes the store's own)."""
    return payload.read_samples(conn, group_ids, segments_dir)


_EPISODES_IN_STATE = "SELECT group_id, generation_index, attempt FROM rollouts WHERE state = ?"


def episode_keys(conn: Connection | sqlite3.Connection, state: str, *, except_reason: str | None = None) -> list[str]:
    """The episode keys (`pools.episode_key`) of the attempts in `state` ('running',
    'abandoned', ...), leaving out those abandoned with `except_reason`. Also over the raw
    connection of a snapshot cut. 'abandoned' reads the partial index of the abandoned
    attempts (ix_rollouts_abandoned; SQLite plans with the bound value): the snapshot pump
    reads them at every snapshot with agent servers."""
    if state not in ROLLOUT_STATES:
        raise ValueError(f"rollout state {state!r} unknown; use one of {', '.join(ROLLOUT_STATES)}")
    rows: Sequence[Any]
    sql, args = _EPISODES_IN_STATE, [state]
    if except_reason is not None:
        sql, args = sql + " AND abandon_reason IS NOT ?", [state, except_reason]
    if isinstance(conn, sqlite3.Connection):
        rows = conn.execute(sql, args).fetchall()
    else:
        rows = conn.exec_driver_sql(sql, tuple(args)).all()
    return [episode_key(g, i, a) for g, i, a in rows]


_ATTEMPTS_OF_KEYS = """SELECT r.group_id, r.generation_index, r.attempt, r.attempt_id, r.state
FROM json_each(?) AS k JOIN rollouts AS r
  ON r.group_id = json_extract(k.value, '$[0]') AND r.generation_index = json_extract(k.value, '$[1]')
 AND r.attempt = json_extract(k.value, '$[2]')"""


def attempts_by_key(conn: Connection | sqlite3.Connection, keys: Iterable[str]) -> dict[str, tuple[int, str]]:
    """episode key -> (attempt id, state) for the keys the ledger knows; keys it does not
    know (or that are not episode keys) are left out. Also over a snapshot cut's raw
    connection (the snapshot pump checks an environment's export with it)."""
    parts = []
    for key in keys:
        try:
            rollout, attempt = key.rsplit("-a", 1)
            group, generation = rollout.split(".", 1)
            parts.append([int(group), int(generation), int(attempt)])
        except ValueError:
            continue
    if not parts:
        return {}
    arg = (json.dumps(parts),)
    rows = conn.execute(_ATTEMPTS_OF_KEYS, arg).fetchall() if isinstance(conn, sqlite3.Connection) \
        else conn.exec_driver_sql(_ATTEMPTS_OF_KEYS, arg).all()
    return {episode_key(g, i, a): (attempt_id, state) for g, i, a, attempt_id, state in rows}


# Group ids are AUTOINCREMENT (revision v1_4_a) and only compaction deletes a group row,
# so an id at or under the sequence's high water without a row is a settled group's.
_GROUPS_SETTLED = """SELECT k.value FROM json_each(?) AS k
WHERE k.value >= 1 AND k.value <= (SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'prompt_groups')
  AND NOT EXISTS (SELECT 1 FROM prompt_groups AS g WHERE g.group_id = k.value)"""


def settled_episode_keys(conn: Connection | sqlite3.Connection, keys: Iterable[str]) -> set[str]:
    """The episode keys among `keys` whose group has settled (trained or discarded) and
    left the live store: its id was handed out (at or under the `prompt_groups`
    AUTOINCREMENT high water, ids start at 1) and the ledger no longer has it. A key of
    a live group, of an id never handed out, or not an episode key is left out. Which generation and
    attempt a settled group had is gone with its rows, so only the group id is checked.
    Also over a snapshot cut's raw connection."""
    by_group: dict[int, list[str]] = {}
    for key in keys:
        try:
            rollout, _attempt = key.rsplit("-a", 1)
            group, _generation = rollout.split(".", 1)
            by_group.setdefault(int(group), []).append(key)
        except ValueError:
            continue
    run = conn.execute if isinstance(conn, sqlite3.Connection) else conn.exec_driver_sql
    if not by_group or not run("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence'").fetchone():
        return set()  # no AUTOINCREMENT table has been written yet: nothing has settled
    rows = run(_GROUPS_SETTLED, (json.dumps(sorted(by_group)),)).fetchall()
    return {key for (g,) in rows for key in by_group[g]}


_GROUP_PROMPTS = "SELECT group_id, prompt_id, target_step FROM prompt_groups WHERE group_id IN (SELECT value FROM json_each(?))"


def group_prompts(conn: Connection | sqlite3.Connection, group_ids: Iterable[int]) -> dict[int, tuple[int, int | None]]:
    """group id -> (prompt id, target step). Also over a snapshot cut's raw connection."""
    arg = (json.dumps(sorted(set(group_ids))),)
    rows = conn.execute(_GROUP_PROMPTS, arg).fetchall() if isinstance(conn, sqlite3.Connection) \
        else conn.exec_driver_sql(_GROUP_PROMPTS, arg).all()
    return {g: (p, s) for g, p, s in rows}


_EPISODE_TURNS = "SELECT attempt_id, turn FROM env_episodes WHERE attempt_id IN (SELECT value FROM json_each(?))"


def episode_turns(conn: Connection | sqlite3.Connection, attempt_ids: Iterable[int]) -> dict[int, int]:
    """attempt id -> the turn its saved episode is at (turns finished), for the attempts
    that saved one. Also over a snapshot cut's raw connection."""
    arg = (json.dumps(list(attempt_ids)),)
    rows = conn.execute(_EPISODE_TURNS, arg).fetchall() if isinstance(conn, sqlite3.Connection) \
        else conn.exec_driver_sql(_EPISODE_TURNS, arg).all()
    return dict(rows)


# --------------------------------------------------------------------------- settled record


FOLDED = "folded"  # SettledRun.outcome of the folded prefix: settled, counted in `settled_prefix`


@dataclass(frozen=True)
class SettledRun:
    """Positions [start, end) that settled the same way: `outcome` 'trained' (at
    `trained_step`, stamped for `target_step`), 'discarded' (for `discard_reason`) or
    'folded' (the prefix `settled_prefix` counts: settled once each, how is not kept)."""

    start: int
    end: int
    outcome: str
    trained_step: int | None
    target_step: int | None
    discard_reason: str | None


def _table(raw: sqlite3.Connection, name: str) -> bool:
    return raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def settled_runs(conn: Connection | sqlite3.Connection) -> list[SettledRun]:
    """Every settled position, as runs sorted by start (a position settled in two rows
    appears in two overlapping runs: `verify` counts it duplicated). Reads `settled_steps`
    (v1_5_a on), a v1_4_a file's `settled_ranges` as they are, and nothing in an older
    file (its settled groups are still ledger rows). Every reader of the settled record
    (invariants, audit_ledger, restore, inspect, the tests' and the crash harness's
    twin comparison) goes through here; the blob's decoder is compaction.decode_row,
    beside the writer. Python over every row: one row per step, ~3000 rows decode in a
    few ms; since v1_12_a the steps older than the kept ones are one run of outcome
    'folded' from position 0 (`settled_prefix`: counted, not decoded), so the rows are
    bounded by the steps kept (compaction.fold_settled)."""
    raw = conn if isinstance(conn, sqlite3.Connection) else _driver(conn)
    out: list[SettledRun] = []
    prefix = read_prefix(raw)  # v1_12_a on: the folded positions, one run
    if prefix.seq_end:
        out.append(SettledRun(0, prefix.seq_end, FOLDED, None, None, None))
    if _table(raw, "settled_steps"):
        reasons = {}
        for row in raw.execute("SELECT code, reason FROM discard_reasons"):
            check_types(f"discard_reasons row code={row[0]!r:.40}", row, _REASON_COLUMNS)
            reasons[row[0]] = row[1]
        for start, end, trained, target, others in raw.execute(
                "SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps"):
            runs = decode_row(start, end, others)  # refuses a row of the wrong types, naming it
            check_types(f"settled_steps row seq_start={start}", (trained, target), STAMP_COLUMNS)
            for a, b, code in runs:
                if code == TRAINED:
                    out.append(SettledRun(a, b, "trained", trained, target, None))
                elif code != OPEN:
                    out.append(SettledRun(a, b, "discarded", None, None, reasons.get(code, f"unknown code {code}")))
    elif _table(raw, "settled_ranges"):
        for row in raw.execute("SELECT seq_start, seq_end, outcome, trained_step, target_step, discard_reason "
                               "FROM settled_ranges"):
            check_types(f"settled_ranges row seq_start={row[0]!r:.40}", row, _RANGE_COLUMNS)
            out.append(SettledRun(*row))
    out.sort(key=lambda r: (r.start, r.end))
    return out


# The declared types of the settled record's other columns (SQLite keeps any type in any
# column: a forged file is refused naming the row, not failed in arithmetic later).
_REASON_COLUMNS = (("code", "int"), ("reason", "text"))
_RANGE_COLUMNS = (("seq_start", "int"), ("seq_end", "int"), ("outcome", "text"), ("trained_step", "int?"),
                  ("target_step", "int?"), ("discard_reason", "text?"))


def settled_prefix(conn: Connection | sqlite3.Connection) -> Prefix:
    """The settled record's folded prefix (`settled_prefix`, v1_12_a; empty before it)."""
    return read_prefix(conn if isinstance(conn, sqlite3.Connection) else _driver(conn))


def settled_counts(conn: Connection | sqlite3.Connection) -> dict[str, int]:
    """{'trained': n, 'discarded': n}: groups in the settled record (`settled_runs`, the
    folded prefix by its counts)."""
    raw = conn if isinstance(conn, sqlite3.Connection) else _driver(conn)
    prefix = read_prefix(raw)
    out = {"trained": prefix.trained, "discarded": sum(prefix.discarded.values())}
    for r in settled_runs(raw):
        if r.outcome == FOLDED:
            continue
        out[r.outcome] = out.get(r.outcome, 0) + r.end - r.start
    return out
