"""Experiment tracking: a run's metrics, evaluations and configs in TensorBoard, W&B or MLflow.

``--report-to tensorboard,wandb,mlflow`` (the Hugging Face Trainer's convention; ``none``, the
default, reports nowhere) on ``boltstream learn``, ``train`` and ``demo``. Each backend is one
small class behind the same three calls (:class:`Tracker`): ``log_params`` (a component's
resolved config, once), ``log_metrics`` (scalars at a step) and ``close``. Each is an optional
extra, imported only when asked for, so a missing package fails at start with the extra to
install, never mid-run.

Why trackers never throw: a dashboard is a convenience; the training step it describes is not.
:class:`Trackers` calls every backend inside a guard: the first error is logged with its traceback
and that backend is switched off for the rest of the run; the others go on.

What each backend relies on (all public APIs):

* TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package);
  one event-file folder per component under ``<dir>/tensorboard/<name>``.
* W&B: ``wandb.init(dir=..., group=...)``, ``run.log(step=...)``, ``run.config.update``,
  ``run.finish``. ``WANDB_MODE=offline`` works with no network (``wandb sync`` uploads later);
  the run folders go under ``<dir>/wandb``. The project is ``WANDB_PROJECT`` or ``boltstream``.
* MLflow: ``MlflowClient`` (``mlflow-skinny`` is enough). The tracking URI is
  ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a file store at
  ``<dir>/mlruns``; MLflow 3 keeps that store in maintenance mode behind
  ``MLFLOW_ALLOW_FILE_STORE``, which is set to true for that default only. The experiment is
  ``MLFLOW_EXPERIMENT_NAME`` or ``boltstream``; each component is one run in it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from boltstream.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("tensorboard", "wandb", "mlflow")
# backend -> (module that must import, extra that installs it)
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
REPORT_TO_HELP = ("experiment trackers that get every step's metrics and the resolved config, comma-separated: "
                  f"{', '.join(BACKENDS)} or none (default none; extras boltstream[tensorboard|wandb|mlflow])")


def parse_report_to(value: str | Iterable[str] | None, name: str = "report_to") -> tuple[str, ...]:
    """The backends named (``none`` and empty items dropped, duplicates once), or a ConfigError."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    out: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if item in ("", "none"):
            continue
        if item not in BACKENDS:
            raise ConfigError(name, item, f"one of {', '.join(BACKENDS)} or none")
        if item not in out:
            out.append(item)
    return tuple(out)


def check_installed(backends: Iterable[str]) -> None:
    """Fail at start, naming the extra, when a backend's package is missing."""
    import importlib.util

    for backend in backends:
        module, extra = _NEEDS[backend]
        if importlib.util.find_spec(module) is None:
            raise ConfigError("report_to", backend, f"the {module} package is not installed: "
                                                    f'pip install "boltstream[{extra}]"')


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) record, keys joined with ``/``; lists and text are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A config as flat ``key -> text`` pairs (what MLflow params and TensorBoard text hold)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}/"))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


class Tracker(Protocol):
    """One backend; each call may raise (:class:`Trackers` guards it)."""

    name: str

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, directory: Path, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / "tensorboard" / run_name))

    def log_params(self, params: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(flat_params(params).items()))
        self.writer.add_text("config", text, 0)  # indented: TensorBoard renders text as markdown

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, directory: Path, run_name: str, group: str | None) -> None:
        import wandb

        wandb_dir = directory / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "boltstream"), name=run_name, group=group,
                              dir=str(directory), reinit="create_new")

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"
    MAX_PARAM = 6000  # MLflow's limit on a param value's length

    def __init__(self, directory: Path, run_name: str, group: str | None) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            store = directory / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "boltstream")
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {"boltstream.group": group} if group else None
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[: self.MAX_PARAM]) for k, v in sorted(flat_params(params).items())]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every tracker of one component, fanned out; a tracker that fails is logged once and dropped."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call: Any) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception:
                logger.exception("%s tracker failed in %s: it is off for the rest of this run", tracker.name, what)
                self.trackers.remove(tracker)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._each("log_params", lambda t: t.log_params(params))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        values = scalars(metrics)
        if values:
            self._each("log_metrics", lambda t: t.log_metrics(values, step))

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        self.trackers.clear()


def open_trackers(report_to: Iterable[str], directory: str | Path, run_name: str,
                  group: str | None = None) -> Trackers:
    """Start each named backend under ``directory`` (a backend that cannot start is logged and left out;
    a missing package raises, naming the extra: that is a setup error, seen before any training)."""
    backends = parse_report_to(report_to)
    check_installed(backends)
    directory = Path(directory)
    made: list[Tracker] = []
    for backend in backends:
        try:
            if backend == "tensorboard":
                made.append(TensorBoardTracker(directory, run_name))
            elif backend == "wandb":
                made.append(WandbTracker(directory, run_name, group))
            else:
                made.append(MlflowTracker(directory, run_name, group))
        except Exception:
            logger.exception("%s tracker could not start: training goes on without it", backend)
    if made:
        logger.info("reporting to %s under %s", ", ".join(t.name for t in made), directory)
    return Trackers(made)
