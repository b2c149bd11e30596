"""Tree attention by chains: a trie's micro-batch without the masked pairs of a dense tree mask.

Why: in a trie flattened in depth-first pre-order (:mod:`.token_trie`), most nodes continue their
parent, the node just before them. A maximal run of such nodes is a *chain* (an agent's rollout
after the shared prompt is one chain: every call extends the previous one). A chain's nodes see
the same keys (the shared prefix, the chain's ancestors) plus the chain itself causally, so each
chain is two maskless flash calls (:mod:`.flash_cpu`) instead of its rows of an ``[N, P + N]``
dense mask, which makes the kernel compute every masked pair too (the upper triangle of each
chain and every pair between chains).

The forward reaches the attention through transformers' public attention interface: this module
registers :data:`NAME` (``AttentionInterface``, and ``AttentionMaskInterface`` with the sdpa mask)
and :func:`install` switches the learner's model to it. A forward that passes ``chain_plan`` (a
:class:`ChainPlan`) runs by chains; every other forward is the sdpa attention, unchanged.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any

import torch

from . import flash_cpu
from .config import StepConfig
from .token_trie import build_tree
from .tree_forward import CHAINS as NAME
from .tree_forward import (
    attention_implementation,
    causal_model,
    probe_against_plain,
    probe_tokens,
    tree_inputs,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """A micro-batch's chains: ``chains[c] = (start, end)`` node ranges in pre-order, and the key
    ranges each chain sees in full, ``visible[c]`` (``(lo, hi)`` in the forward's key axis: the
    shared prefix's ``P`` keys, then the nodes at ``P + node``)."""

    chains: tuple[tuple[int, int], ...]
    visible: tuple[tuple[tuple[int, int], ...], ...]


def _merged(ranges: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    if ranges and ranges[-1][1] == new[0]:
        return [*ranges[:-1], (ranges[-1][0], new[1])]
    return [*ranges, new]


def chain_plan(parents: torch.Tensor | list[int], prefix_length: int = 0, min_mean_tokens: int = 1
               ) -> ChainPlan | None:
    """The chains of a pre-order trie from its ``parents`` (-1 for a root), after a shared prefix of
    ``prefix_length`` keys every node sees; None when they average fewer than ``min_mean_tokens``
    nodes. A chain starts at node 0 and wherever a node's parent is not the node before it; it
    sees the prefix, its first node's ancestors (the ancestors' chains up to the parent: earlier
    chains, so their ranges are known) and itself causally."""
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    n = len(parent_list)
    starts = [i for i in range(n) if i == 0 or parent_list[i] != i - 1]
    if not starts or n < min_mean_tokens * len(starts):
        return None
    ends = [*starts[1:], n]
    base = [(0, prefix_length)] if prefix_length else []
    visible: list[list[tuple[int, int]]] = []
    for start in starts:
        parent = parent_list[start]
        if parent < 0:
            visible.append(base)
            continue
        owner = bisect.bisect_right(starts, parent) - 1  # the chain holding the parent
        visible.append(_merged(visible[owner], (prefix_length + starts[owner], prefix_length + parent + 1)))
    return ChainPlan(chains=tuple(zip(starts, ends, strict=True)), visible=tuple(tuple(v) for v in visible))


def _keys(tensor: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor | None:
    if not ranges:
        return None
    parts = [tensor[:, :, lo:hi] for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def chain_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            chain_plan: ChainPlan | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' interface: by chains when the forward passed
    ``chain_plan`` (one sequence on CPU, no dropout, no sliding window or soft-capping), else sdpa's."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if (chain_plan is None or dropout or query.shape[0] != 1 or query.device.type != "cpu"
            or kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix = key.shape[2] - query.shape[2]
    outputs = []
    for (start, end), ranges in zip(chain_plan.chains, chain_plan.visible, strict=True):
        outputs.append(flash_cpu.visible_then_causal(
            query[:, :, start:end], _keys(key, ranges), _keys(value, ranges),
            key[:, :, prefix + start : prefix + end], value[:, :, prefix + start : prefix + end], scale))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make :data:`NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, chain_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def installed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forwards take ``chain_plan``."""
    return attention_implementation(model) == NAME


def install(model: torch.nn.Module) -> str | None:
    """Switch ``model`` (sdpa attention, on CPU) to :data:`NAME`; returns why not, or None."""
    impl = attention_implementation(model)
    if impl == NAME:
        return None
    if impl != "sdpa":
        return f"attention implementation {impl!r} (chains replace sdpa only)"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on CPU (the chains use torch's CPU flash kernel)"
    problem = flash_cpu.problem()
    if problem is not None:
        return problem
    register()
    causal_model(model).set_attn_implementation(NAME)
    if attention_implementation(model) != NAME:
        return f"{type(causal_model(model)).__name__} did not take attention implementation {NAME!r}"
    return None


@torch.no_grad()
def probe(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run by chains, or None: :func:`install`, then the trie ``a -> b -> c,
    a -> c`` (two chains, the second seeing the first's ``a``) run by chains, compared with the
    plain sequence ``a c``."""
    problem = install(model)
    if problem is not None:
        return problem
    a, b, c = probe_tokens(model)
    tree = build_tree([[a, b, c], [a, c]])
    plan = chain_plan(tree.parents)
    return probe_against_plain(model, lambda device: model(**tree_inputs(model, tree, device), chain_plan=plan,
                                                           use_cache=False),
                               int(tree.node_index[1][1]), [a, c], "a forward by chains")


def resolve_chain_attention(model: torch.nn.Module, cfg: StepConfig) -> StepConfig:
    """``cfg`` as ``model`` can run it: chains off (logged
    once, with the reason, and the model's attention back to sdpa) when :func:`probe` finds a problem.
    Called once when a trainer is built, after :func:`.tree_forward.resolve_prefix_tree`."""
    if not cfg.prefix_tree or not cfg.chain_attention_min_tokens:
        return cfg
    problem = probe(model)
    if problem is None:
        logger.info("trie chains run as maskless flash attention")
        return cfg
    if installed(model):
        causal_model(model).set_attn_implementation("sdpa")
    logger.warning("chain attention off, tries use the dense tree mask: %s", problem)
    return dataclasses.replace(cfg, chain_attention_min_tokens=0)
