"""One optimizer step of PPO/GRPO on a list of Sample dicts.

Memory: the model's *decoder* runs on the padded micro-batch, then only the hidden
states at trained (response) positions go through the LM head, in chunks, with the
chunk logits recomputed in backward (:func:`losses.linear_token_logprobs`). Prompt
positions never produce logits. Peak activation memory is therefore bounded by
``max_tokens_per_micro_batch`` (decoder activations) plus ``logprob_chunk_size * vocab``
floats, independent of the step's size. Models whose head is not a plain ``nn.Linear``
(LoRA on ``lm_head``, logit soft-capping or scaling) or wrapped models (DDP) run the model's
own forward and gather log-probs from its logits.

Prefix tree (``StepConfig.prefix_tree``): each micro-batch's samples run as one token trie
(:mod:`.token_trie`, :mod:`.tree_forward`), so a prefix that samples share (system prompt, the
task's question, a previous call) is computed once; each sample then gathers the hidden states
of its own nodes and everything after the decoder is the flat path's, on the same tensors.
Micro-batches are then bounded by unique tokens (trie nodes) and mask size. A prefix that every
sample of the step shares (``StepConfig.shared_prefix_min_tokens``: the system prompt) runs once
per step instead of once per micro-batch when the step needs more than one
(:mod:`.shared_prefix`): the tries hold the tokens after it and attend to its cached keys/values,
whose gradient goes back through it after the last micro-batch.

Which of these paths a model takes is its trainer's :class:`.step_plan.StepPlan`, decided once
when the trainer is built; a step runs its plan and decides nothing.
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
from .shared_prefix import SharedPrefix, prefixed_inputs
from .step_plan import StepPlan, lm_head_parts, plan_step
from .token_trie import PrefixTree, build_tree, pack_by_unique_tokens, shared_prefix_length
from .tree_forward import label_nodes, tree_inputs

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


def sequence_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    cfg: StepConfig,
    with_entropy: bool = False,
    tree: PrefixTree | None = None,
    prefix: SharedPrefix | None = None,
    fused_head: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Model log-probs of ``batch.labels`` at trained positions, ``[B, T-1]`` float32
    (0 elsewhere), plus per-token entropy (metric) if asked. Differentiable. Each row is
    scored at its sample's temperature (``batch.temperatures``), as it was sampled.

    With ``tree`` (the trie of ``batch``'s samples, in the same order) the decoder runs once on
    the trie's nodes instead of the padded rows, and each trained position takes the hidden state
    of its sample's node; the head, temperatures and outputs are the flat path's. With ``prefix``
    the trie holds the samples' tokens after that shared prefix and attends to its cached keys and
    values. ``fused_head`` (default ``cfg.fused_head``; a :class:`StepPlan` says whether the model
    has such a head) runs the decoder and the LM head apart, the head at trained positions only."""
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
    parts = lm_head_parts(model) if (cfg.fused_head if fused_head is None else fused_head) else None
    if parts is not None:
        decoder, head = parts
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        lp, ent = linear_token_logprobs(trained(hidden), head.weight, labels, bias=head.bias,
                                        chunk_size=cfg.logprob_chunk_size, temperature=temperatures,
                                        with_entropy=with_entropy)
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
def _reference_logprobs(model: torch.nn.Module, ref_model: torch.nn.Module | None, plan: StepPlan, batch: Batch,
                        tree: PrefixTree | None, prefix: SharedPrefix | None) -> torch.Tensor | None:
    """Frozen-reference log-probs (None when the plan has no reference): ``ref_model``, or the peft
    model with its adapters disabled (the base model *is* the reference for LoRA: no second copy).
    ``tree`` and ``prefix`` (the reference's own, :func:`_shared_prefixes`) only where the plan
    says the reference takes them."""
    if plan.reference == "none":
        return None
    if not plan.reference_tree:
        tree = prefix = None
    if ref_model is not None:
        return sequence_logprobs(ref_model, batch, plan.cfg, tree=tree, prefix=prefix,
                                 fused_head=plan.reference_fused_head)[0]
    with model.disable_adapter():
        return sequence_logprobs(model, batch, plan.cfg, tree=tree, prefix=prefix, fused_head=plan.fused_head)[0]


