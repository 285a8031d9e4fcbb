"""Prompts from a file: JSONL (gzipped or not) or Parquet, one prompt per record, addressed
by position; or from every file a glob pattern matches, in name order, as one dataset.

`FileDataset` implements `PromptDataset` (`controller/protocols.py`): `len()`, a
fingerprint, and `dataset[i]` (the prompt of record i); `record(i)` is what a reward
function receives. `PromptFormatter` turns a prompt into token ids through the policy's
tokenizer: its chat template when it has one (`apply_chat_template`), plain text
otherwise.

Which library reads what, and why:
- Parquet through DuckDB (`read_parquet`). DuckDB is already a dependency (the trace
  analysis runs on it) and reads Parquet with no other package; pyarrow would add a
  ~100 MB wheel for the same result. `file_row_number` keeps the file's row order.
- JSONL through the standard library's `json` parser, one line at a time. DuckDB's
  NDJSON reader was the first choice and was measured: for an unclosed object on line 2
  it reports "line 3" (its parser reads on across the newline), and it skips blank lines
  without saying which line a record came from, so it cannot say "line 7 has no field
  'prompt'". An error must name its line; `json.loads` per line gives it exactly,
  and it is a maintained parser, not a hand-written one.

The fingerprint is the sha256 of the file's bytes, combined with the field selection (a
different `prompt_field` over the same bytes is a different dataset): a resume against a
changed file is refused by the restore's run_meta check, naming both fingerprints.

The file is read a line at a time (a line past a bound set by the policy's context is
refused before it is all read, `BYTES_PER_POSITION`). Records are held in memory (a list
of dicts): a million short prompts is a few hundred MB, and `env.start(i)` then costs a
list index, not a query. Every error is one line, a
`DatasetError` (a ValueError) naming the key, the file and, where it applies, the line.
"""

from __future__ import annotations

import copy
import glob
import gzip
import hashlib
import itertools
import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rolloutdb.config import ChatTemplate, DatasetSection
from rolloutdb.store import refuse_special_file

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# JSON Lines compressed with gzip (`prompts.jsonl.gz`): read through the standard library's
# gzip stream, line by line as a plain file; the fingerprint is of the decompressed bytes,
# so recompressing the same records (another level, another gzip) is the same dataset.
GZIP_SUFFIX = ".gz"
PARQUET_SUFFIXES = (".parquet", ".pq")
# Bounds that refuse a prompt too long for the policy's context without tokenizing it (a
# 50 MB line took over 5 minutes through the tokenizer, after the run directory was made).
# No tokenizer puts more than a few dozen characters in a token, so a prompt of more than
# CHARS_PER_POSITION characters per context position cannot fit; a line is refused unread
# past BYTES_PER_POSITION bytes per position plus RECORD_SLACK for the record's other
# fields (a reward's reference answer, test cases). The token count itself is checked
# once the tokenizer is loaded (plugins.RewardEnvironment.check_context).
CHARS_PER_POSITION = 32
BYTES_PER_POSITION = 64
RECORD_SLACK = 4 << 20
_READ_CHUNK = 1 << 20
# How much of a bad value an error line shows.
_SHOWN = 60


class DatasetError(ValueError):
    """A dataset file or setting that cannot be used; the message is one line."""


# ----------------------------------------------------------------------------- reading


def _one_line(text: object) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _read_jsonl(path: Path, max_line: int | None) -> tuple[list[dict], list[int], str]:
    """(records, the 1-based line of each, the sha256 of the file's bytes), streamed: a
    line longer than `max_line` bytes is refused as soon as that many are read. Blank
    lines are skipped (a trailing newline or a separating blank line is common); anything
    else must be one JSON object."""
    records: list[dict] = []
    lines: list[int] = []
    digest = hashlib.sha256()
    opener = gzip.open if path.suffix.lower() == GZIP_SUFFIX else open
    with opener(path, "rb") as f:
        try:
            for number in itertools.count(1):
                raw = _read_line(f, path, number, max_line)
                if not raw:
                    break
                digest.update(raw)
                value = _parse_line(path, number, raw)
                if value is not None:
                    records.append(value)
                    lines.append(number)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise DatasetError(f"dataset.path: {path} is not a readable gzip file ({_one_line(e) or type(e).__name__}"
                               f", at line {number}); recompress it with gzip") from None
    return records, lines, digest.hexdigest()


class _Lines(Protocol):
    """A binary file read by lines: a plain file or a gzip stream."""

    def readline(self, size: int = -1, /) -> bytes: ...


