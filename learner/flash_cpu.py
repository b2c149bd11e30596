"""Attention to a block of visible keys plus a causal block, in two flash calls merged exactly (CPU).

Why: a trie's node attends to the shared prefix, to its ancestors, and causally to the chain it is
on. Handed to ``scaled_dot_product_attention`` as one dense mask, the kernel also computes every
masked pair (the upper triangle of each chain) and reads the mask block by block. Split in two,
neither call needs a mask: the visible keys are all seen (no mask), the chain's own keys are causal
over a square (``is_causal`` skips the blocks above the diagonal). The two results are merged with
their log-sum-exps, which is exact.

What it relies on, torch's private CPU flash kernel (checked by :func:`problem` on the installed
torch, and by a unit test against ``scaled_dot_product_attention`` with a dense mask):

* ``aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
  scale)`` returns ``(output [B, H, L, E], logsumexp [B, H, L] float32)``; ``is_causal`` with
  ``L == S`` is the plain causal mask.
* ``aten::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
  dropout_p, is_causal, *, attn_mask, scale)`` recomputes the probabilities as ``exp(s - logsumexp)``
  and uses ``rowsum(grad_out * out)``: given the *merged* output and log-sum-exp, each block's
  backward returns that block's exact share of the gradient (the identity ring attention uses).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# float32 rounding (the kernel's block order follows the thread count) stays ~1e-7; other semantics move O(1)
TOLERANCE = 1e-4
_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _ops() -> tuple[Any, Any]:
    return getattr(torch.ops.aten, _FORWARD), getattr(torch.ops.aten, _BACKWARD)


class _VisibleThenCausal(torch.autograd.Function):
    """Attention of ``q`` over ``[visible keys; own keys]``, all of the first and the second causally."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_vis: torch.Tensor, v_vis: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float) -> torch.Tensor:
        forward, _ = _ops()
        out_vis, lse_vis = forward(q, k_vis, v_vis, 0.0, False, scale=scale)
        out_own, lse_own = forward(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_vis, lse_own)  # float32, as the kernel returns it: the merge too
        out = (out_vis.float() * torch.exp(lse_vis - lse).unsqueeze(-1)
               + out_own.float() * torch.exp(lse_own - lse).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k_vis, v_vis, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _, backward = _ops()
        q, k_vis, v_vis, k_own, v_own, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_vis, dk_vis, dv_vis = backward(grad_out, q, k_vis, v_vis, out, lse, 0.0, False, scale=ctx.scale)
        dq_own, dk_own, dv_own = backward(grad_out, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq_vis + dq_own, dk_vis, dv_vis, dk_own, dv_own, None


def visible_then_causal(q: torch.Tensor, k_vis: torch.Tensor | None, v_vis: torch.Tensor | None,
                        k_own: torch.Tensor, v_own: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, H, L, E]``: each of ``q``'s ``L`` rows attends to every key of ``k_vis`` (``[B, H, S, E]``,
    None or ``S = 0`` for none) and causally to ``k_own`` (``[B, H, L, E]``: row ``i`` sees own keys
    ``0..i``); the same as ``scaled_dot_product_attention`` over the concatenated keys with the
    matching bool mask, without computing the masked pairs. Differentiable."""
    if k_vis is None or k_vis.shape[-2] == 0:
        return torch.nn.functional.scaled_dot_product_attention(q, k_own, v_own, is_causal=True, scale=scale)
    return _VisibleThenCausal.apply(q, k_vis, v_vis, k_own, v_own, scale)


@functools.cache
def problem() -> str | None:
    """Why :func:`visible_then_causal` cannot run on this torch, or None: the ops exist and a small
    case (values and gradients) matches ``scaled_dot_product_attention`` with a dense mask."""
    try:
        _ops()
        with torch.enable_grad():  # callers may probe under no_grad
            return _mismatch()
    except Exception as exc:  # an op missing or with another signature: the dense mask stays
        return f"torch {torch.__version__}'s CPU flash attention ops differ: {type(exc).__name__}: {exc}"


def _mismatch() -> str | None:
    """Why a small case (values and gradients) differs from sdpa's dense mask, or None."""
    gen = torch.Generator().manual_seed(0)
    q, k_vis, v_vis, k_own, v_own = (torch.randn(1, 2, n, 8, generator=gen, requires_grad=True)
                                     for n in (5, 7, 7, 5, 5))
    scale = 8 ** -0.5
    mask = torch.cat([torch.ones(5, 7, dtype=torch.bool), torch.ones(5, 5, dtype=torch.bool).tril()], dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k_vis, k_own], 2), torch.cat([v_vis, v_own], 2), attn_mask=mask, scale=scale)
    got = visible_then_causal(q, k_vis, v_vis, k_own, v_own, scale)
    inputs = (q, k_vis, v_vis, k_own, v_own)
    seed = torch.randn(want.shape, generator=gen)
    grads_want = torch.autograd.grad(want, inputs, seed)
    grads_got = torch.autograd.grad(got, inputs, seed)
    pairs = zip((got, *grads_got), (want, *grads_want), strict=True)
    worst = max(float((a - b).detach().abs().max()) for a, b in pairs)
    if worst > TOLERANCE:
        return f"torch {torch.__version__}'s CPU flash attention merged in two parts differs by {worst:.3g}"
    return None
