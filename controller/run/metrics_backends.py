"""Where a run's metrics go: `logging.backends: [jsonl, tensorboard, wandb]`.

The run logs *events* (dicts with a "kind": train_step, snapshot, restore, store_share).
`RunMetrics` takes them through `MetricsLog`'s two methods (`write(event)`, `close()`):
- JSONL is always written, through `run_log.MetricsLog` itself, so its lines are the same
  whichever backends are on; the summary line, the reward plot and the CLI read it back.
- Every other backend implements `MetricsBackend` (`log(step, scalars)`, `close()`) and
  gets each event as scalars (`event_scalars`): the numeric fields under the event's kind
  ("train/reward_mean", "train/loss", "snapshot/timings/cut_s", ...), plus what a
  dashboard needs and the JSONL leaves to the reader: "train/tokens_per_s" (policy tokens
  trained per wall second since the previous step), "train/step_s", and for snapshots a
  running count per outcome ("snapshot/outcome/published"). Events without a step (a
  snapshot, the store share) are logged at the last train step seen.

TensorBoard: torch's `SummaryWriter` (it needs the `tensorboard` package), into
`<logs>/tensorboard/`. Flushed after every event: a killed run then keeps what it logged,
as the JSONL does; an event is a few hundred bytes, and train steps are seconds apart.
W&B: `wandb.init(mode="offline")`, files under `<logs>/wandb/`; `wandb sync` uploads
them. Both are optional packages; naming one that is not installed is refused at start
with the pip command, before anything is written.

A resume (`resumed_at`: the train step it restored) trains the steps after that step
again. TensorBoard is opened with `purge_step` = that step + 1: readers drop what the
earlier processes logged from there on, so each step shows one value, the retrained
one. W&B resumes the run's own W&B run (its id is kept in `<logs>/wandb/run_id`), whose
history only grows: a retrained step keeps the value first logged (the JSONL has both,
each line marked with its attempt: `run_log.MetricsLog`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rolloutdb.controller.run.run_log import MetricsLog
from rolloutdb.store import write_file_atomic

BACKENDS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb")
# Event fields that are times of day or identifiers, not metrics to plot.
_NOT_SCALARS = {"kind", "t", "t_start", "t_end", "step", "sequence"}


class MetricsBackendError(ValueError):
    """A backend that cannot be used (its package is missing); one line."""


@runtime_checkable
class MetricsBackend(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record these scalars at this train step."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- scalars


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, int | float):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)


def event_scalars(event: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of an event as "<kind>/<field>[/<nested>]" (a train_step's
    kind is shortened to "train"). Text, lists and times of day are left out."""
    kind = str(event.get("kind", "event"))
    prefix = "train" if kind == "train_step" else kind
    out: dict[str, float] = {}
    for key, value in event.items():
        if key not in _NOT_SCALARS:
            _flatten(f"{prefix}/{key}", value, out)
    return out


# --------------------------------------------------------------------------- backends


