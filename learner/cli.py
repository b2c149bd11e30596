"""``boltstream learn``: run the learner, or ``boltstream learn --plot metrics.jsonl out.png``.

Every :class:`~boltstream.learner.config.LearnerConfig` field is a flag (``--groups-per-step``,
``--lora/--no-lora``, ...) and a ``BOLTSTREAM_LEARN_*`` variable; flags win. Broker and S3
come from ``BOLTSTREAM_*`` or the embedded stack's state file. Progress lines go to stdout
(``boltstream learn: ready ...``, ``... step N version V``, ``... checkpoint vN URI``,
``... done ...``) so scripts and tests can follow a run without parsing logs; SIGTERM or
Ctrl-C finishes the running step, publishes a final checkpoint and exits 0.

DeepSpeed: start one process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` (torchrun or the deepspeed launcher set them) and ``--deepspeed``; rank 0
reads Kafka and publishes, the other ranks follow its commands.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from boltstream.config import flags_from_dataclass

from .config import LearnerConfig, load_config
from .memory import pin_mmap_threshold

logger = logging.getLogger(__name__)

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream learn", description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", nargs=2, metavar=("METRICS_JSONL", "OUT_PNG"),
                   help="render the curves of a metrics file to a PNG and exit")
    flags_from_dataclass(p, LearnerConfig)
    return p


def _say(line: str) -> None:
    sys.stdout.write(f"boltstream learn: {line}\n")
    sys.stdout.flush()


async def _run(cfg: LearnerConfig) -> int:
    from .loop import train

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await train(cfg, stop=stop, progress=_say)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    plot = args.pop("plot")
    if plot is not None:
        from .plot import plot_metrics

        out = plot_metrics(plot[0], plot[1])
        _say(f"wrote {out}")
        return 0
    cfg = load_config(args)
    logging.getLogger("boltstream").setLevel(cfg.log_level.upper())
    if cfg.malloc_mmap_threshold_kb is not None:  # before the model exists: see learner/memory.py
        pin_mmap_threshold(cfg.malloc_mmap_threshold_kb)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at every checkpoint
    if cfg.deepspeed:
        from .deepspeed_backend import dist_env, run_follower

        if dist_env()[0] != 0:
            return run_follower(cfg)
    return asyncio.run(_run(cfg))
