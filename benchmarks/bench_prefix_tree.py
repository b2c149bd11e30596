"""Learner step time, flat vs prefix tree, on agent-shaped samples (SmolLM2 + LoRA on CPU, as the demo trains).

    .venv/bin/python benchmarks/bench_prefix_tree.py [--shape demo,agent] [--steps 1]
        [--agent-scale 10] [--agent-groups 1] [--agent-budget N] [--agent-tree-budget N]
        [--flat-samples N] [--without-shared-prefix] [--keep-prefix-tokens N]

Samples of one agent share most of their tokens: the system prompt, the task's question across a
group's attempts, and a call's prompt holds the previous call whole. The flat step computes every
token of every sample; the tree step (``StepConfig.prefix_tree``) computes each shared prefix once
per micro-batch, and a prefix that every sample starts with (the system prompt) once per step
(``StepConfig.shared_prefix_min_tokens``). Both steps here run in the same process, one after the
other, on the same samples and trainer (the demo's learner: ``learner_config()`` of the pipeline) after one untimed
warm-up step, each with its own peak RSS (VmHWM reset in between). The updates are the same (tests/unit/learner/test_tree_forward.py).

Shapes:

* ``demo``: the calculator demo's samples, built with the real SmolLM2 tokenizer and chat template
  from the agent's own prompt (examples/calc/agent.py: system prompt + worked example + the
  task's question): 4 tasks x 4 attempts, each a 2-call trajectory (``CALC: ...``, then
  ``ANSWER: ...`` after the ``RESULT:`` tool message; the 2nd call's prompt is the 1st prompt +
  response + tool message). The demo's micro-batch budget (1,024).
* ``agent``: a longer agent: a 2,000-token system prompt, 5 turns of 200 tokens (100 tool/user +
  100 response; turn 1's user message is the task, shared by the group), groups of 8, one sample
  per call. ``--agent-scale S`` divides every length by S (default 10; 1 is the full size). The
  flat path's budget is ``--agent-budget`` rows x padded length (default: twice the longest
  sample, rounded up to 1,024s); the tree's is ``--agent-tree-budget`` unique tokens after the
  shared prefix (default: the longest sample's tokens after it, rounded up to 256s: about one
  rollout per micro-batch; the prefix itself runs in chunks of the same budget).

``--flat-samples N`` runs the flat step on the first N samples only (for the agent shape, default
5: one attempt's five calls, every turn length once) and scales its time to the whole step by
tokens: the flat path runs every sample as its own sequence, so its cost is that of its samples,
summed (the printed line says "scaled" and from how many samples; 0 runs every sample). The tree
always runs the whole step. ``--without-shared-prefix`` adds a tree step with the shared prefix
computed in each micro-batch (``shared_prefix_min_tokens=0``), for comparison. ``--keep-prefix-tokens N``
sets ``shared_prefix_keep_tokens`` for every tree step (a shared prefix up to N tokens keeps its activations
instead of a second forward: faster, by that many tokens' more memory).

Prints per shape the time ratio, unique vs total tokens and peak RSS; JSON to
benchmarks/results/prefix_tree.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_learner_memory import demo_learner_config

RESULTS = Path(__file__).parent / "results"


def _sample(prompt: list[int], response: list[int], advantage: float) -> dict[str, Any]:
    mask = [False] * len(prompt) + [True] * len(response)
    return {"token_ids": prompt + response, "prompt_length": len(prompt), "loss_mask": mask,
            "behaviour_logprobs": [-1.0 if m else 0.0 for m in mask], "advantage": advantage,
            "loss_weight": 1.0, "temperature": 0.7}


def demo_samples(tokenizer: Any, seed: int, groups: int = 4, attempts: int = 4) -> list[dict[str, Any]]:
    """The calculator demo's LLM calls: its prompt text through SmolLM2's chat template."""
    from boltstream.examples.calc.agent import EXAMPLE, SYSTEM, _fmt, evaluate
    from boltstream.examples.calc.tasks import generate

    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for g, task in enumerate(generate(groups, seed, "bench")):
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task["question"]}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
        for a in range(attempts):
            x, y = rng.randint(2, 99), rng.randint(2, 99)
            op = rng.choice("+-*/")
            result = _fmt(evaluate(f"{x} {op} {y}"))
            calc = tokenizer.encode(f"CALC: {x} {op} {y}", add_special_tokens=False) + [end]
            tool = tokenizer.encode(f"\n<|im_start|>user\nRESULT: {result}<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
            answer = tokenizer.encode(f"ANSWER: {result}", add_special_tokens=False) + [end]
            advantage = (1.0 if (g + a) % 2 else -1.0) * (0.5 + a / 4)
            out.append(_sample(prompt, calc, advantage))
            out.append(_sample(prompt + calc + tool, answer, advantage))
    return out


def agent_samples(vocab: int, seed: int, *, scale: int, groups: int, group_size: int = 8,
                  system: int = 2000, turns: int = 5, turn: int = 200) -> list[dict[str, Any]]:
    """A multi-turn agent's calls: call k's prompt = system + turns 1..k-1 + turn k's user part."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(max(1, n // scale))]

    shared = toks(system)
    out = []
    for g in range(groups):
        task = toks(turn // 2)
        for a in range(group_size):
            context = shared[:]
            for k in range(turns):
                user = task if k == 0 else toks(turn // 2)
                response = toks(turn // 2)
                out.append(_sample(context + user, response, (1.0 if (g + a) % 2 else -1.0) * (0.5 + a / 8)))
                context = context + user + response
    return out


def _timed_step(trainer: Any, lr: float, samples: list[dict[str, Any]], plan: Any) -> dict[str, Any]:
    from boltstream.learner.memory import memory_status, reset_peak_rss

    trainer.plan = plan
    reset_peak_rss()
    t0 = time.perf_counter()
    m = trainer.step(samples, lr)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 2), "samples": len(samples), "input_tokens": m.input_tokens,
            "unique_tokens": m.unique_tokens, "loss_tokens": m.loss_tokens, "micro_batches": m.micro_batches,
            "peak_rss_mb": round(memory_status().get("peak_rss_mb", float("nan")))}


def run_shape(trainer: Any, lr: float, name: str, samples: list[dict[str, Any]], budget: int, steps: int, *,
              tree_budget: int | None = None, flat_samples: int = 0, without_shared_prefix: bool = False
              ) -> dict[str, Any]:
    """``steps`` x (tree step on all ``samples``, [tree step without the shared prefix], flat step on the
    first ``flat_samples`` of them (0: all), its time scaled to all by tokens)."""
    from boltstream.learner.step_plan import plan_step
    from boltstream.learner.token_trie import shared_prefix_length

    def plan(cfg: Any) -> Any:
        return plan_step(trainer.model, cfg, ref_model=trainer.ref_model)

    base_plan = trainer.plan
    base = base_plan.cfg
    tree_cfg = dataclasses.replace(base, prefix_tree=True, max_tokens_per_micro_batch=tree_budget or budget)
    tree_plan, flat_plan = plan(tree_cfg), plan(dataclasses.replace(base, prefix_tree=False,
                                                                    max_tokens_per_micro_batch=budget))
    without_plan = plan(dataclasses.replace(tree_cfg, shared_prefix_min_tokens=0, max_tokens_per_micro_batch=(
        tree_cfg.max_tokens_per_micro_batch + shared_prefix_length(samples, base.shared_prefix_min_tokens))))
    subset = samples[:flat_samples] if 0 < flat_samples < len(samples) else samples
    total_tokens = sum(len(s["token_ids"]) for s in samples)
    rows = []
    for step in range(steps):
        row: dict[str, Any] = {"step": step, "tree": _timed_step(trainer, lr, samples, tree_plan)}
        if without_shared_prefix:  # the same tries, each with the prefix in front: a budget larger by it
            row["tree_without_shared_prefix"] = _timed_step(trainer, lr, samples, without_plan)
        flat = _timed_step(trainer, lr, subset, flat_plan)
        scale = total_tokens / flat["input_tokens"]
        flat.update(measured_seconds=flat["seconds"], scaled_by=round(scale, 4),
                    seconds=round(flat["seconds"] * scale, 2))
        row["flat"] = flat
        row["ratio"] = round(flat["seconds"] / row["tree"]["seconds"], 2)
        rows.append(row)
        f, t = flat, row["tree"]
        if len(subset) < len(samples):
            flat_text = (f"flat {f['seconds']:.1f} s SCALED from {len(subset)} of {len(samples)} samples "
                         f"({f['measured_seconds']:.1f} s for their {f['input_tokens']} tokens x {scale:.2f}) "
                         f"in {f['micro_batches']} micro-batches")
        else:
            flat_text = f"flat {f['seconds']:.1f} s in {f['micro_batches']} micro-batches"
        print(f"{name} step {step}: {len(samples)} samples, {total_tokens} tokens ({t['unique_tokens']} unique, "
              f"{total_tokens / t['unique_tokens']:.1f}x); {flat_text}, peak RSS {f['peak_rss_mb']} MB; "
              f"tree {t['seconds']:.1f} s in {t['micro_batches']}, peak RSS {t['peak_rss_mb']} MB: "
              f"tree {row['ratio']:.2f}x faster", flush=True)
        if without_shared_prefix:
            w = row["tree_without_shared_prefix"]
            print(f"{name} step {step}: tree without the shared prefix: {w['unique_tokens']} unique tokens, "
                  f"{w['seconds']:.1f} s in {w['micro_batches']} micro-batches, peak RSS {w['peak_rss_mb']} MB: "
                  f"{flat['seconds'] / w['seconds']:.2f}x faster than flat", flush=True)
    trainer.plan = base_plan
    ratios = [r["ratio"] for r in rows]
    return {"shape": name, "budget": budget, "tree_budget": tree_budget or budget, "samples": len(samples),
            "flat_samples": len(subset), "flat_scaled": len(subset) < len(samples), "steps": rows,
            "median_ratio": round(statistics.median(ratios), 2),
            "overall_ratio": round(sum(r["flat"]["seconds"] for r in rows) / sum(r["tree"]["seconds"] for r in rows), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="demo,agent", help="comma-separated: demo, agent")
    ap.add_argument("--steps", type=int, default=1, help="steps per shape, each flat and tree")
    ap.add_argument("--agent-scale", type=int, default=10, help="divide the agent shape's lengths by this")
    ap.add_argument("--agent-groups", type=int, default=1, help="groups of 8 per agent step")
    ap.add_argument("--agent-budget", type=int, default=None,
                    help="flat micro-batch budget of the agent shape (default: twice its longest sample, in 1024s)")
    ap.add_argument("--agent-tree-budget", type=int, default=None,
                    help="tree micro-batch budget of the agent shape, unique tokens after the shared prefix "
                         "(default: the longest sample's tokens after it, about one rollout, in 256s)")
    ap.add_argument("--flat-samples", type=int, default=None,
                    help="run the flat step on the first N samples and scale its time to the whole step by tokens "
                         "(default: 5 for the agent shape, all for demo; 0: all)")
    ap.add_argument("--without-shared-prefix", action="store_true",
                    help="also time a tree step that computes the shared prefix in each micro-batch")
    ap.add_argument("--keep-prefix-tokens", type=int, default=None,
                    help="shared_prefix_keep_tokens of the tree steps (default: the learner's)")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    from boltstream.learner.memory import pin_mmap_threshold
    from boltstream.learner.model_setup import vocab_size
    from boltstream.learner.step_plan import plan_step
    from boltstream.learner.token_trie import shared_prefix_length
    from boltstream.learner.trainer import make_trainer

    cfg = demo_learner_config(args.model, pinned=True)
    pin_mmap_threshold(cfg.malloc_mmap_threshold_kb)
    trainer = make_trainer(cfg)
    if args.keep_prefix_tokens is not None:
        trainer.plan = plan_step(trainer.model, dataclasses.replace(
            trainer.plan.cfg, shared_prefix_keep_tokens=args.keep_prefix_tokens), ref_model=trainer.ref_model)
    if not trainer.plan.tree:
        print("the model cannot run prefix trees (see the log): nothing to compare")
        return 1
    # the first step pays one-time costs (AdamW's state, allocator growth): not on either side's clock
    trainer.step(demo_samples(trainer.tokenizer, 1, groups=1, attempts=2), cfg.lr)
    shapes = []
    for shape in args.shape.split(","):
        if shape == "demo":
            shapes.append(run_shape(trainer, cfg.lr, "demo", demo_samples(trainer.tokenizer, 0),
                                    cfg.step.max_tokens_per_micro_batch, args.steps,
                                    flat_samples=args.flat_samples or 0,
                                    without_shared_prefix=args.without_shared_prefix))
        elif shape == "agent":
            samples = agent_samples(vocab_size(trainer.model), 0, scale=args.agent_scale, groups=args.agent_groups)
            longest = max(len(s["token_ids"]) for s in samples)
            budget = args.agent_budget or -(-longest // 1024) * 1024 * 2
            prefix = shared_prefix_length(samples, trainer.plan.cfg.shared_prefix_min_tokens)
            tree_budget = args.agent_tree_budget or -(-(longest - prefix) // 256) * 256
            step = trainer.plan.cfg
            print(f"agent/{args.agent_scale}: {len(samples)} samples, shared prefix {prefix} tokens "
                  f"({'kept' if prefix <= step.shared_prefix_keep_tokens else 'recomputed'} for the backward), "
                  f"flat budget {budget}, tree budget {tree_budget} unique tokens after it", flush=True)
            shapes.append(run_shape(trainer, cfg.lr, f"agent/{args.agent_scale}", samples, budget, args.steps,
                                    tree_budget=tree_budget,
                                    flat_samples=5 if args.flat_samples is None else args.flat_samples,
                                    without_shared_prefix=args.without_shared_prefix))
        else:
            ap.error(f"unknown shape {shape!r}")
    for s in shapes:
        t = s["steps"][0]
        scaled = f", flat scaled from {s['flat_samples']} of {s['samples']} samples" if s["flat_scaled"] else ""
        print(f"learner step, {s['shape']} shape: tree {s['median_ratio']:.2f}x faster than flat (median of "
              f"{len(s['steps'])} steps, {s['overall_ratio']:.2f}x in total; "
              f"{t['tree']['input_tokens']} tokens, {t['tree']['unique_tokens']} unique; peak RSS tree "
              f"{t['tree']['peak_rss_mb']} MB, flat {t['flat']['peak_rss_mb']} MB{scaled})")
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "prefix_tree", "machine": platform.node(), "args": vars(args), "shapes": shapes}
    (RESULTS / "prefix_tree.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
