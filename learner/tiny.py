"""Tiny randomly initialised models and synthetic samples for tests (no downloads, ms).

The model (:func:`boltstream.weights.models.tiny_llama`, re-exported) is a real ``LlamaForCausalLM``
(same code path as SmolLM2), only small, so every test exercises the production
forward/backward rather than a mock.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from boltstream.weights.models import tiny_llama

__all__ = ["random_samples", "shared_prefix_samples", "tiny_llama"]

logger = logging.getLogger(__name__)


def random_samples(
    n: int,
    vocab_size: int = 64,
    seed: int = 0,
    *,
    min_len: int = 6,
    max_len: int = 20,
    policy_version: int = 0,
) -> list[dict[str, Any]]:
    """Schema-shaped Sample dicts with random tokens, a prompt of 1..len-2 tokens, a
    response whose middle token is masked out (like a tool observation), advantages
    alternating in sign and behaviour log-probs of -1.0 (call :func:`with_model_logprobs`
    in ``boltstream.learner.step`` for on-policy numbers)."""
    if min_len < 2 or max_len < min_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        plen = rng.randint(1, max(1, length - 2))
        mask = [False] * plen + [True] * (length - plen)
        if length - plen >= 3:
            mask[plen + 1] = False
        out.append(
            {
                "sample_id": f"a{seed}-{i}:0",
                "rollout_id": f"r{seed}-{i}",
                "attempt_id": f"a{seed}-{i}",
                "task_id": f"t{seed}-{i // 4}",
                "call_index": 0,
                "token_ids": [rng.randrange(3, vocab_size) for _ in range(length)],
                "prompt_length": plen,
                "loss_mask": mask,
                "behaviour_logprobs": [-1.0 if m else 0.0 for m in mask],
                "advantage": (1.0 if i % 2 == 0 else -1.0) * (0.5 + rng.random()),
                "loss_weight": 1.0,
                "reward": 0.0,
                "policy_version": policy_version,
                "agent_name": None,
                "temperature": None,  # scored at 1.0
            }
        )
    return out


def shared_prefix_samples(vocab_size: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """Samples that share prefixes the way an agent's do: one system prompt, 2 tasks x 2 attempts,
    each attempt's second call = its first call + response + a tool output, one sample repeated
    exactly; a masked-out token inside longer responses; temperatures per sample (0.7, 1.3, greedy,
    unrecorded). For prefix-tree tests: their trie has well under half their tokens."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    def sample(prompt: list[int], response: list[int], advantage: float, temperature: float | None) -> dict:
        ids = prompt + response
        mask = [False] * len(prompt) + [True] * len(response)
        if len(response) > 2:
            mask[len(prompt) + 1] = False
        return {"token_ids": ids, "prompt_length": len(prompt), "loss_mask": mask,
                "behaviour_logprobs": [-1.5 if m else 0.0 for m in mask], "advantage": advantage,
                "loss_weight": 1.0, "temperature": temperature}

    system = toks(9)
    out = []
    temperatures = [0.7, 1.3, 0.0, None]
    for task in range(2):
        question = system + toks(4)
        for attempt in range(2):
            first = toks(3 + attempt)
            advantage = (-1.0) ** (task + attempt) * (0.5 + attempt)
            out.append(sample(question, first, advantage, temperatures[(task + attempt) % 4]))
            out.append(sample(question + first + toks(2), toks(4), advantage, temperatures[(task + attempt + 1) % 4]))
    out.append(dict(out[0]))  # two identical responses in a group
    return out
