"""Every use of a private torch API, in one place: products on prepacked weights for the decode step.

Why: a decode step of a few rows multiplies them by every weight matrix once, and
the step is bound by reading the weights. At so few rows torch's ordinary product
repacks each weight panel on every call: on a 2-core Xeon, SmolLM2-135M's 538 MB
of float32 weights went through ``F.linear`` at ~8 GB/s for 16 rows against
~22 GB/s for one row. Packed once per model, the same products take ~0.7-0.75x
the time in float32 (MKL's ``cblas_sgemm_pack`` on that Xeon; oneDNN's blocked layout
on an AMD EPYC, where it beat MKL's by more) and in bfloat16 (oneDNN's), with results
equal to ``F.linear``'s. torch exposes both only as private operators (they exist for
its own CPU inference passes), so nothing outside this module calls them.

The contract (torch, as of the versions in :data:`CHECKED_WITH`; x86 builds with MKL and oneDNN):

* ``torch.ops.mkl._mkl_reorder_linear_weight(weight, batch_size)`` takes a float32
  ``[out, in]`` weight (``F.linear``'s layout) and returns an opaque tensor holding it
  packed for products of exactly ``batch_size`` rows (as many bytes as the weight);
* ``torch.ops.mkl._mkl_linear(x, packed, weight, bias, batch_size)`` returns
  ``x @ weight.T`` (+ ``bias``) from the packed copy when ``x`` has ``batch_size`` rows,
  and falls back to ``F.linear(x, weight, bias)`` for any other row count;
* ``torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)`` returns the weight
  (float32 or bfloat16) in oneDNN's layout for products of about ``batch_size`` rows, and
  ``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`` returns
  ``x @ weight.T`` from it for any row count.

:func:`check_api` checks all of it on real tensors; ``tests/unit/inference/test_torch_internals.py``
calls it and fails, naming the version, when the installed torch is not one in :data:`CHECKED_WITH`.
Where an operator is missing (another build, another CPU architecture), or oneDNN cannot lay
bfloat16 weights out on this CPU (it needs avx512bw/vl/dq or avx_ne_convert; an AVX2-only CPU
has neither), :func:`packing_for` says so and the step multiplies with ``F.linear``.
"""

from __future__ import annotations

import functools
from typing import Any

# distribution -> versions this module's contract was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {"torch": ("2.13.0", "2.13.0+cpu")}

# The row count oneDNN lays weights out for (any count multiplies from the layout).
ONEDNN_ROWS_HINT = 16


def packing_for(dtype: Any) -> str | None:
    """How weights of ``dtype`` are packed here: "mkl" (float32, for exact row counts), "onednn"
    (any row count) or None (not at all).

    float32 has both where both exist, and the CPU's vendor picks (:func:`float32_packing`); bfloat16
    only oneDNN's, where this CPU can lay it out (:func:`onednn_packs`)."""
    import torch

    if dtype == torch.float32:
        able = [kind for kind in ("mkl", "onednn") if can_pack(kind, "float32")]
        preferred = float32_packing()
        return preferred if preferred in able else next(iter(able), None)
    if dtype == torch.bfloat16 and can_pack("onednn", "bfloat16"):
        return "onednn"
    return None


def float32_packing(cpuinfo: str | None = None) -> str:
    """The faster float32 packing of the two on this CPU, by its vendor: MKL's on an Intel one, oneDNN's
    elsewhere. Measured (docs/results.md), SmolLM2-135M decode steps of 1-32 rows: on a Xeon MKL's packed
    products were as fast as oneDNN's at 8-16 rows and 1.2x faster at 32; on an AMD EPYC (AVX2)
    oneDNN's made whole steps 1.4-2.2x faster than MKL's. ``cpuinfo`` is ``/proc/cpuinfo``'s text."""
    from boltstream.weights.models import cpu_vendor

    return "mkl" if cpu_vendor(cpuinfo) == "GenuineIntel" else "onednn"


def can_pack(kind: str, dtype: str) -> bool:
    """Whether packing ``kind`` ("mkl": float32 only; "onednn") serves ``dtype`` here: its operators exist
    and, for oneDNN, this CPU lets it lay ``dtype`` out."""
    if kind == "mkl":
        return dtype == "float32" and _operators("mkl")
    return _operators("onednn") and onednn_packs(dtype)


def _operators(kind: str) -> bool:
    """Whether this torch build has the operators of packing ``kind``."""
    import torch

    try:
        if kind == "mkl":
            return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear") \
                and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_packs(dtype: str) -> bool:
    """Whether oneDNN lays weights of ``dtype`` ("float32", "bfloat16") out on this CPU: it refuses
    bfloat16 on one without avx512bw/vl/dq or avx_ne_convert (an AVX2-only CPU), which only trying tells."""
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=getattr(torch, dtype)), ONEDNN_ROWS_HINT)
    except (AttributeError, RuntimeError):
        return False
    return True


def pack(weight: Any, packing: str, rows: int = 0) -> Any:
    """``weight`` (``[out, in]``) packed the ``packing`` way; "mkl" for products of exactly ``rows`` rows."""
    import torch

    weight = weight.detach().contiguous()
    if packing == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)


def mkl_linear(x: Any, packed: Any, weight: Any, rows: int) -> Any:
    """``x @ weight.T`` from ``packed`` (MKL-packed from ``weight`` for ``rows`` rows) when ``x`` has that
    many rows; from ``weight`` itself otherwise."""
    import torch

    return torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)


def onednn_linear(x: Any, packed: Any) -> Any:
    """``x @ weight.T`` from ``packed`` (the weight in oneDNN's layout), for any row count."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _broken(what: str) -> RuntimeError:
    import torch

    return RuntimeError(f"torch {torch.__version__}: {what}; boltstream.inference.torch_internals was checked "
                        f"with {', '.join(CHECKED_WITH['torch'])}")


def check_api(rows: int = 16) -> tuple[str, ...]:
    """Raise RuntimeError, naming the installed torch, unless the operators behave as the contract says.

    Returns the packings checked, as "<dtype> <packing>": MKL's for float32, and oneDNN's for each dtype
    this CPU lets it lay out (elsewhere :func:`packing_for` never picks it, so nothing relies on it).
    """
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    checked = []
    for dtype, packing, tol in ((torch.float32, "mkl", 1e-4), (torch.float32, "onednn", 1e-4),
                                (torch.bfloat16, "onednn", 2e-2)):
        name = str(dtype).removeprefix("torch.")
        if packing == "onednn" and _operators("onednn") and not onednn_packs(name):
            continue
        if not _operators(packing):
            raise _broken(f"the operators that pack {name} weights ({packing}) are missing")
        weight = torch.randn(96, 64, generator=gen).to(dtype)
        packed = pack(weight, packing, rows)
        for n in (rows, rows - 1, 1):  # for "mkl", the packed product, then the fallback for other row counts
            x = torch.randn(n, 64, generator=gen).to(dtype)
            got = mkl_linear(x, packed, weight, rows) if packing == "mkl" else onednn_linear(x, packed)
            want = F.linear(x, weight)
            if got.shape != want.shape or got.dtype != want.dtype:
                raise _broken(f"{packing}, {n} rows: {got.dtype} {tuple(got.shape)}, F.linear's "
                              f"{want.dtype} {tuple(want.shape)}")
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            if not err <= tol:
                raise _broken(f"{packing}, {n} rows: the product differs from F.linear by {err:.2e} (relative)")
        checked.append(f"{name} {packing}")
    return tuple(checked)
