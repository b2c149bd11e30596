"""``boltstream evaluate``: the demo's held-out evaluation, before and after, for any published policy.

The same measurement ``boltstream demo`` and ``train`` make (:func:`boltstream.runs.pipeline.evaluate`):
each held-out task ``--eval-samples`` times at the agent's own sampling settings
(evaluation calls are never captured), the mean per task, then the mean and its
standard error across tasks. "Before" is the base model; "after" is the newest
checkpoint a learner announced under ``--checkpoint-model`` (the learner's
``--model-name``) on the ``checkpoints`` topic, as an inference worker loads it. The
same tasks are scored twice, so the per-task difference gives the improvement and
its paired standard error, the numbers the demo prints. This is how a policy trained
offline (``boltstream learn --offline``) is compared with one trained live.

Broker and S3 come from ``BOLTSTREAM_*`` or the embedded stack's state file, like every
component. Writes ``summary.json`` and the workers' logs under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from boltstream.broker.log_range import LogRangeError, parse_position, read_range, resolve
from boltstream.config import Settings, load
from boltstream.errors import BoltstreamError
from boltstream.processes import Processes, free_port, wait_until
from boltstream.runs.demo import CALC_AGENT
from boltstream.runs.pipeline import (
    MODEL_NAME,
    component_env,
    evaluate,
    load_tasks,
    mean_and_se,
    worker_version,
)
from boltstream.runs.train import print_summary
from boltstream.stack import run_sync

log = logging.getLogger(__name__)


async def newest_version(settings: Settings, model_name: str) -> int | None:
    """The highest version announced for ``model_name`` on the checkpoints topic (None: none yet)."""
    from boltstream.schemas import Codec

    topic = settings.topic("checkpoints")
    try:
        log_range = await resolve(settings, topic, parse_position("earliest"), parse_position("now", "--to"),
                                  allow_empty=True)
    except LogRangeError as exc:
        raise BoltstreamError(f"cannot read the checkpoint events: {exc}") from exc
    codec, newest = Codec.from_registry_url(settings.schema_registry_url), None
    async for records in read_range(settings, log_range):
        for record in records:
            try:
                event = codec.decode(record.value, topic=topic, expect="CheckpointEvent")
            except Exception:  # not ours to judge here: the worker skips it too
                continue
            if event["model"] == model_name:
                newest = max(newest or 0, int(event["version"]))
    return newest


def _serve_and_evaluate(procs: Processes, args: argparse.Namespace, name: str, agent_fn: Any,
                        tasks: list[dict[str, Any]], version: int | None) -> dict[str, Any]:
    """Start a worker (base model, or following the checkpoints up to ``version``), evaluate, stop it."""
    port = free_port()
    follow = ["--checkpoint-model", args.checkpoint_model] if version else ["--no-reload"]
    procs.start(name, "serve", "--model", args.model, "--served-model-name", MODEL_NAME, "--port", str(port),
                "--no-capture", "--lora" if args.lora else "--no-lora", *follow)
    try:
        wait_until(lambda: worker_version(port) is not None, args.timeout, f"the {name} worker", procs)
        if version:
            wait_until(lambda: (worker_version(port) or 0) >= version, args.timeout,
                       f"the worker to load {args.checkpoint_model} v{version}", procs)
        served = worker_version(port)
        log.info("evaluating policy version %s on %d held-out tasks", served, len(tasks))
        result = evaluate(agent_fn, tasks, f"http://127.0.0.1:{port}/v1", args.eval_samples)
        return {**result, "policy_version": served}
    finally:
        procs.stop(name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-model", required=True,
                   help="model name of the checkpoint events to evaluate (the learner's --model-name)")
    p.add_argument("--test", type=Path, required=True, help="held-out tasks (JSONL), e.g. out/demo/data/test.jsonl")
    p.add_argument("--agent", default=CALC_AGENT, help=f"module:function of the agent (default {CALC_AGENT})")
    p.add_argument("--model", default="smollm2", help="the base model the checkpoints were trained from")
    p.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True,
                   help="LoRA checkpoints (default; --no-lora for full weights)")
    p.add_argument("--eval-tasks", type=int, default=None, help="use only the first N held-out tasks")
    p.add_argument("--eval-samples", type=int, default=2, help="attempts per held-out task (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for a worker to start and load")
    p.add_argument("--out", type=Path, default=Path("out/evaluate"), help="summary.json and logs go here")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.eval_samples < 1:
        raise BoltstreamError(f"--eval-samples must be >= 1, got {args.eval_samples}")
    if not args.test.is_file():
        raise BoltstreamError(f"--test: no such file {args.test}")
    from boltstream.producers.agent import load_agent

    started = time.monotonic()
    settings = load(Settings)
    version = run_sync(newest_version(settings, args.checkpoint_model))
    if not version:
        raise BoltstreamError(f"no checkpoint of model {args.checkpoint_model!r} on {settings.topic('checkpoints')} "
                              "(the learner's --model-name)")
    agent_fn, tasks = load_agent(args.agent), load_tasks(args.test, args.eval_tasks)
    state_file = Path(settings.state_file) if Path(settings.state_file).is_file() else None
    args.out.mkdir(parents=True, exist_ok=True)
    procs = Processes(args.out / "logs", component_env(settings, state_file, ()))
    try:
        summary: dict[str, Any] = {"checkpoint_model": args.checkpoint_model, "model": args.model,
                                   "test": str(args.test), "agent": args.agent}
        summary["before"] = _serve_and_evaluate(procs, args, "worker-before", agent_fn, tasks, None)
        summary["after"] = _serve_and_evaluate(procs, args, "worker-after", agent_fn, tasks, version)
    finally:
        procs.stop_all()
    diffs = [a - b for a, b in zip(summary["after"]["per_task"], summary["before"]["per_task"], strict=True)]
    summary["improvement"], summary["improvement_se"] = mean_and_se(diffs)
    summary["policy_version_served"] = summary["after"]["policy_version"]
    summary["wall_s"] = round(time.monotonic() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    sys.stdout.write(f"boltstream evaluate: wrote {args.out / 'summary.json'}\n")
    return 0
