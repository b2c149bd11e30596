"""The transformers internals the worker and the learner use (inference/transformers_internals.py): the
installed version is one the contract was checked with, and the contract holds on it."""

from __future__ import annotations

import pytest

from boltstream.inference import transformers_internals
from boltstream.learner.tiny import tiny_llama
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(transformers_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(transformers_internals, dist)


def test_the_cache_internals_hold() -> None:
    transformers_internals.check_api(tiny_llama(64, seed=0).eval())


def test_a_cache_of_leaf_tensors_passes_their_gradient_back() -> None:
    transformers_internals.check_gradient_api(tiny_llama(64, seed=1))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_attention_implementation_is_read_from_the_config(attention: str) -> None:
    assert transformers_internals.attention_implementation(tiny_llama(64, attn_implementation=attention).config) \
        == attention


def test_a_broken_internal_is_named_with_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama(64, seed=0).eval()
    monkeypatch.setattr(transformers_internals, "is_growing", lambda cache: False)
    with pytest.raises(RuntimeError, match=r"transformers \d.*checked with 5\.17\.0"):
        transformers_internals.check_api(model)
