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
    bf16 = torch_internals.onednn_packs("bfloat16")
    assert torch_internals.onednn_packs("float32")  # oneDNN lays float32 out on any x86 CPU
    assert torch_internals.check_api() == ("float32 mkl", "float32 onednn", *(("bfloat16 onednn",) if bf16 else ()))


def test_bfloat16_weights_are_packed_exactly_where_the_cpu_has_what_onednn_needs() -> None:
    flags = _cpu_flags()
    able = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert torch_internals.onednn_packs("bfloat16") == able, sorted(f for f in flags if f.startswith("avx"))


def test_without_bfloat16_packing_bfloat16_products_are_not_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch_internals, "onednn_packs", lambda dtype: dtype == "float32")
    assert torch_internals.packing_for(torch.bfloat16) is None
    assert torch_internals.packing_for(torch.float32) == torch_internals.float32_packing()
    assert torch_internals.check_api() == ("float32 mkl", "float32 onednn")


INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f\n"
AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2\n"


def test_float32_weights_are_packed_by_mkl_on_intel_and_by_onednn_elsewhere(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    import torch

    assert torch_internals.float32_packing(INTEL) == "mkl"
    assert torch_internals.float32_packing(AMD) == "onednn"
    assert torch_internals.float32_packing("processor\t: 0\n") == "onednn"  # no vendor: the vendor-neutral one
    real = torch_internals.float32_packing
    for cpuinfo, kind in ((INTEL, "mkl"), (AMD, "onednn")):
        monkeypatch.setattr(torch_internals, "float32_packing", lambda info=cpuinfo: real(info))
        assert torch_internals.packing_for(torch.float32) == kind
    # where oneDNN cannot lay float32 out, MKL's packing serves on any CPU
    monkeypatch.setattr(torch_internals, "onednn_packs", lambda dtype: False)
    assert torch_internals.packing_for(torch.float32) == "mkl"


@pytest.mark.parametrize("op", ["mkl_linear", "onednn_linear"])
def test_a_broken_operator_is_named_with_the_versions(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    import torch

    monkeypatch.setattr(torch_internals, op, lambda x, *args: torch.zeros(x.shape[0], 96, dtype=x.dtype))
    with pytest.raises(RuntimeError, match=r"torch \d.*differs.*checked with 2\.13\.0"):
        torch_internals.check_api()
