"""One optimizer step of PPO/GRPO on a list of Sample dicts.

Memory: the model's *decoder* runs on the padded micro-batch, then only the hidden
states at trained (response) positions go through the LM head, in chunks, with the
chunk logits recomputed in backward (:func:`losses.linear_token_logprobs`). Prompt
positions never produce logits. Peak activation memory is therefore bounded by
``max_tokens_per_micro_batch`` (decoder activations) plus ``logprob_chunk_size * vocab``
floats, independent of the step's size. Models whose head is not a plain ``nn.Linear``
(LoRA on ``lm_head``, logit soft-capping or scaling) or wrapped models (DDP) fall back to
the model's own forward and gather log-probs from its logits.

Prefix tree (``StepConfig.prefix_tree``): each micro-batch's samples run as one token trie
(:mod:`.token_trie`, :mod:`.tree_forward`), so a prefix that samples share (system prompt, the
task's question, a previous call) is computed once; each sample then gathers the hidden states
of its own nodes and everything after the decoder is the flat path's, on the same tensors.
Micro-batches are then bounded by unique tokens (trie nodes) and mask size. A prefix that every
sample of the step shares (``StepConfig.shared_prefix_min_tokens``: the system prompt) runs once
per step instead of once per micro-batch when the step needs more than one
(:mod:`.shared_prefix`): the tries hold the tokens after it and attend to its cached keys/values,
whose gradient goes back through it after the last micro-batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .collate import Batch, Sample, as_tensor, collate, split_by_token_budget, step_normaliser
from .config import StepConfig
from .losses import (
    LossMetrics,
    entropy_from_logits,
    linear_token_logprobs,
    ppo_clip_loss,
    row_temperatures,
    token_logprobs,
)
from .shared_prefix import SharedPrefix, prefixed_inputs, shared_prefix_problem
from .token_trie import PrefixTree, build_tree, pack_by_unique_tokens, shared_prefix_length
from .tree_forward import label_nodes, tree_inputs, tree_problem

logger = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    """What one step did; plain floats/ints, ready for JSONL / Prometheus."""

    loss: float
    clip_fraction: float
    approx_kl: float
    ref_kl: float
    entropy: float
    ratio_mean: float
    ratio_max: float
    is_weight_mean: float
    is_truncated_fraction: float
    grad_norm: float
    advantage_mean: float
    advantage_std: float
    loss_tokens: int
    input_tokens: int  # tokens of the samples run (a shared prefix counts once per sample)
    samples: int
    micro_batches: int
    seconds: float
    tokens_per_s: float
    skipped: bool = False
    zero_advantage_skipped: int = 0  # samples not run: their gradient is exactly 0 (see contributes)
    unique_tokens: int = 0  # tokens the decoder computed: input_tokens, less what prefix trees shared

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- log-probs


def _lm_head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when the fused path computes exactly the model's logits, else None."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    if not (hasattr(causal, "get_output_embeddings") and hasattr(causal, "get_decoder")):
        return None
    head = causal.get_output_embeddings()
    decoder = causal.get_decoder()
    if type(head) is not torch.nn.Linear or decoder is None or decoder is causal:
        return None
    config = getattr(causal, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            return None
    return decoder, head


def sequence_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    cfg: StepConfig,
    with_entropy: bool = False,
    tree: PrefixTree | None = None,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Model log-probs of ``batch.labels`` at trained positions, ``[B, T-1]`` float32
    (0 elsewhere), plus per-token entropy (metric) if asked. Differentiable. Each row is
    scored at its sample's temperature (``batch.temperatures``), as it was sampled.

    With ``tree`` (the trie of ``batch``'s samples, in the same order) the decoder runs once on
    the trie's nodes instead of the padded rows, and each trained position takes the hidden state
    of its sample's node; the head, temperatures and outputs are the flat path's. With ``prefix``
    the trie holds the samples' tokens after that shared prefix and attends to its cached keys and
    values."""
    sel = batch.loss_mask
    labels = batch.labels[sel]
    temperatures = batch.temperatures.unsqueeze(1).expand(sel.shape)[sel]
    if tree is None:
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}

        def trained(states: torch.Tensor) -> torch.Tensor:
            return states[:, :-1][sel]
    else:
        offset = prefix.length if prefix is not None else 0
        inputs = (tree_inputs(model, tree, sel.device) if prefix is None
                  else prefixed_inputs(model, tree, prefix, sel.device))
        nodes = label_nodes(tree, sel.shape, offset).to(sel.device)[sel]

        def trained(states: torch.Tensor) -> torch.Tensor:
            return states[0][nodes]
    parts = _lm_head_parts(model) if cfg.fused_head else None
    if parts is not None:
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        lp, ent = linear_token_logprobs(
            trained(hidden),
            head.weight,
            labels,
            bias=head.bias,
            chunk_size=cfg.logprob_chunk_size,
            temperature=temperatures,
            with_entropy=with_entropy,
        )
    else:
        logits = model(**inputs, use_cache=False).logits
        picked = trained(logits)
        divisor = row_temperatures(temperatures, picked.shape[0], picked.device)
        if divisor is not None:
            picked = picked / divisor.unsqueeze(-1)
        lp = token_logprobs(picked, labels, cfg.logprob_chunk_size)
        ent = entropy_from_logits(picked, cfg.logprob_chunk_size) if with_entropy else None
    zeros = torch.zeros(sel.shape, dtype=torch.float32, device=sel.device)
    return zeros.masked_scatter(sel, lp), (zeros.masked_scatter(sel, ent) if ent is not None else None)


