"""How reports show time: a point in time as an ISO-8601 UTC string (`iso_utc`), never a
bare epoch float; an age as one relative style (`ago`).
Stores, manifests and traces keep epoch seconds; the commands convert at the output edge
with `iso_utc` (text and --json alike)."""

from __future__ import annotations

import math
import time


def iso_utc(seconds: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC ("2026-11-30T21:33:04Z"; milliseconds when the value
    has them: "2026-11-30T21:33:04.250Z"). None, and a non-finite or out-of-range value,
    stay None."""
    if seconds is None or isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds):
        return None
    try:
        whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(seconds // 1)))
    except (OverflowError, OSError, ValueError):
        return None
    ms = int(round(seconds % 1 * 1000))
    if ms == 1000:  # rounding carried into the next second
        return iso_utc(math.floor(seconds) + 1)
    return whole + (f".{ms:03d}Z" if ms else "Z")


def ago(seconds: float | None) -> str:
    """A relative age or duration in whole units, the two largest that apply: "42s",
    "3m12s", "1h2m", "2d4h"; "-" for None. Negative (a clock that stepped back) is 0s.
    The one style every command uses (`snapshots` AGE, `inspect` "... ago")."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h}h"
    if h:
        return f"{h}h{m}m"
    return f"{m}m{s}s" if m else f"{s}s"
