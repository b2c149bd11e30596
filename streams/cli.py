"""``boltstream stream worker``: run a stream worker (faust underneath).

Every :class:`StreamConfig` setting is a flag (``--gamma``, ``--std-normalize/--no-std-normalize``,
...) and a ``BOLTSTREAM_STREAM_*`` variable; flags win. Run more workers with the same
``--app-id`` to split the partitions between them.
"""

from __future__ import annotations

import argparse
import logging

from boltstream.config import flags_from_dataclass

from .config import StreamConfig, load_stream_config

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream stream", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="consume spans, emit trajectories and training batches")
    w.add_argument("-l", "--loglevel", default="info", help="log level (default info)")
    flags_from_dataclass(w, StreamConfig)
    return p


def main(argv: list[str]) -> int:
    args = vars(parser().parse_args(argv))
    loglevel = args.pop("loglevel")
    config = load_stream_config(args)
    from .worker import run_worker

    return run_worker(config, loglevel=loglevel)