@torch.no_grad()
def _reference_logprobs(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    batch: Batch,
    cfg: StepConfig,
    tree: PrefixTree | None = None,
    prefix: SharedPrefix | None = None,
) -> torch.Tensor | None:
    """Frozen-reference log-probs: ``ref_model`` if given, else the peft model with its
    adapters disabled (the base model *is* the reference for LoRA: no second copy). ``prefix`` is
    the reference's own shared prefix (:func:`_reference_prefix`), used with ``tree``."""
    if ref_model is not None:
        if tree_problem(ref_model) is not None:
            return sequence_logprobs(ref_model, batch, cfg)[0]
        return sequence_logprobs(ref_model, batch, cfg, tree=tree, prefix=prefix)[0]
    if not needs_reference(ref_model, cfg):
        return None
    if not hasattr(model, "disable_adapter"):
        raise ValueError("kl_coef > 0 needs a ref_model (or a peft model, whose base is the reference)")
    with model.disable_adapter():
        return sequence_logprobs(model, batch, cfg, tree=tree, prefix=prefix)[0]


def needs_reference(ref_model: torch.nn.Module | None, cfg: StepConfig) -> bool:
    return ref_model is not None or cfg.kl_coef != 0.0


@torch.no_grad()
def _reference_prefix(model: torch.nn.Module, ref_model: torch.nn.Module | None, token_ids: torch.Tensor,
                      chunk_size: int) -> SharedPrefix | None:
    """The shared prefix's keys/values under the reference policy (no gradient); None when a
    separate reference model cannot continue from them (it then scores the samples flat)."""
    if ref_model is not None:
        if shared_prefix_problem(ref_model) is not None:
            return None
        return SharedPrefix.run(ref_model, token_ids, chunk_size)
    with model.disable_adapter():
        return SharedPrefix.run(model, token_ids, chunk_size)


# --------------------------------------------------------------------------- the step


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


_logged_fallbacks: set[str] = set()


def runs_tree(model: torch.nn.Module, cfg: StepConfig) -> bool:
    """Whether steps of ``model`` under ``cfg`` run prefix trees: asked for, and the model's attention
    takes a 4-D mask (:func:`.tree_forward.tree_problem`; the reason it does not is logged once)."""
    if not cfg.prefix_tree:
        return False
    problem = tree_problem(model)
    if problem is not None and problem not in _logged_fallbacks:
        _logged_fallbacks.add(problem)
        logger.warning("prefix-tree training off, the step runs flat: %s", problem)
    return problem is None


def plan_micro_batches(samples: Sequence[Sample], cfg: StepConfig, tree: bool, prefix_length: int = 0
                       ) -> list[list[Sample]]:
    """The step's micro-batches: tries packed by unique tokens and mask size (``tree``; with
    ``prefix_length``, tries of the tokens after a shared prefix), else rows packed by rows x padded
    length. One function, so a backend that must know the count in advance (DeepSpeed's
    accumulation boundary) gets the step's own."""
    if tree:
        return pack_by_unique_tokens(samples, cfg.max_tokens_per_micro_batch, cfg.max_tree_mask_elements,
                                     prefix_length)
    return split_by_token_budget(samples, cfg.max_tokens_per_micro_batch)