def _read_line(f: _Lines, path: Path, number: int, max_line: int | None) -> bytes:
    """One line with its newline (b"" at the end of the file), read in bounded pieces."""
    parts: list[bytes] = []
    size = 0
    while True:
        part = f.readline(_READ_CHUNK)
        parts.append(part)
        size += len(part)
        if max_line is not None and size > max_line:
            raise DatasetError(f"dataset.path: {path} line {number} is longer than {max_line} bytes: a prompt that "
                               f"long cannot fit the policy's context (at most {BYTES_PER_POSITION} bytes per "
                               "position, plus room for the record's other fields); shorten or drop it")
        if not part or part.endswith(b"\n"):
            return b"".join(parts)


def _parse_line(path: Path, number: int, raw: bytes) -> dict | None:
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset.path: {path} line {number} is not UTF-8 text (byte {e.start + 1} of the "
                           "line); save the file as UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"dataset.path: {path} line {number} is not valid JSON ({e.msg} at column {e.colno}); "
                           "each line must be one JSON object") from None
    except RecursionError:
        raise DatasetError(f"dataset.path: {path} line {number} is nested too deeply to be a prompt record") from None
    except ValueError as e:  # Python's int limit: "Exceeds the limit (4300 digits) for integer string conversion"
        raise DatasetError(f"dataset.path: {path} line {number} holds a value JSON cannot be read into "
                           f"({_one_line(e)}); write long numbers as strings") from None
    if not isinstance(value, dict):
        raise DatasetError(f"dataset.path: {path} line {number} is a JSON {type(value).__name__}, not an object; "
                           "each line must be one object such as {\"prompt\": \"...\"}")
    return value


def _read_parquet(path: Path) -> tuple[list[dict], list[int], list[str]]:
    """(records, the 1-based row of each, the file's column names), in file order."""
    import duckdb

    conn = duckdb.connect(":memory:")
    try:
        # The path is a bound parameter: no quoting of user text into SQL.
        cur = conn.execute("SELECT * FROM read_parquet($path, file_row_number = true) ORDER BY file_row_number",
                           {"path": str(path)})
        columns = [d[0] for d in cur.description]
        rows = cur.fetchall()
    except duckdb.Error as e:
        raise DatasetError(f"dataset.path: {path} is not a readable Parquet file ({_one_line(e)})") from None
    finally:
        conn.close()
    at = columns.index("file_row_number")
    names = [c for c in columns if c != "file_row_number"]
    records = [{c: v for c, v in zip(columns, row) if c != "file_row_number"} for row in rows]
    return records, [int(row[at]) + 1 for row in rows], names


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_messages(value: list, where: str) -> None:
    for k, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DatasetError(f"{where}: message {k} is {_shown(message)}; a chat prompt is a list of "
                               "{\"role\": ..., \"content\": ...} with text values")
    if not value:
        raise DatasetError(f"{where}: the chat prompt is an empty list of messages")


