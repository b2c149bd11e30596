"""The private torch operators the decode step multiplies with (inference/torch_internals.py): the
installed version is one the contract was checked with, and the contract holds on it."""

from __future__ import annotations

import pytest

from boltstream.inference import torch_internals
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(torch_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(torch_internals, dist)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_packed_products_equal_f_linear_in_float32_and_bfloat16() -> None:
    bf16 = torch_internals.onednn_packs_bfloat16()
    assert torch_internals.check_api() == (("mkl", "onednn") if bf16 else ("mkl",))


def test_bfloat16_weights_are_packed_exactly_where_the_cpu_has_what_onednn_needs() -> None:
    flags = _cpu_flags()
    able = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert torch_internals.onednn_packs_bfloat16() == able, sorted(f for f in flags if f.startswith("avx"))


def test_without_bfloat16_packing_bfloat16_products_are_not_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch_internals, "onednn_packs_bfloat16", lambda: False)
    assert torch_internals.packing_for(torch.bfloat16) is None
    assert torch_internals.packing_for(torch.float32) == "mkl"
    assert torch_internals.check_api() == ("mkl",)


@pytest.mark.parametrize("op", ["mkl_linear", "onednn_linear"])
def test_a_broken_operator_is_named_with_the_versions(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    import torch

    if op == "onednn_linear" and not torch_internals.onednn_packs_bfloat16():
        pytest.skip("this CPU has no bfloat16 packing to break (oneDNN needs avx512bw/vl/dq or avx_ne_convert)")

    monkeypatch.setattr(torch_internals, op, lambda x, *args: torch.zeros(x.shape[0], 96, dtype=x.dtype))
    with pytest.raises(RuntimeError, match=r"torch \d.*differs.*checked with 2\.13\.0"):
        torch_internals.check_api()
