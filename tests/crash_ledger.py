"""The crash harness's reads of a finished run's ledger: the prompts it handed out and
what became of each (trained at a step, discarded and why), and the comparison of a
killed chain with its never-killed twin. Moved out of crash_harness.py (which passed
the 600-line guideline) when the settled record became `settled_steps` (v1_5_a): the
settled positions are read through the store's one decoder of that record,
`queries.settled_runs`; the live rows with plain sqlite3.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from rolloutdb.store import queries


def handed_out_problems(conn: sqlite3.Connection, order) -> list[str]:
    """The positions handed out are the dataloader's `order` without a gap: live rows
    carry their prompt; settled groups only their position, which is the sampler's order
    by construction: both must cover the positions below the cursor once."""
    problems = []
    rows = conn.execute("SELECT sample_seq, epoch, prompt_id FROM prompt_groups UNION ALL "
                        "SELECT sample_seq, epoch, prompt_id FROM spare_prompts ORDER BY 1").fetchall()
    spans = [(r.start, r.end) for r in queries.settled_runs(conn)]
    cursor = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
    if sorted([r[0] for r in rows] + [q for a, b in spans for q in range(a, b)]) != list(range(cursor)):
        problems.append("the prompts handed out are not the dataloader's order without a gap")
    wrong = [r for r in rows if (order.at(r[0]).epoch, order.at(r[0]).prompt_id) != (r[1], r[2])]
    if wrong:
        problems.append(f"{len(wrong)} prompts differ from the dataloader's order, e.g. {wrong[0]}")
    return problems


# ------------------------------------------------------------------ the never-killed twin

ZERO_VARIANCE = "zero_reward_variance"  # written here, not imported: the harness's own word


def ledger_outcomes(db: Path, order) -> dict[int, tuple]:
    """Sampler position -> (epoch, prompt_id, outcome, trained_step) from the finished
    run's store, read with plain sqlite3. outcome: 'trained', 'zero_variance' (discarded
    for zero reward variance), 'spare' (handed out, never dispatched), or what else the
    row says ('discarded:<reason>', a state). A settled group (v1_4_a on) is a position
    in the settled record (`queries.settled_runs`); its (epoch, prompt) is the one the
    dataloader's `order` has there."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT sample_seq, epoch, prompt_id, state, discard_reason, trained_step "
                            "FROM prompt_groups").fetchall()
        for r in queries.settled_runs(conn):
            rows += [(q, order.at(q).epoch, order.at(q).prompt_id, r.outcome, r.discard_reason, r.trained_step)
                     for q in range(r.start, r.end)]
        spare = conn.execute("SELECT sample_seq, epoch, prompt_id FROM spare_prompts").fetchall()
    out: dict[int, tuple] = {seq: (e, p, "spare", None) for seq, e, p in spare}
    for seq, e, p, state, reason, step in rows:
        outcome = state if state != "discarded" else ("zero_variance" if reason == ZERO_VARIANCE else f"discarded:{reason}")
        if seq in out:  # two rows for one position: a hand-out twice (verify_run counts it too)
            outcome = f"twice:{out[seq][2]}+{outcome}"
        out[seq] = (e, p, outcome, step)
    return out


def compare_with_twin(run_dir: Path, twin_dir: Path, config) -> list[str]:
    """The prompts the killed chain trained against those of a never-killed run with the
    same seed and config (`config`: the chain's crash_harness.HarnessConfig).

    What must agree, and why. Both runs hand out the same dataloader order (position i is
    the same (epoch, prompt) in both), so one run's hand-outs are a prefix of the other's.
    What a position becomes is not deterministic: a group's rewards depend on the policy
    version it was generated with, which depends on timing (asynchronous pumps; a resumed
    group is generated again under the restored weights), so a group can have zero reward
    variance, be discarded and be replaced by the next prompt in one run and be trained in
    the other. The step a prompt is trained at depends on those discards too (a discard
    raises its step's shortfall, and when the next step was opened meanwhile depends on
    timing), so steps are compared only where no discard came before. Hence:
      1. every position dispatched in either run ends trained or discarded for zero
         variance, never otherwise (a prompt handed out and then dropped is lost);
      2. a position dispatched in both runs and trained in one is, in the other, trained
         or discarded for zero variance: trained ∪ zero-variance agree over the common
         prefix, and the multiset of (epoch, prompt_id) trained per epoch holds each
         prompt at most once in each run;
      3. both trained steps x groups_per_step groups, and each run handed out exactly as
         many positions beyond its trained ones as it discarded for zero variance (plus
         spares): no replacement prompt without a zero-variance discard;
      4. positions before the first zero-variance discard of either run were trained at
         the same step in both (stamping is deterministic until then).
    The planted bug "the rollout pump drops the groups a restore hands back (discard as
    restart, refill their steps with new prompts)" breaks 1, 2 and 3."""
    problems = []
    expected = config.steps * config.groups
    from rolloutdb.controller.run.sampler import PromptOrder

    order = PromptOrder(config.dataset, config.seed)
    run = ledger_outcomes(run_dir / "rollout_state.sqlite", order)
    twin = ledger_outcomes(twin_dir / "rollout_state.sqlite", order)
    for name, led in (("killed chain", run), ("twin", twin)):
        bad = sorted((seq, o) for seq, (_, _, o, _) in led.items() if o not in ("trained", "zero_variance", "spare"))
        if bad:
            problems.append(f"{name}: {len(bad)} handed-out prompt(s) neither trained nor discarded for zero "
                            f"variance, e.g. {bad[:4]}")
        per_epoch: dict[int, list[int]] = {}
        for e, p, o, _ in led.values():
            if o == "trained":
                per_epoch.setdefault(e, []).append(p)
        for e, prompts in per_epoch.items():
            if len(prompts) != len(set(prompts)):
                problems.append(f"{name}: epoch {e} trained a prompt more than once")
        trained = sum(len(v) for v in per_epoch.values())
        dispatched = sum(1 for _, _, o, _ in led.values() if o != "spare")
        zero = sum(1 for _, _, o, _ in led.values() if o == "zero_variance")
        if trained != expected or dispatched != trained + zero:
            problems.append(f"{name}: trained {trained} of {dispatched} dispatched with {zero} zero-variance discards "
                            f"(expected trained = {expected} = dispatched - zero-variance)")
    common = sorted(set(run) & set(twin))
    differ = [(seq, run[seq][:2], run[seq][2], twin[seq][2]) for seq in common if run[seq][:2] != twin[seq][:2]]
    if differ:
        problems.append(f"the two runs handed out different prompts at the same positions: {differ[:4]}")
    settled = ("trained", "zero_variance")
    disagree = [(seq, run[seq][:2], run[seq][2], twin[seq][2]) for seq in common
                if "spare" not in (run[seq][2], twin[seq][2]) and "trained" in (run[seq][2], twin[seq][2])
                and not (run[seq][2] in settled and twin[seq][2] in settled)]
    if disagree:
        problems.append(f"prompts trained in one run and not settled by the algorithm in the other "
                        f"(position, (epoch, prompt), killed chain, twin): {disagree[:4]}")
    first_zero = min([seq for led in (run, twin) for seq, v in led.items() if v[2] == "zero_variance"], default=None)
    steps_off = [(seq, run[seq][3], twin[seq][3]) for seq in common if (first_zero is None or seq < first_zero)
                 and run[seq][2] == twin[seq][2] == "trained" and run[seq][3] != twin[seq][3]]
    if steps_off:
        problems.append(f"before any zero-variance discard, prompts trained at different steps "
                        f"(position, killed chain, twin): {steps_off[:4]}")
    return problems
