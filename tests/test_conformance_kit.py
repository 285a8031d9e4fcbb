"""The conformance kit (controller/agent_server/conformance.py, `rolloutdb conformance`)
against real HTTP servers: the minimal example server (a real process, restarted by the
kit) passes every check; each planted non-conforming server fails exactly its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _nonconforming_servers import Answers500ToMalformedJson, ExportsBeforeDraining, IgnoresLease, serving
from restartable_server import minimal_server, token_file
from rolloutdb.config import load_config
from rolloutdb.controller.agent_server import conformance
from rolloutdb.controller.job import build

TOKEN = "kit-token-" + "0123456789abcdef"


@pytest.mark.parametrize("planted, broken", [
    (IgnoresLease, "lease_releases_dispatch"),
    (ExportsBeforeDraining, "export_is_the_commit_copy"),
    (Answers500ToMalformedJson, "malformed_requests_get_4xx"),
])
def test_a_planted_server_fails_exactly_the_guarantee_it_breaks(planted, broken):
    with serving(planted(TOKEN)) as url:
        results = conformance.run_kit(url, TOKEN, timeout=20)
    assert conformance.failed(results) == [broken], conformance.results_table(results)
    row = next(r for r in results if r.guarantee == broken)
    assert row.request and row.got, row  # the table names the request that failed and what came back


@pytest.mark.parametrize("task", ["toy", "digits"])
def test_the_minimal_server_passes_every_check_including_a_kill_between_prepare_and_commit(tmp_path, task):
    policy_dir = None
    if task == "digits":  # the built-in digits task over a real policy tokenizer, as in its config.yaml
        cfg = tmp_path / "run.yaml"
        cfg.write_text("run: {seed: 0}\nenvironment: {task: digits, kind: copy, n_digits: 2, turns: 3}\n")
        policy_dir = build.build_policy(load_config(cfg), tmp_path / "policy")
    server = minimal_server(tmp_path, TOKEN, policy_dir=policy_dir)
    url = server.start()
    try:
        results = conformance.run_kit(url, TOKEN, restart_cmd=server.restart_cmd, timeout=20)
    finally:
        server.stop()
    table = conformance.results_table(results)
    assert [(r.guarantee, r.status) for r in results] == [(g, "pass") for g in conformance.GUARANTEES], table


def test_the_command_prints_a_table_and_exits_1_naming_the_failed_guarantee(tmp_path):
    key = token_file(tmp_path, TOKEN)
    with serving(IgnoresLease(TOKEN)) as url:
        text = subprocess.run([sys.executable, "-m", "rolloutdb", "conformance", url, "--key-file", str(key)],
                              capture_output=True, text=True, timeout=300)
        as_json = subprocess.run([sys.executable, "-m", "rolloutdb", "conformance", url, "--key-file", str(key),
                                  "--json"], capture_output=True, text=True, timeout=300)
    assert text.returncode == 1, text.stderr
    rows = {line.split()[0]: line.split()[1] for line in text.stdout.splitlines()[1:]}
    assert rows["lease_releases_dispatch"] == "fail" and rows["export_equals_restore"] == "pass", text.stdout
    assert rows["killed_between_prepare_and_commit"] == "skipped", text.stdout
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False
    assert [r["guarantee"] for r in report["results"] if r["status"] == "fail"] == ["lease_releases_dispatch"]


def test_the_command_exits_0_on_a_conforming_server(tmp_path):
    key = token_file(tmp_path, TOKEN)
    with serving(ExportsBeforeDraining.__mro__[1](TOKEN)) as url:
        done = subprocess.run([sys.executable, "-m", "rolloutdb", "conformance", url, "--key-file", str(key)],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("args, says", [
    (["ftp://127.0.0.1:1"], "http://HOST:PORT"),
    (["http://127.0.0.1:1", "--key-file", "/nonexistent/token"], "not found"),
    (["http://127.0.0.1:1", "--lease-s", "0"], "--lease-s"),
])
def test_unusable_arguments_exit_2_with_one_line(args, says):
    done = subprocess.run([sys.executable, "-m", "rolloutdb", "conformance", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
