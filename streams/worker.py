"""Run one stream worker process: topics checked, the faust app built, faust's Worker until a signal.

Why a function of our own rather than ``faust -A ... worker``: the worker must
resolve :class:`StreamConfig` like every boltstream process (env vars, the
embedded stack's state file), make sure its input/output topics exist before
faust subscribes (faust only creates its own changelog topics), keep
boltstream's log format, and remove its private data directory on exit. faust's
:class:`~faust.Worker` still runs the loop and handles SIGINT/SIGTERM as a
graceful stop (SIGKILL is the crash case the changelog design covers).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
from collections.abc import Iterator

import faust

from boltstream.broker.kafka import wait_for_broker
from boltstream.broker.topics import ensure_topics

from .app import StreamApp
from .config import StreamConfig

log = logging.getLogger(__name__)

TOPICS = ("spans", "trajectories", "batches", "dlq")
# faust/mode/aiokafka log a lot at INFO (ASCII tables per rebalance); ours stay at the chosen level.
NOISY_LOGGERS = ("faust", "mode", "aiokafka")


async def prepare(config: StreamConfig, timeout: float = 60.0) -> None:
    """Wait for the broker and create the stage topics that do not exist yet."""
    await wait_for_broker(config.settings, timeout=timeout)
    await ensure_topics(config.settings, TOPICS, timeout=timeout)


def configure_logging(level: str) -> None:
    """Our loggers at ``level``; faust's, mode's and aiokafka's one step quieter unless debugging."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.getLogger().setLevel(numeric)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))


@contextlib.contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """Profile the block into ``path`` (pstats format) when given.

    Why yappi first: faust runs aiokafka in a thread of its own, which cProfile
    (main thread only) does not see; yappi profiles every thread. It is optional
    (``pip install yappi``); without it cProfile covers the event-loop thread.
    """
    if not path:
        yield
        return
    if importlib.util.find_spec("yappi") is not None:
        import yappi  # type: ignore[import-not-found,import-untyped,unused-ignore]

        yappi.set_clock_type("cpu")
        yappi.start(builtins=False)
        try:
            yield
        finally:
            yappi.stop()
            yappi.get_func_stats().save(path, type="pstat")
            log.info("profile (yappi, cpu time, all threads) written to %s", path)
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)
        log.info("profile (cProfile, event-loop thread) written to %s", path)


# gen0 collections every 20,000 allocations instead of 700: a worker allocates a dict per
# attribute of every decoded span and keeps open rollouts alive; measured on the pure core,
# the default thresholds cost ~25 % of its time in collections that free little.
GC_THRESHOLDS = (20_000, 20, 50)


def tune_gc() -> None:
    """Freeze what start-up allocated (never collected again) and collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_worker(config: StreamConfig, loglevel: str = "info") -> int:
    """Run until SIGINT/SIGTERM; returns the process exit code."""
    configure_logging(loglevel)
    asyncio.run(prepare(config))
    stream_app = StreamApp(config)
    log.info(
        "stream worker %s: %s -> %s -> %s (group_size %d, grace %.1fs, rollout timeout %.0fs, group timeout %.0fs)",
        config.app_name,
        config.settings.topic("spans"),
        config.settings.topic("trajectories"),
        config.settings.topic("batches"),
        config.group_size,
        config.grace_s,
        config.rollout_timeout_s,
        config.group_timeout_s,
    )
    log.info("credit: %s", config.credit)
    if config.metrics_port is not None:
        stream_app.metrics.serve(config.metrics_host, config.metrics_port)
    tune_gc()
    worker = faust.Worker(
        stream_app.faust,
        loglevel=loglevel,
        quiet=True,
        redirect_stdouts=False,
        override_logging=False,
    )
    code = 0
    try:
        with profiled(config.profile):
            worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        stream_app.cleanup()
    log.info("stream worker %s stopped (exit %d)", config.app_name, code)
    return code
