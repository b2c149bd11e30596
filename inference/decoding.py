"""Batched incremental decoding for the transformers engine: prefill, join, sample, step.

Why hand-written: one batch mixes requests with different temperatures, top_p,
seeds, stop strings and lengths; requests JOIN a running batch between decode
steps (continuous batching: closed-loop agents never line up at batch
boundaries), finished rows LEAVE it (a quarter of the batch at a time,
:func:`retire`); and every sampled token's log-probability
must follow the convention in :mod:`boltstream.inference.backend`.

A :class:`DecodeState` holds the active rows and, aligned with them, the KV
cache, the attention mask (left padding), each row's last position and the
logits for its next token. Joining left-pads the shorter of two states' caches
and masks to a common length and concatenates them along the batch.

The KV cache is a :class:`~boltstream.inference.llama_step.KVBuffer` decoded by
:mod:`boltstream.inference.llama_step` for the models that step reproduces
(Llama-shaped, checked once per model object), else the model's own cache,
decoded by its own forward.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from boltstream.inference import llama_step, transformers_internals
from boltstream.inference.backend import SamplingParams
from boltstream.inference.llama_step import KVBuffer

# Finished rows stay in the batch until they are this share of it (:func:`retire`).
RETIRE_SHARE = 0.25


@dataclass
class Row:
    """One sequence being sampled: choice ``choice`` of ``request``."""

    request: Any
    choice: int
    generator: Any
    # int32 / float32 arrays: appending costs what a list append does, and the LLM span takes them as
    # its packed payload without a conversion (inference/capture.py)
    ids: array = field(default_factory=lambda: array("i"))
    logprobs: array = field(default_factory=lambda: array("f"))
    finish: str | None = None
    stop_string: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass
class DecodeState:
    rows: list[Row]
    cache: Any
    mask: Any  # [B, T] 1 = real token
    positions: Any  # [B, 1] position of each row's last token
    logits: Any  # [B, V] float32 logits for each row's next token
    temps: Any  # [B] temperature used for logprobs (1.0 for greedy)


def make_rows(requests: list[Any]) -> list[Row]:
    """``n`` rows per request, each with its own generator (seed + choice index, or random)."""
    import torch

    rows = []
    for req in requests:
        for i in range(req.params.n):
            gen = torch.Generator(device="cpu")
            seed = req.params.seed + i if req.params.seed is not None else secrets.randbits(63)
            gen.manual_seed(seed % (2**63))
            rows.append(Row(req, i, gen))
    return rows


def prefill(model: Any, rows: list[Row], pad_id: int, device: Any) -> DecodeState:
    """Run the (left-padded) prompts of ``rows``: their cache and first logits."""
    import torch

    width = max(len(r.request.prompt_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        p = r.request.prompt_ids  # an int32 array (the backend's request): wrapped, not copied
        ids[i, width - len(p):] = torch.frombuffer(p, dtype=torch.int32) if isinstance(p, array) else torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device)
    cache = out.past_key_values
    if transformers_internals.is_growing(cache):
        cache = decode_cache(model, transformers_internals.layers_of(cache))
    return DecodeState(rows, cache, mask, positions[:, -1:], out.logits[:, -1, :].float(), temps)


def decode_cache(model: Any, layers: transformers_internals.KV) -> Any:
    """The cache a decode state keeps ``layers`` in: a KV buffer when ``model`` has a
    :func:`~boltstream.inference.llama_step.step_for`, else a ``DynamicCache``."""
    if llama_step.step_for(model) is not None:
        return KVBuffer.from_layers(layers)
    return transformers_internals.make_cache(layers)


def cache_layers(cache: Any) -> transformers_internals.KV:
    """``(keys, values)`` per layer of a decode state's cache (filled positions only)."""
    return cache.layers() if isinstance(cache, KVBuffer) else transformers_internals.layers_of(cache)


def can_join(state: DecodeState) -> bool:
    """Joining needs plain growing caches (sliding-window or static layers are left alone)."""
    return isinstance(state.cache, KVBuffer) or transformers_internals.is_growing(state.cache)


def join(a: DecodeState, b: DecodeState, reuse: Sequence[int] = ()) -> DecodeState:
    """One state holding the rows of ``a`` then ``b``; the shorter side is left-padded (masked out).

    ``reuse``: rows of ``a`` whose sequences finished; the first rows of ``b`` take their places (a KV
    buffer only), so a request joining as another leaves moves no other row."""
    import torch
    import torch.nn.functional as F

    length = max(a.mask.shape[1], b.mask.shape[1])
    pad_a, pad_b = length - a.mask.shape[1], length - b.mask.shape[1]
    if isinstance(a.cache, KVBuffer):
        reuse = list(reuse)[:len(b.rows)]
        cache: Any = a.cache
        cache.append(cache_layers(b.cache), into=reuse)  # in place: the running rows stay where they are
    else:
        if reuse:
            raise ValueError("only a KV buffer reuses rows")
        cache = transformers_internals.make_cache([
            (torch.cat([F.pad(ka, (0, 0, pad_a, 0)), F.pad(kb, (0, 0, pad_b, 0))]),
             torch.cat([F.pad(va, (0, 0, pad_a, 0)), F.pad(vb, (0, 0, pad_b, 0))]))
            for (ka, va), (kb, vb) in zip(cache_layers(a.cache), cache_layers(b.cache), strict=True)])
    k = len(reuse)
    rows = list(a.rows)
    for i, j in enumerate(reuse):
        rows[j] = b.rows[i]
    parts = []
    for ta, tb in ((F.pad(a.mask, (pad_a, 0)), F.pad(b.mask, (pad_b, 0))), (a.positions, b.positions),
                   (a.logits, b.logits), (a.temps, b.temps)):
        if k:
            ta = ta.clone()
            ta[torch.tensor(reuse, device=ta.device)] = tb[:k]
        parts.append(torch.cat([ta, tb[k:]]))
    return DecodeState(rows + b.rows[k:], cache, *parts)