class FileDataset:
    """The prompts of one JSONL or Parquet file. Implements `PromptDataset`.

    `base_dir`: where a relative `path` is read from (the config file's directory).
    `reward_fields`: the fields `record(i)` passes on besides the prompt, each required in
    every record; None passes the whole record. `max_positions`: the policy's context;
    a prompt that cannot fit it is refused while reading (CHARS_PER_POSITION), None: no
    bound here."""

    def __init__(self, path: str | Path, *, prompt_field: str = "prompt", reward_fields: Sequence[str] | None = None,
                 base_dir: str | Path | None = None, max_positions: int | None = None):
        given = Path(path)
        self.path = given if given.is_absolute() or base_dir is None else Path(base_dir) / given
        self.prompt_field = prompt_field
        self.reward_fields = None if reward_fields is None else list(reward_fields)
        self.max_positions = max_positions
        self._hint = "" if given.is_absolute() or base_dir is None else f" (read relative to {base_dir})"
        # A glob pattern (`data/part-*.jsonl`) reads every file it matches, in name order,
        # as one dataset; prompt ids run on across the files.
        self.files = self._matched_files()
        kinds = {self._kind(f) for f in self.files}
        if len(kinds) > 1:
            raise DatasetError(f"dataset.path: {self.path} matches both JSON Lines and Parquet files; match one kind")
        self._unit = "row" if kinds == {"parquet"} else "line"
        self._records: list[dict] = []
        self._numbers: list[int] = []
        self._file_index: list[int] = []
        hashes = []
        for k, file in enumerate(self.files):
            records, numbers, sha = self._read_file(file)
            self._records += records
            self._numbers += numbers
            self._file_index += [k] * len(records)
            hashes.append(sha)
        # One file: its content hash, as before globs existed (a resume keeps its fingerprint).
        # Several: the hashes in file order (the order is the prompt ids'), not the names.
        self.content_sha256 = hashes[0] if len(hashes) == 1 and not glob.has_magic(str(given)) else \
            hashlib.sha256(json.dumps(hashes).encode()).hexdigest()

    def _matched_files(self) -> list[Path]:
        if not glob.has_magic(str(self.path)):
            return [self.path]
        files = [Path(p) for p in sorted(glob.glob(str(self.path))) if Path(p).is_file()]
        if not files:
            raise DatasetError(f"dataset.path: the pattern {self.path} matches no file{self._hint}; check the pattern")
        return files

    def _kind(self, path: Path) -> str:
        suffix = path.suffix.lower()
        if suffix == GZIP_SUFFIX and Path(path.stem).suffix.lower() in JSONL_SUFFIXES:
            return "jsonl"  # prompts.jsonl.gz: JSON Lines, gzipped
        if suffix in JSONL_SUFFIXES:
            return "jsonl"
        if suffix in PARQUET_SUFFIXES:
            return "parquet"
        accepted = JSONL_SUFFIXES + tuple(s + GZIP_SUFFIX for s in JSONL_SUFFIXES) + PARQUET_SUFFIXES
        raise DatasetError(f"dataset.path: {path} has the extension {suffix or '(none)'!r}; accepted: "
                           f"{', '.join(accepted)} (JSON Lines, gzipped or not, or Parquet)")

    def _read_file(self, path: Path) -> tuple[list[dict], list[int], str]:
        """(records, their lines or rows, the content hash) of one file, checked."""
        try:
            refuse_special_file(path, DatasetError)  # a FIFO would block the read
        except DatasetError as e:
            raise DatasetError(f"dataset.path: {e}") from None
        if not path.is_file():
            raise DatasetError(f"dataset.path: {path} not found{self._hint}; give an existing .jsonl or .parquet file")
        before = os.stat(path)
        columns: list[str] | None = None
        if self._kind(path) == "jsonl":
            max_line = None if self.max_positions is None else BYTES_PER_POSITION * self.max_positions + RECORD_SLACK
            records, numbers, sha = _read_jsonl(path, max_line)
        else:
            sha = _sha256_of(path)
            records, numbers, columns = _read_parquet(path)
            after = os.stat(path)
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                # DuckDB read the file again after we hashed it; a writer came between.
                raise DatasetError(f"dataset.path: {path} changed while it was being read; start again once "
                                   "it is written")
        if not records:
            raise DatasetError(f"dataset.path: {path} holds no records; it needs at least one "
                               f"{{{self.prompt_field!r}: ...}}")
        self._check_fields(path, records, numbers, columns)
        return records, numbers, sha

    def _check_fields(self, path: Path, records: list[dict], numbers: list[int], columns: list[str] | None) -> None:
        unit = self._unit
        wanted = [self.prompt_field, *(self.reward_fields or [])]
        if columns is not None:  # Parquet: a column is there for every row or for none
            for name in wanted:
                if name not in columns:
                    key = "prompt_field" if name == self.prompt_field else "reward_fields"
                    raise DatasetError(f"dataset.{key}: {path} has no column {name!r}; its columns are "
                                       f"{', '.join(columns)}")
        for record, number in zip(records, numbers):
            where = f"dataset.path: {path} {unit} {number}"
            for name in wanted:
                if record.get(name) is None:
                    what = "is null" if name in record else "has no field"
                    key = "prompt_field" if name == self.prompt_field else "reward_fields"
                    known = ", ".join(map(str, list(record)[:12])) or "none"
                    if what == "is null":
                        raise DatasetError(f"{where}: field {name!r} is null (dataset.{key}); give it a value "
                                           "or drop the record")
                    raise DatasetError(f"{where} has no field {name!r} (dataset.{key}); its fields are {known}")
            prompt = record[self.prompt_field]
            if isinstance(prompt, list):
                _check_messages(prompt, where)
            elif not isinstance(prompt, str):
                raise DatasetError(f"{where}: field {self.prompt_field!r} is {_shown(prompt)}; a prompt is text or a "
                                   "list of chat messages")
            elif not prompt.strip():
                raise DatasetError(f"{where}: field {self.prompt_field!r} is empty; give every record a prompt")
            self._check_length(prompt, where)

    def _check_length(self, prompt: str | list[dict], where: str) -> None:
        if self.max_positions is None:
            return
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if chars > CHARS_PER_POSITION * self.max_positions:
            raise DatasetError(f"{where}: the prompt is {chars} characters, more than fit the policy's context of "
                               f"{self.max_positions} tokens (at most {CHARS_PER_POSITION} characters a token); "
                               "shorten it")

    # --------------------------------------------------------------- PromptDataset

    def __len__(self) -> int:
        return len(self._records)

    def fingerprint(self) -> str:
        """sha256 over the field selection and the file's content hash."""
        head = json.dumps({"dataset": "file", "prompt_field": self.prompt_field,
                           "reward_fields": self.reward_fields, "content_sha256": self.content_sha256},
                          sort_keys=True)
        return hashlib.sha256(head.encode()).hexdigest()

    def __getitem__(self, index: int) -> str | list[dict]:
        """The prompt of record `index`: text, or a list of chat messages."""
        return self._records[self._index(index)][self.prompt_field]

    def _index(self, index: int) -> int:
        if not 0 <= index < len(self._records):
            raise IndexError(f"prompt index {index} out of range 0..{len(self._records) - 1}")
        return index

    def record(self, index: int) -> dict:
        """What the reward receives: a copy of the record (the prompt and the reward
        fields, or every field), so a reward cannot change the dataset."""
        full = self._records[self._index(index)]
        if self.reward_fields is None:
            return copy.deepcopy(full)
        return {name: copy.deepcopy(full[name]) for name in (self.prompt_field, *self.reward_fields)}

    def location(self, index: int) -> str:
        """'line 12' / 'row 12': where record `index` is in its file (`file_of`), for messages."""
        return f"{self._unit} {self._numbers[self._index(index)]}"

    def file_of(self, index: int) -> Path:
        """The file record `index` came from (`path` itself unless it is a glob pattern)."""
        return self.files[self._file_index[self._index(index)]]

    def characters(self) -> set[str]:
        """Every character the prompts use (the tiny policy's tokenizer needs them all)."""
        seen: set[str] = set()
        for record in self._records:
            prompt = record[self.prompt_field]
            texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
            for text in texts:
                seen.update(text)
        return seen


