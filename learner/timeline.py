"""Where one RL step's wall time went: generation, the learner's compute, publishing, idle.

Why in every step record: a step's wall time is spent in several processes
(inference workers generating the rollouts, the learner computing, the
checkpoint upload and the workers' reload), and the next slowdown must be
visible in ``metrics.jsonl``, the run summary and the piped progress without a
profiler. The learner times its own parts; the workers' parts come from their
``/metrics`` (``--worker-metrics``), scraped at every step record, as the
difference since the previous record.

A step's *window* runs from the previous step record to this one: the previous
checkpoint's publish, the wait for this step's groups (the workers generating
them, the stream app assembling them) and this step's compute. The first step's
window starts when the learner is ready, which can be after its rollouts began. Generation and
the learner can overlap (with staleness > 0, or a worker serving other traffic),
so ``idle_s`` — the window that neither a worker's generation thread, the
learner's compute, the publish nor a reload filled — is a lower bound when they do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# worker counter -> the Prometheus series that carries it (summed over label sets and workers)
WORKER_SERIES = {
    "busy_s": "boltstream_inference_busy_seconds_total",
    "decode_steps": "boltstream_inference_decode_steps_total",
    "decode_rows": "boltstream_inference_decode_rows_total",
    "prefill_tokens": "boltstream_inference_prefill_tokens_computed_total",
    "decode_tokens": "boltstream_inference_completion_tokens_total",
    "reload_s": "boltstream_inference_reload_seconds_sum",
    "reloads": "boltstream_inference_reload_seconds_count",
}


def parse_counters(text: str) -> dict[str, float]:
    """The :data:`WORKER_SERIES` values in a Prometheus text exposition (label sets summed)."""
    wanted = {series: key for key, series in WORKER_SERIES.items()}
    out = dict.fromkeys(WORKER_SERIES, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        key = wanted.get(name_labels.split("{", 1)[0])
        if key is not None:
            out[key] += float(value)
    return out


def scrape(urls: Sequence[str], timeout: float = 2.0) -> dict[str, float] | None:
    """The workers' counters summed, or None if any worker did not answer (the timeline then leaves the
    workers' part out rather than report a partial sum)."""
    import httpx

    total = dict.fromkeys(WORKER_SERIES, 0.0)
    for url in urls:
        try:
            response = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.debug("step timeline: %s/metrics did not answer: %s", url, exc)
            return None
        for key, value in parse_counters(response.text).items():
            total[key] += value
    return total


def step_timeline(window_s: float, compute_s: float, publish_s: float,
                  before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, Any]:
    """The split of one step's ``window_s`` (see the module docstring); the workers' part when both
    scrapes (``before``: at the previous record, ``after``: now) are there."""
    out: dict[str, Any] = {"window_s": window_s, "learner_compute_s": compute_s, "checkpoint_publish_s": publish_s,
                           "learner_wait_s": max(0.0, window_s - compute_s - publish_s)}
    if before is None or after is None:
        return out
    d = {k: max(0.0, after[k] - before[k]) for k in WORKER_SERIES}
    busy = min(d["busy_s"], window_s)
    out.update({
        "generation_busy_s": busy,
        "worker_busy_share": busy / window_s if window_s > 0 else 0.0,
        "decode_steps": int(d["decode_steps"]),
        "mean_decode_batch": d["decode_rows"] / d["decode_steps"] if d["decode_steps"] else 0.0,
        "prefill_tokens": int(d["prefill_tokens"]),
        "decode_tokens": int(d["decode_tokens"]),
        "reload_s": d["reload_s"],
        "idle_s": max(0.0, window_s - busy - compute_s - publish_s - d["reload_s"]),
    })
    return out


def totals(timelines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several steps' timelines as one: seconds and tokens added up, shares and the mean decode batch
    recomputed over the sum (what a run's summary reports)."""
    if not timelines:
        return {}
    out: dict[str, Any] = {}
    for key in timelines[0]:
        if key not in ("worker_busy_share", "mean_decode_batch"):
            out[key] = sum(t.get(key, 0) for t in timelines)
    if "generation_busy_s" in out:
        out["worker_busy_share"] = out["generation_busy_s"] / out["window_s"] if out["window_s"] > 0 else 0.0
        rows = sum(t.get("mean_decode_batch", 0.0) * t.get("decode_steps", 0) for t in timelines)
        out["mean_decode_batch"] = rows / out["decode_steps"] if out["decode_steps"] else 0.0
    return out


def format_timeline(t: Mapping[str, Any]) -> str:
    """One line: the window and its parts (what the piped progress and the summary show)."""
    parts = [f"{t['window_s']:.1f}s"]
    if "generation_busy_s" in t:
        parts.append(f"generate {t['generation_busy_s']:.1f}s ({t['worker_busy_share']:.0%} busy, decode batch "
                     f"{t['mean_decode_batch']:.1f}, {t['prefill_tokens']} prefill + {t['decode_tokens']} "
                     f"decode tokens)")
    parts.append(f"learn {t['learner_compute_s']:.1f}s")
    parts.append(f"publish {t['checkpoint_publish_s']:.1f}s")
    if "reload_s" in t:
        parts.append(f"reload {t['reload_s']:.1f}s")
        parts.append(f"idle {t['idle_s']:.1f}s")
    else:
        parts.append(f"wait {t['learner_wait_s']:.1f}s")
    return " | ".join(parts)
