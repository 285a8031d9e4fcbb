"""rolloutdb as a library, from your own loop (no rolloutdb controller, no model).

Each step: reserve prompt groups stamped for the step, dispatch them, finish their
generations (random tokens from a tiny torch "policy"), seal them into replay, train on
them, mark them trained, and publish a trainer checkpoint. Halfway through each step's
generations, with work in flight, a rollout snapshot is published, anchored to the last
trainer checkpoint. `--resume` restores the newest snapshot: the weights from its anchor,
the store as of its cut, and the unfinished generations of the groups in flight then.

    python examples/own_loop.py RUN_DIR --steps 6 [--kill-at-step 3] [--resume]

Only names that `rolloutdb` exports are used (tests/test_own_loop.py checks it).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch

import rolloutdb
from rolloutdb import FinishedGeneration, Publisher, Reservation, Store

GROUPS, GENERATIONS, TOKENS, VOCAB, PROMPTS = 4, 4, 8, 16, 10_000
FINGERPRINT = "own-loop-v1"  # yours: a hash of your config; a resume with another is refused


class Trainer:
    """A stand-in for yours: logits over a vocabulary, nudged towards rewarded tokens."""

    def __init__(self, seed: int):
        self.logits, self.step = torch.zeros(VOCAB), 0
        self.rng = torch.Generator().manual_seed(seed)

    def generate(self) -> FinishedGeneration:
        probs = torch.softmax(self.logits, 0)
        tokens = torch.multinomial(probs, TOKENS, replacement=True, generator=self.rng)
        reward = float((tokens == 7).float().mean())  # the "task": say 7
        return FinishedGeneration(tokens.tolist(), probs[tokens].log().tolist(), reward, [(self.step, TOKENS)])

    def train_step(self, samples: list[tuple[list[int], float]]) -> None:
        mean = sum(r for _, r in samples) / len(samples)
        for tokens, reward in samples:
            self.logits[tokens] += 0.1 * (reward - mean)
        self.step += 1

    def save(self, directory: Path) -> None:  # a checkpoint is any set of files
        torch.save({"logits": self.logits, "step": torch.tensor(self.step)}, directory / "policy.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "policy.pt", weights_only=True)
        self.logits, self.step = state["logits"], int(state["step"])


def snapshot(store: Store, publisher: Publisher, trainer: Trainer) -> None:
    """A rollout snapshot at a cut, anchored to the trainer checkpoint of `trainer.step`,
    and its outcome recorded in the store (the Publisher records nothing)."""

    def at_cut(conn):  # runs inside the capture's read transaction: sees exactly the copy
        report = rolloutdb.check_invariants(conn)
        if report.problems:
            raise RuntimeError(f"not publishing a store that breaks its invariants: {report.problems[0]}")

    anchor = rolloutdb.anchor_name(trainer.step or None)
    try:
        published = publisher.publish_rollout_snapshot(anchor, lambda path: store.capture(path, at_cut=at_cut))
    except rolloutdb.PublishError as e:  # a failed snapshot is an outcome; the run goes on
        store.record_snapshot_attempt("failed", anchor=anchor, error=str(e))
        return
    store.record_snapshot_attempt("published", anchor=anchor, snapshot_seq=published.sequence,
                                  mutation_counter=published.manifest.mutation_counter, timings=published.timings)


def generate_into_replay(store: Store, trainer: Trainer, attempts: list[int], group_ids: list[int]) -> None:
    for attempt_id in attempts:
        store.finish(attempt_id, trainer.generate())
    store.seal(group_ids)
    store.enter_replay(group_ids)


def run_step(store: Store, publisher: Publisher, trainer: Trainer, step: int, kill_at: int | None) -> None:
    with store.read() as conn:
        cursor = rolloutdb.pools.read_cursor(conn).next_seq
        have = len(rolloutdb.queries.replay_groups_for_step(conn, step))  # restored ones
    seqs = range(cursor, cursor + GROUPS - have)
    if seqs:
        ids = store.reserve([Reservation(s, s // PROMPTS, s % PROMPTS) for s in seqs],
                            num_generations=GENERATIONS, target_step=step)
        attempts = store.dispatch(ids, policy_version=trainer.step)
        half = len(attempts) // 2
        for attempt_id in attempts[:half]:
            store.finish(attempt_id, trainer.generate())
        snapshot(store, publisher, trainer)  # with generations in flight
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a real crash: nothing below runs
        generate_into_replay(store, trainer, attempts[half:], ids)
    with store.read() as conn:
        ids = rolloutdb.queries.replay_groups_for_step(conn, step)
        rows = rolloutdb.queries.samples_of(conn, ids)
    trainer.train_step([(rolloutdb.codec.decode_tokens(r[3]).tolist(), float(r[5])) for r in rows])
    store.mark_trained(ids, step=step)
    publisher.publish_trainer_checkpoint(step, trainer.save)
    print(f"step {step}: {len(ids)} groups, reward {sum(float(r[5]) for r in rows) / len(rows):.3f}", flush=True)


def resume(run: Path, trainer: Trainer) -> Store:
    """Weights from the newest snapshot's anchor, then the store as of its cut; the
    generations that were in flight are run again (new attempts), nothing twice."""
    plan = rolloutdb.select_and_restore(
        run / "checkpoints", run / "store.db", before_restore=lambda sel: trainer.load(sel.anchor.path),
        config_fingerprint=FINGERPRINT, dataset_fingerprint=FINGERPRINT, forest_training={}, groups_per_step=GROUPS)
    rolloutdb.drop_checkpoints_after(run / "checkpoints", trainer.step)  # the branch the crash cut off
    store = Store.open(run / "store.db")
    for group in sorted(plan.redispatch + plan.to_finalize, key=lambda g: g.sample_seq):
        with store.atomic() as tx:
            # The attempts the crash left running are abandoned here (reason restart), as
            # their replacements start.
            attempts, _abandoned = rolloutdb.ledger.restart_attempts(
                tx, [(group.group_id, i) for i in group.generations_to_run], policy_version=trainer.step)
        generate_into_replay(store, trainer, attempts, [group.group_id])
    print(f"resumed from {plan.snapshot_dir.name} at step {trainer.step}: "
          f"{len(plan.redispatch)} group(s) in flight run again", flush=True)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-step", type=int, help="SIGKILL this process mid-step (a crash test)")
    args = parser.parse_args()
    run = args.run_dir
    trainer = Trainer(seed=os.getpid())
    if args.resume:
        store = resume(run, trainer)
    else:
        run.mkdir(parents=True)  # a fresh run never reuses a directory
        store = Store.create(run / "store.db", config_fingerprint=FINGERPRINT, dataset_fingerprint=FINGERPRINT)
    publisher = Publisher(run / "checkpoints")
    if not args.resume:
        publisher.publish_bootstrap(trainer.save)
    with store:
        for step in range(trainer.step + 1, args.steps + 1):
            run_step(store, publisher, trainer, step, args.kill_at_step)
        publisher.close()
    audit = rolloutdb.audit_ledger(run / "store.db", groups_per_step=GROUPS)
    done = audit.ok and not audit.pending  # pending: groups neither trained nor discarded
    print(f"exactly-once: {'ok' if done else 'FAILED'} ({audit.line()} pending={audit.pending})", flush=True)


if __name__ == "__main__":
    main()
