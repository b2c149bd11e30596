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
import dataclasses
import logging
import signal
import sys
import types
import typing
from typing import Any

from .config import LearnerConfig, load_config

logger = logging.getLogger(__name__)

HELP = {
    "model": "smollm2 (default) | tiny | an HF model directory | a .gguf file",
    "model_name": "model name in checkpoint events (default: derived from --model, as `serve` does)",
    "lora": "train LoRA adapters (peft) instead of all weights",
    "lora_targets": "comma-separated module names for LoRA (default q_proj,k_proj,v_proj,o_proj)",
    "lr_warmup_steps": "ramp the lr linearly from lr/N to lr over the first N steps (default 0: none)",
    "groups_per_step": "K: complete GRPO groups per optimizer step (default 4)",
    "max_staleness": "drop samples more than this many policy versions old (default 4; none = keep all)",
    "checkpoint_every": "publish a checkpoint every N steps (default 10)",
    "keep_last": "checkpoint versions kept in S3 (default 3)",
    "publish_dtype": "full checkpoints: the dtype workers download, e.g. bfloat16 (half the bytes); the "
                     "exact weights go with the training state",
    "run": "S3 prefix of this run's checkpoints (default <namespace>/<model name>)",
    "max_steps": "stop after this many learner steps in total, resumed ones included",
    "idle_exit_s": "stop when no record arrived for this many seconds",
    "metrics_path": "append one JSON line per step/checkpoint here",
    "metrics_port": "serve Prometheus /metrics on this port (0 = any free port)",
    "max_tokens_per_micro_batch": "micro-batch budget, rows x padded length (default 1024)",
    "deepspeed": "DeepSpeed ZeRO backend (extra [deepspeed]); ranks from RANK/WORLD_SIZE/MASTER_*",
    "zero_stage": "ZeRO stage 0, 1 or 2 (default 1)",
    "resume": "start from the run's newest checkpoint (default on)",
    "checkpoint_on_exit": "publish the steps since the last checkpoint on a clean exit (default on)",
}
SETTINGS_FLAGS = ("bootstrap_servers", "namespace", "s3_endpoint", "s3_bucket", "schema_registry_url")


def _is_bool(typ: Any) -> bool:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return bool in typing.get_args(typ)
    return typ is bool


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream learn", description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", nargs=2, metavar=("METRICS_JSONL", "OUT_PNG"),
                   help="render the curves of a metrics file to a PNG and exit")
    hints = typing.get_type_hints(LearnerConfig)
    for f in dataclasses.fields(LearnerConfig):
        if f.name == "settings":
            continue
        flag = "--" + f.name.replace("_", "-")
        if _is_bool(hints[f.name]):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELP.get(f.name))
        else:  # strings: boltstream.config.load converts them and names the flag in its errors
            p.add_argument(flag, default=None, help=HELP.get(f.name))
    group = p.add_argument_group("broker and object store (default: BOLTSTREAM_* or the embedded stack)")
    for name in SETTINGS_FLAGS:
        group.add_argument("--" + name.replace("_", "-"), default=None)
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
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at every checkpoint
    if cfg.deepspeed:
        from .deepspeed_backend import dist_env, run_follower

        if dist_env()[0] != 0:
            return run_follower(cfg)
    return asyncio.run(_run(cfg))
