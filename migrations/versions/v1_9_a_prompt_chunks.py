"""A settle rewrites one bounded chunk of its epoch's bitmap: ``settled_prompts`` by chunk.

Revision ID: v1_9_a
Revises: v1_8_a
Create Date: 2026-12-03

Until this revision ``settled_prompts`` held one bitmap per epoch, and every settling
commit read and rewrote the whole of it: O(dataset) bytes per settle (p50 0.58 ms at ~1k
prompts, 0.88 ms at ~300k; 36 KB per settle at 300k prompts, spilling to overflow pages
past ~4k). From here on an epoch's bitmap is cut into fixed chunks of 4096 prompt ids:

* table ``settled_prompts``: primary key (``epoch``, ``chunk``); ``bits``: bit
  ``(prompt_id % 4096) % 8`` of byte ``(prompt_id % 4096) // 8`` of chunk
  ``prompt_id // 4096``, set once the prompt settled (at most 512 bytes, trailing zero
  bytes left off: one row fits a page); ``settles``: how many groups of the epoch whose
  prompt falls in the chunk settled.

Data migration: each old epoch bitmap is cut into its non-empty chunks; each chunk's
``settles`` is its set bits, and the epoch's excess (old ``settles`` minus its set bits,
prompts settled twice) goes to its first chunk, so the audit, which sums an epoch's
chunks, reports what it reported before. An epoch bitmap with no bit set keeps its count
in chunk 0.

Frozen: the tables and the bit layout are written out here as they are at this revision.
"""

from alembic import op

revision = "v1_9_a"
down_revision = "v1_8_a"
branch_labels = None
depends_on = None

CHUNK = 4096  # prompt ids per chunk: 512 bytes of bits, one row per page

CREATE_CHUNKED = """CREATE TABLE _v1_9_a_settled_prompts (
\tepoch INTEGER NOT NULL,
\tchunk INTEGER NOT NULL,
\tbits BLOB NOT NULL,
\tsettles INTEGER NOT NULL,
\tCONSTRAINT pk_settled_prompts PRIMARY KEY (epoch, chunk)
)"""

CREATE_WHOLE = """CREATE TABLE _v1_9_a_settled_prompts (
\tepoch INTEGER NOT NULL,
\tbits BLOB NOT NULL,
\tsettles INTEGER NOT NULL,
\tCONSTRAINT pk_settled_prompts PRIMARY KEY (epoch)
)"""


def _ones(bits: bytes) -> int:
    return sum(bin(b).count("1") for b in bits)


def _chunks(bits: bytes, settles: int) -> list[tuple[int, bytes, int]]:
    width = CHUNK // 8
    out: list[tuple[int, bytes, int]] = []
    for chunk in range(0, (len(bits) + width - 1) // width):
        part = bits[chunk * width:(chunk + 1) * width].rstrip(b"\0")
        if part:
            out.append((chunk, part, _ones(part)))
    if not out:
        return [(0, b"", settles)]
    first, part, ones = out[0]
    out[0] = (first, part, ones + settles - sum(k for _, _, k in out))
    return out


def _replace(bind, create: str, columns: str, rows: list[tuple]) -> None:
    bind.exec_driver_sql(create)
    if rows:
        marks = ", ".join("?" * len(rows[0]))
        bind.connection.driver_connection.executemany(
            f"INSERT INTO _v1_9_a_settled_prompts ({columns}) VALUES ({marks})", rows)
    bind.exec_driver_sql("DROP TABLE settled_prompts")
    bind.exec_driver_sql("ALTER TABLE _v1_9_a_settled_prompts RENAME TO settled_prompts")


def upgrade() -> None:
    bind = op.get_bind()
    rows = [(epoch, chunk, part, n)
            for epoch, bits, settles in bind.exec_driver_sql(
                "SELECT epoch, bits, settles FROM settled_prompts ORDER BY epoch").fetchall()
            for chunk, part, n in _chunks(bytes(bits), int(settles))]
    _replace(bind, CREATE_CHUNKED, "epoch, chunk, bits, settles", rows)


def downgrade() -> None:
    bind = op.get_bind()
    whole: dict[int, tuple[bytearray, int]] = {}
    for epoch, chunk, bits, settles in bind.exec_driver_sql(
            "SELECT epoch, chunk, bits, settles FROM settled_prompts ORDER BY epoch, chunk").fetchall():
        out, n = whole.get(epoch, (bytearray(), 0))
        at = chunk * (CHUNK // 8)
        if bits:
            out.extend(bytes(max(0, at + len(bits) - len(out))))
            out[at:at + len(bits)] = bits
        whole[epoch] = (out, n + settles)
    _replace(bind, CREATE_WHOLE, "epoch, bits, settles",
             [(epoch, bytes(bits), n) for epoch, (bits, n) in sorted(whole.items())])
