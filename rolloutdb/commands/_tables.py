"""Query results as the commands print them: an aligned text table, CSV or JSON (the
leading underscore keeps it out of command discovery). `inspect --sql` and `sql` print
through it, so a value looks the same whichever command read it."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from typing import Any

MAX_CELL = 80  # text tables cut longer cells; CSV and JSON keep them whole
FORMATS = ("table", "csv", "json")


def json_cell(value: Any) -> Any:
    """A JSON-safe value: BLOBs become `<blob N bytes>`, non-finite floats strings."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<blob {len(value)} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    text = str(json_cell(value)).replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def format_table(columns: list[str], rows: list[tuple] | list[list], cell: Callable[[Any], str] | None = None) -> str:
    """An aligned text table; numbers right-aligned, everything else left. `cell` shows a
    value (default: NULL for None, BLOBs as <blob N bytes>, long text cut)."""
    cells = [[(cell or _text)(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def format_csv(columns: list[str], rows: list[tuple]) -> str:
    """RFC 4180 CSV with a header row; NULL is an empty field."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([["" if v is None else json_cell(v) for v in row] for row in rows])
    return buf.getvalue().rstrip("\n")


def format_json(columns: list[str], rows: list[tuple]) -> str:
    """One JSON array of objects, one per row, keyed by column name."""
    return json.dumps([{c: json_cell(v) for c, v in zip(columns, row)} for row in rows], indent=1, default=str)


def format_result(columns: list[str], rows: list[tuple], form: str) -> str:
    if form == "csv":
        return format_csv(columns, rows)
    if form == "json":
        return format_json(columns, rows)
    return format_table(columns, rows)
