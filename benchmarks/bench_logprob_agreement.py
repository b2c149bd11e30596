"""Served log-probs against the learner's recomputation, per serving dtype, same run.

    .venv/bin/python benchmarks/bench_logprob_agreement.py [--model smollm2] [--dtypes float32,bfloat16]
        [--tasks 8] [--group 4]

The importance ratio of a PPO/GRPO step is ``exp(learner log p - behaviour log p)``;
on the first step (the weights that served are the weights that learn) it is 1 up
to the numerics of the two sides. For each serving dtype: an in-process worker
engine (the transformers backend, prefix cache on, as ``boltstream serve`` runs it)
samples the demo's first step — ``--tasks`` training tasks x ``--group`` attempts,
the calculator's first call at T = 1 — and the learner's model recomputes
``log_softmax(logits / T)`` of every sampled token: in float32, and, for bf16 serving,
also with its base weights in bfloat16 (what a run's LoRA learner computes in beside a
bf16 worker, ``PipelineConfig.learner_dtype``). Printed per pair: mean and max |Δ log p| over the sampled tokens, and the
fraction of them whose ratio falls outside the learner's clip range (what the first
step's clip fraction would be from numerics alone). With the CPU's flags: bf16 on a
CPU without native bf16 runs emulated. JSON goes to benchmarks/results/logprob_agreement.json.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import torch
from machine import write_report

from boltstream.examples.calc.agent import EXAMPLE, SYSTEM
from boltstream.examples.calc.tasks import train_test
from boltstream.inference.backend import SamplingParams
from boltstream.inference.chat import render_prompt
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.learner.config import StepConfig
from boltstream.weights.models import cpu_facts, describe_cpu, load_model

RESULTS = Path(__file__).parent / "results"


async def _sample(model: Any, tokenizer: Any, prompts: list[list[int]], group: int) -> list[tuple[list[int], Any]]:
    """(prompt, completion) of ``group`` attempts per prompt, all at once (one batch, as a step's first calls)."""
    backend = TransformersBackend(model, tokenizer, model_name="policy", max_batch_size=len(prompts) * group,
                                  prefix_cache_bytes=256 << 20)
    await backend.start()
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=24, stop=("\n",), seed=i) for i in range(group)]
        gens = await asyncio.gather(*(backend.generate(p, s) for p in prompts for s in params))
    finally:
        await backend.stop()
    return [(list(g.prompt_token_ids), c) for g in gens for c in g.completions]


def _recompute(model: Any, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The learner's log-probs (float32, T = 1) of ``ids`` after ``prompt``."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "logprob_agreement.json"))
    args = p.parse_args(argv)
    clip = StepConfig()
    learner, tokenizer = load_model(args.model, dtype="float32")
    learners = {"float32": learner}
    questions = [t["question"] for t in train_test()[0][:args.tasks]]
    prompts = [render_prompt(tokenizer, [{"role": "system", "content": SYSTEM}, *EXAMPLE,
                                         {"role": "user", "content": q}], None) for q in questions]
    facts = cpu_facts()
    print(f"machine: {describe_cpu(facts)}")
    report: dict[str, Any] = {"benchmark": "logprob_agreement", "model": args.model, "machine": facts,
                              "clip_range": [1 - clip.clip_low, 1 + clip.clip_high], "dtypes": {}}
    for dtype in args.dtypes.split(","):
        served, _ = load_model(args.model, dtype=dtype)
        samples = asyncio.run(_sample(served, tokenizer, prompts, args.group))
        if dtype == "bfloat16":
            learners.setdefault("bfloat16", load_model(args.model, dtype="bfloat16")[0])
        for learner_dtype in ("float32", "bfloat16") if dtype == "bfloat16" else ("float32",):
            learner = learners[learner_dtype]
            diffs = torch.cat([_recompute(learner, prompt, list(c.token_ids)) - torch.tensor(list(c.logprobs))
                               for prompt, c in samples])
            ratio = diffs.exp()
            clipped = ((ratio < 1 - clip.clip_low) | (ratio > 1 + clip.clip_high)).float().mean().item()
            row = {"tokens": diffs.numel(), "mean_abs_diff": diffs.abs().mean().item(),
                   "max_abs_diff": diffs.abs().max().item(), "clip_fraction": clipped}
            report["dtypes"][dtype if learner_dtype == "float32" else f"{dtype}/learner-{learner_dtype}"] = row
            print(f"served in {dtype}, learner in {learner_dtype}: {row['tokens']} sampled tokens, mean |Δ log p| "
                  f"{row['mean_abs_diff']:.2e}, max {row['max_abs_diff']:.2e}, outside the clip range {clipped:.2%}",
                  flush=True)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