class TensorBoardBackend:
    """Scalars into TensorBoard event files under `log_dir`."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None):
        """`purge_step`: readers hide what earlier writers of `log_dir` logged at this
        step and later (a resume retrains those steps)."""
        writer_class = _import_tensorboard_writer()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = writer_class(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _import_tensorboard_writer() -> Any:
    try:
        module = importlib.import_module("torch.utils.tensorboard")
    except ImportError:
        raise MetricsBackendError("logging.backends: tensorboard needs the tensorboard package; "
                                  "pip install tensorboard (or pip install 'rolloutdb[tensorboard]')") from None
    return module.SummaryWriter


WANDB_RUN_ID_FILE = "run_id"


class WandbBackend:
    """Scalars into a W&B run in offline mode (`wandb sync <dir>` uploads it later). Every
    process of one run directory logs into one W&B run: its id is written to
    `log_dir/run_id` by the first and resumed by the next (until `--start-over` moves the
    logs aside)."""

    def __init__(self, log_dir: Path, *, run_name: str, config: Mapping[str, Any] | None = None,
                 project: str = "rolloutdb", entity: str | None = None, tags: Sequence[str] = (),
                 resumed_at: int | None = None):
        wandb = import_wandb()
        log_dir.mkdir(parents=True, exist_ok=True)
        id_file = log_dir / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self._run = wandb.init(mode="offline", dir=str(log_dir), project=project, entity=entity, tags=list(tags),
                               name=run_name, config=dict(config or {}), id=run_id or None,
                               resume="allow" if run_id else None)
        if not run_id:
            write_file_atomic(id_file, f"{self._run.id}\n")
        self._last_step = -1 if resumed_at is None else resumed_at

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        # W&B drops a step lower than one it has seen; a resumed run trains the steps after
        # its snapshot again, and those records are logged at the step W&B is already at.
        self._last_step = max(self._last_step, step)
        self._run.log(dict(scalars), step=self._last_step)

    def close(self) -> None:
        self._run.finish()


def import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise MetricsBackendError("logging.backends: wandb is not installed; pip install wandb "
                                  "(or pip install 'rolloutdb[wandb]'), or remove wandb from logging.backends") from None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_backends(names: Sequence[str]) -> None:
    """Refuse, before anything is written, a backend whose package is missing. Looked up,
    not imported: `rolloutdb train` refuses bad input before it imports torch."""
    for name in names:
        if name not in BACKENDS:
            raise MetricsBackendError(f"logging.backends: unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")
        if name == "tensorboard" and not _installed("tensorboard"):
            _import_tensorboard_writer()  # raises the one-line refusal
        elif name == "wandb" and not _installed("wandb"):
            import_wandb()


# ----------------------------------------------------------------------- the fan-out


class RunMetrics:
    """The run's metrics sink: `write(event)` appends the JSONL line (through
    `MetricsLog`) and hands the event's scalars to every other backend. Thread-safe:
    both pumps log."""

    def __init__(self, jsonl_path: Path, backends: Sequence[MetricsBackend] = (), *, attempt: int | None = None,
                 resumed_at: int | None = None):
        self.jsonl = MetricsLog(jsonl_path, attempt=attempt)
        self.backends = list(backends)
        self._lock = threading.Lock()
        self._step = resumed_at or 0  # a resume's first events belong to the step it restored
        self._last_step_end: float | None = None
        self._outcomes: dict[str, int] = {}

    @property
    def path(self) -> Path:
        return self.jsonl.path

    def write(self, event: dict) -> None:
        self.jsonl.write(event)
        if not self.backends:
            return
        with self._lock:
            step, scalars = self._scalars(event)
            for backend in self.backends:
                backend.log(step, scalars)

    def _scalars(self, event: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
        scalars = event_scalars(event)
        kind = event.get("kind")
        if kind == "train_step" and isinstance(event.get("step"), int):
            self._step = int(event["step"])
            t_start, t_end = event.get("t_start"), event.get("t_end")
            if isinstance(t_start, int | float) and isinstance(t_end, int | float):
                scalars["train/step_s"] = float(t_end - t_start)
                # Tokens trained per wall second since the previous step ended: rollout runs
                # beside training, so the time between steps, not the step itself, is what
                # the tokens cost. The first step is measured from its own start.
                since = self._last_step_end if self._last_step_end is not None else t_start
                tokens = event.get("policy_tokens")
                if isinstance(tokens, int | float) and t_end > since:
                    scalars["train/tokens_per_s"] = float(tokens) / float(t_end - since)
                self._last_step_end = float(t_end)
        elif kind == "snapshot" and isinstance(event.get("outcome"), str):
            outcome = event["outcome"]
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
            scalars[f"snapshot/outcome/{outcome}"] = float(self._outcomes[outcome])
        return self._step, scalars

    def close(self) -> None:
        errors: list[BaseException] = []
        for backend in self.backends:
            try:
                backend.close()
            except Exception as e:  # noqa: BLE001 - close the others and the JSONL first
                errors.append(e)
        self.jsonl.close()
        if errors:
            raise errors[0]


def open_metrics(jsonl_path: Path, backends: Sequence[str] = ("jsonl",), *, log_dir: Path, run_name: str,
                 config: Mapping[str, Any] | None = None, attempt: int | None = None,
                 resumed_at: int | None = None) -> RunMetrics:
    """The sink for a run: `backends` from `logging.backends` (jsonl is written whether
    listed or not); tensorboard writes under `log_dir/tensorboard`, wandb under
    `log_dir/wandb` (project, entity and tags from `config["logging"]`'s wandb_* keys).
    `attempt` marks every JSONL line; `resumed_at` is the train step a resume restored
    (see the module docstring). Missing packages are refused before any file is opened."""
    check_backends(backends)
    logging_settings = dict((config or {}).get("logging") or {})
    opened: list[MetricsBackend] = []
    try:
        if "tensorboard" in backends:
            purge = None if resumed_at is None else resumed_at + 1
            opened.append(TensorBoardBackend(log_dir / "tensorboard", purge_step=purge))
        if "wandb" in backends:
            opened.append(WandbBackend(log_dir / "wandb", run_name=run_name, config=config,
                                       project=logging_settings.get("wandb_project") or "rolloutdb",
                                       entity=logging_settings.get("wandb_entity"),
                                       tags=logging_settings.get("wandb_tags") or (), resumed_at=resumed_at))
    except BaseException:
        for backend in opened:
            backend.close()
        raise
    return RunMetrics(jsonl_path, opened, attempt=attempt, resumed_at=resumed_at)
