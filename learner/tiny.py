"""Tiny randomly initialised models and synthetic samples for tests (no downloads, ms).

The model is a real ``LlamaForCausalLM`` (same code path as SmolLM2), only small, so
every test exercises the production forward/backward rather than a mock.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

logger = logging.getLogger(__name__)


def tiny_llama(
    vocab_size: int = 64,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
) -> torch.nn.Module:
    """A 2-layer Llama with random weights, built under its own RNG so the global torch
    seed of the calling test is left untouched and the weights depend on ``seed`` only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model


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
            }
        )
    return out