# --------------------------------------------------------------------------- the step


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def micro_batches(plan: StepPlan, samples: Sequence[Sample]) -> tuple[int, list[list[Sample]]]:
    """The step's shared prefix length (0: none) and micro-batches: tries packed by unique tokens
    and mask size (with a shared prefix, tries of the tokens after it), else rows packed by rows x
    padded length. One function, so a backend that must know the count in advance (DeepSpeed's
    accumulation boundary) gets the step's own."""
    cfg = plan.cfg
    if not plan.tree:
        return 0, split_by_token_budget(samples, cfg.max_tokens_per_micro_batch)
    budget, mask = cfg.max_tokens_per_micro_batch, cfg.max_tree_mask_elements
    groups = pack_by_unique_tokens(samples, budget, mask)
    # One trie computes the shared prefix once already; only a step split over micro-batches gains.
    length = shared_prefix_length(samples, cfg.shared_prefix_min_tokens) if plan.shared_prefix and len(groups) > 1 \
        else 0
    return length, (pack_by_unique_tokens(samples, budget, mask, length) if length else groups)


@torch.no_grad()
def _reference_prefix(model: torch.nn.Module, ref_model: torch.nn.Module | None, token_ids: torch.Tensor,
                      chunk_size: int) -> SharedPrefix:
    """The shared prefix's keys/values under the reference policy (no gradient)."""
    if ref_model is not None:
        return SharedPrefix.run(ref_model, token_ids, chunk_size)
    with model.disable_adapter():
        return SharedPrefix.run(model, token_ids, chunk_size)


def _shared_prefixes(model: torch.nn.Module, ref_model: torch.nn.Module | None, plan: StepPlan,
                     sample: Sample, length: int) -> tuple[SharedPrefix | None, SharedPrefix | None]:
    """The policy's and the reference's run of the step's shared prefix (the first ``length`` tokens of
    ``sample``; none when 0)."""
    if not length:
        return None, None
    ids = as_tensor(sample["token_ids"], torch.long)[:length].long()
    budget = plan.cfg.max_tokens_per_micro_batch
    prefix = SharedPrefix.run(model, ids, budget, plan.cfg.shared_prefix_keep_tokens)
    with_ref = plan.reference != "none" and plan.reference_tree
    return prefix, (_reference_prefix(model, ref_model, ids, budget) if with_ref else None)


def _micro_batch_loss(model: torch.nn.Module, ref_model: torch.nn.Module | None, plan: StepPlan, batch: Batch,
                      trie: PrefixTree | None, prefixes: tuple[SharedPrefix | None, SharedPrefix | None],
                      normaliser: float) -> tuple[torch.Tensor, LossMetrics, torch.Tensor | None]:
    """One micro-batch's share of the step's loss (divided by the step's ``normaliser``)."""
    cfg = plan.cfg
    ref = _reference_logprobs(model, ref_model, plan, batch, trie, prefixes[1])
    logprobs, entropy = sequence_logprobs(model, batch, cfg, with_entropy=cfg.compute_entropy, tree=trie,
                                          prefix=prefixes[0], fused_head=plan.fused_head)
    loss, metrics = ppo_clip_loss(
        logprobs, batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        proximal_logprobs=logprobs.detach() if cfg.decoupled else None, is_cap=cfg.is_cap,
        ref_logprobs=ref, kl_coef=cfg.kl_coef, weights=batch.weights, loss_agg=cfg.loss_agg, normaliser=normaliser,
    )
    return loss, metrics, entropy


