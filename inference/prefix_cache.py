"""The prefix cache of the transformers engine: KV of token prefixes reused across requests.

Why: an agent's calls repeat most of their prompt. The calculator demo's system
prompt and worked example are the same in every call, a group's attempts share
the question, and an agent's second call starts with its whole first call
(prompt, response, tool result). Prefilling only what is new saves most of the
prefill compute.

How: a :class:`~boltstream.inference.prefix_tree.PrefixTree` maps token ids to
per-layer key/value tensors (``[kv_heads, tokens, head_dim]`` per layer, K and V,
cloned so they never pin a batch's cache). :func:`prefill` runs each distinct
prompt of a batch alone: the longest stored prefix (never the last prompt token,
whose logits start the sampling) becomes the past, only the rest runs through
the model (positions continuing after the prefix), and the prompt's KV is stored
for the next request. The rows are then left-padded into one
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
from typing import Any

from boltstream.inference import kv_cache
from boltstream.inference.decoding import DecodeState, Row, decode_cache
from boltstream.inference.prefix_tree import PrefixTree

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

    def insert_row(self, namespace: Hashable, tokens: Sequence[int], layers: kv_cache.KV, row: int,
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


def prefill(model: Any, rows: list[Row], device: Any, cache: PrefixCache, namespace: Hashable,
            valid: Callable[[], bool]) -> DecodeState:
    """:func:`~boltstream.inference.decoding.prefill` of ``rows``, reusing and storing prompt KV."""
    import torch
    import torch.nn.functional as F

    done: dict[int, tuple[kv_cache.KV, Any]] = {}  # id(request) -> (its prompt's KV, its next-token logits)
    for r in rows:
        req = r.request
        prompt = req.prompt_ids
        if id(req) in done:
            cache.count(0, len(prompt))  # another choice of the same request: computed once
            continue
        m, past = cache.lookup(namespace, prompt, valid)
        suffix = prompt[m:]
        ids = (torch.frombuffer(suffix, dtype=torch.int32) if isinstance(suffix, array) and len(suffix)
               else torch.tensor(list(suffix), dtype=torch.long)).to(torch.long).unsqueeze(0).to(device)
        positions = torch.arange(m, len(prompt), device=device).unsqueeze(0)
        mask = torch.ones((1, len(prompt)), dtype=torch.long, device=device)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=kv_cache.make_cache(past) if past else None, use_cache=True, logits_to_keep=1)
        layers = kv_cache.layers_of(out.past_key_values)
        cache.insert_row(namespace, prompt, layers, 0, valid)
        cache.count(len(prompt) - m, m)
        done[id(req)] = (layers, out.logits[:, -1, :].float())
    width = max(len(r.request.prompt_ids) for r in rows)
    pads = [width - len(r.request.prompt_ids) for r in rows]
    per_row = [done[id(r.request)][0] for r in rows]
    data = [(torch.cat([F.pad(kv[i][0], (0, 0, p, 0)) for kv, p in zip(per_row, pads, strict=True)]),
             torch.cat([F.pad(kv[i][1], (0, 0, p, 0)) for kv, p in zip(per_row, pads, strict=True)]))
            for i in range(len(per_row[0]))]
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for j, p in enumerate(pads):
        mask[j, p:] = 1
    positions = torch.tensor([[len(r.request.prompt_ids) - 1] for r in rows], device=device)
    logits = torch.cat([done[id(r.request)][1] for r in rows])
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device)
    return DecodeState(rows, decode_cache(model, data), mask, positions, logits, temps)