def step_prefix_length(model: torch.nn.Module, samples: Sequence[Sample], cfg: StepConfig,
                       custom_backward: bool) -> int:
    """Length of the prefix this step runs once (:mod:`.shared_prefix`), 0 for none: the samples'
    :func:`.token_trie.shared_prefix_length`, when the model can continue from cached keys/values
    and the backward is autograd's own (a custom one, DeepSpeed's, scales and reduces per
    micro-batch: the prefix is then computed in each micro-batch, logged once)."""
    length = shared_prefix_length(samples, cfg.shared_prefix_min_tokens)
    if not length:
        return 0
    problem = shared_prefix_problem(model)
    if problem is None and custom_backward:
        problem = "a custom backward (DeepSpeed) runs each micro-batch's backward itself"
    if problem is not None:
        if problem not in _logged_fallbacks:
            _logged_fallbacks.add(problem)
            logger.warning("shared-prefix reuse off, each micro-batch computes the shared prefix: %s", problem)
        return 0
    return length


def accumulate_gradients(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    cfg: StepConfig,
    *,
    ref_model: torch.nn.Module | None = None,
    backward: bool = True,
    backward_fn: Callable[[torch.Tensor], None] | None = None,
) -> StepMetrics:
    """Forward (+ backward) every micro-batch, adding into ``.grad``; no optimizer step.

    Each micro-batch loss is divided by the *step's* normaliser, so the gradients summed
    here equal those of one batch holding all samples. Does not zero gradients.
    ``backward_fn`` replaces ``loss.backward()`` (e.g. a DeepSpeed engine's ``backward``;
    mind that engine's own gradient-accumulation scaling). With ``cfg.skip_zero_advantage``
    the samples that cannot move the weights (:func:`contributes`) are not run; never with a
    ``backward_fn``, whose ranks must all run their collectives.
    """
    if not samples:
        raise ValueError("a step needs at least one sample")
    t0 = time.perf_counter()
    device = _device(model)
    tree = runs_tree(model, cfg)
    groups = plan_micro_batches(samples, cfg, tree)
    batches = [collate(g, cfg.pad_token_id) for g in groups]
    normaliser = step_normaliser(batches, cfg.loss_agg)  # over every sample: the update's scale is theirs
    trained = samples
    if cfg.skip_zero_advantage and backward and backward_fn is None:
        trained = [s for s in samples if contributes(s, cfg)] or list(samples[:1])
    planned = groups
    if len(trained) < len(samples):
        groups = plan_micro_batches(trained, cfg, tree)
    # One trie computes the shared prefix once already; only a step split over micro-batches gains.
    prefix_length = step_prefix_length(model, trained, cfg, backward_fn is not None) if tree and len(groups) > 1 else 0
    if prefix_length:
        groups = plan_micro_batches(trained, cfg, tree, prefix_length)
    if groups is not planned:
        batches = [collate(g, cfg.pad_token_id) for g in groups]
    trees = [build_tree([as_tensor(s["token_ids"], torch.long)[prefix_length:] for s in g]) if tree else None
             for g in groups]
    total_loss = 0.0
    metrics: LossMetrics | None = None
    entropy_sum = 0.0
    grad_ctx = contextlib.nullcontext() if backward else torch.no_grad()
    with grad_ctx:
        prefix = ref_prefix = None
        if prefix_length:
            prefix_ids = as_tensor(trained[0]["token_ids"], torch.long)[:prefix_length].long()
            prefix = SharedPrefix.run(model, prefix_ids, cfg.max_tokens_per_micro_batch,
                                      cfg.shared_prefix_keep_tokens)
            if needs_reference(ref_model, cfg):
                ref_prefix = _reference_prefix(model, ref_model, prefix_ids, cfg.max_tokens_per_micro_batch)
        for batch, trie in zip(batches, trees, strict=True):
            batch = batch.to(device)
            ref_tree = trie if not prefix_length or ref_prefix is not None else None  # a trie after P needs P
            ref = _reference_logprobs(model, ref_model, batch, cfg, ref_tree, ref_prefix)
            logprobs, entropy = sequence_logprobs(model, batch, cfg, with_entropy=cfg.compute_entropy, tree=trie,
                                                  prefix=prefix)
            loss, m = ppo_clip_loss(
                logprobs,
                batch.behaviour_logprobs,
                batch.advantages,
                batch.loss_mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
                proximal_logprobs=logprobs.detach() if cfg.decoupled else None,
                is_cap=cfg.is_cap,
                ref_logprobs=ref,
                kl_coef=cfg.kl_coef,
                weights=batch.weights,
                loss_agg=cfg.loss_agg,
                normaliser=normaliser,
            )
            if backward:
                (backward_fn or torch.Tensor.backward)(loss)
            total_loss += float(loss.detach())
            metrics = m if metrics is None else metrics.merge(m)
            if entropy is not None:
                entropy_sum += float(entropy.sum())
        if prefix is not None and backward:
            prefix.backward()
    assert metrics is not None
    adv = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float64)
    input_tokens = sum(b.num_input_tokens for b in batches)
    unique_tokens = prefix_length + sum(t.unique_tokens if t is not None else b.num_input_tokens
                                        for b, t in zip(batches, trees, strict=True))
    seconds = time.perf_counter() - t0
    tokens = float(metrics.tokens)
    return StepMetrics(
        loss=total_loss,
        clip_fraction=metrics.clip_fraction,
        approx_kl=metrics.approx_kl,
        ref_kl=metrics.ref_kl,
        entropy=entropy_sum / tokens if tokens else 0.0,
        ratio_mean=metrics.ratio_mean,
        ratio_max=float(metrics.ratio_max),
        is_weight_mean=metrics.is_weight_mean,
        is_truncated_fraction=metrics.is_truncated_fraction,
        grad_norm=float("nan"),
        advantage_mean=float(adv.mean()),
        advantage_std=float(adv.std(unbiased=False)),
        loss_tokens=int(tokens),
        input_tokens=input_tokens,
        samples=len(samples),
        micro_batches=len(batches),
        seconds=seconds,
        tokens_per_s=input_tokens / seconds if seconds > 0 else 0.0,
        zero_advantage_skipped=len(samples) - len(trained),
        unique_tokens=unique_tokens,
    )


