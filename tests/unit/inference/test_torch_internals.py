"""The private torch operators the decode step multiplies with (inference/torch_internals.py): the
installed version is one the contract was checked with, and the contract holds on it."""

from __future__ import annotations

import pytest

from boltstream.inference import torch_internals
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(torch_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(torch_internals, dist)


def test_packed_products_equal_f_linear_in_float32_and_bfloat16() -> None:
    torch_internals.check_api()


@pytest.mark.parametrize("op", ["mkl_linear", "onednn_linear"])
def test_a_broken_operator_is_named_with_the_versions(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    import torch

    monkeypatch.setattr(torch_internals, op, lambda x, *args: torch.zeros(x.shape[0], 96, dtype=x.dtype))
    with pytest.raises(RuntimeError, match=r"torch \d.*differs.*checked with 2\.13\.0"):
        torch_internals.check_api()