def tiny_policy_alphabet(dataset: FileDataset, base: str) -> str:
    """The tiny policy's alphabet for this dataset: `base` (its default alphabet) plus
    any other character the prompts use. Its tokenizer is byte-level over single bytes
    and drops what it cannot represent, so a non-ASCII prompt is refused here rather than
    trained on with characters silently missing."""
    extra = sorted(dataset.characters() - set(base))
    wide = [ch for ch in extra if len(ch.encode("utf-8")) != 1]
    if wide:
        for i in range(len(dataset)):
            prompt = dataset[i]
            texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
            if any(ch in text for text in texts for ch in wide):
                raise DatasetError(f"dataset.path: {dataset.file_of(i)} {dataset.location(i)} uses {_shown(wide[0])}, "
                                   "which the tiny policy's ASCII tokenizer cannot represent; set policy.model_dir "
                                   "to a Hugging Face model for non-ASCII prompts")
    return base + "".join(extra)


# ----------------------------------------------------------------------- chat templates


class PromptFormatter:
    """Token ids for a prompt through a Hugging Face tokenizer.

    With a chat template (mode auto and the tokenizer has one, or mode always): a text
    prompt becomes one user message, a message list is used as is; the template renders
    it with the generation prompt and the text is encoded without adding special tokens
    (the template writes its own BOS), as transformers' chat-template guide does.
    Without: the text is encoded with the tokenizer's own special tokens (Llama adds BOS,
    GPT-2 adds nothing), and a message-list prompt is refused."""

    def __init__(self, tokenizer: Any, mode: ChatTemplate = "auto"):
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")
        if mode == "always" and not has_template:
            raise DatasetError(f"dataset.chat_template: always, but the tokenizer "
                               f"({_tokenizer_name(tokenizer)}) has no chat template; use auto or never")
        self.use_template = has_template and mode != "never"

    def check(self, dataset: FileDataset) -> None:
        """Refuse, at start, a chat prompt that would be rendered as plain text."""
        if self.use_template:
            return
        for i in range(len(dataset)):
            if not isinstance(dataset[i], str):
                raise DatasetError(f"dataset.path: {dataset.file_of(i)} {dataset.location(i)} is a list of chat messages "
                                   "but no chat template is used (the tokenizer has none, or chat_template: never); "
                                   "give text prompts or a tokenizer with a template")

    def text(self, prompt: str | list[dict]) -> str:
        """The text the policy sees."""
        if not self.use_template:
            if not isinstance(prompt, str):
                raise DatasetError("a chat-message prompt needs a tokenizer with a chat template")
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(rendered)

    def encode(self, prompt: str | list[dict]) -> list[int]:
        text = self.text(prompt)
        # verbose=False: transformers warns of a prompt longer than the model's context;
        # RewardEnvironment.check_context refuses those at start, in one line of its own.
        ids = self.tokenizer.encode(text, add_special_tokens=not self.use_template, verbose=False)
        return [int(t) for t in ids]


def _tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

