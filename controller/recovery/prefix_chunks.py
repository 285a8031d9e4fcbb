"""Incremental prefix cuts: what each running call's snapshots have already made durable,
so that a cut writes only the tokens decoded since the last published one.

A prefix-level cut saves every running call's output so far. Written whole at every cut,
that cost the tokens decoded so far, on every cut (issue 28: ~2.3 us a token, under the
commit lock). Here a call's tokens are written once, the way a finished sample's payload
is (store/checkpoints/segments.py): each cut writes the tokens each call decoded since
the last PUBLISHED cut into one new immutable segment file (`write_chunk_segment`, the
one file commit, hashed), and the snapshot's `token_chunks` rows reference, for every
call it saves, all the chunks that call needs, earlier cuts' segments included
(`pools.put_chunk_references`). The snapshot file records those segments in its
`payload_segments`, so its manifest lists and hashes them, `verify` and restore check
them, and retention keeps a segment exactly while a kept snapshot lists it.

`PrefixChunks` is the snapshot pump's memory of it, per engine request id: the chunks
(segment, row, position, length, version) the last published snapshot referenced.

* It asks the engine only for what lies past them (`since`), so the engine copies the
  new tail, not the call.
* It advances only when the snapshot that wrote or referenced the chunks is published
  (`published`): a failed, aborted or refused attempt leaves it as it was, and its
  segment, referenced by no kept snapshot, is removed by the next retention.
* It becomes exactly the calls that snapshot saved: a call that finished, was abandoned
  or fell back is no longer in it, so no later snapshot references its chunks, and its
  segments go once no kept snapshot lists them.
* A segment it names that retention removed meanwhile (no kept snapshot listed it: a
  retention policy that dropped every snapshot of the previous anchor) is dropped from
  it before the engine is read (`forget_missing`), and those calls are written whole.
* After a restore it starts empty: the resumed calls are new attempts (new request ids)
  whose prefix the first cut writes once more; one copy per call per restore, against
  one per call per cut before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rolloutdb.gpu_capture.protocol import RunningCall
from rolloutdb.store import ChunkReference, SegmentRef

_TOKEN = np.dtype("<i4")  # the store's BLOB dtypes (store/live/codec.py)
_LOGPROB = np.dtype("<f4")


@dataclass(frozen=True)
class SavedCall:
    """A running call a cut saves: its attempt, the tokens read from `call.start` on (no
    token of a version newer than the cut's), and the turn it is in (for the trace)."""

    request_id: str
    attempt_id: int
    turn: int
    call: RunningCall


@dataclass(frozen=True)
class DurableChunk:
    """One chunk of a call, durable in `segment` at `row`: output positions
    [prefix_count, prefix_count + count), all of `policy_version`."""

    segment: SegmentRef
    row: int
    prefix_count: int
    count: int
    policy_version: int


@dataclass(frozen=True)
class CallChunks:
    attempt_id: int
    chunks: tuple[DurableChunk, ...]
    has_logprobs: bool

    @property
    def end(self) -> int:
        return self.chunks[-1].prefix_count + self.chunks[-1].count if self.chunks else 0


@dataclass
class CutChunks:
    """What one cut writes and references: the new segment (None when no call decoded
    anything new), the `token_chunks` rows of the snapshot, and the memory to adopt once
    the snapshot is published."""

    segment: SegmentRef | None = None
    references: list[ChunkReference] = field(default_factory=list)
    after: dict[str, CallChunks] = field(default_factory=dict)
    new_tokens: int = 0


_NEW = SegmentRef(0, "", "", 0, 0)  # stands for the segment this cut writes, until it is written


class PrefixChunks:
    """The snapshot pump's memory of the durable chunks of each running call (module
    docstring). Used only under the save lock (one snapshot attempt at a time)."""

    def __init__(self) -> None:
        self._durable: dict[str, CallChunks] = {}

    def since(self) -> dict[str, int]:
        """The offsets to ask the engine from: where each call's durable chunks end. A
        call whose chunks have no logprobs is read whole (its new tokens may come with
        logprobs, and a call's chunks have them all or none: `CallPrefix.of`)."""
        return {rid: c.end for rid, c in self._durable.items() if c.has_logprobs}

    def forget_missing(self, segments_dir: Path) -> None:
        """Drop the calls whose chunks name a segment file that is gone (module docstring)."""
        names = {ch.segment.file_name for c in self._durable.values() for ch in c.chunks}
        gone = {n for n in names if not (segments_dir / n).is_file()}
        if gone:
            self._durable = {rid: c for rid, c in self._durable.items()
                             if not any(ch.segment.file_name in gone for ch in c.chunks)}

    def last_version(self, request_id: str) -> int | None:
        """The policy version of the call's last durable token (None: none is durable)."""
        known = self._durable.get(request_id)
        return known.chunks[-1].policy_version if known is not None and known.chunks else None

    def can_continue(self, request_id: str, attempt_id: int, call: RunningCall) -> bool:
        """Whether `call` (read from `call.start` on) adds up with what is durable of it
        into its whole output: read whole, or from no later than its durable end."""
        if call.start == 0:
            return True
        known = self._durable.get(request_id)
        return known is not None and known.attempt_id == attempt_id and call.start <= known.end <= call.end

    def cut(self, saved: Sequence[SavedCall], write: Callable[[list[tuple[int, bytes, bytes]]], SegmentRef]) -> CutChunks:
        """Plan this cut's chunks, write the new ones into one segment (`write`, durable
        on return), and return the snapshot's references."""
        rows: list[tuple[int, bytes, bytes]] = []
        out = CutChunks()
        layouts: list[tuple[SavedCall, list[DurableChunk], bool]] = []
        for s in saved:
            call = s.call
            complete = len(call.logprobs) == len(call.token_ids)
            known = self._durable.get(s.request_id)
            if known is not None and (known.attempt_id != s.attempt_id or not call.start <= known.end <= call.end
                                      or (known.has_logprobs != complete and call.end > known.end)):
                known = None
            if known is None and call.start != 0:
                continue  # the caller checked `can_continue`: not reached
            chunks = list(known.chunks) if known is not None else []
            has_logprobs = known.has_logprobs if known is not None and known.chunks else complete
            begin = known.end if known is not None else 0
            skip = begin - call.start
            tokens, versions = call.token_ids[skip:], call.token_versions[skip:]
            logprobs = call.logprobs[skip:] if has_logprobs else []
            i = 0
            while i < len(tokens):
                j = i
                while j < len(tokens) and versions[j] == versions[i]:
                    j += 1
                row = len(rows)
                rows.append((row, np.asarray(tokens[i:j], dtype=_TOKEN).tobytes(),
                             np.asarray(logprobs[i:j], dtype=_LOGPROB).tobytes() if has_logprobs else b""))
                chunks.append(DurableChunk(_NEW, row, begin + i, j - i, versions[i]))
                out.new_tokens += j - i
                i = j
            if chunks:
                layouts.append((s, chunks, has_logprobs))
        if rows:
            out.segment = write(rows)
        for s, chunks, has_logprobs in layouts:
            placed = tuple(c if c.segment is not _NEW else DurableChunk(out.segment, c.row, c.prefix_count, c.count,
                                                                        c.policy_version) for c in chunks)
            out.after[s.request_id] = CallChunks(s.attempt_id, placed, has_logprobs)
            out.references += [ChunkReference(s.attempt_id, index, c.prefix_count, s.call.max_tokens, s.call.min_tokens,
                                              c.policy_version, c.segment, c.row, s.call.sampler)
                               for index, c in enumerate(placed)]
        return out

    def published(self, cut: CutChunks) -> None:
        """The snapshot that wrote and referenced `cut` is published: its chunks are what
        is durable now, and only the calls it saved keep any."""
        self._durable = dict(cut.after)
