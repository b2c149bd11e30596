"""The prefix cache of the transformers engine: KV of token prefixes reused across requests.

Why: an agent's calls repeat most of their prompt. The calculator demo's system
prompt and worked example are the same in every call, a group's attempts share
the question, and an agent's second call starts with its whole first call
(prompt, response, tool result). Prefilling only what is new saves most of the
prefill compute.

How: a :class:`~boltstream.inference.radix_tree.PrefixTree` maps token ids to
per-layer key/value tensors (``[kv_heads, tokens, head_dim]`` per layer, K and V,
cloned so they never pin a batch's cache). :func:`prefill` looks up each distinct
prompt of a batch: the longest stored prefix (never the last prompt token, whose
logits start the sampling) becomes the past, and only the rest runs through the
model (positions continuing after the prefix), prompts with similar remainders
in one forward; the prompt's KV is stored for the next request. The rows are then left-padded into one
:class:`~boltstream.inference.decoding.DecodeState`, as joining batches does.
The ``n`` choices of one request share one prefill. When a row finishes, its
prompt plus generated tokens are stored too (:meth:`PrefixCache.insert_row`),
so an agent's next turn finds its previous one.

KV belongs to the weights that computed it: entries live in a namespace per
policy key (the adapter, or None), every operation passes ``valid`` (is the
batch's policy still the served one?) and checks it under the cache's lock, and
a reload drops the key's namespace under the same lock after swapping the
policy, so a batch still draining on the old weights can never store KV that
the new weights would read.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from boltstream.inference import transformers_internals
from boltstream.inference.decoding import DecodeState, Row, decode_cache
from boltstream.inference.radix_tree import PrefixTree

Payload = tuple[Any, ...]  # K0, V0, K1, V1, ...: each [kv_heads, tokens, head_dim]


def _nbytes(payload: Payload) -> int:
    return sum(t.nelement() * t.element_size() for t in payload)


def _split(payload: Payload, k: int) -> tuple[Payload, Payload]:
    return tuple(t[:, :k].clone() for t in payload), tuple(t[:, k:].clone() for t in payload)


class PrefixCache:
    """The tree, its lock and its counters; thread-safe (generation thread + reloads on the event loop)."""

    def __init__(self, budget_bytes: int) -> None:
        self.enabled = budget_bytes > 0
        self._tree: PrefixTree[Payload] = PrefixTree(budget_bytes, _nbytes, _split)
        self._lock = threading.Lock()
        self.hits = 0  # prompts that found a stored prefix
        self.misses = 0  # prompts that found none
        self.tokens_computed = 0  # prompt tokens run through the model in prefills
        self.tokens_saved = 0  # prompt tokens whose KV was reused instead (stored, or another choice's)

    def stats(self) -> dict[str, int]:
        """Counters and sizes, read at each metrics scrape."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "tokens_computed": self.tokens_computed,
                    "tokens_saved": self.tokens_saved, "bytes": self._tree.bytes, "tokens": self._tree.tokens,
                    "evictions": self._tree.evictions, "budget_bytes": self._tree.budget_bytes}

    def lookup(self, namespace: Hashable, tokens: Sequence[int], valid: Callable[[], bool]) -> tuple[int, Any]:
        """``(m, past)``: the longest stored prefix of ``tokens`` leaving the last one out, as a KV list
        (``[1, kv_heads, m, head_dim]`` per layer), or ``(0, None)``."""
        import torch

        with self._lock:
            path = self._tree.lookup(namespace, tokens, len(tokens) - 1) if valid() else []
            m = sum(k for _, k in path)
            self.hits += bool(m)
            self.misses += not m
            if not m:
                return 0, None
            flat = [torch.cat([p[i][:, :k] for p, k in path], dim=1).unsqueeze(0) for i in range(len(path[0][0]))]
        return m, list(zip(flat[0::2], flat[1::2], strict=True))

    def insert_row(self, namespace: Hashable, tokens: Sequence[int], layers: transformers_internals.KV, row: int,
                   valid: Callable[[], bool]) -> None:
        """Store ``tokens`` whose KV is the last ``len(tokens)`` positions of batch row ``row`` of ``layers``
        (left padding before them); only the part not stored yet is copied."""
        total = layers[0][0].shape[2]
        offset = total - len(tokens)
        if offset < 0:
            raise ValueError(f"{len(tokens)} tokens but only {total} cached positions")

        def make(start: int, end: int) -> Payload:
            return tuple(t[row, :, offset + start:offset + end].clone() for kv in layers for t in kv)

        with self._lock:
            if valid():
                self._tree.insert(namespace, tokens, make)

    def drop(self, namespace: Hashable) -> None:
        """Forget a policy's KV (its weights changed)."""
        with self._lock:
            self._tree.drop(namespace)

    def count(self, computed: int, saved: int) -> None:
        with self._lock:
            self.tokens_computed += computed
            self.tokens_saved += saved


