"""Training moves the reward the right way: a few real learner steps on a tiny random Llama.

Every other learner test checks one step's arithmetic; none notices when the pieces together stop
learning (an advantage sign flipped somewhere, log-probs scored at the wrong temperature, an lr that
never reaches the optimizer). Here the whole loop runs on production code, in one process:

- sample ``GROUP_SIZE`` responses per prompt from the current policy, recording behaviour log-probs
  as the inference worker does (``log_softmax(logits / T)`` of each sampled token);
- reward each response with the share of one target token in it (a 16-token vocabulary makes that
  token easy to learn);
- turn each prompt's responses into a TrainingBatch with the stream app's grouping and credit
  (:func:`build_training_batches`), through the Avro codec the topic uses;
- step the learner's own torch backend (:class:`TorchTrainer`: AdamW from the learner config, the
  default StepConfig) at the learner loop's warmup lr.

The mean reward of a fixed evaluation (same prompts and sampling seed) must rise by more than three
standard errors. The same run with the advantages' sign flipped, or at lr 0, must not: without those
controls the test could pass on noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from boltstream.learner.config import LearnerConfig
from boltstream.learner.step import warmup_lr
from boltstream.learner.tiny import tiny_llama
from boltstream.learner.trainer import TorchTrainer
from boltstream.schemas import Codec
from boltstream.streams import build_training_batches
from tests.unit.streams.factory import trajectory, turn

VOCAB, TARGET = 16, 5
PROMPT_LEN, RESPONSE_LEN, TEMPERATURE = 4, 8, 0.8
# One step: GROUPS prompts x GROUP_SIZE responses. Full fine-tuning of a random 16-token model at 1e-2
# (after the learner's default 3-step warmup) lifts the target's share 0.06 -> ~0.38 in 6 steps; flipped,
# it falls to ~0.01; each run takes about a second on one thread.
GROUPS, GROUP_SIZE, STEPS, LR = 4, 8, 6, 1e-2
EVAL_PROMPTS = 256


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tensors this small gain nothing from intra-op threads, and on a busy 2-core machine two threads
    that spin-wait on each other made the same run 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(responses, behaviour log-probs), each ``[B, RESPONSE_LEN]``, sampled at ``TEMPERATURE``."""
    model.eval()
    ids, logprobs = prompts, []
    for _ in range(RESPONSE_LEN):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float() / TEMPERATURE, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
        logprobs.append(logp.gather(-1, token))
    return ids[:, prompts.shape[1]:], torch.cat(logprobs, dim=1)


def reward(responses: torch.Tensor) -> torch.Tensor:
    """The share of ``TARGET`` in each response."""
    return (responses == TARGET).float().mean(dim=1)


def random_prompts(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, PROMPT_LEN), generator=generator)


def evaluate(model: torch.nn.Module) -> tuple[float, float]:
    """(mean reward, its standard error) over the same ``EVAL_PROMPTS`` prompts and sampling seed every time."""
    generator = torch.Generator().manual_seed(1234)
    rewards = reward(sample(model, random_prompts(EVAL_PROMPTS, generator), generator)[0])
    return float(rewards.mean()), float(rewards.std() / math.sqrt(len(rewards)))


def step_samples(model: torch.nn.Module, step: int, generator: torch.Generator) -> list[dict]:
    """One learner step's samples: ``GROUPS`` GRPO groups, as the stream app emits them."""
    codec = Codec()
    group_prompts = random_prompts(GROUPS, generator)
    responses, logprobs = sample(model, group_prompts.repeat_interleave(GROUP_SIZE, dim=0), generator)
    rewards = reward(responses)
    samples = []
    for g, prompt in enumerate(group_prompts.tolist()):
        task = f"s{step}-t{g}"
        attempts = [
            trajectory(f"{task}:{i}", [turn(0, prompt, responses[j].tolist(), logprobs=logprobs[j].tolist(),
                                            policy_version=step - 1, temperature=TEMPERATURE)],
                       final_reward=float(rewards[j]), task_id=task)
            for i, j in enumerate(range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE))
        ]
        for batch in build_training_batches(task, attempts, group_size=GROUP_SIZE):
            samples += codec.decode(codec.encode("TrainingBatch", batch, topic="batches"), expect="TrainingBatch")["samples"]
    return samples


def train(variant: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(evaluation before, evaluation after) ``STEPS`` learner steps of ``variant``."""
    model = tiny_llama(VOCAB, seed=0)
    cfg = LearnerConfig(model="tiny", lr=LR, groups_per_step=GROUPS)
    trainer = TorchTrainer(cfg, model=model, tokenizer=None)  # pad id 0, as tiny_llama's config says
    before = evaluate(model)
    generator = torch.Generator().manual_seed(0)
    base_lr = 0.0 if variant == "lr 0" else cfg.lr
    for step in range(1, STEPS + 1):
        samples = step_samples(model, step, generator)
        if variant == "flipped sign":
            samples = [{**s, "advantage": -s["advantage"]} for s in samples]
        metrics = trainer.step(samples, warmup_lr(base_lr, step, cfg.lr_warmup_steps))
        assert not metrics.skipped
        if step == 1:  # on-policy: scored at the sampling temperature, the ratio is 1
            assert metrics.ratio_max == pytest.approx(1.0, abs=1e-3)
    return before, evaluate(model)


@pytest.mark.parametrize("variant", ["normal", "flipped sign", "lr 0"])
def test_reward_rises_only_when_the_learner_follows_the_advantages(variant: str) -> None:
    (before, se_before), (after, se_after) = train(variant)
    noise = 3 * math.hypot(se_before, se_after)
    print(f"{variant}: reward {before:.3f} -> {after:.3f} ({after - before:+.3f}, 3 SE {noise:.3f})")
    if variant == "normal":
        assert after - before > noise
    else:
        assert after - before < noise