def retire(state: DecodeState, live: list[int]) -> DecodeState:
    """``state`` with only its ``live`` rows once the finished ones are :data:`RETIRE_SHARE` of it
    (:func:`select`), else unchanged: finished rows ride along, fed their last token, their samples
    ignored. Dropping rows copies every other row's keys/values; done each time a row finished, that
    was a tenth of an agent step's generation, while a finished row costs a step little more than
    its share of the attention."""
    if len(state.rows) - len(live) < RETIRE_SHARE * len(state.rows):
        return state
    return select(state, live)


def select(state: DecodeState, keep: list[int]) -> DecodeState:
    """Only the rows at ``keep`` (the cache is narrowed in place)."""
    import torch

    if len(keep) == len(state.rows):
        return state
    sel = torch.tensor(keep, device=state.mask.device)
    if isinstance(state.cache, KVBuffer):
        state.cache.select(sel)
    else:
        transformers_internals.select_rows(state.cache, sel)
    return DecodeState([state.rows[j] for j in keep], state.cache, state.mask[sel], state.positions[sel],
                       state.logits[sel], state.temps[sel])


def advance(model: Any, state: DecodeState) -> None:
    """Feed every row's last sampled token; ``state.logits`` becomes the next step's."""
    nxt = _feed(state)
    if isinstance(state.cache, KVBuffer):
        step = llama_step.step_for(model)
        assert step is not None, "a KV buffer is only made for a model with a llama_step"
        state.logits = step(nxt, state.positions, state.mask, state.cache)
        return
    out = model(input_ids=nxt.unsqueeze(-1), attention_mask=state.mask, position_ids=state.positions,
                past_key_values=state.cache, use_cache=True)
    state.cache = out.past_key_values
    state.logits = out.logits[:, -1, :].float()


def advance_and_prefill(model: Any, state: DecodeState, block: Any) -> tuple[transformers_internals.KV, Any]:
    """:func:`advance`, and in the same pass over the weights the prefill of ``block`` (a
    :class:`~boltstream.inference.prefix_cache.Block`): its KV per layer and its next-token logits."""
    step = llama_step.step_for(model)
    assert step is not None and isinstance(state.cache, KVBuffer), "needs the plain-torch step"
    nxt = _feed(state)
    state.logits, logits, layers = step(nxt, state.positions, state.mask, state.cache, block)
    return layers, logits


def _feed(state: DecodeState) -> Any:
    """Every row's last sampled token (``[batch]``), its column added to the mask and its position."""
    import torch

    nxt = torch.tensor([r.ids[-1] for r in state.rows], dtype=torch.long, device=state.mask.device)
    state.mask = torch.cat([state.mask, torch.ones_like(nxt).unsqueeze(-1)], dim=-1)
    state.positions = state.positions + 1
    return nxt


def sample(state: DecodeState) -> tuple[list[int], list[float]]:
    """Next token of every row and its logprob under log_softmax(logits / T), before top-p truncation.

    Greedy rows take the argmax of the raw logits (logprob at T = 1). Others draw
    one uniform number from their own generator and take the token where it falls
    in the cumulative distribution of softmax(logits / T), over the top-p nucleus
    when top_p < 1: one vectorised search for the whole batch instead of a
    ``multinomial`` per row (which draws an exponential variate per vocabulary
    entry: 12 of a 16-row step's 20 ms on SmolLM2's 49k vocabulary).
    """
    import torch

    logp = torch.log_softmax(state.logits / state.temps.unsqueeze(-1), dim=-1)
    probs = logp.exp()
    rows = state.rows
    u = torch.cat([torch.rand(1, generator=row.generator) for row in rows])
    order: dict[int, Any] = {}
    for j, row in enumerate(rows):
        if not row.params.greedy and row.params.top_p < 1.0:
            sorted_p, order[j] = torch.sort(probs[j], descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= row.params.top_p
            # The most likely token always stays: a top_p that rounds to 0 in float32 (1e-300) would
            # drop every token, and the failed batch would fail its other requests too.
            drop[0] = False
            probs[j] = sorted_p.masked_fill(drop, 0.0)
    cdf = probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp_(max=cdf.shape[-1] - 1)
    tokens = picks.squeeze(-1).tolist()
    for j, row in enumerate(rows):
        if row.params.greedy:
            tokens[j] = int(torch.argmax(state.logits[j]))
        elif j in order:
            tokens[j] = int(order[j][tokens[j]])
    picked = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1)
    return tokens, picked.tolist()
