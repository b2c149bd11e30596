"""Policy-gradient losses as pure tensor functions (no model, no optimizer, no I/O).

Conventions shared by every function here:

* Per-token tensors are ``[B, T]`` (or any shape with the same layout as ``mask``);
  ``mask`` is true where a token is trained. Position ``t`` of a log-prob tensor is the
  log-probability of the *label* at ``t`` (collate shifts everything to label positions).
* Log-probabilities are computed in float32 whatever the model's dtype: the importance
  ratio ``exp(new - old)`` amplifies bf16 rounding error into a biased clip fraction.
* Nothing here materialises ``[N, vocab]`` for all N positions at once. A bare loop
  that did ran out of 24 GB: vocabularies are 50k-150k wide, so the logits of a few
  thousand tokens already weigh gigabytes.

The objective is PPO-clip against the *behaviour* log-probs carried by each sample
(the inference engine's own numbers), with an optional decoupled / truncated-importance-
sampling correction for samples produced by an older policy (AReaL's decoupled PPO,
Yao et al.'s TIS): ``loss = -min(w, cap) * min(r * A, clip(r) * A)`` with
``r = pi / pi_prox`` and ``w = pi_prox / pi_behaviour`` (detached).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Literal

import torch

from .config import LOSS_AGG_MODES

logger = logging.getLogger(__name__)

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


# --------------------------------------------------------------------------- log-probs


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits`` (``[..., V]`` vs ``[...]``), in float32.

    Equivalent to ``log_softmax(logits).gather(labels)`` but chunked over positions and
    computed as ``logit[label] - logsumexp(logits)``: only ``[chunk_size, V]`` float32 is
    alive at a time instead of a full-size log-softmax copy (twice, in float32, for a bf16
    model). Differentiable. Prefer :func:`linear_token_logprobs` when you hold hidden
    states: it never forms the logits of all positions at all.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].float()
        lab = flat_labels[start : start + chunk_size]
        picked = chunk.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return flat.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(out).reshape(labels.shape)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the softmax at every position (a metric: no gradient), chunked like
    :func:`token_logprobs`. ``H = logsumexp(z) - sum(softmax(z) * z)``."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].float()
        lse = torch.logsumexp(chunk, dim=-1, keepdim=True)
        out.append(lse.squeeze(-1) - (torch.exp(chunk - lse) * chunk).sum(-1))
    if not out:
        return flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])


class _LinearLogprobs(torch.autograd.Function):
    """Log-probs of labels through a linear head, recomputing each logit chunk in backward.

    Autograd through a plain chunked loop would still *save* every chunk's logits for the
    backward pass, so peak memory would be the full ``[N, V]`` again. Saving only the
    inputs and the per-row logsumexp, and recomputing one chunk at a time in backward,
    keeps the peak at ``[chunk, V]`` (the "cut cross-entropy" / fused-linear-CE trick).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temperatures: torch.Tensor | None,
        chunk_size: int,
        with_entropy: bool,
    ):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _chunk_logits(hidden[start:end], weight, bias, _rows(temperatures, start, end))
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = z.gather(-1, labels[start:end].unsqueeze(-1)).squeeze(-1) - chunk_lse
            if with_entropy:
                p = torch.exp(z - chunk_lse.unsqueeze(-1))
                entropy[start:end] = chunk_lse - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, temperatures, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, labels, temperatures, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_size):
            end = min(start + ctx.chunk_size, n)
            h = hidden[start:end]
            t = _rows(temperatures, start, end)
            z = _chunk_logits(h, weight, bias, t)
            g_out = grad_logp[start:end].float()
            # d logp / d z = onehot(label) - softmax(z); z = logits / T
            g = torch.exp(z - lse[start:end].unsqueeze(-1)).mul_(-g_out.unsqueeze(-1))
            g.scatter_add_(-1, labels[start:end].unsqueeze(-1), g_out.unsqueeze(-1))
            if t is not None:
                g.div_(t)
            if grad_h is not None:
                grad_h[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += g.t() @ h.to(torch.float32)
            if grad_b is not None:
                grad_b += g.sum(0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def _rows(temperatures: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Rows ``start:end`` of the per-row temperatures as a ``[n, 1]`` divisor (None: all 1)."""
    return None if temperatures is None else temperatures[start:end].unsqueeze(-1)


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperatures: torch.Tensor | None
) -> torch.Tensor:
    z = (h.to(weight.dtype) @ weight.t()).float()
    if bias is not None:
        z = z + bias.float()
    if temperatures is not None:
        z = z / temperatures
    return z


def row_temperatures(temperature: torch.Tensor | float, n: int, device: torch.device) -> torch.Tensor | None:
    """``temperature`` (one for all rows, or one per row) as a float32 ``[n]`` tensor, or None when
    every row is at 1 (nothing to divide). Raises ``ValueError`` for a wrong shape or a value <= 0."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device)
    if t.dim() == 0:
        t = t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"temperature must be a scalar or one value per row ({n}); got shape {tuple(t.shape)}")
    if not bool((t > 0).all()):
        raise ValueError("temperatures must be > 0 (score greedy calls at 1.0)")
    return None if bool((t == 1.0).all()) else t


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: torch.Tensor | float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` for hidden states ``[N, H]`` through a head ``weight [V, H]``.

    Pass ONLY the hidden states of positions that carry loss (response tokens): prompt
    positions then never produce logits at all. Memory is ``O(chunk_size * V)`` in forward
    *and* backward (see :class:`_LinearLogprobs`). Returns float32 ``[N]`` log-probs and,
    if asked, their entropies (metric, no gradient). ``temperature`` (one value, or ``[N]``: one per
    row, as each sample was sampled at its own) divides the logits, so the log-probs are
    ``log_softmax(logits / T)``: what inference engines report as behaviour log-probs.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and labels [N]; got {tuple(hidden.shape)}, {tuple(labels.shape)}"
        )
    temperatures = row_temperatures(temperature, hidden.shape[0], hidden.device)
    logp, entropy = _LinearLogprobs.apply(
        hidden, weight, bias, labels, temperatures, int(chunk_size), bool(with_entropy)
    )
    return logp, (entropy if with_entropy else None)


# --------------------------------------------------------------------------- aggregation


def loss_normaliser(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """What a loss-aggregation mode divides by: the number of trained tokens (token-mean)
    or of sequences with at least one trained token (seq-mean-*). Additive over disjoint
    sets of sequences, so the normaliser of a whole optimizer step is the sum over its
    micro-batches; passing that to every micro-batch makes the accumulated gradient equal
    to the single-big-batch gradient."""
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg={loss_agg!r}; expected one of {LOSS_AGG_MODES}")
    m = mask.bool()
    if loss_agg == "token-mean":
        return m.sum().to(torch.float32)
    return (m.reshape(m.shape[0], -1).sum(-1) > 0).sum().to(torch.float32)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    normaliser: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    * ``token-mean``: ``sum_i w_i sum_t l_it / N_tokens`` -- every token counts equally,
      so long responses dominate (DAPO's choice).
    * ``seq-mean-token-mean``: ``sum_i w_i mean_t l_it / N_seq`` -- every sequence counts
      equally (original GRPO).
    * ``seq-mean-token-sum``: ``sum_i w_i sum_t l_it / N_seq`` (no length normalisation;
      Dr. GRPO divides by a constant instead, which is just a learning-rate scale).

    ``weights`` (per sequence, ``[B]``) multiply the loss but NOT the normaliser: they are
    the sample's ``loss_weight`` (e.g. LightningRL's 1/T_i per-rollout weight) and must be
    able to shrink a sample's share. ``normaliser`` overrides the denominator; micro-batched
    steps pass the whole step's :func:`loss_normaliser` here.
    """
    m = mask.to(per_token.dtype)
    if weights is not None:
        shape = (per_token.shape[0],) + (1,) * (per_token.dim() - 1)
        per_token = per_token * weights.to(per_token.dtype).reshape(shape)
    denom = loss_normaliser(mask, loss_agg) if normaliser is None else normaliser
    denom = torch.clamp(torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device), min=1.0)
    masked = per_token * m
    if loss_agg == "token-mean":
        return masked.sum() / denom
    flat_m = m.reshape(m.shape[0], -1)
    seq_sum = masked.reshape(m.shape[0], -1).sum(-1)
    if loss_agg == "seq-mean-token-mean":
        seq_sum = seq_sum / torch.clamp(flat_m.sum(-1), min=1.0)
    return seq_sum.sum() / denom


# --------------------------------------------------------------------------- PPO


@dataclass
class LossMetrics:
    """Token-level *sums* (detached tensors), so micro-batches add up exactly; read the
    means through the properties. ``merge`` is the accumulation operator."""

    tokens: torch.Tensor
    clipped_tokens: torch.Tensor
    approx_kl_sum: torch.Tensor
    ratio_sum: torch.Tensor
    ratio_max: torch.Tensor
    is_weight_sum: torch.Tensor
    is_truncated_tokens: torch.Tensor
    ref_kl_sum: torch.Tensor

    def merge(self, other: LossMetrics) -> LossMetrics:
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = torch.maximum(a, b) if f.name == "ratio_max" else a + b
        return LossMetrics(**out)

    def _mean(self, value: torch.Tensor) -> float:
        n = float(self.tokens)
        return float(value) / n if n > 0 else 0.0

    @property
    def clip_fraction(self) -> float:
        return self._mean(self.clipped_tokens)

    @property
    def approx_kl(self) -> float:
        return self._mean(self.approx_kl_sum)

    @property
    def ratio_mean(self) -> float:
        return self._mean(self.ratio_sum)

    @property
    def is_weight_mean(self) -> float:
        return self._mean(self.is_weight_sum)

    @property
    def is_truncated_fraction(self) -> float:
        return self._mean(self.is_truncated_tokens)

    @property
    def ref_kl(self) -> float:
        return self._mean(self.ref_kl_sum)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) from samples of pi (Schulman's blog):
    ``exp(ref - logp) - (ref - logp) - 1``; unbiased, always >= 0, low variance."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    is_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
    loss_agg: str = "token-mean",
    normaliser: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip loss (to minimise) and its metrics; all per-token inputs share ``mask``'s shape.

    ``ratio = exp(logprobs - anchor)`` where the anchor is ``proximal_logprobs`` if given,
    else ``behaviour_logprobs`` (plain PPO against the engine's numbers). The clip is
    asymmetric ``[1 - clip_low, 1 + clip_high]`` (DAPO's clip-higher keeps low-probability
    tokens explorable). ``dual_clip`` (> 1) bounds the loss of negative-advantage tokens
    at ``-dual_clip * A`` so one huge ratio cannot dominate a step.

    Stale samples (decoupled PPO / TIS): with ``proximal_logprobs`` the policy is clipped
    against the proximal policy and each token is reweighted by the detached importance
    weight ``exp(proximal - behaviour)``, truncated at ``is_cap`` -- that weight corrects
    for the data having come from an older (or numerically different) policy, and the cap
    bounds its variance. Passing ``proximal_logprobs = logprobs.detach()`` (one optimizer
    step per batch) gives the truncated-IS policy gradient without an extra forward pass.
    Without ``proximal_logprobs``, ``is_cap`` is ignored.

    ``ref_logprobs`` + ``kl_coef`` add ``kl_coef * k3(pi || ref)`` per token (GRPO's KL
    penalty). Aggregation follows :func:`aggregate_loss`.
    """
    mask_b = mask.bool()
    logprobs = logprobs.float()
    behaviour = behaviour_logprobs.float().detach()
    advantages = advantages.float().detach()
    anchor = behaviour if proximal_logprobs is None else proximal_logprobs.float().detach()
    # masked positions can hold anything (padding, zeros): keep exp() finite there
    log_ratio = torch.where(mask_b, logprobs - anchor, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surr1 = ratio * advantages
    surr2 = clipped_ratio * advantages
    per_token = -torch.minimum(surr1, surr2)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)

    if proximal_logprobs is not None:
        is_weight, truncated = _importance_weights(anchor, behaviour, mask_b, is_cap)
        per_token = per_token * is_weight
    else:
        is_weight = torch.ones_like(logprobs)
        truncated = torch.zeros_like(mask_b)

    ref_kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref = torch.where(mask_b, ref_logprobs.float().detach(), logprobs.detach())
        ref_kl = k3_kl(logprobs, ref)
        if kl_coef:
            per_token = per_token + kl_coef * ref_kl

    loss = aggregate_loss(per_token, mask_b, loss_agg, weights=weights, normaliser=normaliser)

    metrics = _loss_metrics(logprobs, behaviour, advantages, ratio, mask_b, clip_low=clip_low,
                            clip_high=clip_high, is_weight=is_weight, truncated=truncated, ref_kl=ref_kl)
    return loss, metrics


def _importance_weights(anchor: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                        is_cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's per-token weight ``exp(proximal - behaviour)`` (1 on masked positions),
    truncated at ``is_cap``; and which tokens the cap truncated."""
    is_weight = torch.exp(torch.where(mask, anchor - behaviour, torch.zeros_like(anchor)))
    truncated = (is_weight > is_cap) if is_cap is not None else torch.zeros_like(mask)
    if is_cap is not None:
        is_weight = torch.clamp(is_weight, max=is_cap)
    return is_weight, truncated


def _loss_metrics(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor, ratio: torch.Tensor,
                  mask_b: torch.Tensor, *, clip_low: float, clip_high: float, is_weight: torch.Tensor,
                  truncated: torch.Tensor, ref_kl: torch.Tensor) -> LossMetrics:
    """The step's sums over trained tokens (no gradient): clipping, KL estimates, ratios, IS weights."""
    maskf = mask_b.to(torch.float32)
    with torch.no_grad():
        # clipped = the clipped branch was selected, i.e. this token gives no gradient
        clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | (
            (advantages < 0) & (ratio < 1.0 - clip_low)
        )
        # approx KL(behaviour || current), k3 on the log-ratio against the behaviour policy
        lr_b = torch.where(mask_b, logprobs.detach() - behaviour, torch.zeros_like(logprobs))
        metrics = LossMetrics(
            tokens=maskf.sum(),
            clipped_tokens=(clipped.float() * maskf).sum(),
            approx_kl_sum=((torch.exp(lr_b) - 1.0 - lr_b) * maskf).sum(),
            ratio_sum=(ratio.detach() * maskf).sum(),
            ratio_max=torch.where(mask_b, ratio.detach(), torch.zeros_like(ratio)).max()
            if ratio.numel()
            else ratio.new_zeros(()),
            is_weight_sum=(is_weight.detach() * maskf).sum(),
            is_truncated_tokens=(truncated.float() * maskf).sum(),
            ref_kl_sum=(ref_kl.detach() * maskf).sum(),
        )
    return metrics
