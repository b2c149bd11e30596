"""``boltstream stream worker``: run a stream worker (faust underneath).

Every option maps to a :class:`StreamConfig` field and overrides its
``BOLTSTREAM_STREAM_*`` env var; run more workers with the same ``--app-id``
to split the partitions between them.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .config import load_stream_config

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream stream", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="consume spans, emit trajectories and training batches")
    w.add_argument("--app-id", help="faust app id = consumer group (default '<namespace>stream')")
    w.add_argument("-l", "--loglevel", default="info", help="log level (default info)")
    w.add_argument("--group-size", type=int, help="attempts per task = GRPO group size (default 4)")
    w.add_argument("--grace-s", type=float, help="wait after the root span for out-of-band spans (default 0)")
    w.add_argument("--rollout-timeout-s", type=float, help="close a rollout without root after this idle time")
    w.add_argument("--group-timeout-s", type=float, help="emit an incomplete group after this time")
    w.add_argument("--air-rules-file", help="YAML AIR rules (default: the built-in rules)")
    w.add_argument("--agent-match", help="regex: train only calls of matching agents")
    w.add_argument("--gamma", type=float, help="discount over a rollout's calls (default 1.0)")
    w.add_argument("--call-credit", choices=("return", "episode"),
                   help="a call's advantage from its own return G_t (default) or the rollout's episode return")
    w.add_argument("--no-std-normalize", dest="std_normalize", action="store_false", default=None,
                   help="advantage = G - group mean, not divided by the group's std (Dr. GRPO)")
    w.add_argument("--loss-weight", choices=("none", "inverse_calls"), help="per-sample loss weight")
    w.add_argument("--trajectory-mode", action="store_true", default=None, help="merge calls that extend a prompt")
    w.add_argument("--store", help="faust table store URL (default memory://)")
    w.add_argument("--profile", metavar="PATH", help="write a pstats profile of the worker to PATH on exit")
    w.add_argument(
        "--no-fast-consumer", dest="fast_consumer", action="store_false", default=None,
        help="use faust's stock per-record delivery",
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    explicit: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k not in ("command", "loglevel") and v is not None
    }
    config = load_stream_config(explicit)
    from .worker import run_worker

    return run_worker(config, loglevel=args.loglevel)
