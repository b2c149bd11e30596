"""Weight swaps while vLLM serves: LoRA versions under load, full reloads that drain and reset the prefix cache."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from boltstream.errors import CheckpointError
from boltstream.inference.backend import SamplingParams
from tests.vllm.conftest import (
    CALL_TIMEOUT,
    MODEL,
    Served,
    lora_adapter,
    reference_greedy,
    reference_logprobs,
    reference_model,
)

PROMPT = list(b"The quick brown fox")
LONG_PROMPT = list(b"An agent's preamble, repeated by every call of its rollout. " * 5)  # > 2 CPU KV blocks (128)
LORA_TOLERANCE = 1e-3  # vLLM applies the adapter unmerged (x @ A @ B), the reference merged into W


def _greedy(served: Served, prompt: list[int] = PROMPT, n: int = 20):
    gen = served.generate(prompt, SamplingParams(0.0, 1.0, n))
    assert len(gen.completions[0].token_ids) == n  # a comparison of two early stops would prove nothing
    return gen


def _long_request(served: Served, max_tokens: int = 400):
    """A greedy request started on the app's loop; returns (future, event set at its first token)."""
    started = threading.Event()
    fut = served.start(served.backend.generate, PROMPT, SamplingParams(0.0, 1.0, max_tokens),
                       on_token=lambda *a: started.set())
    assert started.wait(CALL_TIMEOUT), "the long request produced no token"
    return fut


def test_lora_reload_while_a_request_runs(served: Served, model_dirs, tmp_path: Path, fresh_sink) -> None:
    served.serve_base(0)
    base = model_dirs(0)
    adapters = {1: lora_adapter(base, 1, tmp_path / "a1"), 2: lora_adapter(base, 2, tmp_path / "a2", r=8)}
    v1 = served.next_version()
    served.call(served.backend.load_weights, adapters[1], "lora", v1)
    first = _greedy(served)
    assert first.policy_version == v1
    expected_v1 = list(first.completions[0].token_ids)
    ref_v1 = reference_model(base, adapters[1])
    assert expected_v1 == reference_greedy(ref_v1, PROMPT, 20)  # the adapter really is applied

    long = _long_request(served)
    v2 = served.next_version()
    served.call(served.backend.load_weights, adapters[2], "lora", v2)
    assert not long.done(), "the reload must happen while the long request runs"
    assert served.backend.policy_version == v2
    new = _greedy(served)
    ref_v2 = reference_model(base, adapters[2])
    assert new.policy_version == v2
    assert list(new.completions[0].token_ids) == reference_greedy(ref_v2, PROMPT, 20) != expected_v1
    assert new.completions[0].logprobs == pytest.approx(
        reference_logprobs(ref_v2, PROMPT, new.completions[0].token_ids, 0.0), abs=LORA_TOLERANCE)

    old = long.result(CALL_TIMEOUT)
    assert old.policy_version == v1  # finished on, and tagged with, the adapter it started with
    assert list(old.completions[0].token_ids[:20]) == expected_v1
    assert old.completions[0].logprobs[:20] == pytest.approx(
        reference_logprobs(ref_v1, PROMPT, expected_v1, 0.0), abs=LORA_TOLERANCE)

    r = served.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert fresh_sink.spans[-1]["llm"]["policy_version"] == v2
    assert served.client.get("/v1/models").json()["data"][0]["policy_version"] == v2


def test_lora_versions_after_a_full_reload_rotate_through_the_engines_slots(served: Served, model_dirs,
                                                                           tmp_path: Path) -> None:
    """A full reload drops the workers' adapters; LoRA versions after it still load, more of them than
    the engine holds at once (the oldest are removed), and each serves its own weights."""
    served.serve_base(1)
    base = model_dirs(1)
    outputs = []
    for seed in range(5):
        version = served.next_version()
        adapter = lora_adapter(base, 10 + seed, tmp_path / f"a{seed}")
        served.call(served.backend.load_weights, adapter, "lora", version)
        gen = _greedy(served)
        assert gen.policy_version == version
        outputs.append(list(gen.completions[0].token_ids))
    assert outputs[-1] == reference_greedy(reference_model(base, adapter), PROMPT, 20)
    assert len({tuple(o) for o in outputs}) == 5


def test_lora_adapter_over_the_rank_limit_is_refused(served: Served, model_dirs, tmp_path: Path) -> None:
    version = served.serve_base(0)
    before = _greedy(served)
    too_big = lora_adapter(model_dirs(0), 3, tmp_path / "r16", r=16)  # the engine was started with rank <= 8
    with pytest.raises(CheckpointError):
        served.call(served.backend.load_weights, too_big, "lora", served.next_version())
    assert served.backend.policy_version == version
    after = _greedy(served)
    assert after.policy_version == version and after.completions[0].token_ids == before.completions[0].token_ids


def test_full_reload_drains_and_resets_the_prefix_cache(served: Served, model_dirs, tolerance: float) -> None:
    old_version = served.serve_base(0)
    warm = [served.generate(LONG_PROMPT, SamplingParams(0.0, 1.0, 8)) for _ in range(2)]
    assert warm[1].extra["cached_prompt_tokens"] >= 256  # the prefix cache is on and serves this prompt

    long = _long_request(served)
    version = served.next_version()
    reload = served.start(served.backend.load_weights, model_dirs(1), "full", version)
    waiting = served.start(served.backend.generate, PROMPT, SamplingParams(0.0, 1.0, 5))  # queued at the gate
    old = long.result(CALL_TIMEOUT)
    reload.result(CALL_TIMEOUT)
    assert old.policy_version == old_version and waiting.result(CALL_TIMEOUT).policy_version == version

    reference = reference_model(model_dirs(1))
    after = served.generate(LONG_PROMPT, SamplingParams(0.0, 1.0, 8))
    assert after.policy_version == version
    # Nothing computed by the old weights is reused: stale KV would change these tokens.
    assert after.extra["cached_prompt_tokens"] == 0
    c = after.completions[0]
    assert list(c.token_ids) == reference_greedy(reference, LONG_PROMPT, 8)
    assert c.logprobs == pytest.approx(reference_logprobs(reference, LONG_PROMPT, c.token_ids, 0.0), abs=tolerance)
    again = served.generate(LONG_PROMPT, SamplingParams(0.0, 1.0, 8))
    assert again.extra["cached_prompt_tokens"] >= 256 and again.completions[0].token_ids == c.token_ids


def test_incomplete_full_checkpoint_is_refused(served: Served, model_dirs, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    version = served.serve_base(0)
    before = _greedy(served)
    broken = Path(shutil.copytree(model_dirs(1), tmp_path / "broken"))
    weights = load_file(broken / "model.safetensors")
    weights.pop(next(k for k in weights if "layers.1" in k))
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing_keys"):
        served.call(served.backend.load_weights, broken, "full", served.next_version())
    assert served.backend.policy_version == version
    after = _greedy(served)
    assert after.policy_version == version and after.completions[0].token_ids == before.completions[0].token_ids
