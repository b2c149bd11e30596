"""The transformers engine: batching, the logprob convention, and weight swaps under load."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from boltstream.errors import CheckpointError
from boltstream.inference.backend import SamplingParams
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import save_model_dir, tiny_model_and_tokenizer

PROMPT = list(b"The quick brown fox")  # greedy on seeds 0-2 runs 200+ tokens without an end token


def _fresh(seed: int = 0, **kw: Any) -> TransformersBackend:
    model, tok = tiny_model_and_tokenizer(seed)
    return TransformersBackend(model, tok, model_name="tiny", max_batch_size=kw.pop("max_batch_size", 8), **kw)


async def _started(backend: TransformersBackend) -> TransformersBackend:
    await backend.start()
    return backend


def _reference_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """What a learner computes: log_softmax(logits / T) of each response token given its prefix."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.7, 0.9), (1.3, 1.0)])
async def test_logprobs_match_what_the_learner_recomputes(temperature: float, top_p: float) -> None:
    backend = await _started(_fresh())
    try:
        prompts = [PROMPT, PROMPT[:-5], list(b"a longer prompt that forces left padding")]
        gens = await asyncio.gather(*(backend.generate(p, SamplingParams(temperature, top_p, 12, seed=1, n=2))
                                      for p in prompts))
        for prompt, gen in zip(prompts, gens, strict=True):
            for c in gen.completions:
                ref = _reference_logprobs(backend._base, prompt, c.token_ids, temperature)
                assert c.logprobs == pytest.approx(ref, abs=2e-4)
    finally:
        await backend.stop()


async def test_concurrent_requests_share_batches() -> None:
    backend = await _started(_fresh())
    try:
        gens = await asyncio.gather(*(backend.generate(PROMPT, SamplingParams(1.0, 1.0, 6 + i, seed=i))
                                      for i in range(8)))
        assert backend.batches_run <= 2  # 8 requests, not 8 batches
        for i, g in enumerate(gens):
            c = g.completions[0]  # rows finish one a step; the finished ride along until retired, changing nothing
            assert c.logprobs == pytest.approx(_reference_logprobs(backend._base, PROMPT, c.token_ids, 1.0), abs=2e-4)
            if c.finish_reason == "length":
                assert len(c.token_ids) == 6 + i
            else:  # the random model sampled an end-of-turn token
                assert c.finish_reason == "stop" and c.token_ids[-1] in backend.stop_ids
        solo = await backend.generate(PROMPT, SamplingParams(1.0, 1.0, 9, seed=3))
        assert solo.completions[0].token_ids == gens[3].completions[0].token_ids  # seeded: batch-independent
    finally:
        await backend.stop()


async def _greedy(backend: TransformersBackend, n_tokens: int = 20) -> list[int]:
    ids = (await backend.generate(PROMPT, SamplingParams(0.0, 1.0, n_tokens))).completions[0].token_ids
    assert len(ids) == n_tokens  # a comparison of two early stops would prove nothing
    return ids.tolist()


async def test_full_reload_keeps_in_flight_requests_on_the_old_version(tmp_path: Path) -> None:
    v1_model, tok = tiny_model_and_tokenizer(1)
    save_model_dir(v1_model, tok, tmp_path / "v1")
    expected_v1 = await _greedy(await _started(ref := _fresh(1)))
    await ref.stop()
    backend = await _started(_fresh(0, max_batch_size=1))
    try:
        expected_v0 = await _greedy(backend)
        started = asyncio.Event()
        long = asyncio.create_task(backend.generate(PROMPT, SamplingParams(0.0, 1.0, 200),
                                                    on_token=lambda *a: started.set()))
        await started.wait()
        await backend.load_weights(tmp_path / "v1", "full", 1)
        assert backend.policy_version == 1
        old = await long
        assert old.policy_version == 0 and old.completions[0].token_ids[:20].tolist() == expected_v0
        new = await backend.generate(PROMPT, SamplingParams(0.0, 1.0, 20))
        assert new.policy_version == 1 and new.completions[0].token_ids.tolist() == expected_v1 != expected_v0
    finally:
        await backend.stop()


