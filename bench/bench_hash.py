"""sha256 vs BLAKE3, and what the hash costs publication and verification.

    python bench/bench_hash.py                  # the figures in BENCHMARKS.md (512 MiB, 256 MiB)
    python bench/bench_hash.py --quick          # tiny, for the smoke test

In one run, interleaved over `--repeats` rounds, medians reported:

* hash: GiB/s of sha256, BLAKE3 on one thread and BLAKE3 with `max_threads=AUTO`, each
  streaming the same `--mib` file in the 4 MiB chunks rolloutdb reads
  (store/checkpoints/hashing.py), from the page cache (the file was just written and
  read once before timing);
* publish + verify: a directory holding one `--payload-mib` file of random bytes and a
  small config, committed through the real protocol (`commit_directory`: hash of every
  file while a helper thread fsyncs it, manifest, fsyncs, rename, parent fsync) as
  manifest format 1 (sha256) and format 2 (blake3), then checked by `verify_files` (what
  `rolloutdb verify` runs). The payload is copied into place before the clock starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line  # noqa: E402

from rolloutdb.store.checkpoints.hashing import SHA256, Hashing, uses_threads  # noqa: E402
from rolloutdb.store.checkpoints.manifest import KIND_SNAPSHOT, Manifest, read_manifest, verify_files  # noqa: E402
from rolloutdb.store.checkpoints.publish import commit_directory  # noqa: E402

BLAKE3_AUTO = Hashing("blake3 AUTO", lambda _size: blake3.blake3(max_threads=blake3.blake3.AUTO))
BLAKE3_ONE = Hashing("blake3 1 thread", lambda _size: blake3.blake3())
HASHES = (SHA256, BLAKE3_ONE, BLAKE3_AUTO)


def write_random(path: Path, mib: int) -> None:
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))


def time_hash(hashing: Hashing, path: Path) -> float:
    t0 = time.perf_counter()
    hashing.file(path)
    return time.perf_counter() - t0


def publish_and_verify(work: Path, payload: Path, fmt: int, n: int) -> tuple[float, float]:
    tmp, target = work / f"tmp_{fmt}_{n}", work / f"snapshot_{fmt}_{n}"
    tmp.mkdir()
    shutil.copyfile(payload, tmp / "payload.bin")
    (tmp / "config.yaml").write_text("algorithm: {}\n")
    manifest = Manifest(kind=KIND_SNAPSHOT, anchor="bootstrap", files=[], sequence=n, format_version=fmt)
    t0 = time.perf_counter()
    commit_directory(tmp, target, manifest)
    t1 = time.perf_counter()
    problems = verify_files(target, read_manifest(target))
    t2 = time.perf_counter()
    assert not problems, problems
    assert read_manifest(target).hashing.name == ("sha256" if fmt == 1 else "blake3")
    shutil.rmtree(target)
    return t1 - t0, t2 - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="size of the hashed file")
    ap.add_argument("--payload-mib", type=int, default=256, help="size of the published payload file")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="8 MiB / 4 MiB, 2 rounds (smoke test)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir in /tmp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.payload_mib, args.repeats = 8, 4, 2
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_hash_", dir=args.dir)))
        big, payload = work / "hashed.bin", work / "payload.bin"
        write_random(big, args.mib)
        write_random(payload, args.payload_mib)
        for hashing in HASHES:  # warm: page cache, thread pool
            time_hash(hashing, big)
        hash_s: dict[str, list[float]] = {h.name: [] for h in HASHES}
        publish_s: dict[int, list[float]] = {1: [], 2: []}
        verify_s: dict[int, list[float]] = {1: [], 2: []}
        for n in range(args.repeats):
            for hashing in HASHES:
                hash_s[hashing.name].append(time_hash(hashing, big))
            for fmt in (1, 2):
                p, v = publish_and_verify(work, payload, fmt, n)
                publish_s[fmt].append(p)
                verify_s[fmt].append(v)
    gib = args.mib / 1024
    speeds = {name: gib / statistics.median(ts) for name, ts in hash_s.items()}
    pub = {fmt: statistics.median(ts) for fmt, ts in publish_s.items()}
    ver = {fmt: statistics.median(ts) for fmt, ts in verify_s.items()}
    figures = {
        "machine": machine_line(), "args": vars(args) | {"dir": str(args.dir), "json": str(args.json)},
        "hash_gib_per_s": speeds,
        "ratio_blake3_vs_sha256": {"1 thread": speeds[BLAKE3_ONE.name] / speeds[SHA256.name],
                                   "AUTO": speeds[BLAKE3_AUTO.name] / speeds[SHA256.name]},
        "rolloutdb_uses_auto_threads_here": uses_threads(args.mib << 20),
        "publish_s": {"format 1 (sha256)": pub[1], "format 2 (blake3)": pub[2], "ratio_1_over_2": pub[1] / pub[2]},
        "verify_s": {"format 1 (sha256)": ver[1], "format 2 (blake3)": ver[2], "ratio_1_over_2": ver[1] / ver[2]},
    }
    print(figures["machine"])
    print(f"hash of one {args.mib} MiB file, 4 MiB chunks, median of {args.repeats}:")
    for name, v in speeds.items():
        print(f"  {name:<16} {v:6.2f} GiB/s   x{v / speeds[SHA256.name]:.2f} of sha256")
    print(f"  rolloutdb hashes with AUTO threads here: {figures['rolloutdb_uses_auto_threads_here']} ({os.cpu_count()} CPUs)")
    print(f"publish + verify, one {args.payload_mib} MiB payload file, median of {args.repeats}:")
    print(f"  {'':<18} {'publish':>9} {'verify':>9}")
    for fmt, label in ((1, "format 1 sha256"), (2, "format 2 blake3")):
        print(f"  {label:<18} {pub[fmt]:8.3f}s {ver[fmt]:8.3f}s")
    print(f"  {'ratio f1/f2':<18} {pub[1] / pub[2]:8.2f}x {ver[1] / ver[2]:8.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
