"""The plain-torch decode step equals the model's own forward: step by step, across rows that
leave and join, past a buffer's growth, and through the whole engine's sampling."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from boltstream.inference import decoding, llama_step
from boltstream.inference.backend import SamplingParams
from boltstream.inference.llama_step import KVBuffer
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import tiny_llama, tiny_model_and_tokenizer


def rows_for(prompts: list[list[int]]) -> list[decoding.Row]:
    from array import array

    reqs = [SimpleNamespace(prompt_ids=array("i", p), params=SamplingParams(temperature=1.0, max_tokens=64, seed=i))
            for i, p in enumerate(prompts)]
    return decoding.make_rows(reqs)


def run(model: Any, feed: list[list[int]], steps: int, monkeypatch: pytest.MonkeyPatch, fast: bool) -> list[Any]:
    """Logits of every step: prefill 2 rows, decode, one row leaves, a third joins, decode on."""
    llama_step._steps.pop(model, None)
    if not fast:
        monkeypatch.setattr(llama_step, "step_for", lambda m: None)
    out = []
    with torch.inference_mode():
        state = decoding.prefill(model, rows_for(feed[:2]), 0, "cpu")
        assert isinstance(state.cache, KVBuffer) == fast
        for i in range(steps):
            for j, row in enumerate(state.rows):
                row.ids.append(int(state.logits[j].argmax()))
            if i == 3:
                state = decoding.select(state, [1])
            if i == 5:
                state = decoding.join(state, decoding.prefill(model, rows_for(feed[2:]), 0, "cpu"))
                for row in state.rows[1:]:
                    row.ids.append(int(state.logits[-1].argmax()))
            decoding.advance(model, state)
            out.append(state.logits.clone())
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("growth", [128, 2])
def test_steps_equal_the_models_forward_across_leaves_joins_and_growth(monkeypatch: pytest.MonkeyPatch,
                                                                         growth: int) -> None:
    model, _ = tiny_model_and_tokenizer(0)
    monkeypatch.setattr(llama_step, "GROWTH", growth)
    feed = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    fast = run(model, feed, 12, monkeypatch, fast=True)
    monkeypatch.setattr(llama_step, "GROWTH", growth)
    plain = run(model, feed, 12, monkeypatch, fast=False)
    assert [f.shape for f in fast] == [p.shape for p in plain]
    for f, p in zip(fast, plain, strict=True):
        torch.testing.assert_close(f, p, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("packing", "multiplied"), [
    ("mkl", [32, 16]),  # 20 rows padded to 32, 6 to 16, 3 below the padding threshold: unpacked
    ("onednn", [20, 6, 3]),  # any row count from one layout, no padding
])
def test_float32_steps_multiply_on_packed_weights_and_equal_the_forward(
        monkeypatch: pytest.MonkeyPatch, packing: str, multiplied: list[int]) -> None:
    """20 rows, then 6, then 3, on the float32 packing the CPU would pick (forced to each in turn), each
    step's logits as the model's own forward gives them."""
    from boltstream.inference import torch_internals

    model, _ = tiny_model_and_tokenizer(0)
    assert next(model.parameters()).dtype == torch.float32
    monkeypatch.setattr(torch_internals, "float32_packing", lambda cpuinfo=None: packing)
    packed_rows: list[int] = []
    name = "mkl_linear" if packing == "mkl" else "onednn_linear"
    real = getattr(torch_internals, name)

    def counting(x: Any, *args: Any) -> Any:
        packed_rows.append(int(x.shape[0]))
        return real(x, *args)

    prompts = [[5 + i] * (3 + i % 7) for i in range(20)]
    out = {}
    for fast in (True, False):
        llama_step._steps.pop(model, None)
        if fast:
            assert llama_step.step_for(model) is not None  # probed before counting
            assert llama_step.step_for(model).packing == packing
        with monkeypatch.context() as m:
            m.setattr(torch_internals, name, counting)
            if not fast:
                m.setattr(llama_step, "step_for", lambda model: None)
            logits = []
            with torch.inference_mode():
                state = decoding.prefill(model, rows_for(prompts), 0, "cpu")
                for keep in (list(range(20)), [0, 1, 2, 7, 11, 19], [0, 2, 4]):
                    state = decoding.select(state, keep) if len(keep) < len(state.rows) else state
                    for j, row in enumerate(state.rows):
                        row.ids.append(int(state.logits[j].argmax()))
                    decoding.advance(model, state)
                    logits.append(state.logits.clone())
            out[fast] = logits
    per_step = 4 * model.config.num_hidden_layers + 1  # 4 products a layer, and the head
    assert packed_rows == [n for n in multiplied for _ in range(per_step)], sorted(set(packed_rows))
    for f, p in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(f, p, atol=1e-5, rtol=1e-5)


def test_bfloat16_steps_multiply_on_onednn_packed_weights_and_match_the_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from boltstream.inference import torch_internals

    if not torch_internals.onednn_packs("bfloat16"):
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU (it needs avx512bw/vl/dq or avx_ne_convert)")
    model = tiny_model_and_tokenizer(0)[0].to(torch.bfloat16)
    rows: list[int] = []
    real = torch_internals.onednn_linear

    def counting(x: Any, packed: Any) -> Any:
        rows.append(int(x.shape[0]))
        return real(x, packed)

    monkeypatch.setattr(torch_internals, "onednn_linear", counting)
    assert llama_step.probe(model) is None  # the step's logits within bf16 rounding of the model's forward
    assert set(rows) == {2}, "the 2-row step did not multiply on packed weights (nor pad: bf16 needs none)"


def test_bfloat16_steps_multiply_with_f_linear_where_the_cpu_cannot_pack_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from boltstream.inference import torch_internals

    def refused(*_: Any) -> Any:
        raise AssertionError("a packed product on a CPU that cannot pack bfloat16 weights")

    monkeypatch.setattr(torch_internals, "onednn_packs", lambda dtype: dtype != "bfloat16")
    monkeypatch.setattr(torch_internals, "pack", refused)
    model = tiny_model_and_tokenizer(0)[0].to(torch.bfloat16)
    assert llama_step.probe(model) is None  # the step runs, within bf16 rounding of the model's forward


def test_the_probe_accepts_llama_and_refuses_what_it_cannot_reproduce() -> None:
    model, _ = tiny_model_and_tokenizer(0)
    assert llama_step.probe(model) is None
    biased = tiny_llama(attention_bias=True)
    assert "biases" in (llama_step.probe(biased) or "")
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny_model_and_tokenizer(0)[0], LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert llama_step.probe(peft) is not None


def test_a_step_that_computes_something_else_is_refused_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_model_and_tokenizer(0)
    monkeypatch.setattr(llama_step, "_rotate_half", lambda x: x)  # a wrong rotary embedding
    assert "differ" in (llama_step.probe(model) or "")


def test_the_engine_samples_the_same_tokens_and_logprobs_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = tiny_model_and_tokenizer(0)
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=7, n=3)

    async def serve() -> list[Any]:
        backend = TransformersBackend(model, tokenizer, model_name="tiny", max_batch_size=8)
        await backend.start()
        try:
            gens = await asyncio.gather(*(backend.generate(list(range(5, 5 + k)), params) for k in (3, 9, 4)))
        finally:
            await backend.stop()
        return [(list(c.token_ids), list(c.logprobs)) for g in gens for c in g.completions]

    llama_step._steps.pop(model, None)
    fast = asyncio.run(serve())
    assert llama_step._steps.get(model) is not None, "the engine did not take the plain-torch step"
    monkeypatch.setattr(llama_step, "step_for", lambda m: None)
    plain = asyncio.run(serve())
    assert [t for t, _ in fast] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(fast, plain, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_a_block_prefilled_in_the_decode_pass_equals_its_own_forward() -> None:
    """Joiners of different lengths, one with a cached prefix (recomputing part of it) and one shorter than
    the block (left-padded): logits and KV as the model's own forward gives them, the running rows' step
    unchanged."""
    from boltstream.inference import prefix_cache, transformers_internals

    model, _ = tiny_model_and_tokenizer(0)
    cache = prefix_cache.PrefixCache(64 << 20)
    with torch.inference_mode():
        prefix_cache.prefill(model, rows_for([[40, 41, 42, 43, 44, 45, 46, 47, 48]]), "cpu", cache, None, lambda: True)
        joiners = rows_for([[40, 41, 42, 43, 44, 45, 46, 47, 60, 61, 62], [70, 71], [80, 81, 82, 83, 84, 85, 86]])
        (block,) = prefix_cache.plan(joiners, cache, None, lambda: True)
        assert block.past is not None and block.mask[2, :block.mask.shape[1] - block.ids.shape[1]].sum() == 0

        def running() -> decoding.DecodeState:
            state = decoding.prefill(model, rows_for([[5, 6, 7], [8, 9, 10, 11, 12]]), 0, "cpu")
            for j, row in enumerate(state.rows):
                row.ids.append(int(state.logits[j].argmax()))
            return state

        merged = running()
        layers, logits = decoding.advance_and_prefill(model, merged, block)
        plain = running()
        decoding.advance(model, plain)
        out = model(input_ids=block.ids, attention_mask=block.mask, position_ids=block.positions,
                    past_key_values=transformers_internals.make_cache(block.past), use_cache=True, logits_to_keep=1)
    torch.testing.assert_close(merged.logits, plain.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, out.logits[:, -1].float(), atol=1e-5, rtol=1e-5)
    real = block.mask.bool()  # padded positions hold whatever they computed: only real tokens' KV counts
    for (k, v), (k2, v2) in zip(layers, transformers_internals.layers_of(out.past_key_values), strict=True):
        torch.testing.assert_close(k.permute(0, 2, 1, 3)[real], k2.permute(0, 2, 1, 3)[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.permute(0, 2, 1, 3)[real], v2.permute(0, 2, 1, 3)[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("left", "spare_rows"), [(128, 8), (0, 0)])  # in place, and after a rebuild
def test_appended_rows_are_the_parts_left_padded_with_zeros_one_under_the_other(
        monkeypatch: pytest.MonkeyPatch, left: int, spare_rows: int) -> None:
    monkeypatch.setattr(llama_step, "LEFT_ROOM", left)
    monkeypatch.setattr(llama_step, "ROW_ROOM", spare_rows)
    a = [(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)) for _ in range(2)]  # 2 rows of 4 columns
    b = [(torch.randn(1, 3, 6, 5), torch.randn(1, 3, 6, 5)) for _ in range(2)]  # 1 row of 6 columns
    c = [(torch.randn(2, 3, 3, 5), torch.randn(2, 3, 3, 5)) for _ in range(2)]  # 2 rows of 3 columns
    buf = KVBuffer.from_layers(a, room=3)
    kept = buf.keys[0]
    assert buf.append(b) == (2, 0) and buf.append(c) == (0, 3)
    assert (buf.keys[0] is kept) == (spare_rows > 0)  # free rows and columns: the running rows stayed put
    assert buf.rows == 5 and buf.length == 6
    pad = torch.nn.functional.pad
    for (k, v), (ka, va), (kb, vb), (kc, vc) in zip(buf.layers(), a, b, c, strict=True):
        assert torch.equal(k, torch.cat([pad(ka, (0, 0, 2, 0)), kb, pad(kc, (0, 0, 3, 0))]))
        assert torch.equal(v, torch.cat([pad(va, (0, 0, 2, 0)), vb, pad(vc, (0, 0, 3, 0))]))


def test_finished_rows_ride_along_until_a_quarter_of_the_batch_has_finished() -> None:
    model, _ = tiny_model_and_tokenizer(0)
    with torch.inference_mode():  # as the generation thread runs it: the buffer is narrowed in place
        state = decoding.prefill(model, rows_for([[5, 6, 7, 8 + i] for i in range(8)]), 0, "cpu")
        assert decoding.retire(state, [0, 1, 2, 3, 4, 5, 7]) is state  # 1 of 8 finished: kept, no copy
        keys = state.cache.layers()[0][0].clone()
        smaller = decoding.retire(state, [0, 1, 3, 4, 5, 7])  # 2 of 8: dropped
    assert smaller.rows == [state.rows[j] for j in (0, 1, 3, 4, 5, 7)]
    assert smaller.cache.rows == 6 and smaller.logits.shape[0] == 6
    torch.testing.assert_close(smaller.cache.layers()[0][0], keys[[0, 1, 3, 4, 5, 7]])


@pytest.mark.parametrize("longer", [False, True])  # the joiner's context shorter / longer than the batch's
def test_a_joiner_in_a_finished_rows_place_decodes_as_one_appended_below(longer: bool) -> None:
    model, _ = tiny_model_and_tokenizer(0)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    joiner = [[20, 21, 22, 23, 24, 25, 26, 27, 28]] if longer else [[20, 21]]
    out = {}
    with torch.inference_mode():
        for mode in ("reuse", "append"):
            state = decoding.prefill(model, rows_for(prompts), 0, "cpu")
            for j, row in enumerate(state.rows):
                row.ids.append(int(state.logits[j].argmax()))
            decoding.advance(model, state)
            for j, row in enumerate(state.rows):
                row.ids.append(int(state.logits[j].argmax()))
            new = decoding.prefill(model, rows_for(joiner), 0, "cpu")
            new.rows[0].ids.append(int(new.logits[0].argmax()))
            if mode == "reuse":  # row 1 finished: the joiner takes its place
                state = decoding.join(state, new, reuse=[1])
                order = [0, 2, 1]
            else:
                state = decoding.join(decoding.select(state, [0, 2]), new)
                order = [0, 1, 2]
            logits = []
            for _ in range(3):
                decoding.advance(model, state)
                logits.append(state.logits[order].clone())
                for j, row in enumerate(state.rows):
                    row.ids.append(int(state.logits[j].argmax()))
            out[mode] = logits
    for a, b in zip(out["reuse"], out["append"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
