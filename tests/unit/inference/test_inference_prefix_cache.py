"""The prefix cache in the transformers engine: identical samples with and without it, and never stale KV.

Every case runs the same requests (same seeds) on a backend with the cache and on
one without; token ids must be equal and log-probs within 1e-4.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from boltstream.inference.backend import Generation, SamplingParams
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.weights.models import save_model_dir, tiny_model_and_tokenizer

SHARED = list(b"You solve arithmetic word problems with a calculator. Example: 4 rows of 9 trees. ")
QUESTIONS = [list(b"Q: 3 boxes of 7 eggs?"), list(b"Q: 12 cars, 4 wheels each?"), list(b"Q: half of 88?")]
BUDGET = 64 << 20


def _backend(seed: int = 0, budget: int = BUDGET, **kw: Any) -> TransformersBackend:
    model, tok = tiny_model_and_tokenizer(seed)
    return TransformersBackend(model, tok, model_name="tiny", max_batch_size=kw.pop("max_batch_size", 8),
                               prefix_cache_bytes=budget, **kw)


async def _run(backend: TransformersBackend, prompts: list[list[int]], params: list[SamplingParams]
               ) -> list[Generation]:
    return list(await asyncio.gather(*(backend.generate(p, s) for p, s in zip(prompts, params, strict=True))))


def _assert_same(cached: list[Generation], plain: list[Generation]) -> None:
    for a, b in zip(cached, plain, strict=True):
        assert len(a.completions) == len(b.completions)
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert ca.token_ids.tolist() == cb.token_ids.tolist()
            assert list(ca.logprobs) == pytest.approx(list(cb.logprobs), abs=1e-4)


async def _both(prompts: list[list[int]], params: list[SamplingParams], rounds: int = 2
                ) -> tuple[TransformersBackend, list[list[Generation]], list[list[Generation]]]:
    """``rounds`` times the same requests on a cached and an uncached backend (the stopped cached one is
    returned for its counters)."""
    cached, plain = _backend(), _backend(budget=0)
    await cached.start()
    await plain.start()
    try:
        got = [await _run(cached, prompts, params) for _ in range(rounds)]
        want = [await _run(plain, prompts, params) for _ in range(rounds)]
    finally:
        await cached.stop()
        await plain.stop()
    return cached, got, want


async def test_a_repeated_request_is_served_from_the_cache_with_the_same_samples() -> None:
    prompt = SHARED + QUESTIONS[0]
    backend, got, want = await _both([prompt], [SamplingParams(0.8, 1.0, 16, seed=3)])
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    stats = backend.prefix_cache.stats()
    assert (stats["hits"], stats["misses"]) == (1, 1)
    # the 2nd call reuses all but the last prompt token (its prompt and response were stored by the 1st)
    assert stats["tokens_saved"] == len(prompt) - 1
    assert stats["tokens_computed"] == len(prompt) + 1
    assert stats["bytes"] > 0 and stats["tokens"] >= len(prompt)


async def test_a_batch_with_shared_prefixes_samples_what_an_uncached_batch_does() -> None:
    prompts = [SHARED + q for q in QUESTIONS] + [list(b"unrelated short one")]
    params = [SamplingParams(t, p, 12, seed=i) for i, (t, p) in enumerate([(0.7, 1.0), (1.0, 0.9), (0.0, 1.0),
                                                                            (0.7, 1.0)])]
    backend, got, want = await _both(prompts, params)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    stats = backend.prefix_cache.stats()
    # 2nd round: every prompt finds itself (and the three questions the shared preamble) stored by the 1st
    assert stats["hits"] >= 4 and stats["tokens_saved"] >= 3 * (len(SHARED) - 1)


async def test_identical_prompts_in_one_batch_are_prefilled_once_and_sample_as_without_the_cache() -> None:
    prompts = [SHARED + QUESTIONS[0]] * 4  # a GRPO group: the attempts of one task, separate requests
    params = [SamplingParams(1.0, 1.0, 8, seed=i) for i in range(4)]
    backend, got, want = await _both(prompts, params, rounds=1)
    _assert_same(got[0], want[0])
    stats = backend.prefix_cache.stats()
    assert backend.batches_run == 1, "the four requests did not arrive in one batch"
    assert stats["tokens_computed"] == len(prompts[0]) and stats["tokens_saved"] == 3 * len(prompts[0]), stats


async def test_n_choices_share_one_prefill_and_sample_as_without_the_cache() -> None:
    prompts = [SHARED + QUESTIONS[1], SHARED + QUESTIONS[2]]
    params = [SamplingParams(0.9, 1.0, 10, seed=5, n=3), SamplingParams(0.7, 0.95, 10, seed=6, n=2)]
    backend, got, want = await _both(prompts, params, rounds=1)
    _assert_same(got[0], want[0])
    stats = backend.prefix_cache.stats()
    assert stats["tokens_saved"] >= 2 * len(prompts[0]) + len(prompts[1])  # the choices after the first


async def test_joiners_use_the_cache_share_the_decode_pass_and_sample_as_without_it() -> None:
    forwards: list[int] = []

    async def scenario(backend: TransformersBackend) -> list[Generation]:
        model = backend._base
        own = model.forward
        await backend.start()
        try:
            started = asyncio.Event()
            long = asyncio.create_task(backend.generate(SHARED + QUESTIONS[0], SamplingParams(0.0, 1.0, 120),
                                                        on_token=lambda *a: started.set()))
            await started.wait()
            calls = [0]

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return own(*args, **kwargs)

            model.forward = counted  # the model's own forward, from the moment the long request decodes
            joined = await _run(backend, [SHARED + QUESTIONS[1], SHARED + QUESTIONS[2]],
                                [SamplingParams(0.9, 1.0, 10, seed=4, n=2), SamplingParams(0.5, 1.0, 10, seed=7)])
            assert backend.joined == 2 and not long.done()
            forwards.append(calls[0])
            return [*joined, await long]
        finally:
            del model.forward
            await backend.stop()

    cached = _backend()
    _assert_same(await scenario(cached), await scenario(_backend(budget=0)))
    assert cached.prefix_cache.stats()["tokens_saved"] >= 2 * (len(SHARED) - 1)
    # with the cache the joiners' prompts make one block, prefilled in a decode step's pass (no forward of
    # their own); without it they are prefilled by the model's forward
    assert forwards[0] == 0 and forwards[1] >= 1, forwards


async def test_an_agents_next_turn_finds_its_previous_turn_and_samples_as_without_the_cache() -> None:
    first = SHARED + QUESTIONS[0]

    async def turns(backend: TransformersBackend) -> list[Generation]:
        await backend.start()
        try:
            one = await backend.generate(first, SamplingParams(0.8, 1.0, 12, seed=1))
            second = first + one.completions[0].token_ids.tolist() + list(b"RESULT: 21")
            return [one, await backend.generate(second, SamplingParams(0.8, 1.0, 12, seed=2))]
        finally:
            await backend.stop()

    cached = _backend()
    got = await turns(cached)
    _assert_same(got, await turns(_backend(budget=0)))
    response = got[0].completions[0].token_ids
    assert len(response) == 12  # a comparison of early stops would prove little
    # the 2nd call reuses the 1st call's prompt and all of its response but the last token (never fed)
    assert cached.prefix_cache.stats()["tokens_saved"] == len(first) + len(response) - 1


async def test_after_a_full_reload_no_kv_of_the_old_weights_is_used(tmp_path: Path) -> None:
    v1_model, tok = tiny_model_and_tokenizer(1)
    save_model_dir(v1_model, tok, tmp_path / "v1")
    prompt, params = SHARED + QUESTIONS[0], SamplingParams(0.0, 1.0, 12)
    reference = _backend(1, budget=0)
    await reference.start()
    want = await reference.generate(prompt, params)
    await reference.stop()
    backend = _backend(0)
    await backend.start()
    try:
        old = await backend.generate(prompt, params)
        assert backend.prefix_cache.stats()["bytes"] > 0
        await backend.load_weights(tmp_path / "v1", "full", 1)
        assert backend.prefix_cache.stats()["bytes"] == 0
        new = await backend.generate(prompt, params)
        assert new.policy_version == 1
        _assert_same([new], [want])
        assert old.completions[0].token_ids.tolist() != want.completions[0].token_ids.tolist()
    finally:
        await backend.stop()


def _adapter(adapter_seed: int, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_model_and_tokenizer(0)
    torch.manual_seed(adapter_seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"],
                                                  init_lora_weights=False))
    peft_model.save_pretrained(out)
    return out


async def test_lora_reloads_and_other_adapters_never_read_an_adapters_kv(tmp_path: Path) -> None:
    prompt, params = SHARED + QUESTIONS[2], SamplingParams(0.0, 1.0, 12)

    async def outputs(backend: TransformersBackend) -> list[Generation]:
        await backend.start()
        try:
            await backend.load_weights(_adapter(1, tmp_path / "w1"), "lora", 1, adapter="writer")
            got = [await backend.generate(prompt, params, adapter="writer"),
                   await backend.generate(prompt, params, adapter="checker")]  # the base weights
            await backend.load_weights(_adapter(2, tmp_path / "w2"), "lora", 2, adapter="writer")
            got.append(await backend.generate(prompt, params, adapter="writer"))
            got.append(await backend.generate(prompt, params, adapter="checker"))  # kept: not reloaded
            return got
        finally:
            await backend.stop()

    cached = _backend(adapters=("writer", "checker"))
    got = await outputs(cached)
    _assert_same(got, await outputs(_backend(budget=0, adapters=("writer", "checker"))))
    assert len({tuple(g.completions[0].token_ids.tolist()) for g in got[:3]}) == 3  # three different policies
    assert cached.prefix_cache.stats()["hits"] == 1  # only the checker's second call


def _metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_serve_reports_the_prefix_cache_on_metrics(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from boltstream.config import load
    from boltstream.inference.cli import ServeConfig, build_app, parser

    argv = ["--model", "tiny", "--no-capture", "--no-reload", "--prefix-cache-mib", "8"]
    cfg = load(ServeConfig, explicit=vars(parser().parse_args(argv)), env={}, state_file="/nonexistent")
    body = {"model": "tiny", "prompt": bytes(SHARED).decode(), "max_tokens": 4, "temperature": 0}
    with TestClient(build_app(cfg, tmp_path)) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    assert _metric(text, "boltstream_inference_prefix_cache_hits_total") == 1
    assert _metric(text, "boltstream_inference_prefix_cache_misses_total") == 1
    computed = _metric(text, "boltstream_inference_prefill_tokens_computed_total")
    saved = _metric(text, "boltstream_inference_prefill_tokens_saved_total")
    assert saved > 0 and computed > saved  # the 1st prompt whole, then its last token (+ anything new)
    assert _metric(text, "boltstream_inference_prefix_cache_budget_bytes") == 8 << 20
    assert 0 < _metric(text, "boltstream_inference_prefix_cache_bytes") <= 8 << 20
    assert _metric(text, "boltstream_inference_prefix_cache_tokens") >= saved
    assert _metric(text, "boltstream_inference_prefix_cache_evictions_total") == 0


@pytest.mark.parametrize("slack", [0, 1000])
async def test_prompts_with_and_without_cached_prefixes_share_a_forward_and_sample_as_without_the_cache(
        monkeypatch: pytest.MonkeyPatch, slack: int) -> None:
    """One forward (slack 1000: the cached prompt recomputes part of its prefix to line up with an uncached
    one) or one per prompt (slack 0): the same samples as an uncached worker."""
    from boltstream.inference import prefix_cache

    monkeypatch.setattr(prefix_cache, "RECOMPUTE_SLACK", slack)
    warm = [SHARED + QUESTIONS[0]]
    prompts = [SHARED + QUESTIONS[1], list(b"a longer prompt that nothing stored starts like, none at all"),
               list(b"short")]
    params = [SamplingParams(1.0, 1.0, 10, seed=i) for i in range(3)]
    cached, plain = _backend(), _backend(budget=0)
    await cached.start()
    await plain.start()
    try:
        await _run(cached, warm, params[:1])
        got = await _run(cached, prompts, params)
        want = await _run(plain, prompts, params)
    finally:
        await cached.stop()
        await plain.stop()
    _assert_same(got, want)
    assert cached.prefix_cache.stats()["hits"] >= 1
