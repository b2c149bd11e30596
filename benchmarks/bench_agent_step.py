"""The generation of one RL step of the calculator demo, per engine configuration, same run.

    .venv/bin/python benchmarks/bench_agent_step.py [--model smollm2] [--serve-dtype auto|float32|bfloat16]
        [--tasks 8] [--group 4] [--rounds 2]

What a demo step waits for: ``--tasks`` x ``--group`` rollouts of the calculator
agent, all started at once, each two calls (the first asks the question; the
second follows with the model's own first answer and a calculator result), at
T = 1 with each rollout's own seed, against one in-process engine (the worker's
transformers backend, prefix cache on, batch size as served), warmed up on the
same prompts. Configurations, alternating for ``--rounds`` rounds:

* ``joined``: the engine as it serves: plain-torch decode steps, requests that
  join a running batch prefilled in a decode step's pass;
* ``separate``: joiners prefilled by a forward of their own;
* ``forward``: every step through the model's own forward.

Sampling is seeded per rollout, so every configuration generates the same tokens
(checked: the runs' token counts must agree) and only the time differs. Prints
wall time, decode steps and tokens per configuration and the ratios, with the
CPU's flags, dtype and threads. JSON goes to benchmarks/results/agent_step.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from machine import as_command, write_report

from boltstream.examples.calc.agent import CALC_RE, EXAMPLE, SYSTEM, calculator
from boltstream.examples.calc.tasks import train_test
from boltstream.inference import decoding, llama_step
from boltstream.inference.backend import SamplingParams
from boltstream.inference.chat import render_prompt
from boltstream.inference.cli import ServeConfig
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import cpu_facts, describe_cpu, load_model, resolve_dtype

RESULTS = Path(__file__).parent / "results"
MODES = ("joined", "separate", "forward")


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """The engine configured as ``name`` (see the module docstring) while the block runs."""
    saved = llama_step.step_for
    if name == "separate":
        TransformersBackend._advance_joining = _separate  # type: ignore[method-assign]
    elif name == "forward":
        llama_step.step_for = lambda m: None  # type: ignore[assignment]
    try:
        yield
    finally:
        llama_step.step_for = saved  # type: ignore[assignment]
        TransformersBackend._advance_joining = _JOINING  # type: ignore[method-assign]


_JOINING = TransformersBackend._advance_joining


def _separate(self: TransformersBackend, policy: Any, state: Any, new_rows: Any, key: Any) -> Any:
    decoding.advance(policy.model, state)
    return decoding.join(state, self._prefill(policy, new_rows, key))


async def rollout(backend: TransformersBackend, tokenizer: Any, question: str, seed: int) -> int:
    """One calculator rollout of two calls; the tokens it generated."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    params = SamplingParams(temperature=1.0, max_tokens=24, stop=("\n",), seed=seed)
    first = (await backend.generate(render_prompt(tokenizer, messages, None), params)).completions[0]
    calc = CALC_RE.search(first.text)
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": f"RESULT: {calculator(calc.group(1)) if calc else 'error'}"}]
    second = (await backend.generate(render_prompt(tokenizer, messages, None), params)).completions[0]
    return len(first.token_ids) + len(second.token_ids)


async def step(model: Any, tokenizer: Any, questions: list[str], group: int) -> dict[str, float]:
    backend = TransformersBackend(model, tokenizer, model_name="policy",
                                  max_batch_size=ServeConfig().max_batch_size, prefix_cache_bytes=256 << 20)
    await backend.start()
    try:  # warm: the shared preamble stored and the step's probe run, as in a serving worker
        await asyncio.gather(*(rollout(backend, tokenizer, q, 10_000 + i) for i, q in enumerate(questions)))
        for _ in range(500):  # the warm-up batch's last bookkeeping (its busy time) before counting
            if not backend._in_job:
                break
            await asyncio.sleep(0.01)
        busy, steps = backend.busy_seconds, backend.decode_steps
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(rollout(backend, tokenizer, q, i * group + k)
                                        for i, q in enumerate(questions) for k in range(group)))
        wall = time.perf_counter() - t0
    finally:
        await backend.stop()
    return {"wall_s": wall, "tokens": sum(tokens), "busy_s": backend.busy_seconds - busy,
            "decode_steps": backend.decode_steps - steps, "joined": backend.joined}


def main(argv: list[str] | None = None) -> int:
    as_command("serve")  # the engine below runs with the worker's thread settings
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--serve-dtype", default="auto")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES), help=f"a subset of {','.join(MODES)}")
    p.add_argument("--out", default=str(RESULTS / "agent_step.json"))
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model, dtype=resolve_dtype(args.serve_dtype))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    questions = [t["question"] for t in train_test()[0][:args.tasks]]
    facts = cpu_facts()
    print(f"machine: {describe_cpu(facts)}; serving dtype {dtype}; {args.tasks} x {args.group} rollouts")
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for name in modes:
            with mode(name):
                result = asyncio.run(step(model, tokenizer, questions, args.group))
            runs[name].append(result)
            print(f"round {r + 1} {name:9s}: {result['wall_s']:.2f} s, {result['tokens']} tokens, "
                  f"{result['decode_steps']} decode steps, engine busy {result['busy_s']:.2f} s", flush=True)
    tokens = {run["tokens"] for rs in runs.values() for run in rs}
    best = {name: min(r["wall_s"] for r in rs) for name, rs in runs.items()}
    ratios = [f"joined is {best[m] / best['joined']:.2f}x faster than {m}" for m in ("separate", "forward")
              if m in best and "joined" in best]
    print(f"best of {args.rounds}: " + ", ".join(f"{n} {best[n]:.2f} s" for n in modes) + "; " + "; ".join(ratios)
          + f"; tokens generated per run: {sorted(tokens)} (seeded: the same up to rounding that flips a sample)")
    write_report(args.out, {"benchmark": "agent_step", "machine": facts, "dtype": dtype, "tasks": args.tasks,
                            "group": args.group, "runs": runs, "best_s": best, "same_tokens": len(tokens) == 1})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
