"""Several named LoRA adapters on one base model in the transformers engine.

What must hold: every request is decoded with its own adapter even when requests for
both arrive together (a batch never mixes adapters), each adapter's reload moves only
its own version, and the other adapter's outputs stay bitwise the same.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from boltstream.errors import CheckpointError
from boltstream.inference.backend import Generation, SamplingParams
from boltstream.inference.transformers_backend import TransformersBackend
from tests.unit.inference.test_inference_backend import PROMPT, _adapter, _fresh, _started

GREEDY = SamplingParams(0.0, 1.0, 20)


async def _ask(backend: TransformersBackend, adapter: str | None, prompt: list[int] = PROMPT) -> Generation:
    return await backend.generate(prompt, GREEDY, adapter=adapter)


async def _reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy ids of a one-policy worker serving the adapter at ``path``: what the adapter alone gives."""
    ref = await _started(_fresh(0))
    try:
        await ref.load_weights(path, "lora", 1)
        return [(await _ask(ref, None, p)).completions[0].token_ids for p in prompts]
    finally:
        await ref.stop()


async def test_each_adapter_answers_with_its_own_weights_even_in_one_burst(tmp_path: Path) -> None:
    prompts = [PROMPT, list(b"SELECT name FROM"), list(b"a longer prompt, so rows are padded")]
    writer, checker = _adapter(0, 1, tmp_path / "w1"), _adapter(0, 2, tmp_path / "c1", r=8)
    expected = {"writer": await _reference(writer, prompts), "checker": await _reference(checker, prompts)}
    backend = await _started(_fresh(0, adapters=("writer", "checker")))
    try:
        base = (await _ask(backend, "checker")).completions[0].token_ids  # no checkpoint yet: the base weights
        await backend.load_weights(writer, "lora", 3, adapter="writer")
        await backend.load_weights(checker, "lora", 5, adapter="checker")
        assert (backend.version_of("writer"), backend.version_of("checker"), backend.policy_version) == (3, 5, 3)
        asks = [(a, i) for i in range(len(prompts)) for a in ("writer", "checker")] * 2  # interleaved
        gens = await asyncio.gather(*(_ask(backend, a, prompts[i]) for a, i in asks))
        for (a, i), gen in zip(asks, gens, strict=True):
            assert (gen.adapter, gen.policy_version) == (a, 3 if a == "writer" else 5)
            assert gen.completions[0].token_ids == expected[a][i], (a, i)
        assert expected["writer"][0] != expected["checker"][0] != base
        assert set(backend._peft.peft_config) <= {"writer-a", "writer-b", "checker-a", "checker-b"}
    finally:
        await backend.stop()


async def test_reloading_one_adapter_leaves_the_other_bitwise_unchanged(tmp_path: Path) -> None:
    backend = await _started(_fresh(0, adapters=("writer", "checker"), max_batch_size=1))
    try:
        await backend.load_weights(_adapter(0, 1, tmp_path / "w1"), "lora", 1, adapter="writer")
        await backend.load_weights(_adapter(0, 2, tmp_path / "c1"), "lora", 1, adapter="checker")
        checker_v1, writer_v1 = await _ask(backend, "checker"), await _ask(backend, "writer")
        for version, seed, rank in ((2, 3, 4), (3, 4, 8)):  # a same-shape copy, then a new-shape rebuild
            # a checker request decodes while the writer's new weights are loaded next to it
            started = asyncio.Event()
            running = asyncio.create_task(backend.generate(PROMPT, GREEDY, lambda *a, e=started: e.set(),
                                                           "checker"))
            await started.wait()
            await backend.load_weights(_adapter(0, seed, tmp_path / f"w{version}", r=rank), "lora", version,
                                       adapter="writer")
            for checker in (await running, await _ask(backend, "checker")):
                assert (checker.policy_version, checker.adapter) == (1, "checker")
                assert checker.completions[0].token_ids == checker_v1.completions[0].token_ids
                assert checker.completions[0].logprobs == checker_v1.completions[0].logprobs  # bitwise
            writer = await _ask(backend, "writer")
            assert writer.policy_version == version == backend.version_of("writer")
            assert writer.completions[0].token_ids != writer_v1.completions[0].token_ids
        assert backend.version_of("checker") == 1
    finally:
        await backend.stop()


async def test_unknown_adapters_and_full_checkpoints_for_an_adapter_are_refused(tmp_path: Path) -> None:
    from boltstream.weights.models import save_model_dir, tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(1)
    full = save_model_dir(model, tok, tmp_path / "full")
    backend = await _started(_fresh(0, adapters=("writer", "checker")))
    try:
        with pytest.raises(ValueError, match=r"'planner' is not served by this worker \(it serves writer, checker\)"):
            await _ask(backend, "planner")
        with pytest.raises(CheckpointError, match="adapter 'checker': a full checkpoint cannot be served"):
            await backend.load_weights(full, "full", 2, adapter="checker")
        assert backend.version_of("checker") == 0
        assert (await _ask(backend, None)).adapter == "writer"  # None: the default (first) adapter
    finally:
        await backend.stop()
    one = _fresh(0)
    with pytest.raises(ValueError, match="no named adapters"):
        one.version_of("writer")
