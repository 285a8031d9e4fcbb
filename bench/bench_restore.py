"""Restore time of a large rollout snapshot, against reading the same file, in one run.

    python bench/bench_restore.py                      # 100k groups + 1 GiB (the BENCHMARKS.md figure)
    python bench/bench_restore.py --groups 20000 --payload-gb 0.3
    python bench/bench_restore.py --quick              # seconds

Builds a live store through the store API (`bench/rollout_payload.py`): `--groups`
ledger groups in all, of which `--in-flight` are dispatched (half their generations
finished with `--sample-tokens`-token samples while the payload lasts, the rest
running), a few published, sealed and reserved groups and spare prompts, and the rest
trained (their rollout rows kept, as in a long run). The payload (`--payload-gb` of
token-id and logprob BLOBs) sits in the published, sealed and in-flight groups. It
publishes the trainer checkpoint the trained steps reach and a rollout snapshot anchored
to it (`Publisher.publish_rollout_snapshot` + `store.capture`), then measures, `--repeats`
times with the order rotated, each after `os.sync()`:

* restore: `restore_snapshot(snapshot_dir, live_path, ...)`, every check included
  (manifest and checksums while copying, schema, integrity, run settings, replay,
  invariants before and after restart normalization, spare pool and cursor, fsync and
  rename into place); its phase timings are printed;
* read: the snapshot file read in 4 MiB chunks from Python (`readinto`);
* cat: ``cat FILE > /dev/null``;
* read+sha256: 4 MiB chunks into sha256 (format-1 manifests);
* read+blake3: the same into BLAKE3, the hash of format-2 manifests, which restore
  verifies (the floor of a verifying restore);
* copy+blake3+fsync: what any restore that copies must do at least (read, hash, write
  the copy, fsync it), for context;
* restart (after each restore, on its result, not in the restore's time): what the rollout
  pump then does with the restored groups, one call a transaction of RESTART_BATCH
  groups as `_dispatch_restored` makes it: `ledger.restart_attempts` (abandons the
  stopped run's attempts, reason `restart`, and starts new ones), or `start_attempts` on
  a revision from before it (its restore had abandoned them). Restore + restart is the
  whole work on the in-flight attempts, wherever it is done.

With `--segments`, the payload is sealed into a payload segment before
the snapshot is taken (`seal_inline_payload`, what the snapshot pump does): the
snapshot's store file holds the ledger and the references, its manifest lists the
segment, and a restore copies the store file and only reads and hashes the segment.
The baselines then read the same bytes: the store file and the segment(s), one after
the other; ratio = restore / read+blake3 (goal <= 1.2x).

Cache state: `warm` (the file was just written or read; 1 GiB fits in the page cache
here) and, with `--cold`, `cold`: the snapshot file's pages dropped with
``posix_fadvise(DONTNEED)`` before each measurement (the disk is a shared virtual disk,
so cold figures are noisy). Ratio = restore / read (goal <= 2x).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).parent))
import benchlib  # noqa: E402
from benchlib import say  # noqa: E402
from rollout_payload import Layout, populate  # noqa: E402

from rolloutdb.store import Publisher, Reservation, Store, ledger, seal_inline_payload, segments_dir_of
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.checkpoints.manifest import read_manifest
from rolloutdb.store.restore.apply import restore_snapshot
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots, Retention

CHUNK = 4 * 2**20
RATIO_GOAL = 2.0
SEGMENTS_GOAL = 1.2  # restore of 100k groups + 1 GiB vs read + hash of the same bytes (BENCHMARKS.md, "Payload written once")
FINGERPRINT = "bench-restore"


def build(work: Path, args) -> tuple[Path, int, dict]:
    """A published snapshot of the layout; returns (snapshot dir, anchor step, counts)."""
    layout = Layout(
        in_flight=args.in_flight,
        num_generations=args.generations,
        payload_bytes=int(args.payload_gb * 2**30),
        sample_tokens=args.sample_tokens,
        finished_per_group=args.generations // 2,
        published=args.published,
        sealed=args.sealed,
        reserved=args.reserved,
        spare=args.spare,
        groups_per_step=8,
    )
    layout.trained = args.groups - (layout.in_flight + layout.published + layout.sealed + layout.reserved)
    if layout.trained < 0:
        raise SystemExit("error: --groups is smaller than the in-flight, published, sealed and reserved groups; raise --groups")
    step = layout.trained_steps
    layout.in_flight_step = step + 1
    live = work / "live.sqlite"
    store = Store.create(live, synchronous="OFF", replay_capacity=1024, config_fingerprint=FINGERPRINT,
                         dataset_fingerprint=FINGERPRINT)
    try:
        counts = populate(store, layout, lambda s: Reservation(s, s // 1_000_000, s % 1_000_000))
    finally:
        store.close()
    pub = Publisher(work / "checkpoints", retention=Retention(KeepNewestSnapshots(10)))
    pub.publish_trainer_checkpoint(step or None, lambda tmp: (tmp / "weights.bin").write_bytes(b"\0" * 4096))
    with Store.open(live) as store:
        if args.segments:
            store.segments_dir = segments_dir_of(pub.root)
            with pub.lock:
                seal_inline_payload(store, pub.root)
        published = pub.publish_rollout_snapshot(published_anchor(step), lambda p: store.capture(p), "bench: restore\n")
    pub.close()
    live.unlink()
    return published.path, step, {**counts, "snapshot_rows": published.manifest.row_counts,
                                  "snapshot_states": published.manifest.group_states}


RESTART_BATCH = 64  # restored groups per pump transaction (a commit starts as many as there is room for)


def restart_every_group(live: Path, plan) -> float:
    """Seconds to start every restored group's unfinished generations again, as the
    rollout pump does (see the module docstring)."""
    restart = getattr(ledger, "restart_attempts", None)
    with Store.open(live) as store:
        t = time.perf_counter()
        for k in range(0, len(plan.redispatch), RESTART_BATCH):
            wanted = [(g.group_id, i) for g in plan.redispatch[k:k + RESTART_BATCH] for i in g.generations_to_run]
            with store.atomic() as tx:
                if restart is not None:
                    restart(tx, wanted, policy_version=plan.trained_step)
                else:
                    ledger.start_attempts(tx, wanted, policy_version=plan.trained_step)
        return time.perf_counter() - t


def published_anchor(step: int) -> str:
    return f"step_{step}" if step else "bootstrap"


# ---------------------------------------------------------------------- what is timed


# Each takes the list of files a restore reads: the snapshot's store file, and with
# --segments the payload segments its manifest lists.


def py_read(paths: list[Path]) -> None:
    buf = bytearray(CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def cat(paths: list[Path]) -> None:
    subprocess.run("cat " + " ".join(f"'{p}'" for p in paths) + " > /dev/null", shell=True, check=True)


def read_sha256(paths: list[Path]) -> None:
    for path in paths:
        _read_into(path, hashlib.sha256())


def read_blake3(paths: list[Path]) -> None:
    for path in paths:
        _read_into(path, blake3.blake3())


def _read_into(path: Path, digest) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    digest.hexdigest()


def copy_blake3_fsync(paths: list[Path], dst: Path) -> None:
    for k, path in enumerate(paths):
        digest = blake3.blake3()
        with open(path, "rb") as fin, open(dst.with_suffix(f".{k}"), "wb") as fout:
            while chunk := fin.read(CHUNK):
                digest.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100_000, help="ledger groups in the snapshot, all states")
    ap.add_argument("--in-flight", type=int, default=10_000, help="of which dispatched, with running attempts")
    ap.add_argument("--payload-gb", type=float, default=1.0, help="sample payload (GiB)")
    ap.add_argument("--sample-tokens", type=int, default=16384, help="tokens per full-size sample")
    ap.add_argument("--generations", type=int, default=8, help="generations per group")
    ap.add_argument("--published", type=int, default=32)
    ap.add_argument("--sealed", type=int, default=32)
    ap.add_argument("--reserved", type=int, default=16)
    ap.add_argument("--spare", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also measure with the snapshot's pages dropped from the cache")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--segments", action="store_true", help="payload sealed into a payload segment")
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir); needs ~3x the payload")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.in_flight, args.payload_gb, args.sample_tokens, args.repeats = 400, 100, 0.004, 1024, 1
        args.published = args.sealed = 8
        args.reserved = args.spare = 4
    work = Path(tempfile.mkdtemp(prefix="bench_restore_", dir=args.dir))
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "machine": benchlib.machine_line()}
    try:
        say(result["machine"])
        t0 = time.perf_counter()
        snap_dir, step, counts = build(work, args)
        snap = snap_dir / SNAPSHOT_DB
        files = [snap] + [segments_dir_of(work / "checkpoints") / e.path
                          for e in read_manifest(snap_dir).segments]
        size = sum(p.stat().st_size for p in files)
        result["store_file_bytes"] = snap.stat().st_size
        result.update(build=counts, snapshot_bytes=size, build_s=time.perf_counter() - t0)
        say(f"snapshot: {size / 2**30:.3f} GiB (store file {snap.stat().st_size / 2**20:.1f} MiB, "
            f"{len(files) - 1} segment(s)), {counts['groups']} groups ({counts['snapshot_states']}), "
            f"{counts['samples']} full-size samples, built in {result['build_s']:.0f} s")
        live_dir = work / "run"
        live_dir.mkdir()
        live = live_dir / "rollout_state.sqlite"
        copy = work / "copy.sqlite"
        plans = []

        def restore() -> None:
            live.unlink(missing_ok=True)
            plans.append(restore_snapshot(snap_dir, live, config_fingerprint=FINGERPRINT, dataset_fingerprint=FINGERPRINT,
                                          forest_training={}, groups_per_step=8, ledger_dispatch=True, trainer_step=step))

        def copy_floor() -> None:
            for p in work.glob("copy.*"):
                p.unlink()
            copy_blake3_fsync(files, copy)

        ops = {"restore": restore, "read": lambda: py_read(files), "cat": lambda: cat(files),
               "read+sha256": lambda: read_sha256(files), "read+blake3": lambda: read_blake3(files),
               "copy+blake3+fsync": copy_floor}
        caches = ["warm"] + (["cold"] if args.cold else [])
        times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in ops} for c in caches}
        restarts: list[float] = []
        names = list(ops)
        py_read(files)  # warm
        for r in range(args.repeats):
            rotated = names[r % len(names):] + names[: r % len(names)]
            for cache in caches:
                for name in rotated:
                    os.sync()
                    if cache == "cold":
                        drop_cache(files)
                    t = time.perf_counter()
                    ops[name]()
                    times[cache][name].append(time.perf_counter() - t)
                    if name == "restore" and cache == "warm":
                        restarts.append(restart_every_group(live, plans[-1]))
            say(f"  repeat {r + 1}: " + "; ".join(
                f"{c} " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times[c].items()) for c in caches))
        result["times_s"] = times
        result["summary"] = {}
        for cache in caches:
            med = {k: statistics.median(v) for k, v in times[cache].items()}
            ratios = {f"restore/{k}": med["restore"] / med[k] for k in med if k != "restore"}
            result["summary"][cache] = {"median_s": med, "ratios": ratios}
            say(f"\n{cache} cache, median of {args.repeats} ({size / 2**20:.0f} MiB):")
            for k, v in med.items():
                say(f"  {k:<18} {v:7.3f} s  {size / 2**20 / v:7.0f} MiB/s")
            say("  " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
                + f"  (goal restore/read <= {RATIO_GOAL:.0f}x: {'met' if ratios['restore/read'] <= RATIO_GOAL else 'MISSED'})")
            if args.segments:
                r = ratios["restore/read+blake3"]
                say(f"  restore / read+blake3 of the same bytes {r:.2f}x "
                    f"(goal <= {SEGMENTS_GOAL}x: {'met' if r <= SEGMENTS_GOAL else 'MISSED'})")
        restore_and_restart = [a + b for a, b in zip(times["warm"]["restore"], restarts)]
        result["restart"] = {"median_s": statistics.median(restarts),
                             "restore_and_restart_median_s": statistics.median(restore_and_restart),
                             "restore_and_restart_over_read_blake3": statistics.median(restore_and_restart)
                             / result["summary"]["warm"]["median_s"]["read+blake3"]}
        say(f"restart of every restored group afterwards (the pump's work, {RESTART_BATCH} groups a transaction): "
            f"{result['restart']['median_s']:.3f} s; restore + restart {result['restart']['restore_and_restart_median_s']:.3f} s "
            f"({result['restart']['restore_and_restart_over_read_blake3']:.2f}x read+blake3)")
        phases = {k: statistics.median(p.timings.get(k, 0.0) for p in plans) for k in plans[0].timings}
        result["restore_phases_s"] = phases
        result["restore_counts"] = plans[-1].counts
        say("restore phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        say(f"restore counts: {plans[-1].counts}; redispatch {len(plans[-1].redispatch)} groups")
        benchlib.write_json(args.json, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