# A prefill batches the prompts whose uncached suffixes differ by at most this many tokens: a shorter
# suffix is padded to the longest by recomputing that many of its cached tokens (rounding aside, the
# same KV), which costs less than another pass over the weights (~50 tokens' worth for SmolLM2 on CPU).
RECOMPUTE_SLACK = 64


def prefill(model: Any, rows: list[Row], device: Any, cache: PrefixCache, namespace: Hashable,
            valid: Callable[[], bool]) -> DecodeState:
    """:func:`~boltstream.inference.decoding.prefill` of ``rows``, reusing and storing prompt KV: each
    :class:`Block` of :func:`plan` is one forward of the model."""
    return prefill_blocks(model, rows, plan(rows, cache, namespace, valid), device, cache, namespace, valid)


def prefill_blocks(model: Any, rows: list[Row], blocks: list[Block], device: Any, cache: PrefixCache,
                   namespace: Hashable, valid: Callable[[], bool]) -> DecodeState:
    """The decode state of ``rows`` after one forward of the model per block of their :func:`plan`."""
    done: Done = {}
    for block in blocks:
        out = model(input_ids=block.ids.to(device), attention_mask=block.mask.to(device),
                    position_ids=block.positions.to(device),
                    past_key_values=transformers_internals.make_cache(block.past) if block.past else None, use_cache=True,
                    logits_to_keep=1)
        record(block, transformers_internals.layers_of(out.past_key_values), out.logits[:, -1, :].float(), cache, namespace,
               valid, done)
    return assemble(model, rows, done, device)


Found = tuple[Any, int, Any]  # (request, tokens found in the cache, their KV or None)
Done = dict[bytes, tuple[transformers_internals.KV, Any]]  # prompt -> (its KV, its next-token logits)


@dataclass
class Block:
    """One left-padded forward over a group of prompts and their cached KV.

    Every row feeds its prompt's last ``S`` tokens (``S``: the group's longest uncached
    remainder; a shorter prompt is left-padded) after the cached KV of the tokens before
    them, the pasts left-padded to a common length ``P``: each row's tokens stay contiguous
    at the right, as in a decode state."""

    requests: list[Any]
    kept: list[int]  # cached tokens each row attends to (the rest of its prompt is in the block)
    ids: Any  # [G, S] token ids, 0 where padded
    mask: Any  # [G, P + S] 1 = a real token
    positions: Any  # [G, S]
    past: transformers_internals.KV | None  # [G, kv_heads, P, head_dim] per layer, or None when P = 0


def plan(rows: list[Row], cache: PrefixCache, namespace: Hashable, valid: Callable[[], bool]) -> list[Block]:
    """The forwards that prefill ``rows``: each distinct prompt once (a request's ``n`` choices and identical
    requests share it), looked up in ``cache``, grouped by what is left to compute (:data:`RECOMPUTE_SLACK`)."""
    distinct = list({r.request.prompt_ids.tobytes(): r.request for r in rows}.values())
    found = [(req, *cache.lookup(namespace, req.prompt_ids, valid)) for req in distinct]
    cache.count(0, sum(len(r.request.prompt_ids) for r in rows) - sum(len(q.prompt_ids) for q in distinct))
    return [_block(group) for group in _groups(found)]