def contributes(sample: Sample, cfg: StepConfig) -> bool:
    """Whether ``sample`` can move the weights: a zero advantage zeroes every term of the PPO loss
    (``ratio * A``, its clipped twin, dual clip, IS weight), so without a KL term its gradient is
    exactly 0 and its forward and backward are pure cost (in the calculator demo 60 % of the samples:
    the groups whose attempts all scored alike). The step's normaliser still counts it, so skipping
    it leaves the update unchanged; only the metrics (clip fraction, KL, entropy) then describe the
    samples that were run."""
    return float(sample["advantage"]) != 0.0 or cfg.kl_coef != 0.0


def warmup_lr(base_lr: float, step: int, warmup_steps: int) -> float:
    """Learning rate of the 1-based ``step``: a linear ramp to ``base_lr`` over ``warmup_steps``.

    Why: Adam's first updates move every parameter by about the full lr whatever
    the gradient's size (its second-moment estimate has no history yet), so a
    first step on 16 noisy rollouts at lr 1e-3 is a sign-SGD step in every
    direction at once. The step number (not a scheduler's state) drives it, so a
    resumed learner continues the ramp exactly.
    """
    if warmup_steps <= 0 or step >= warmup_steps:
        return base_lr
    return base_lr * max(step, 1) / warmup_steps


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    cfg: StepConfig | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
) -> StepMetrics:
    """zero_grad -> micro-batched forward/backward -> clip grad norm -> optimizer.step().

    ``samples`` must already be validated (:func:`collate.sample_problem`). A step whose
    gradient norm is not finite is skipped (gradients dropped, ``skipped=True``) rather
    than poisoning the weights. Puts the model in train mode. LR schedulers are the
    caller's business (call ``scheduler.step()`` after this).
    """
    cfg = cfg or StepConfig()
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(model, samples, cfg, ref_model=ref_model)
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning("non-finite gradient norm (%s): step skipped", grad_norm)
        metrics.skipped = True
    optimizer.zero_grad(set_to_none=True)
    metrics.grad_norm = grad_norm
    metrics.seconds = time.perf_counter() - t0
    metrics.tokens_per_s = metrics.input_tokens / metrics.seconds if metrics.seconds > 0 else 0.0
    logger.debug("step: %s", metrics)
    return metrics


def evaluate_loss(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    cfg: StepConfig | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
) -> StepMetrics:
    """The step's loss and metrics without gradients or an update (uses the current
    train/eval mode of ``model``)."""
    return accumulate_gradients(model, samples, cfg or StepConfig(), ref_model=ref_model, backward=False)


@torch.no_grad()
def with_model_logprobs(
    model: torch.nn.Module, samples: Sequence[Sample], cfg: StepConfig | None = None
) -> list[dict[str, Any]]:
    """Copies of ``samples`` whose ``behaviour_logprobs`` are ``model``'s own (0 off the
    loss mask): on-policy data for tests, or a recomputed proximal policy."""
    cfg = cfg or StepConfig()
    device = _device(model)
    out = []
    for s in samples:
        batch = collate([s], cfg.pad_token_id).to(device)
        lp = sequence_logprobs(model, batch, cfg)[0][0].cpu()
        mask = batch.loss_mask[0].cpu()
        values = [0.0] + [float(v) if m else 0.0 for v, m in zip(lp.tolist(), mask.tolist(), strict=True)]
        out.append({**s, "behaviour_logprobs": values[: len(s["token_ids"])]})
    return out