def accumulate_gradients(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    plan: StepPlan | StepConfig,
    *,
    ref_model: torch.nn.Module | None = None,
    backward: bool = True,
    backward_fn: Callable[[torch.Tensor], None] | None = None,
) -> StepMetrics:
    """Forward (+ backward) every micro-batch, adding into ``.grad``; no optimizer step.

    Each micro-batch loss is divided by the *step's* normaliser, so the gradients summed
    here equal those of one batch holding all samples. Does not zero gradients. ``plan`` is
    the trainer's (:func:`.step_plan.plan_step`); a bare :class:`StepConfig` is planned for this
    call. ``backward_fn`` replaces ``loss.backward()`` (e.g. a DeepSpeed engine's ``backward``;
    mind that engine's own gradient-accumulation scaling). With ``cfg.skip_zero_advantage``
    the samples that cannot move the weights (:func:`contributes`) are not run; never with a
    ``backward_fn``, whose ranks must all run their collectives.
    """
    if not samples:
        raise ValueError("a step needs at least one sample")
    if isinstance(plan, StepConfig):
        plan = plan_step(model, plan, ref_model=ref_model, custom_backward=backward_fn is not None)
    t0, cfg, device = time.perf_counter(), plan.cfg, _device(model)
    normaliser = step_normaliser(samples, cfg.loss_agg)  # over every sample: the update's scale is theirs
    trained = samples
    if cfg.skip_zero_advantage and backward and backward_fn is None:
        trained = [s for s in samples if contributes(s, cfg)] or list(samples[:1])
    prefix_length, groups = micro_batches(plan, trained)
    batches = [collate(g, cfg.pad_token_id) for g in groups]
    trees = [build_tree([as_tensor(s["token_ids"], torch.long)[prefix_length:] for s in g]) if plan.tree else None
             for g in groups]
    total_loss, entropy_sum, metrics = 0.0, 0.0, None
    with contextlib.nullcontext() if backward else torch.no_grad():
        prefixes = _shared_prefixes(model, ref_model, plan, trained[0], prefix_length)
        for batch, trie in zip(batches, trees, strict=True):
            loss, m, entropy = _micro_batch_loss(model, ref_model, plan, batch.to(device), trie, prefixes, normaliser)
            if backward:
                (backward_fn or torch.Tensor.backward)(loss)
            total_loss += float(loss.detach())
            metrics = m if metrics is None else metrics.merge(m)
            entropy_sum += float(entropy.sum()) if entropy is not None else 0.0
        if prefixes[0] is not None and backward:
            prefixes[0].backward()
    assert metrics is not None
    unique_tokens = prefix_length + sum(t.unique_tokens if t is not None else b.num_input_tokens
                                        for b, t in zip(batches, trees, strict=True))
    return _step_metrics(samples, metrics, total_loss, entropy_sum, batches, time.perf_counter() - t0,
                         skipped=len(samples) - len(trained), unique_tokens=unique_tokens)


def _step_metrics(samples: Sequence[Sample], metrics: LossMetrics, loss: float, entropy_sum: float,
                  batches: Sequence[Batch], seconds: float, *, skipped: int, unique_tokens: int) -> StepMetrics:
    adv = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float64)
    input_tokens = sum(b.num_input_tokens for b in batches)
    tokens = float(metrics.tokens)
    return StepMetrics(
        loss=loss,
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
        zero_advantage_skipped=skipped,
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
    plan: StepPlan | StepConfig | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
) -> StepMetrics:
    """zero_grad -> micro-batched forward/backward -> clip grad norm -> optimizer.step().

    ``samples`` must already be validated (:func:`collate.sample_problem`). A step whose
    gradient norm is not finite is skipped (gradients dropped, ``skipped=True``) rather
    than poisoning the weights. Puts the model in train mode. LR schedulers are the
    caller's business (call ``scheduler.step()`` after this).
    """
    plan = plan or StepConfig()
    cfg = plan.cfg if isinstance(plan, StepPlan) else plan
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_gradients(model, samples, plan, ref_model=ref_model)
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
    plan: StepPlan | StepConfig | None = None,
    *,
    ref_model: torch.nn.Module | None = None,
) -> StepMetrics:
    """The step's loss and metrics without gradients or an update (uses the current
    train/eval mode of ``model``)."""
    return accumulate_gradients(model, samples, plan or StepConfig(), ref_model=ref_model, backward=False)


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
