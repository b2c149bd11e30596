"""TRL's GRPOTrainer on a single-call example agent, set up as ``boltstream train``'s defaults are, for the
agent suite (benchmarks/agent_suite.py).

Shared with boltstream, each read from boltstream's own config so the two cannot drift: the base model
(SmolLM2-135M-Instruct, float32), the LoRA adapter (rank, alpha, dropout, target modules), AdamW's
learning rate with a warm-up over the same number of steps and then a constant rate, samples a step
(groups a step x group size, every group one task), the PPO clip range (DAPO's asymmetric one),
token-mean loss, no KL term, no std scaling of the advantages, the training temperature, the agent's token
limit, and held-out scoring at the agent's own temperature: every test task as often as the suite says,
each reply scored by the agent's own ``reward``. Not shared: TRL generates with ``model.generate`` in its own process, boltstream with its
inference worker.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

from boltstream.config import DEFAULT_GROUP_SIZE
from boltstream.learner.config import DEFAULT_LR, LearnerConfig, StepConfig
from boltstream.runs.pipeline import TRAIN_TEMPERATURE, mean_and_se
from boltstream.weights.models import load_model


def _tasks(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Held-out tasks sampled in one generate call (each task's attempts side by side, left-padded).
SCORE_TASKS_PER_CALL = 8


def score(model: Any, tokenizer: Any, agent: ModuleType, tasks: list[dict[str, Any]], samples: int,
          seed: int) -> dict[str, Any]:
    """Every task ``samples`` times at the agent's temperature: mean reward per task, its mean and SE."""
    import torch

    torch.manual_seed(seed)
    model.eval()
    per_task = []
    tokenizer.padding_side = "left"
    for i in range(0, len(tasks), SCORE_TASKS_PER_CALL):
        chunk = tasks[i:i + SCORE_TASKS_PER_CALL]
        prompts = [tokenizer.apply_chat_template(agent.messages(t), add_generation_prompt=True, tokenize=False)
                   for t in chunk]
        inputs = tokenizer([p for p in prompts for _ in range(samples)], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=agent.TEMPERATURE, top_p=1.0, top_k=0,
                                 max_new_tokens=agent.MAX_TOKENS, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        per_task += [sum(agent.reward(t, r) for r in replies[j * samples:(j + 1) * samples]) / samples
                     for j, t in enumerate(chunk)]
    mean, se = mean_and_se(per_task)
    return {"score": mean, "se": se, "tasks": len(tasks), "samples_per_task": samples, "per_task": per_task}


def train_and_score(agent: ModuleType, train_path: Path, test_path: Path, seed: int, steps: int, out: Path,
                    eval_samples: int) -> dict[str, Any]:
    """Score the base model, train ``steps`` GRPO steps, score again; the summary ``boltstream train`` writes
    (before, after, improvement and its paired SE, learner_steps, train_s, wall_s) plus the versions."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    started = time.monotonic()
    learner, step = LearnerConfig(lora=True), StepConfig()
    group_size, lr = DEFAULT_GROUP_SIZE, learner.lr or DEFAULT_LR["lora"]
    model, tokenizer = load_model("smollm2", seed=seed)
    test = _tasks(test_path)
    before = score(model, tokenizer, agent, test, eval_samples, seed)
    rows = [{"prompt": agent.messages(t), "task": json.dumps(t)} for t in _tasks(train_path)]

    def reward(prompts: list[Any], completions: list[Any], task: list[str], **_: Any) -> list[float]:
        return [agent.reward(json.loads(t), c[-1]["content"] if isinstance(c, list) else c)
                for t, c in zip(task, completions, strict=True)]

    args = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, seed=seed, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=steps, learning_rate=lr, warmup_steps=learner.lr_warmup_steps,
        lr_scheduler_type="constant_with_warmup", adam_beta1=learner.adam_beta1, adam_beta2=learner.adam_beta2,
        weight_decay=learner.weight_decay, max_grad_norm=step.max_grad_norm,
        per_device_train_batch_size=learner.groups_per_step * group_size, gradient_accumulation_steps=1,
        num_generations=group_size, temperature=TRAIN_TEMPERATURE, top_p=1.0, top_k=0,
        max_completion_length=agent.MAX_TOKENS, beta=0.0, epsilon=step.clip_low, epsilon_high=step.clip_high,
        loss_type="dapo", scale_rewards="none",
    )
    lora = LoraConfig(r=learner.lora_r, lora_alpha=learner.lora_alpha, lora_dropout=learner.lora_dropout,
                      target_modules=list(learner.lora_targets), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, peft_config=lora)
    train_started = time.monotonic()
    trainer.train()
    train_s = time.monotonic() - train_started
    after = score(trainer.model, tokenizer, agent, test, eval_samples, seed)
    diffs = [a - b for a, b in zip(after["per_task"], before["per_task"], strict=True)]
    improvement, improvement_se = mean_and_se(diffs)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"before": before, "after": after, "improvement": improvement, "improvement_se": improvement_se,
            "learner_steps": int(trainer.state.global_step), "train_s": round(train_s, 1),
            "wall_s": round(time.monotonic() - started, 1), "training_reward": rewards,
            "versions": {d: version(d) for d in ("trl", "transformers", "torch", "peft")}}