def record(block: Block, layers: transformers_internals.KV, logits: Any, cache: PrefixCache, namespace: Hashable,
           valid: Callable[[], bool], done: Done) -> None:
    """Store what ``block``'s forward computed (``layers``: ``[G, kv_heads, P + S, head_dim]``, ``logits``:
    ``[G, vocab]``) in ``cache`` and ``done``, per request."""
    for g, (req, keep) in enumerate(zip(block.requests, block.kept, strict=True)):
        n = len(req.prompt_ids)
        mine = [(k[g:g + 1, :, -n:], v[g:g + 1, :, -n:]) for k, v in layers]
        cache.insert_row(namespace, req.prompt_ids, mine, 0, valid)
        cache.count(n - keep, keep)
        done[req.prompt_ids.tobytes()] = (mine, logits[g:g + 1])


def assemble(model: Any, rows: list[Row], done: Done, device: Any) -> DecodeState:
    """The decode state of ``rows`` from their prompts' KV and logits, left-padded to a common length."""
    import torch
    import torch.nn.functional as F

    width = max(len(r.request.prompt_ids) for r in rows)
    pads = [width - len(r.request.prompt_ids) for r in rows]
    per_row = [done[r.request.prompt_ids.tobytes()][0] for r in rows]
    data = [(torch.cat([F.pad(kv[i][0], (0, 0, p, 0)) for kv, p in zip(per_row, pads, strict=True)]),
             torch.cat([F.pad(kv[i][1], (0, 0, p, 0)) for kv, p in zip(per_row, pads, strict=True)]))
            for i in range(len(per_row[0]))]
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for j, p in enumerate(pads):
        mask[j, p:] = 1
    positions = torch.tensor([[len(r.request.prompt_ids) - 1] for r in rows], device=device)
    logits = torch.cat([done[r.request.prompt_ids.tobytes()][1] for r in rows])
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device)
    return DecodeState(rows, decode_cache(model, data), mask, positions, logits, temps)


def _groups(found: list[Found]) -> list[list[Found]]:
    """``found`` in groups whose uncached suffixes are at most :data:`RECOMPUTE_SLACK` tokens shorter than
    the group's longest (longest first)."""
    order = sorted(found, key=lambda f: len(f[0].prompt_ids) - f[1], reverse=True)
    groups: list[list[Found]] = []
    for item in order:
        suffix = len(item[0].prompt_ids) - item[1]
        if groups and len(groups[-1][0][0].prompt_ids) - groups[-1][0][1] - suffix <= RECOMPUTE_SLACK:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _block(group: list[Found]) -> Block:
    """The :class:`Block` of ``group``."""
    import torch

    width = max(len(req.prompt_ids) - m for req, m, _ in group)
    kept = [max(len(req.prompt_ids) - width, 0) for req, _, _ in group]
    past_len = max(kept)
    ids = torch.zeros((len(group), width), dtype=torch.long)
    mask = torch.zeros((len(group), past_len + width), dtype=torch.long)
    positions = torch.zeros((len(group), width), dtype=torch.long)
    for g, ((req, _, _), keep) in enumerate(zip(group, kept, strict=True)):
        prompt = req.prompt_ids
        block = prompt[keep:]
        ids[g, width - len(block):] = (torch.frombuffer(block, dtype=torch.int32) if isinstance(block, array)
                                       else torch.tensor(list(block)))
        positions[g, width - len(block):] = torch.arange(keep, len(prompt))
        mask[g, past_len - keep:] = 1
        mask[g, past_len:past_len + width - len(block)] = 0  # a prompt shorter than the block: left padding
    past = None
    if past_len:
        past = []
        for i, (k0, _) in enumerate(next(p for _, _, p in group if p is not None)):
            shape = (len(group), k0.shape[1], past_len, k0.shape[3])
            keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
            for g, ((_, _, p), keep) in enumerate(zip(group, kept, strict=True)):
                if keep:
                    keys[g, :, past_len - keep:] = p[i][0][0, :, :keep]
                    values[g, :, past_len - keep:] = p[i][1][0, :, :keep]
            past.append((keys, values))
    return Block([req for req, _, _ in group], kept, ids, mask, positions, past)
