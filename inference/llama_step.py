"""One decode step of a Llama-shaped model in plain torch, over a preallocated KV buffer.

Why not the model's own forward: at a decode step (one new token per row) the
Hugging Face forward spends most of its time outside the matrix products that
must read the weights. Measured on SmolLM2-135M, float32, batch 16, 300 tokens
of context, 2 threads: 128 ms a step, of which ``torch.cat`` growing the
``DynamicCache`` by one column (a copy of the whole cache every step) 45 ms and
the attention call with its mask 16 ms. Here:

* keys/values live in a :class:`KVBuffer` with room to grow: a step writes one
  column in place; joining rows are written into free rows (and free columns on the left when
  their context is longer), leaving rows (:meth:`KVBuffer.select`) are copied over;
* q/k/v and gate/up are each one matrix product over weights concatenated once
  per model (:class:`LlamaStep`);
* attention of one query per row is one ``scaled_dot_product_attention`` call
  whose "query positions" are the query heads sharing a key/value head (no
  ``repeat_kv`` copy);
* every product reads a copy of its weight packed once per model object
  (:mod:`.torch_internals`): in oneDNN's layout, for any row count (bfloat16; float32
  off Intel CPUs); in float32 on an Intel CPU MKL's, for exactly 16 or 32 rows
  (:data:`PACK_ROWS`), so a step of :data:`PACK_MIN_ROWS` rows or more runs as the next
  of them (the rows added are dropped, and attend to nothing).

What it relies on (checked by :func:`probe`, which runs a step against the
model's own forward and refuses on any difference): a ``LlamaForCausalLM``-like
module tree (``model.embed_tokens``, ``model.layers[i].{input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj,
mlp.act_fn}``, ``model.norm``, ``model.rotary_emb(x, position_ids) -> (cos,
sin)``, ``lm_head``) with no projection biases, no sliding window and plain
``nn.Linear`` layers (a PEFT model with adapter slots takes the model's own
forward). Models that fail the probe decode through their own forward.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from boltstream.inference import torch_internals

log = logging.getLogger(__name__)

# Free columns allocated after the filled ones when a buffer is (re)built: a step that finds none left copies
# the buffer into one this much longer.
GROWTH = 128
# Free columns kept before the filled ones: a joining request whose context is longer than the running
# rows' takes them (the running rows gain left padding) instead of a copy of every row.
LEFT_ROOM = 128
# Free rows kept after the used ones: a joining request is written into them, the running rows stay put.
ROW_ROOM = 8
# Row counts float32 products use packed weights for: a step of PACK_MIN_ROWS rows or more runs as the
# next of them (16 rows packed cost what 8 did unpacked: benchmarks/bench_serving.py); below
# PACK_MIN_ROWS, MKL reads the weights in place anyway. The worker decodes at most 32 rows by default.
PACK_ROWS = (16, 32)
PACK_MIN_ROWS = 4


@dataclass
class KVBuffer:
    """Keys and values of every layer, ``[row capacity, kv_heads, column capacity, head_dim]`` each.

    Rows ``[0, rows)`` are the batch's, in order; columns ``[start, start + length)`` are filled, every
    row left-padded to that common length as the decode state's mask says. A decode step writes column
    ``start + length``. Free rows below and free columns on both sides let requests join without
    moving the rows already there; only leaving rows (:meth:`select`) and a full buffer copy."""

    keys: list[Any]
    values: list[Any]
    rows: int
    start: int
    length: int

    @classmethod
    def from_layers(cls, layers: list[tuple[Any, Any]], room: int | None = None, left: int | None = None,
                    spare_rows: int | None = None) -> KVBuffer:
        """A buffer holding ``layers`` (``(keys, values)`` per layer, ``[batch, kv_heads, seq, head_dim]``)
        with ``spare_rows`` free rows below them and ``left`` / ``room`` free columns before / after
        (default :data:`ROW_ROOM`, :data:`LEFT_ROOM`, :data:`GROWTH`)."""
        import torch

        room = GROWTH if room is None else room
        left = LEFT_ROOM if left is None else left
        spare_rows = ROW_ROOM if spare_rows is None else spare_rows
        rows, h, length, d = layers[0][0].shape
        keys, values = [], []
        for k, v in layers:
            kb = torch.empty((rows + spare_rows, h, left + length + room, d), dtype=k.dtype, device=k.device)
            vb = torch.empty_like(kb)
            kb[:rows, :, left:left + length] = k
            vb[:rows, :, left:left + length] = v
            keys.append(kb)
            values.append(vb)
        return cls(keys, values, rows, left, length)

    @property
    def capacity(self) -> int:
        """Columns after ``start`` (filled or free)."""
        return int(self.keys[0].shape[2]) - self.start

    @property
    def end(self) -> int:
        """The column the next step writes."""
        return self.start + self.length

    def layers(self) -> list[tuple[Any, Any]]:
        """Views of the filled part, ``(keys, values)`` per layer, ``[rows, kv_heads, length, head_dim]``."""
        r, s, e = self.rows, self.start, self.end
        return [(k[:r, :, s:e], v[:r, :, s:e]) for k, v in zip(self.keys, self.values, strict=True)]

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` more columns (a copy into a longer buffer when full)."""
        if self.length + columns > self.capacity:
            self._rebuild(room=max(columns, GROWTH))

    def select(self, rows: Any) -> None:
        """Keep only the batch rows at ``rows`` (an index tensor), in place."""
        n, s, e = int(rows.shape[0]), self.start, self.end
        for t in (*self.keys, *self.values):
            t[:n, :, s:e] = t[:self.rows, :, s:e].index_select(0, rows)
        self.rows = n

    def append(self, layers: list[tuple[Any, Any]], into: Sequence[int] = ()) -> tuple[int, int]:
        """Add the rows of ``layers`` (``(keys, values)`` per layer): the first ones into the rows at
        ``into`` (rows whose sequences finished), the rest below the batch's; both sides left-padded to
        the longer. Returns the pad columns ``(running rows, new rows)`` got. Copies only the new rows
        while free rows and columns last."""
        n, width = layers[0][0].shape[0], layers[0][0].shape[2]
        into = list(into)[:n]
        below = n - len(into)
        pad_a, pad_b = max(0, width - self.length), max(0, self.length - width)
        if self.rows + below > self.keys[0].shape[0] or pad_a > self.start:
            self._rebuild(room=GROWTH, left=max(LEFT_ROOM, pad_a), spare_rows=max(ROW_ROOM, below))  # a copy
        r, s = self.rows, self.start - pad_a
        targets = [*into, *range(r, r + below)]
        for t in (*self.keys, *self.values):
            t[:r, :, s:self.start].zero_()  # padding is attended with weight 0: it must not be NaN
        for (kb, vb), k, v in zip(layers, self.keys, self.values, strict=True):
            for buf, src in ((k, kb), (v, vb)):
                for i, row in enumerate(targets):
                    buf[row, :, s:s + pad_b].zero_()
                    buf[row, :, s + pad_b:s + pad_b + width] = src[i]
        self.rows, self.start, self.length = r + below, s, self.length + pad_a
        return pad_a, pad_b

    def _rebuild(self, room: int, left: int | None = None, spare_rows: int | None = None) -> None:
        fresh = KVBuffer.from_layers(self.layers(), room, left, spare_rows)
        self.keys, self.values, self.rows, self.start = fresh.keys, fresh.values, fresh.rows, fresh.start


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Product:
    """``x @ weight.T`` (plus ``residual``) on a packed copy of the weight (:mod:`.torch_internals`):
    "onednn" for any row count; "mkl" (float32) for the row counts of :data:`PACK_ROWS`,
    each packed on its first use (memory only for the counts a worker meets), ``F.linear`` /
    ``addmm`` on the weight itself for other counts or without packing."""

    __slots__ = ("weight", "packing", "packs")

    def __init__(self, weight: Any, packing: str | None) -> None:
        self.weight = weight
        self.packing = packing
        # row count -> packed copy ("onednn": one copy, under 0, for every count)
        self.packs: dict[int, Any] = {0: torch_internals.pack(weight, "onednn")} if packing == "onednn" else {}

    def repack(self) -> None:
        """Pack the weight again, for the row counts packed so far (after it changed in place)."""
        self.packs = {rows: torch_internals.pack(self.weight, self.packing, rows) for rows in self.packs}

    def __call__(self, x: Any, residual: Any = None) -> Any:
        import torch
        import torch.nn.functional as F

        rows = int(x.shape[0])
        if self.packing == "onednn":
            out = torch_internals.onednn_linear(x, self.packs[0])
        elif self.packing == "mkl" and rows in PACK_ROWS:
            packed = self.packs.get(rows)
            if packed is None:
                packed = self.packs[rows] = torch_internals.pack(self.weight, "mkl", rows)
            out = torch_internals.mkl_linear(x, packed, self.weight, rows)
        elif residual is None:
            return F.linear(x, self.weight)
        else:
            return torch.addmm(residual, x, self.weight.t())
        return out if residual is None else out.add_(residual)


