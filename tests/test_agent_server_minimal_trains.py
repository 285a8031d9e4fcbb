"""examples/agent_server_minimal: the standard-library server, written from the protocol
page alone, trains a real run (`rolloutdb train` with its config.yaml, the server at a
`url`) for its steps, and `rolloutdb verify` of the run is clean."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

import yaml

from conftest import REPO
from restartable_server import Restartable, free_port, token_file

EXAMPLE = REPO / "examples" / "agent_server_minimal"
TOKEN = "minimal-token-" + "0123456789abcdef"


def test_the_minimal_server_trains_a_run_that_verifies_clean(tmp_path):
    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    env = cfg["environment"]
    port, key = free_port(), token_file(tmp_path, TOKEN)
    env["servers"][0].update(url=f"http://127.0.0.1:{port}", token_file=str(key))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = tmp_path / "run"
    server = Restartable(tmp_path, [sys.executable, str(EXAMPLE / "server.py"), "--port", str(port), "--token-file",
                                    str(key), "--policy-dir", str(run_dir / "policy"), "--turns", str(env["turns"]),
                                    "--n-digits", str(env["n_digits"]), "--seed", str(cfg["run"]["seed"]),
                                    "--prompts", str(env["dataset_size"])], port)
    server.start()
    try:
        train = subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(config), "--run-dir",
                                str(run_dir)], capture_output=True, text=True, timeout=240)
    finally:
        server.stop()
    assert train.returncode == 0, train.stderr[-3000:]
    conn = sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True)
    try:  # every snapshot ran the server's checkpoint protocol; none was refused at the cut
        outcomes = conn.execute("SELECT outcome, error FROM snapshot_attempts").fetchall()
    finally:
        conn.close()
    assert any(o == "published" for o, _ in outcomes) and not [e for o, e in outcomes if o == "failed"], outcomes
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir)], capture_output=True,
                            text=True, timeout=240)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]
    assert "duplicated=0 lost=0" in verify.stdout, verify.stdout
    trained = int(re.search(r"trained=(\d+)", verify.stdout).group(1))
    assert trained >= cfg["algorithm"]["total_steps"] * cfg["algorithm"]["groups_per_step"], verify.stdout
