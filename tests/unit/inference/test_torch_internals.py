"""The private torch operators the decode step multiplies with (inference/torch_internals.py): the
installed version is one the contract was checked with, and the contract holds on it."""

from __future__ import annotations

import pytest

from boltstream.inference import torch_internals
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(torch_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(torch_internals, dist)


def test_packed_products_equal_f_linear_and_fall_back_for_other_row_counts() -> None:
    torch_internals.check_api()


def test_a_broken_operator_is_named_with_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch_internals, "packed_linear", lambda x, packed, weight, rows: torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"torch \d.*checked with 2\.13\.0"):
        torch_internals.check_api()
