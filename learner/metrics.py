"""Per-step learner metrics, to three places: the console log, Prometheus, a JSONL file
(and to the ``--report-to`` experiment trackers, :mod:`boltstream.monitoring.tracking`, when asked).

The JSONL file is the durable record: one line per step (``"event": "step"``) with the
losses, reward/advantage statistics, the staleness histogram, throughput, drop counters
and the ids of every sample trained, plus ``resume`` and ``checkpoint`` lines. After a
crash the resumed learner writes a ``resume`` line and appends steps again from the
checkpoint's step; :func:`read_steps` replays that into the history of the weights that
survived. Each line is flushed as written, so a SIGKILL loses at most
the line being written.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from boltstream.monitoring.metrics_server import MetricsServer
from boltstream.monitoring.status import STEP_MODE_SERIES
from boltstream.monitoring.tracking import Trackers

from .groups import StepInput
from .memory import peak_rss_mb
from .step import StepMetrics
from .step_plan import StepPlan
from .timeline import format_timeline

logger = logging.getLogger(__name__)

# Step-record fields that are not metrics (the step is the x axis; the time is the tracker's own)
NOT_TRACKED = ("event", "time", "step")
# StepMetrics fields exported as gauges (name -> help)
GAUGES = {
    "loss": "policy loss of the last step",
    "reward_mean": "mean episode reward of the groups in the last step",
    "advantage_mean": "mean sample advantage in the last step",
    "advantage_std": "std of sample advantages in the last step",
    "clip_fraction": "fraction of trained tokens whose ratio was clipped",
    "approx_kl": "approximate KL(behaviour || current) over trained tokens",
    "ref_kl": "KL to the reference policy (0 unless kl_coef > 0)",
    "entropy": "mean token entropy of the current policy",
    "grad_norm": "gradient norm before clipping",
    "tokens_per_s": "input tokens per second of step compute",
    "wall_tokens_per_s": "input tokens per second of wall time (waiting for data included)",
    "unique_tokens": "tokens the decoder computed in the last step (a prefix shared in a micro-batch once)",
    "groups_without_spread": "share of the last step's groups whose attempts all scored alike (no signal)",
    "reward_spread_mean": "mean within-group std of episode rewards in the last step",
}
# a group whose rewards' std is at most this scored alike: its advantages are 0
NO_SPREAD = 1e-9
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


def step_record(step: int, version: int, m: StepMetrics, inp: StepInput, *, wall_seconds: float,
                dropped_total: Mapping[str, int], lag: int | None = None, lr: float | None = None) -> dict[str, Any]:
    """The JSONL/console/Prometheus view of one step (plain JSON types only)."""
    advantages = [float(s["advantage"]) for s in inp.samples]
    alike = [g.reward_mean for g in inp.groups if g.reward_std <= NO_SPREAD]  # their rewards: no signal
    rewards = [float(s.get("reward", 0.0)) for s in inp.samples]
    record: dict[str, Any] = {
        "event": "step",
        "time": time.time(),
        "step": step,
        "version": version,
        **{k: _finite(v) for k, v in m.to_dict().items()},
        "reward_mean": _finite(sum(g.reward_mean for g in inp.groups) / len(inp.groups)),
        "sample_reward_mean": _finite(sum(rewards) / len(rewards)) if rewards else 0.0,
        "advantage_min": min(advantages, default=0.0),
        "advantage_max": max(advantages, default=0.0),
        "groups": len(inp.groups),
        "groups_without_spread": len(alike) / max(1, len(inp.groups)),
        "reward_spread_mean": sum(g.reward_std for g in inp.groups) / max(1, len(inp.groups)),
        "alike_reward_mean": sum(alike) / len(alike) if alike else None,
        "group_reward_min": min((g.reward_mean for g in inp.groups), default=None),
        "group_reward_max": max((g.reward_mean for g in inp.groups), default=None),
        "wall_seconds": wall_seconds,
        "wall_tokens_per_s": m.input_tokens / wall_seconds if wall_seconds > 0 else 0.0,
        "staleness": dict(sorted(inp.staleness.items())),
        "dropped": dict(sorted(inp.dropped.items())),
        "dropped_total": dict(sorted(dropped_total.items())),
        "batch_ids": [g.batch_id for g in inp.groups],
        "sample_ids": inp.sample_ids,
        "peak_rss_mb": peak_rss_mb(),
    }
    if lag is not None:
        record["lag_records"] = lag
    if lr is not None:
        record["lr"] = lr
    return record


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: they become None (and stay visible as gaps in plots)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_step(r: Mapping[str, Any]) -> str:
    """One console line per step."""
    stale = ",".join(f"{k}:{v}" for k, v in r["staleness"].items())
    dropped = sum(r["dropped"].values())

    def f(key: str, fmt: str) -> str:
        v = r.get(key)
        return "nan" if v is None else format(v, fmt)

    return (f"step {r['step']} v{r['version']} | loss {f('loss', '.4f')} | reward {f('reward_mean', '.3f')} | "
            f"adv {f('advantage_mean', '+.3f')}±{f('advantage_std', '.3f')} | clip {f('clip_fraction', '.3f')} | "
            f"kl {f('approx_kl', '.2e')} | ent {f('entropy', '.3f')} | gnorm {f('grad_norm', '.3f')} | "
            f"{r['samples']} samples/{r['groups']} groups | {f('tokens_per_s', '.0f')} tok/s | "
            f"stale {{{stale}}} | dropped {dropped}")


class MetricsSink:
    """Writes step records to the log, the JSONL file and (optionally) a Prometheus endpoint."""

    def __init__(self, path: str | Path | None = None, port: int | None = None, host: str = "127.0.0.1",
                 model_name: str = "model", trackers: Trackers | None = None) -> None:
        self.trackers = trackers or Trackers()
        self.path = Path(path) if path else None
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self.model_name = model_name
        self._dropped_seen: dict[str, int] | None = None
        self._endpoint = MetricsServer()
        self.registry = self._endpoint.registry
        self._build_prometheus()
        self.port = self._endpoint.serve(host, port) if port is not None else None

    def _build_prometheus(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r = self.registry
        label = ["model"]
        self._gauges = {k: Gauge(f"boltstream_learner_{k}", h, label, registry=r) for k, h in GAUGES.items()}
        self._step = Gauge("boltstream_learner_step", "learner steps taken", label, registry=r)
        self._version = Gauge("boltstream_learner_policy_version", "policy version of the weights", label,
                              registry=r)
        self._trained = Counter("boltstream_learner_samples_trained", "samples trained", label, registry=r)
        self._tokens = Counter("boltstream_learner_tokens_trained", "input tokens trained", label, registry=r)
        self._dropped = Counter("boltstream_learner_samples_dropped", "samples or records not trained, by reason",
                                ["model", "reason"], registry=r)
        self._checkpoints = Counter("boltstream_learner_checkpoints", "checkpoints published", label, registry=r)
        self._staleness = Histogram("boltstream_learner_sample_staleness", "policy versions behind, per sample",
                                    label, buckets=STALENESS_BUCKETS, registry=r)
        self._paths = Gauge(STEP_MODE_SERIES, "the step's paths the config asks for: 1 taken, 0 fallen back to a "
                            "slower one (reason says why)", ["model", "path", "reason"], registry=r)

    def plan(self, plan: StepPlan) -> None:
        """The trainer's step plan: one gauge per path the config asks for, and a ``plan`` line."""
        paths = plan.paths()
        for path, reason in paths.items():
            self._paths.labels(self.model_name, path, reason).set(0 if reason else 1)
        self.write({"event": "plan", "time": time.time(), "mode": plan.mode,
                    "fallbacks": {p: r for p, r in paths.items() if r}})

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line and flush it to the OS (survives a SIGKILL of this process)."""
        if self._file is not None:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def step(self, record: Mapping[str, Any]) -> None:
        m = self.model_name
        for key, gauge in self._gauges.items():
            value = record.get(key)
            if value is not None:
                gauge.labels(m).set(float(value))
        self._step.labels(m).set(record["step"])
        self._version.labels(m).set(record["version"])
        self._trained.labels(m).inc(record["samples"])
        self._tokens.labels(m).inc(record["input_tokens"])
        self.sync_dropped(record["dropped_total"])
        for key, n in record["staleness"].items():
            if key.isdigit():
                for _ in range(n):
                    self._staleness.labels(m).observe(int(key))
        logger.info("%s", format_step(record))
        if "timeline" in record:
            logger.info("step %d time: %s", record["step"], format_timeline(record["timeline"]))
        self.write(record)
        self.trackers.log_metrics({k: v for k, v in record.items() if k not in NOT_TRACKED}, int(record["step"]))

    def sync_dropped(self, total: Mapping[str, int]) -> None:
        """Bring the drop counters up to the assembler's cumulative counts (records dropped between
        steps included); the first call sets the baseline (counts restored from a checkpoint)."""
        if self._dropped_seen is None:
            self._dropped_seen = dict(total)
            return
        for reason, n in drop_delta(self._dropped_seen, total).items():
            self._dropped.labels(self.model_name, reason).inc(n)
        self._dropped_seen = dict(total)

    def event(self, event: str, **fields: Any) -> None:
        """A ``resume`` / ``checkpoint`` / ``stop`` line."""
        if event == "checkpoint":
            self._checkpoints.labels(self.model_name).inc()
        self.write({"event": event, "time": time.time(), **fields})

    def close(self) -> None:
        self.trackers.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._endpoint.close()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every JSON line of a metrics file (a torn last line, from a kill mid-write, is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            logger.warning("skipping a torn line in %s", path)
    return out


def read_steps(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The surviving history, in step order: a ``resume`` line from step ``s`` erases the steps
    after ``s`` written before it (their weights died with the crashed process)."""
    last: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("event") == "resume":
            for k in [k for k in last if k > int(r["step"])]:
                del last[k]
        elif r.get("event") == "step":
            last[int(r["step"])] = dict(r)
    return [last[k] for k in sorted(last)]


def drop_delta(before: Mapping[str, int], after: Mapping[str, int]) -> Counter[str]:
    """What was dropped between two snapshots of a cumulative counter."""
    return Counter({k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0})
