"""Sample dicts (``schemas/sample/v3.avsc``) -> padded tensors, and micro-batching.

Decoded samples hold their token payloads as ``array.array`` (packed bytes on the wire): tensors are
built straight from those buffers (``torch.frombuffer``, no per-token Python objects); lists (tests,
offline Parquet) go through ``torch.as_tensor`` as before.

Everything per-token is moved to *label positions* here, once: position ``t`` of
``labels`` / ``loss_mask`` / ``behaviour_logprobs`` / ``advantages`` describes token
``t + 1`` of ``input_ids``, which is what the hidden state at ``t`` predicts. The losses
never shift anything, so an off-by-one cannot hide in two places.

Each sample is scored at its own sampling temperature (:func:`scoring_temperature`), the one
its LLM span recorded: behaviour log-probs are ``log_softmax(logits / T)``, so scoring at any
other T puts the importance ratio off even on-policy.

Micro-batches bound memory by a *token budget* (rows x padded length), not a sample
count: agent calls range from 50 to 5000 tokens. Samples are sorted by length before
packing so padding stays small. The step's loss normaliser is computed over ALL
micro-batches (:func:`step_normaliser`) and handed to each, which makes gradient
accumulation exactly equal to one big batch for every aggregation mode.
"""

from __future__ import annotations

import logging
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .losses import loss_normaliser

logger = logging.getLogger(__name__)

Sample = Mapping[str, Any]


def scoring_temperature(sample: Sample) -> float:
    """The T a sample's tokens are scored at: its recorded sampling temperature, or 1.0 when none
    was recorded (None) or the call was greedy (0), the logprob convention of
    ``boltstream.inference.backend``."""
    return float(sample.get("temperature") or 1.0)


_ARRAY_DTYPES = {"i": torch.int32, "l": torch.int64, "q": torch.int64, "f": torch.float32, "d": torch.float64,
                 "B": torch.uint8, "b": torch.int8}


