"""The ``boltstream`` command.

Each sub-command lives in the module that owns it and is imported only when
used, so ``boltstream stack up`` never pays for torch and an agent host never
needs the learner's dependencies. A sub-command module exposes
``main(argv: list[str]) -> int`` and parses its own arguments.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from boltstream.errors import BoltstreamError
from boltstream.schemas.errors import SchemaError

# torch's OpenMP threads spin-wait between parallel regions by default. A boltstream process rarely has
# the cores to itself (worker, learner, stream app and agents share them; two cores in the demo), and a
# spinning thread then holds the core its partner needs: a SmolLM2 decode step took 0.9-2.1 s instead of
# 0.16 s with two threads on a machine loaded by other processes (benchmarks/bench_threads.py). Read by
# the OpenMP runtime when torch loads, so it is set here, before any sub-command imports torch.
OMP_WAIT_POLICY = "PASSIVE"
# The inference worker is the exception: a decode step is ~150 short parallel regions, and waking the sleeping
# helper thread for each cost a sixth of the step or more; spinning this many rounds first
# made one demo step's generation 1.57x faster on two quiet cores. It cannot stop spinning at runtime, so it
# drops to one thread while other processes keep the cores busy (inference/cpu_share.py).
SERVE_SPINCOUNT = "30000"


def omp_env(command: str, args: list[str] | None = None) -> dict[str, str]:
    """The OpenMP settings a ``boltstream <command> [args]`` process runs with unless its environment sets
    them. Only the transformers worker spins: vLLM runs its own threads, without the thread governor."""
    env = {"OMP_WAIT_POLICY": OMP_WAIT_POLICY}
    if command == "serve" and _backend(args or []) != "vllm":
        env["GOMP_SPINCOUNT"] = SERVE_SPINCOUNT
    return env


def _backend(args: list[str]) -> str:
    """``serve``'s backend as its parser will see it (flag, else env), read before torch loads."""
    for i, arg in enumerate(args):
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
        if arg == "--backend" and i + 1 < len(args):
            return args[i + 1]
    return os.environ.get("BOLTSTREAM_SERVE_BACKEND", "transformers")


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "stack": ("boltstream.stack.cli", "start, inspect or stop the embedded broker + S3 stack"),
    "topics": ("boltstream.broker.topics", "create, list or describe the topics"),
    "tasks": ("boltstream.producers.tasks", "publish a task dataset (JSONL or Parquet) to the tasks topic"),
    "runner": ("boltstream.producers.runner", "run an agent function on tasks from the tasks topic"),
    "ingest": ("boltstream.producers.otlp_ingest", "re-emit OTLP spans written by an OpenTelemetry Collector"),
    "feedback": ("boltstream.producers.feedback_cli", "send a reward for a rollout that already ran (by completion id)"),
    "serve": ("boltstream.inference.cli", "OpenAI-compatible inference worker with token capture"),
    "stream": ("boltstream.streams.cli", "the stream app: spans -> trajectories -> training batches"),
    "replay": ("boltstream.streams.replay_cli", "re-run the stream stages over a range of spans with another configuration"),
    "learn": ("boltstream.learner.cli", "the learner: training batches -> checkpoints (--offline: from a dataset)"),
    "export": ("boltstream.export.cli", "write a range of spans, trajectories or batches to Parquet or JSON lines"),
    "status": ("boltstream.monitoring.status", "where a running pipeline stands: topics, lag, checkpoints, workers"),
    "train": ("boltstream.runs.train", "train your own agent end to end"),
    "demo": ("boltstream.runs.demo", "the whole loop on the embedded stack with a real model"),
    "evaluate": ("boltstream.runs.evaluate", "held-out score of the base model and a model's newest checkpoint"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: boltstream <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'boltstream <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # One INFO line per HTTP request (the agents' OpenAI clients) drowns what the components say.
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage() + "\n")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    for var, value in omp_env(name, rest).items():
        os.environ.setdefault(var, value)  # a user's own setting wins
    if name not in COMMANDS:
        sys.stderr.write(f"boltstream: unknown command {name!r}\n\n{_usage()}\n")
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        sys.stderr.write(
            f"boltstream {name}: a dependency is missing ({exc}). "
            "Install the matching extra, e.g. pip install 'boltstream[stream,learner,inference]'.\n"
        )
        return 2
    try:
        return int(module.main(rest) or 0)
    except (BoltstreamError, SchemaError) as exc:
        sys.stderr.write(f"boltstream {name}: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
