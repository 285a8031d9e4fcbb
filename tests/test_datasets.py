"""Prompts from JSONL and Parquet files (controller/tasks/datasets.py): real files in tmp_path,
Parquet written by DuckDB, chat templates rendered by a real Hugging Face tokenizer
(the tiny policy's, given a Jinja template), one-line errors for every bad input."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import duckdb
import pytest

from rolloutdb.controller.tasks.datasets import (
    DatasetError,
    FileDataset,
    PromptFormatter,
    tiny_policy_alphabet,
)
from rolloutdb.config import DatasetSection
from rolloutdb.controller.protocols import PromptDataset
from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.gpu_capture.tiny_policy import DEFAULT_ALPHABET, build_tokenizer

RECORDS = [
    {"prompt": "What is 2 plus 3?", "answer": 5, "meta": {"level": 1}},
    {"prompt": "What is 7 minus 4?", "answer": 3, "meta": {"level": 2}},
    {"prompt": "What is 6 times 2?", "answer": 12, "meta": {"level": 1}},
]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_jsonl(path, records, *, blank_lines=False):
    lines = [json.dumps(r) for r in records]
    text = ("\n\n".join(lines) if blank_lines else "\n".join(lines)) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def write_parquet(path, jsonl):
    # DuckDB writes the Parquet file from the JSONL (pyarrow is not installed).
    duckdb.sql(f"COPY (SELECT * FROM read_json('{jsonl}', format='newline_delimited')) TO '{path}' (FORMAT parquet)")
    return path


def refused(call) -> str:
    with pytest.raises(DatasetError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and message.startswith("dataset.")
    return message


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", RECORDS)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_ALPHABET)


# ------------------------------------------------------------------------ reading


def test_a_jsonl_file_gives_its_prompts_in_file_order_and_each_record_whole(jsonl):
    data = FileDataset(jsonl)
    assert len(data) == 3
    assert [data[i] for i in range(3)] == [r["prompt"] for r in RECORDS]
    assert data.record(1) == RECORDS[1]
    assert data.location(2) == "line 3"


def test_blank_lines_are_skipped_and_locations_still_name_the_real_line(tmp_path):
    data = FileDataset(write_jsonl(tmp_path / "p.jsonl", RECORDS, blank_lines=True))
    assert len(data) == 3 and data[2] == RECORDS[2]["prompt"]
    assert data.location(2) == "line 5"


def test_a_parquet_file_gives_the_same_prompts_and_records_as_its_jsonl(jsonl, tmp_path):
    parquet = write_parquet(tmp_path / "prompts.parquet", jsonl)
    data = FileDataset(parquet)
    assert [data[i] for i in range(len(data))] == [r["prompt"] for r in RECORDS]
    assert [data.record(i) for i in range(3)] == RECORDS
    assert data.location(0) == "row 1"


def test_reward_fields_give_the_reward_only_the_prompt_and_those_fields(jsonl):
    data = FileDataset(jsonl, reward_fields=["answer"])
    assert data.record(2) == {"prompt": RECORDS[2]["prompt"], "answer": 12}


def test_a_reward_that_changes_its_record_does_not_change_the_dataset(jsonl):
    data = FileDataset(jsonl)
    data.record(0)["meta"]["level"] = 99
    assert data.record(0)["meta"] == {"level": 1}


def test_a_relative_path_is_read_from_the_base_directory(jsonl, tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    assert len(FileDataset("prompts.jsonl", base_dir=tmp_path)) == 3


def test_the_file_dataset_is_a_prompt_dataset_the_sampler_can_order(jsonl):
    data = FileDataset(jsonl)
    assert isinstance(data, PromptDataset)
    order = PromptOrder(len(data), seed=0)
    assert sorted(order.at(i).prompt_id for i in range(3)) == [0, 1, 2]


def test_the_sampler_holds_two_epochs_orders_however_many_epochs_the_run_walks():
    """40 epochs of a 100k-prompt dataset walked position by position: the memory the
    order holds stays about two permutations (800 KB each), and an epoch it let go
    comes back the same. Planted: keeping every epoch's permutation -> ~32 MB held and
    this fails."""
    import tracemalloc

    size = 100_000
    order = PromptOrder(size, seed=7)
    first = [r.prompt_id for r in order.take(0, 50)]
    tracemalloc.start()
    try:
        for epoch in range(1, 40):
            order.take(epoch * size, 3)
            order.take(epoch * size + size - 3, 3)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 3 * 8 * size
    assert [r.prompt_id for r in order.take(0, 50)] == first == [r.prompt_id for r in PromptOrder(size, 7).take(0, 50)]


def test_an_index_outside_the_dataset_is_an_index_error(jsonl):
    with pytest.raises(IndexError, match="out of range 0..2"):
        FileDataset(jsonl)[3]


# ---------------------------------------------------------------------- fingerprint


def test_the_fingerprint_is_stable_and_ignores_where_the_file_lies(jsonl, tmp_path):
    copy = tmp_path / "elsewhere" / "same.jsonl"
    copy.parent.mkdir()
    shutil.copyfile(jsonl, copy)
    assert FileDataset(jsonl).fingerprint() == FileDataset(jsonl).fingerprint() == FileDataset(copy).fingerprint()


def test_one_changed_byte_or_another_prompt_field_changes_the_fingerprint(jsonl):
    before = FileDataset(jsonl).fingerprint()
    assert FileDataset(jsonl, prompt_field="prompt", reward_fields=["answer"]).fingerprint() != before
    jsonl.write_text(jsonl.read_text().replace("2 plus 3", "2 plus 4"))
    assert FileDataset(jsonl).fingerprint() != before


def test_a_resume_against_a_changed_file_is_refused_naming_both_fingerprints(jsonl, tmp_path):
    from rolloutdb.store import RunMismatch, Store
    from rolloutdb.store.restore.plan import check_run_meta

    started = FileDataset(jsonl).fingerprint()
    Store.create(tmp_path / "live.sqlite", config_fingerprint="c", dataset_fingerprint=started).close()
    jsonl.write_text(jsonl.read_text().replace("6 times 2", "6 times 3"))
    now = FileDataset(jsonl).fingerprint()
    conn = sqlite3.connect(tmp_path / "live.sqlite")
    try:
        with pytest.raises(RunMismatch) as e:
            check_run_meta(conn, tmp_path, config_fingerprint="c", dataset_fingerprint=now, forest_training={},
                            ledger_dispatch=None, run_id=None)
    finally:
        conn.close()
    assert f"dataset fingerprint {started} (run: {now})" in str(e.value)


# ---------------------------------------------------------------------------- errors


def test_a_missing_file_is_refused_naming_it_and_where_relative_paths_are_read(tmp_path):
    message = refused(lambda: FileDataset("nope.jsonl", base_dir=tmp_path))
    assert "nope.jsonl not found" in message and f"relative to {tmp_path}" in message


def test_a_gzipped_jsonl_gives_the_records_and_fingerprint_of_the_plain_file(jsonl, tmp_path):
    import gzip

    packed = tmp_path / "packed" / "prompts.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(jsonl.read_bytes(), compresslevel=1))
    plain, gzipped = FileDataset(jsonl), FileDataset(packed)
    assert [gzipped.record(i) for i in range(len(gzipped))] == [plain.record(i) for i in range(len(plain))] == RECORDS
    assert gzipped.fingerprint() == plain.fingerprint()
    packed.write_bytes(gzip.compress(jsonl.read_bytes(), compresslevel=9))
    assert FileDataset(packed).fingerprint() == plain.fingerprint()  # the records, not their compression


def test_a_gzipped_jsonl_with_a_bad_line_or_a_cut_stream_is_refused_naming_it(jsonl, tmp_path):
    import gzip

    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"prompt": "fine"}\nnot json\n'))
    assert "bad.jsonl.gz line 2 is not valid JSON" in refused(lambda: FileDataset(bad))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(jsonl.read_bytes())[:-12])
    assert "cut.jsonl.gz is not a readable gzip file" in refused(lambda: FileDataset(cut))
    other = tmp_path / "p.csv.gz"
    other.write_bytes(gzip.compress(b"prompt\nhi\n"))
    assert "'.gz'" in refused(lambda: FileDataset(other)) and ".jsonl.gz" in refused(lambda: FileDataset(other))


def test_a_glob_reads_every_matching_file_in_name_order_as_one_dataset_naming_each_records_file(tmp_path):
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "part-1.jsonl", RECORDS[2:])
    (data / "part-0.jsonl.gz").write_bytes(gzip.compress(write_jsonl(tmp_path / "first.jsonl", RECORDS[:2]).read_bytes()))
    (data / "notes.txt").write_text("not matched")
    joined = FileDataset("data/part-*", base_dir=tmp_path)
    assert [joined.record(i) for i in range(len(joined))] == RECORDS
    assert [(joined.file_of(i).name, joined.location(i)) for i in range(3)] == [
        ("part-0.jsonl.gz", "line 1"), ("part-0.jsonl.gz", "line 2"), ("part-1.jsonl", "line 1")]
    before = joined.fingerprint()
    assert before == FileDataset(data / "part-*").fingerprint()
    assert before != FileDataset(tmp_path / "first.jsonl").fingerprint()
    write_jsonl(data / "part-1.jsonl", [{**RECORDS[2], "prompt": "What is 6 times 3?"}])
    assert FileDataset(data / "part-*").fingerprint() != before


def test_a_glob_that_matches_nothing_or_both_kinds_or_a_bad_line_is_refused_naming_the_file(tmp_path):
    assert "the pattern" in refused(lambda: FileDataset("none-*.jsonl", base_dir=tmp_path))
    assert "matches no file (read relative to" in refused(lambda: FileDataset("none-*.jsonl", base_dir=tmp_path))
    write_jsonl(tmp_path / "a.jsonl", RECORDS)
    (tmp_path / "b.jsonl").write_text('{"prompt": "fine"}\nnot json\n')
    assert "b.jsonl line 2 is not valid JSON" in refused(lambda: FileDataset(tmp_path / "*.jsonl"))
    write_parquet(tmp_path / "c.parquet", tmp_path / "a.jsonl")
    assert "both JSON Lines and Parquet" in refused(lambda: FileDataset(tmp_path / "[ac].*"))


def test_an_unknown_extension_is_refused_listing_the_accepted_ones(tmp_path):
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    message = refused(lambda: FileDataset(tmp_path / "p.csv"))
    assert "'.csv'" in message and ".jsonl" in message and ".parquet" in message


@pytest.mark.parametrize(
    ("second_line", "expected"),
    [
        # DuckDB's reader names line 3 for this one: its parser reads on across the newline.
        ('{"prompt": "unclosed"', "line 2 is not valid JSON"),
        ("[1, 2]", "line 2 is a JSON list, not an object"),
        ('"just text"', "line 2 is a JSON str, not an object"),
        ("not json at all", "line 2 is not valid JSON"),
    ],
)
def test_a_malformed_line_is_refused_naming_its_line_number(tmp_path, second_line, expected):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + second_line + '\n{"prompt": "also fine"}\n')
    assert expected in refused(lambda: FileDataset(path))


def test_a_line_that_is_not_utf8_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    assert "line 2 is not UTF-8" in refused(lambda: FileDataset(path))


def test_a_record_without_the_prompt_field_is_refused_naming_the_line_and_its_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"question": "b", "answer": 1}])
    message = refused(lambda: FileDataset(path))
    assert "line 2 has no field 'prompt' (dataset.prompt_field); its fields are question, answer" in message


def test_a_missing_reward_field_names_the_reward_fields_key(jsonl):
    message = refused(lambda: FileDataset(jsonl, reward_fields=["answer", "solution"]))
    assert "line 1 has no field 'solution' (dataset.reward_fields)" in message


@pytest.mark.parametrize(("prompt", "expected"), [(None, "is null"), (7, "is 7; a prompt is text"), ("  ", "is empty"),
                                                  ([{"role": "user"}], "message 0 is")])
def test_a_prompt_that_is_not_text_or_chat_messages_is_refused_naming_the_line(tmp_path, prompt, expected):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    message = refused(lambda: FileDataset(path))
    assert "line 2" in message and expected in message


def test_a_parquet_file_without_the_prompt_column_is_refused_listing_its_columns(jsonl, tmp_path):
    parquet = write_parquet(tmp_path / "p.parquet", jsonl)
    message = refused(lambda: FileDataset(parquet, prompt_field="question"))
    assert "has no column 'question'; its columns are prompt, answer, meta" in message


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_file_is_refused(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    assert "holds no records" in refused(lambda: FileDataset(path))


def test_an_empty_parquet_file_is_refused(tmp_path):
    path = tmp_path / "p.parquet"
    duckdb.sql(f"COPY (SELECT 'x' AS prompt WHERE false) TO '{path}' (FORMAT parquet)")
    assert "holds no records" in refused(lambda: FileDataset(path))


def test_a_file_that_is_not_parquet_is_refused_in_one_line(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_text('{"prompt": "I am JSON"}\n')
    assert "is not a readable Parquet file" in refused(lambda: FileDataset(path))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    path = tmp_path / "p.jsonl"
    os.mkfifo(path)
    assert "not a regular file" in refused(lambda: FileDataset(path))


# ---------------------------------------------------------------------- tokenization


def test_without_a_chat_template_a_prompt_is_its_text_with_the_tokenizers_own_bos(tokenizer, jsonl):
    formatter = PromptFormatter(tokenizer)
    assert not formatter.use_template
    ids = formatter.encode("What is 2?")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "What is 2?"


def test_a_chat_template_renders_text_and_message_prompts_through_the_tokenizer(tokenizer):
    templated = build_tokenizer(DEFAULT_ALPHABET)
    templated.chat_template = TEMPLATE
    formatter = PromptFormatter(templated)
    assert formatter.use_template
    assert formatter.text("Hi?") == "<user>Hi?\n<assistant>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    ids = formatter.encode(messages)
    assert templated.decode(ids) == "<system>Be brief.\n<user>Hi?\n<assistant>"
    assert ids[0] != templated.bos_token_id  # the template writes the text; nothing is added
    assert PromptFormatter(templated, "never").text("Hi?") == "Hi?"


def test_chat_template_always_is_refused_for_a_tokenizer_without_one(tokenizer):
    message = refused(lambda: PromptFormatter(tokenizer, "always"))
    assert "has no chat template" in message


def test_chat_message_prompts_without_a_template_are_refused_naming_the_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "text"}, {"prompt": [{"role": "user", "content": "hi"}]}])
    data = FileDataset(path)
    message = refused(lambda: PromptFormatter(tokenizer).check(data))
    assert "line 2 is a list of chat messages" in message


def test_the_tiny_policy_alphabet_adds_what_the_prompts_use_and_refuses_non_ascii(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a & b ~ c"}])
    assert tiny_policy_alphabet(FileDataset(path), DEFAULT_ALPHABET) == DEFAULT_ALPHABET + "&~"
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "plain"}, {"prompt": "café"}])
    message = refused(lambda: tiny_policy_alphabet(FileDataset(path), DEFAULT_ALPHABET))
    assert "line 2 uses 'é'" in message and "policy.model_dir" in message


def test_the_proposed_dataset_section_defaults_to_the_built_in_task_and_refuses_unknown_keys():
    assert DatasetSection().path is None and DatasetSection().chat_template == "auto"
    with pytest.raises(ValueError, match="extra"):
        DatasetSection.model_validate({"path": "p.jsonl", "prompt_feild": "q"})