async def test_incomplete_full_checkpoint_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model, tok = tiny_model_and_tokenizer(2)
    save_model_dir(model, tok, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights.pop(next(k for k in weights if "layers.1" in k))
    save_file(weights, tmp_path / "model.safetensors")
    backend = await _started(_fresh())
    try:
        with pytest.raises(CheckpointError, match="missing_keys"):
            await backend.load_weights(tmp_path, "full", 5)
        assert backend.policy_version == 0
    finally:
        await backend.stop()


async def test_a_bfloat16_serving_copy_loads_into_the_workers_dtype(tmp_path: Path) -> None:
    from boltstream.learner.model_setup import save_weights

    model, tok = tiny_model_and_tokenizer(1)
    save_weights(model, tok, tmp_path / "v1", dtype="bfloat16")  # what `learn --publish-dtype bfloat16` writes
    rounded, _ = tiny_model_and_tokenizer(1)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    reference = await _started(TransformersBackend(rounded, tok, model_name="tiny"))
    expected = await _greedy(reference)
    await reference.stop()
    backend = await _started(_fresh(0))
    try:
        await backend.load_weights(tmp_path / "v1", "full", 1)
        served = backend._policies[None].model
        assert {p.dtype for p in served.parameters()} == {torch.float32}
        for a, b in zip(served.parameters(), rounded.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert await _greedy(backend) == expected
    finally:
        await backend.stop()


def _adapter(base_seed: int, adapter_seed: int, out: Path, r: int = 4) -> Path:
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model_and_tokenizer(base_seed)
    torch.manual_seed(adapter_seed)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    peft_model.save_pretrained(out)
    return out


async def test_lora_adapters_swap_between_batches(tmp_path: Path) -> None:
    backend = await _started(_fresh(0))
    try:
        base = await _greedy(backend)
        outputs = []
        for version, (seed, rank) in enumerate([(1, 4), (2, 4), (3, 4), (4, 8), (5, 8), (6, 4)], start=1):
            await backend.load_weights(_adapter(0, seed, tmp_path / f"a{version}", r=rank), "lora", version)
            gen = await backend.generate(PROMPT, SamplingParams(0.0, 1.0, 20))
            assert gen.policy_version == version
            outputs.append(gen.completions[0].token_ids.tolist())
            assert len(backend._peft.peft_config) <= 2  # two alternating slots, never more
        assert len({tuple(o) for o in outputs} | {tuple(base)}) == 7
        reference = _fresh(0)  # every slot reuse / rebuild gives what a fresh load of that adapter gives
        await reference.start()
        await reference.load_weights(tmp_path / "a5", "lora", 5)
        assert await _greedy(reference) == outputs[4]
        await reference.stop()
    finally:
        await backend.stop()


@pytest.mark.parametrize("merge_lora", [False, True])
async def test_lora_in_flight_batch_finishes_on_its_adapter(tmp_path: Path, merge_lora: bool) -> None:
    backend = await _started(_fresh(0, max_batch_size=1, merge_lora=merge_lora))
    try:
        await backend.load_weights(_adapter(0, 1, tmp_path / "a1"), "lora", 1)
        expected_v1 = await _greedy(backend)
        started = asyncio.Event()
        long = asyncio.create_task(backend.generate(PROMPT, SamplingParams(0.0, 1.0, 120),
                                                    on_token=lambda *a: started.set()))
        await started.wait()
        await backend.load_weights(_adapter(0, 2, tmp_path / "a2"), "lora", 2)
        old = await long
        assert old.policy_version == 1 and old.completions[0].token_ids[:20].tolist() == expected_v1
        assert (await _greedy(backend)) != expected_v1
    finally:
        await backend.stop()


async def test_merged_lora_serves_what_the_unmerged_adapter_does(tmp_path: Path) -> None:
    slots, merged = await _started(_fresh(0)), await _started(_fresh(0, merge_lora=True))
    base = {k: v.clone() for k, v in merged._base.state_dict().items()}
    try:
        for version, (seed, rank) in enumerate([(1, 4), (2, 8), (3, 4)], start=1):
            adapter = _adapter(0, seed, tmp_path / f"a{version}", r=rank)
            await slots.load_weights(adapter, "lora", version)
            await merged.load_weights(adapter, "lora", version)
            a, b = (await asyncio.gather(*(x.generate(PROMPT, SamplingParams(0.7, 1.0, 16, seed=3))
                                           for x in (slots, merged))))
            assert a.policy_version == b.policy_version == version
            assert a.completions[0].token_ids.tolist() == b.completions[0].token_ids.tolist()
            assert b.completions[0].logprobs == pytest.approx(a.completions[0].logprobs, abs=1e-4)
        assert merged._peft is None  # never injected: the base object serves version 0 unchanged
        assert all(torch.equal(v, base[k]) for k, v in merged._base.state_dict().items())
    finally:
        await slots.stop()
        await merged.stop()


async def test_merged_lora_recycles_the_copy_of_the_version_before_the_current_one(tmp_path: Path) -> None:
    backend = await _started(_fresh(0, merge_lora=True))
    try:
        models = []
        for version in (1, 2, 3, 4):
            await backend.load_weights(_adapter(0, version, tmp_path / f"a{version}"), "lora", version)
            await _greedy(backend)  # decodes on it: its step is probed and packed, then refreshed on reuse
            models.append(backend._policies[None].model)
        assert models[2] is models[0] and models[3] is models[1] and models[0] is not models[1]
        reference = await _started(_fresh(0, merge_lora=True))  # a fresh copy with the last adapter
        await reference.load_weights(tmp_path / "a4", "lora", 4)
        assert await _greedy(reference) == await _greedy(backend)
        await reference.stop()
    finally:
        await backend.stop()


async def test_merged_lora_never_rewrites_a_copy_a_running_batch_decodes_on(tmp_path: Path) -> None:
    backend = await _started(_fresh(0, max_batch_size=1, merge_lora=True))
    try:
        await backend.load_weights(_adapter(0, 1, tmp_path / "a1"), "lora", 1)
        expected_v1 = await _greedy(backend, 60)
        v1_model = backend._policies[None].model
        started = asyncio.Event()
        long = asyncio.create_task(backend.generate(PROMPT, SamplingParams(0.0, 1.0, 150),
                                                    on_token=lambda *a: started.set()))
        await started.wait()
        await backend.load_weights(_adapter(0, 2, tmp_path / "a2"), "lora", 2)
        await backend.load_weights(_adapter(0, 3, tmp_path / "a3"), "lora", 3)  # v1's copy is still decoding
        assert backend._policies[None].model is not v1_model
        old = await long
        assert old.policy_version == 1 and old.completions[0].token_ids[:60].tolist() == expected_v1
    finally:
        await backend.stop()


async def test_merged_lora_refuses_an_adapter_of_another_model(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    other, _ = tiny_model_and_tokenizer(0, hidden_size=32)
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "other")
    backend = await _started(_fresh(0, merge_lora=True))
    try:
        with pytest.raises(CheckpointError, match="does not fit the model"):
            await backend.load_weights(tmp_path / "other", "lora", 1)
        assert backend.policy_version == 0 and (await _greedy(backend))  # still serving version 0
    finally:
        await backend.stop()


async def test_stop_fails_pending_requests() -> None:
    backend = await _started(_fresh())
    await backend.stop()
    with pytest.raises(RuntimeError):
        await backend.generate(PROMPT, SamplingParams())


async def test_requests_join_a_running_batch_and_leave_it_early() -> None:
    backend = await _started(_fresh(max_batch_size=8))
    try:
        started = asyncio.Event()
        long = asyncio.create_task(backend.generate(PROMPT, SamplingParams(0.0, 1.0, 150),
                                                    on_token=lambda *a: started.set()))
        await started.wait()
        prompts = [list(b"short"), list(b"a somewhat longer prompt than the first one, to pad")]
        joined = await asyncio.gather(*(backend.generate(p, SamplingParams(0.9, 1.0, 10, seed=4, n=2))
                                        for p in prompts))
        assert not long.done()  # answered while the long request is still decoding
        assert backend.joined == 2 and backend.batches_run == 0
        for prompt, gen in zip(prompts, joined, strict=True):  # joining changes nothing numerically
            for c in gen.completions:
                ref = _reference_logprobs(backend._base, prompt, c.token_ids, 0.9)
                assert c.logprobs == pytest.approx(ref, abs=2e-4)
        solo = _fresh()
        await solo.start()
        expected = await solo.generate(prompts[1], SamplingParams(0.9, 1.0, 10, seed=4, n=2))
        await solo.stop()
        assert [c.token_ids for c in expected.completions] == [c.token_ids for c in joined[1].completions]
        first = (await long).completions[0]
        assert first.logprobs == pytest.approx(_reference_logprobs(backend._base, PROMPT, first.token_ids, 0.0),
                                               abs=2e-4)
    finally:
        await backend.stop()