def as_tensor(values: Any, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor of ``values``: a zero-copy view of an ``array.array`` (in its own item type: the
    caller's assignment into a padded tensor converts), else ``torch.as_tensor(values, dtype)``."""
    if isinstance(values, array) and len(values) and values.typecode in _ARRAY_DTYPES:
        return torch.frombuffer(values, dtype=_ARRAY_DTYPES[values.typecode])
    return torch.as_tensor(values, dtype=dtype)


def sample_problem(sample: Sample, vocab_size: int | None = None) -> str | None:
    """Why ``sample`` cannot be trained on, or None if it can.

    The reasons are short stable strings, meant to be used as counter labels by the
    training loop ("rejected with a counted reason; training continues").
    """
    try:
        ids = sample["token_ids"]
        mask = sample["loss_mask"]
        blp = sample["behaviour_logprobs"]
        plen = int(sample["prompt_length"])
        adv = float(sample["advantage"])
        weight = float(sample.get("loss_weight", 1.0))
        n, n_mask, n_blp = len(ids), len(mask), len(blp)
    except (KeyError, TypeError, ValueError):
        return "missing_field"
    if n_mask != n or n_blp != n:
        return "length_mismatch"
    if not 0 <= plen <= n:
        return "bad_prompt_length"
    try:  # one tensor per payload: the checks below run in C, not per token in Python
        mask_t = as_tensor(mask, torch.bool).bool()
        blp_t = as_tensor(blp, torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return "missing_field"
    if not bool(mask_t[1:].any()):
        return "no_loss_tokens"
    if bool(mask_t[:plen].any()):
        return "loss_in_prompt"
    if not math.isfinite(adv):
        return "nonfinite_advantage"
    if not math.isfinite(weight) or weight < 0:
        return "bad_loss_weight"
    if bool((mask_t & ~(torch.isfinite(blp_t) & (blp_t <= 1e-4))).any()):
        return "bad_behaviour_logprob"
    temperature = sample.get("temperature")
    if temperature is not None and not (isinstance(temperature, int | float) and math.isfinite(temperature)
                                        and temperature >= 0):
        return "bad_temperature"
    if vocab_size is not None:
        ids_t = as_tensor(ids, torch.long)
        if bool(((ids_t < 0) | (ids_t >= vocab_size)).any()):
            return "token_out_of_vocab"
    return None


@dataclass
class Batch:
    """One padded (micro-)batch; per-token fields are at label positions, ``[B, T-1]``."""

    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    labels: torch.Tensor  # [B, T-1] long  (= input_ids[:, 1:])
    loss_mask: torch.Tensor  # [B, T-1] bool
    behaviour_logprobs: torch.Tensor  # [B, T-1] float32, 0 where not trained
    advantages: torch.Tensor  # [B, T-1] float32, the sample's advantage on trained tokens
    weights: torch.Tensor  # [B] float32, the samples' loss_weight
    temperatures: torch.Tensor  # [B] float32, what each sample is scored at (scoring_temperature)
    policy_versions: torch.Tensor  # [B] long
    sample_ids: list[str]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_input_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        return replace(
            self,
            **{
                name: getattr(self, name).to(device)
                for name in (
                    "input_ids",
                    "attention_mask",
                    "labels",
                    "loss_mask",
                    "behaviour_logprobs",
                    "advantages",
                    "weights",
                    "temperatures",
                    "policy_versions",
                )
            },
        )


def collate(samples: Sequence[Sample], pad_token_id: int = 0) -> Batch:
    """Pad ``samples`` (right padding) into a :class:`Batch`.

    A loss-mask flag on token 0 is dropped (nothing predicts the first token);
    :func:`sample_problem` rejects such samples anyway because token 0 is in the prompt.
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    lengths = [len(s["token_ids"]) for s in samples]
    b, t = len(samples), max(max(lengths), 2)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    blp = torch.zeros((b, t), dtype=torch.float32)
    adv = torch.zeros(b, dtype=torch.float32)
    weights = torch.ones(b, dtype=torch.float32)
    temperatures = torch.tensor([scoring_temperature(s) for s in samples], dtype=torch.float32)
    versions = torch.full((b,), -1, dtype=torch.long)
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[i, :n] = as_tensor(s["token_ids"], torch.long)
        attention_mask[i, :n] = 1
        mask[i, :n] = as_tensor(s["loss_mask"], torch.bool)
        blp[i, :n] = as_tensor(s["behaviour_logprobs"], torch.float32)
        adv[i] = float(s["advantage"])
        weights[i] = float(s.get("loss_weight", 1.0))
        versions[i] = int(s.get("policy_version", -1))
    loss_mask = mask[:, 1:]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=input_ids[:, 1:].clone(),
        loss_mask=loss_mask.clone(),
        behaviour_logprobs=torch.where(loss_mask, blp[:, 1:], torch.zeros_like(blp[:, 1:])),
        advantages=adv.unsqueeze(1) * loss_mask.float(),
        weights=weights,
        temperatures=temperatures,
        policy_versions=versions,
        sample_ids=[str(s.get("sample_id", i)) for i, s in enumerate(samples)],
    )


def split_by_token_budget(samples: Sequence[Sample], max_tokens: int) -> list[list[Sample]]:
    """Group samples so each group's padded size (rows x longest row) is <= ``max_tokens``.

    Longest first, greedy: deterministic, and neighbours have similar lengths so little
    is spent on padding. A sample longer than the budget gets a group of its own (logged):
    splitting one sequence is not possible without changing its attention.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["token_ids"]))
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    current_len = 0
    for i in order:
        n = len(samples[i]["token_ids"])
        if current and (len(current) + 1) * max(current_len, n) > max_tokens:
            groups.append(current)
            current, current_len = [], 0
        if not current and n > max_tokens:
            logger.warning(
                "sample %s has %d tokens, above the micro-batch budget %d",
                samples[i].get("sample_id"),
                n,
                max_tokens,
            )
        current.append(samples[i])
        current_len = max(current_len, n)
    if current:
        groups.append(current)
    return groups


def micro_batches(samples: Sequence[Sample], max_tokens: int, pad_token_id: int = 0) -> list[Batch]:
    """:func:`split_by_token_budget` then :func:`collate` each group."""
    return [collate(g, pad_token_id) for g in split_by_token_budget(samples, max_tokens)]


def step_normaliser(samples: Sequence[Sample], loss_agg: str) -> float:
    """The loss denominator of a whole optimizer step (tokens or sequences, per mode), to be
    passed to every micro-batch's loss so the accumulated gradient equals the single-batch
    gradient. Additive over sequences, so summed per sample (the mask shifted by one, as
    :func:`collate` shifts it) without collating anything."""
    return float(sum(float(loss_normaliser(torch.as_tensor(s["loss_mask"][1:], dtype=torch.bool).reshape(1, -1),
                                           loss_agg)) for s in samples))
