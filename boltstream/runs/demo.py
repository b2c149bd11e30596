"""``boltstream demo``: train the calculator agent (boltstream.examples.calc) on the embedded stack.

SmolLM2-135M-Instruct on CPU with LoRA, a few learner steps, held-out score
before and after. Everything runs as real processes on a real broker and a
real S3 endpoint; Ctrl-C stops them all.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from boltstream.config import DEFAULT_GROUP_SIZE
from boltstream.examples.calc import tasks as calc_tasks
from boltstream.runs.pipeline import ZERO_CODE_PROMPT_WINDOW_S
from boltstream.runs.progress import choose_display
from boltstream.runs.train import add_arguments, config_from_args, print_summary, run, stop_on_sigterm

log = logging.getLogger(__name__)

# Learner steps: on 2 quiet cores a step is 22-36 s of generation and learning and each held-out
# evaluation 30-60 s: 8 steps end within 6 minutes (docs/results.md).
DEMO_STEPS = 8
# One partition per topic: the runner takes the training tasks in the file's order, which cycles through
# the four operations, so every step trains on each of them equally. In random order a step could hold
# four `/` tasks and no `*`, and the policy learned which operation the step favoured instead of which one
# each question needs: runs unlearned `*` or `+` while learning `-` and `/` (docs/results.md).
DEMO_PARTITIONS = 1
# A cap, not a target: the demo ends after its steps. A busy machine can take several
# times that; the cap only stops a run that would otherwise go on for an hour.
DEMO_TIME_BUDGET_S = 1500.0

CALC_AGENT = "boltstream.examples.calc.agent:solve"
CALC_AIR_RULES = Path(calc_tasks.__file__).with_name("air.yaml")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="boltstream demo", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--zero-code", action="store_true",
                   help="run the agent as a standalone program under opentelemetry-instrument (no runner, no "
                        "task ids; rewards sent back as feedback by completion id): examples/calc/standalone.py")
    args = p.parse_args(argv)
    data = Path(args.out or "out/demo") / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, test = calc_tasks.train_test(n_train=256, n_test=32, seed=int(args.seed or 0))
    for name, tasks in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    # The learner, stream and pacing settings are `boltstream train`'s defaults (docs/learner.md); the demo
    # adds only the calculator's own files (its AIR rules), its steps and budget, and one partition for the
    # task file's order.
    group_size = args.group_size or DEFAULT_GROUP_SIZE
    stream: dict[str, Any] = {"air_rules_file": CALC_AIR_RULES}
    zero_code: dict[str, Any] = {}
    if args.zero_code:  # attempts at one question share its first prompt: the stream app groups them by it
        stream["prompt_window_s"] = ZERO_CODE_PROMPT_WINDOW_S
        zero_code["agent_program"] = (
            "-m", "boltstream.examples.calc.standalone", "--tasks", str(data / "train.jsonl"),
            "--base-url", "{base_url}", "--attempts", str(group_size),
            "--tasks-per-version", "{tasks_per_version}")
    cfg = config_from_args(
        args, Path("out/demo"), agent=CALC_AGENT, train=data / "train.jsonl",
        test=data / "test.jsonl", steps=args.steps or DEMO_STEPS, group_size=group_size,
        eval_tasks=args.eval_tasks or 32, eval_samples=args.eval_samples or 2,
        time_budget_s=args.time_budget or DEMO_TIME_BUDGET_S,
        partitions=DEMO_PARTITIONS, stream=stream,
        **zero_code,
    )
    stop_on_sigterm()
    with choose_display("boltstream demo", args.no_live) as display:
        summary = run(cfg, external=args.external, display=display)
    print_summary(summary)
    return 0
