"""What a run shows a person: metrics as JSONL, a progress bar (tqdm on a terminal,
plain lines otherwise), a reward-curve PNG and a one-line summary."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from tqdm import tqdm


class MetricsLog:
    """Append-only JSONL, one object per line, flushed per event so a killed run keeps
    everything it logged. Thread-safe: both pumps log. With `attempt`, every line carries
    `"attempt": N`, the process (start or resume) of the run that wrote it: a resumed run
    trains the steps after its snapshot again, and a reader tells the two records of such
    a step apart by it (the later attempt's is the one that counts: `latest_per_step`)."""

    def __init__(self, path: Path, *, attempt: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.attempt = attempt
        self._f = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        if self.attempt is not None:
            event = {**event, "attempt": self.attempt}
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_metrics(path: Path, kind: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if kind is None or event.get("kind") == kind:
            out.append(event)
    return out


class _Bar(tqdm):
    # No monitor thread: the bar moves once per train step, so nothing lags for a monitor
    # to catch up on, and the process's threads stay the ones controller/run/runtime.py lists.
    monitor_interval = 0


class ProgressBar:
    """Step, mean reward, staleness and throughput on stderr. On a terminal, a tqdm bar
    (elapsed, ETA and rate over this process's steps, so a resumed run's ETA is right);
    otherwise (a pipe, a log file, CI) plain lines: the first step, every tenth of the
    run and the last, so a log stays short."""

    def __init__(self, total_steps: int, *, enabled: bool, start_step: int = 0, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        tty = self.stream.isatty()
        self.total = total_steps
        self.plain = enabled and not tty
        self.t0 = time.time()
        self.start_step = start_step
        self.tokens = 0
        self.bar = (_Bar(total=total_steps, initial=start_step, file=self.stream, unit="step", dynamic_ncols=True)
                    if enabled and tty else None)

    def update(self, event: dict) -> None:
        if self.bar is None and not self.plain:
            return
        self.tokens += event.get("policy_tokens", 0)
        step = event["step"]
        rate = f"{self.tokens / max(time.time() - self.t0, 1e-9):.0f} tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(f"reward {event['reward_mean']:.3f} staleness {event['staleness_mean']:.2f} {rate}",
                                     refresh=False)
            self.bar.update(step - self.bar.n)
            if step == self.total:
                self.close()
            return
        if step == self.total or step % max(1, self.total // 10) == 0 or step == self.start_step + 1:
            bar = "#" * int(step / self.total * 24)
            self.stream.write(f"step {step}/{self.total} [{bar:<24}] reward {event['reward_mean']:.3f} "
                              f"staleness {event['staleness_mean']:.2f} {rate}\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line (a run that stops early leaves it where it got to)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def latest_per_step(steps: list[dict]) -> list[dict]:
    """A resumed run trains the steps after its snapshot again; the last record of each
    step is the one that counts."""
    by_step = {e["step"]: e for e in steps}
    return [by_step[k] for k in sorted(by_step)]


def plot_rewards(steps: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    steps = latest_per_step(steps)
    xs = [e["step"] for e in steps]
    ys = [e["reward_mean"] for e in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, ys, marker="o", markersize=3)
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward")
    ax.set_title("reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summary_line(steps: list[dict], snapshots: Sequence[dict] = ()) -> str:
    """The run in one line: steps and reward gain; with rollout snapshots, how many were
    published and how many attempts found no durable anchor (`skipped_not_durable`: the
    weights in force had no trainer checkpoint yet, so a stop then loses that step's
    rollouts; config.snapshot_interval_warning says which setting causes it)."""
    ordered = latest_per_step(steps)
    if not ordered:
        return "no train steps completed"
    first = [e["reward_mean"] for e in ordered[:5]]
    last = [e["reward_mean"] for e in ordered[-5:]]
    f, l = sum(first) / len(first), sum(last) / len(last)
    line = f"steps={ordered[-1]['step']} reward first5={f:.3f} last5={l:.3f} gain={l - f:+.3f}"
    if snapshots:
        outcomes = Counter(e.get("outcome") for e in snapshots)
        line += f" snapshots={outcomes['published']} skipped_not_durable={outcomes['skipped_not_durable']}"
    return line