class LlamaStep:
    """The step for one model object: its modules and fused weights (built once, kept while it lives)."""

    def __init__(self, model: Any, packing: bool | str = True) -> None:
        """``packing``: True, this CPU's packing for the model's dtype (:func:`.torch_internals.packing_for`);
        "mkl" or "onednn", that one; False, products on the weights themselves (benchmarks compare)."""
        import torch

        inner = model.model
        cfg = model.config
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.scaling = float(attn.scaling)
        self.act = self.layers[0].mlp.act_fn
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        self.splits = (q_out, kv_out, kv_out)
        self.intermediate = int(self.layers[0].mlp.gate_proj.weight.shape[0])
        kind = torch_internals.packing_for(model.lm_head.weight.dtype) if packing is True else packing or None
        self.packing = kind
        self.pack_rows = PACK_ROWS if kind == "mkl" else ()
        self.min_rows = PACK_MIN_ROWS
        with torch.no_grad():
            self.qkv = [_Product(torch.cat([la.self_attn.q_proj.weight, la.self_attn.k_proj.weight,
                                            la.self_attn.v_proj.weight]).contiguous(), kind) for la in self.layers]
            self.gate_up = [_Product(torch.cat([la.mlp.gate_proj.weight, la.mlp.up_proj.weight]).contiguous(), kind)
                            for la in self.layers]
            self.o = [_Product(la.self_attn.o_proj.weight, kind) for la in self.layers]
            self.down = [_Product(la.mlp.down_proj.weight, kind) for la in self.layers]
            self.lm_head = _Product(model.lm_head.weight, kind)
        # norms' epsilons as the modules keep them
        self.eps = [(_eps(la.input_layernorm), _eps(la.post_attention_layernorm)) for la in self.layers]
        self.norm_shape = (int(cfg.hidden_size),)

    def refresh(self) -> None:
        """Take the model's weights again after they changed in place (a LoRA adapter merged into a
        model object that served an earlier version, :mod:`.lora_merge`): the fused and the packed
        copies. The probe that admitted the model still holds: its modules are the same ones."""
        import torch

        with torch.inference_mode():  # the step's copies were made in it (the probe runs there)
            for layer, qkv, gate_up in zip(self.layers, self.qkv, self.gate_up, strict=True):
                a, m = layer.self_attn, layer.mlp
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=qkv.weight)
                torch.cat([m.gate_proj.weight, m.up_proj.weight], out=gate_up.weight)
            for product in (*self.qkv, *self.gate_up, *self.o, *self.down, self.lm_head):
                product.repack()

    def __call__(self, ids: Any, positions: Any, mask: Any, kv: KVBuffer, block: Any = None) -> Any:
        """Logits (float32, ``[batch, vocab]``) after feeding ``ids`` (``[batch]``) at ``positions``
        (``[batch, 1]``); ``mask`` (``[batch, kv.length + 1]``, 1 = real token) covers the new column,
        which this step writes into ``kv``.

        With ``block`` (a :class:`~boltstream.inference.prefix_cache.Block`: ``G`` prompts of ``S`` new
        tokens each after a past of ``P``), the same pass over the weights also prefills it: returns
        ``(logits, block_logits [G, vocab], block_layers)``, the latter ``(keys, values)`` per layer of
        ``[G, kv_heads, P + S, head_dim]``. Requests that join a running batch cost no pass of their own."""
        import torch
        import torch.nn.functional as F

        kv.reserve(1)
        start, col = kv.start, kv.end
        rows = ids.shape[0]
        group = self.heads // self.kv_heads
        visible = (mask != 0).view(rows, 1, 1, -1)  # left padding is never attended to
        feed, where = ids, positions.view(-1)
        # rows the products see: padded up to a packed count (the extra rows attend to nothing)
        padded = next((n for n in self.pack_rows if n >= rows), rows) \
            if block is None and rows >= self.min_rows else rows
        if padded > rows:
            feed, where = F.pad(feed, (0, padded - rows)), F.pad(where, (0, padded - rows))
            attended = torch.zeros((padded, self.heads * self.head_dim), dtype=self.lm_head.weight.dtype,
                                   device=ids.device)
        if block is not None:
            g, width = block.ids.shape
            feed = torch.cat([ids, block.ids.reshape(-1).to(ids.device)])
            where = torch.cat([where, block.positions.reshape(-1).to(ids.device)])
            allowed = _block_mask(block.mask.to(ids.device), width)
            block_layers: list[tuple[Any, Any]] = []
        x = self.embed(feed)  # [N, H]: the running rows' tokens, then the block's
        cos, sin = self.rotary(x.unsqueeze(0), where.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, head_dim]

        def attend(i: int, q: Any, k: Any, v: Any) -> Any:
            keys, values = kv.keys[i][:rows], kv.values[i][:rows]
            keys[:, :, col] = k[:rows]
            values[:, :, col] = v[:rows]
            # the query heads of one key/value head attend together, as a query of `group` positions
            qg = q[:rows].view(rows, self.kv_heads, group, self.head_dim)
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, keys[:, :, start:col + 1], values[:, :, start:col + 1], attn_mask=visible,
                scale=self.scaling)
            out = out.reshape(rows, -1)
            if padded > rows:
                attended[:rows] = out
                return attended
            if block is None:
                return out
            bq, bk, bv = (t[rows:].view(g, width, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            if block.past is not None:
                bk = torch.cat([block.past[i][0], bk], dim=2)
                bv = torch.cat([block.past[i][1], bv], dim=2)
            block_layers.append((bk, bv))
            bout = torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, attn_mask=allowed,
                                                                    scale=self.scaling, enable_gqa=True)
            return torch.cat([out, bout.transpose(1, 2).reshape(g * width, -1)])

        x = self._layers(x, cos, sin, attend)
        kv.length += 1
        if block is None:
            return self.lm_head(self.norm(x))[:rows].float()
        last = torch.cat([x[:rows], x[rows + width - 1::width]])  # each block row's last position
        logits = self.lm_head(self.norm(last)).float()
        return logits[:rows], logits[rows:], block_layers

    def _layers(self, x: Any, cos: Any, sin: Any, attend: Any) -> Any:
        """The decoder layers over token rows ``x`` (``[N, H]``); ``attend(layer, q, k, v)`` (``[N, heads,
        head_dim]``, rotated) returns the attention output ``[N, heads * head_dim]``.

        A decode step is a few hundred small operations, each paying torch's dispatch: the norms are one
        ``rms_norm`` call each, the rotation turns q and k together (they sit side by side in the fused
        product), and each residual is added to its product's output in place (or in ``addmm``)."""
        import torch.nn.functional as F

        q_out, kv_out, _ = self.splits
        heads_qk = self.heads + self.kv_heads
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, self.norm_shape, layer.input_layernorm.weight, self.eps[i][0])
            qkv = self.qkv[i](h)
            qk = qkv[:, :q_out + kv_out].view(-1, heads_qk, self.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            v = qkv[:, q_out + kv_out:].view(-1, self.kv_heads, self.head_dim)
            x = self.o[i](attend(i, q, k, v), residual=x)
            h = F.rms_norm(x, self.norm_shape, layer.post_attention_layernorm.weight, self.eps[i][1])
            gate, up = self.gate_up[i](h).split(self.intermediate, dim=-1)
            x = self.down[i](self.act(gate) * up, residual=x)
        return x


def _eps(norm: Any) -> float:
    """An RMS norm module's epsilon (``variance_epsilon`` in Llama's, ``eps`` in torch's)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _block_mask(mask: Any, width: int) -> Any:
    """``[G, 1, S, P + S]`` booleans: a block position sees the real tokens up to itself; a padding
    position sees itself only (some attention kernels return NaN for a query that sees nothing, and
    NaN times a probability of 0 would still reach the real rows through the values)."""
    import torch

    total = mask.shape[1]
    key = torch.arange(total, device=mask.device)
    query = torch.arange(total - width, total, device=mask.device)
    causal = key.view(1, -1) <= query.view(-1, 1)  # [S, P + S]
    allowed = causal.unsqueeze(0) & (mask != 0).unsqueeze(1)
    allowed |= (key.view(1, -1) == query.view(-1, 1)).unsqueeze(0)
    return allowed.unsqueeze(1)


_steps: weakref.WeakKeyDictionary[Any, LlamaStep | None] = weakref.WeakKeyDictionary()


def _shape_problem(model: Any) -> str | None:
    """Why ``model`` is not Llama-shaped as :class:`LlamaStep` needs, or None."""
    import torch

    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or inner is None or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no .model/.lm_head"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"{type(inner).__name__} has no .{name}"
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "sliding-window attention or projection biases"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mods += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear or m.bias is not None for m in mods):
            return "projections are not plain bias-free nn.Linear layers (adapters injected?)"
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head.bias is not None:
        return "lm_head is not a plain bias-free nn.Linear layer"
    return None


def probe(model: Any) -> str | None:
    """None if :class:`LlamaStep` reproduces ``model``'s own decode step on it, else the reason it does not."""
    return _probed(model)[1]


def _probed(model: Any) -> tuple[LlamaStep | None, str | None]:
    """``(the step it checked, None)`` if :class:`LlamaStep` reproduces ``model``'s own decode step on it,
    else ``(None, the reason)``.

    Runs a 2-row, left-padded prompt through the model, then one step both ways (the
    plain-torch one as 2 rows and padded to the packed row count), and compares the
    logits (relative to their scale, 1e-4 in float32; bf16/fp16
    weights round differently in the two orders of operations: 5e-2)."""
    import torch

    from boltstream.inference import transformers_internals

    problem = _shape_problem(model)
    if problem is not None:
        return None, problem
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]], device=device) % model.config.vocab_size
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.tensor([[31], [32]], device=device)
    mask2 = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            layers = transformers_internals.layers_of(out.past_key_values)
            ref = model(input_ids=nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1,
                        past_key_values=out.past_key_values, use_cache=True).logits[:, -1].float()
            step = LlamaStep(model)
            got = []
            for min_rows in (step.min_rows, 1):  # as 2 rows, then padded to the packed count (if any)
                step.min_rows = min_rows
                got.append(step(nxt[:, 0], pos[:, -1:] + 1, mask2, KVBuffer.from_layers(layers)))
            step.min_rows = PACK_MIN_ROWS
    except Exception as exc:  # any shape or API mismatch: the model's own forward serves
        return None, f"the step failed on this model: {type(exc).__name__}: {exc}"
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    err = max(float((g - ref).abs().max() / ref.abs().max().clamp(min=1e-6)) for g in got)
    if not err <= tol:
        return None, f"the step's logits differ from the model's forward by {err:.2e} (relative; bound {tol:g})"
    return step, None


def refresh(model: Any) -> None:
    """After ``model``'s weights changed in place: its step (if it has one) takes them again."""
    step = _steps.get(model)
    if step is not None:
        step.refresh()


def step_for(model: Any) -> LlamaStep | None:
    """The :class:`LlamaStep` of ``model`` (probed and built once per model object), or None when the
    model must decode through its own forward (the reason is logged once)."""
    if model in _steps:
        return _steps[model]
    step, problem = _probed(model)  # the checked step serves: its weights are fused and packed once
    if problem is None:
        log.info("decode steps run as plain torch over a preallocated KV buffer (%s; products on %s)",
                 type(model).__name__, f"{step.packing}-packed weights" if step.packing else "the weights")
    else:
        log.info("decode steps run through the model's own forward: %s", problem)
    _steps[model] = step
    return step
