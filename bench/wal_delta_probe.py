"""What a snapshot made of SQLite's own WAL frames would be, and why it is not built.

Issue 32 item 2 names "SQLite's own WAL frames" as one way for a snapshot to write only
the metadata that changed. The shape it would take without a copy-on-write filesystem
(ext4 here has no reflink): every snapshot's directory hard-links one shared base file
and holds a `-wal` file of the pages that differ from it, so `sqlite3`, DuckDB and
`rolloutdb inspect` open the snapshot as one SQLite database with no step of ours.

This probe builds that shape from a real file (a table of rows, a few of them changed
after the base, WAL frames written by hand with SQLite's checksums) and reports:

- the pages the delta holds against the whole file (the bytes it would save);
- that a read-only open reads the new state, and what it leaves beside the snapshot
  (a `-shm` file: the published directory changes when it is read);
- whether a plain read-write open and close (what `sqlite3 FILE` does; as root, the
  base's read-only mode bits do not stop it) checkpoints the delta *into the shared base*
  and deletes the `-wal`: every other snapshot sharing that base then reads pages that
  are not its own.

Run: `python bench/wal_delta_probe.py [--rows N] [--changed K] [--dir D] [--json F]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import struct
import tempfile
from pathlib import Path

PAGE = 4096
WAL_MAGIC_LE = 0x377F0682  # checksums over little-endian words
SALTS = (0x5EED0001, 0x5EED0002)


def _checksum(data: bytes, s0: int, s1: int) -> tuple[int, int]:
    words = struct.unpack(f"<{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_of_changed_pages(base: bytes, new: bytes) -> tuple[bytes, int]:
    """A WAL file holding, as one transaction, every page of `new` that differs from `base`."""
    pages = len(new) // PAGE
    changed = [p for p in range(pages) if new[p * PAGE : (p + 1) * PAGE] != base[p * PAGE : (p + 1) * PAGE]]
    header = struct.pack(">IIIIII", WAL_MAGIC_LE, 3007000, PAGE, 0, *SALTS)
    s0, s1 = _checksum(header, 0, 0)
    out = [header, struct.pack(">II", s0, s1)]
    for i, p in enumerate(changed):
        frame = struct.pack(">IIII", p + 1, pages if i == len(changed) - 1 else 0, *SALTS)
        page = new[p * PAGE : (p + 1) * PAGE]
        s0, s1 = _checksum(frame[:8], s0, s1)
        s0, s1 = _checksum(page, s0, s1)
        out += [frame, struct.pack(">II", s0, s1), page]
    return b"".join(out), len(changed)


def _image(conn: sqlite3.Connection) -> bytes:
    copy = sqlite3.connect(":memory:")
    conn.backup(copy)
    return copy.serialize()


def probe(work: Path, rows: int, changed_rows: int) -> dict:
    live = sqlite3.connect(work / "live.sqlite")
    live.execute(f"PRAGMA page_size={PAGE}")
    live.execute("CREATE TABLE attempt (id INTEGER PRIMARY KEY, state TEXT, body TEXT)")
    live.executemany("INSERT INTO attempt VALUES (?, 'running', ?)", ((i, "x" * 100) for i in range(rows)))
    live.commit()
    live.execute("PRAGMA journal_mode=wal")  # the base's header says WAL, as the live store's does
    base = _image(live)
    (work / "base.sqlite").write_bytes(base)
    live.execute("UPDATE attempt SET state = 'finished' WHERE id < ?", (changed_rows,))
    live.commit()
    new = _image(live)
    wal, pages_changed = wal_of_changed_pages(base, new)

    snap = work / "snapshot"
    snap.mkdir()
    os.link(work / "base.sqlite", snap / "metadata.sqlite")
    (snap / "metadata.sqlite-wal").write_bytes(wal)
    os.chmod(work / "base.sqlite", 0o444)
    query = "SELECT count(*) FROM attempt WHERE state = 'finished'"
    ro = sqlite3.connect(f"file:{snap / 'metadata.sqlite'}?mode=ro", uri=True)
    read_only_sees = ro.execute(query).fetchone()[0]
    ro.close()
    left_after_read_only = sorted(p.name for p in snap.iterdir())
    rw = sqlite3.connect(snap / "metadata.sqlite")
    read_write_sees = rw.execute(query).fetchone()[0]
    rw.close()
    return {
        "pages": len(new) // PAGE,
        "pages_changed": pages_changed,
        "delta_bytes": len(wal),
        "file_bytes": len(new),
        "read_only_open_reads_new_state": read_only_sees == changed_rows,
        "files_after_read_only_open": left_after_read_only,
        "read_write_open_reads_new_state": read_write_sees == changed_rows,
        "uid": os.getuid(),
        "files_after_read_write_open": sorted(p.name for p in snap.iterdir()),
        "shared_base_changed_by_plain_open": (work / "base.sqlite").read_bytes() != base,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=80_000, help="attempt rows in the file (the bench's 10k groups x 8)")
    ap.add_argument("--changed", type=int, default=80, help="rows changed after the base (the bench's 80 per interval)")
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (a temporary directory, removed)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--quick", action="store_true", help="a small file (the smoke test's run)")
    args = ap.parse_args()
    rows = 5_000 if args.quick else args.rows
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        r = probe(Path(tmp), rows, min(args.changed, rows))
    print(f"delta: {r['pages_changed']} of {r['pages']} pages, {r['delta_bytes'] / 2**20:.2f} MiB "
          f"instead of {r['file_bytes'] / 2**20:.2f} MiB")
    print(f"read-only open reads the snapshot's state: {r['read_only_open_reads_new_state']}; "
          f"it leaves {r['files_after_read_only_open']} in the snapshot's directory")
    print(f"a plain open and close (uid {r['uid']}) changed the shared base: {r['shared_base_changed_by_plain_open']}; "
          f"left {r['files_after_read_write_open']}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
