"""Every use of a private torch API, in one place: MKL's packed float32 products for the decode step.

Why: a decode step of 16 rows multiplies them by every weight matrix once, and
the step is bound by reading the weights. MKL's ``sgemm`` at so few rows copies
(packs) each weight panel before using it: on a 2-core Xeon, SmolLM2-135M's
538 MB of float32 weights went through ``F.linear`` at ~8 GB/s for 16 rows
against ~22 GB/s for one row (where MKL reads them in place). Packed once per
model with ``cblas_sgemm_pack`` (what these ops wrap), the same products take
~0.75x the time. torch exposes the pair only as private operators (they exist
for its own CPU inference passes), so nothing outside this module calls them.

The contract (torch, as of the versions in :data:`CHECKED_WITH`; MKL builds only):

* ``torch.ops.mkl._mkl_reorder_linear_weight(weight, batch_size)`` takes a float32
  ``[out, in]`` weight (``F.linear``'s layout) and returns an opaque tensor holding it
  packed for products of exactly ``batch_size`` rows (as many bytes as the weight);
* ``torch.ops.mkl._mkl_linear(x, packed, weight, bias, batch_size)`` returns
  ``x @ weight.T`` (+ ``bias``) from the packed copy when ``x`` has ``batch_size`` rows,
  and falls back to ``F.linear(x, weight, bias)`` for any other row count.

:func:`check_api` checks both on real tensors; ``tests/unit/inference/test_torch_internals.py``
calls it and fails, naming the version, when the installed torch is not one in :data:`CHECKED_WITH`.
Where the operators are missing (a torch built without MKL, another CPU architecture),
:func:`packing_available` is False and the step multiplies with ``F.linear``.
"""

from __future__ import annotations

from typing import Any

# distribution -> versions this module's contract was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {"torch": ("2.13.0", "2.13.0+cpu")}


def packing_available() -> bool:
    """Whether this torch has MKL and the two packing operators."""
    import torch

    try:
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear") \
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def pack(weight: Any, rows: int) -> Any:
    """``weight`` (float32 ``[out, in]``) packed for products of exactly ``rows`` rows."""
    import torch

    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), rows)


def packed_linear(x: Any, packed: Any, weight: Any, rows: int) -> Any:
    """``x @ weight.T`` from ``packed`` (made by :func:`pack` for ``rows`` rows) when ``x`` has that many
    rows; the weight itself otherwise."""
    import torch

    return torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)


def _broken(what: str) -> RuntimeError:
    import torch

    return RuntimeError(f"torch {torch.__version__}: {what}; boltstream.inference.torch_internals was checked "
                        f"with {', '.join(CHECKED_WITH['torch'])}")


def check_api(rows: int = 16) -> None:
    """Raise RuntimeError, naming the installed torch, unless the operators behave as the contract says."""
    import torch
    import torch.nn.functional as F

    if not packing_available():
        raise _broken("torch.ops.mkl._mkl_linear / _mkl_reorder_linear_weight are missing")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    packed = pack(weight, rows)
    for n in (rows, rows - 1):  # the packed product, then the fallback for another row count
        x = torch.randn(n, 64, generator=gen)
        got = packed_linear(x, packed, weight, rows)
        want = F.linear(x, weight)
        if got.shape != want.shape:
            raise _broken(f"{n} rows: shape {tuple(got.shape)}, F.linear's {tuple(want.shape)}")
        err = float((got - want).abs().max())
        if not err <= 1e-4:
            raise _broken(f"{n} rows: the product differs from F.linear by {err:.2e}")
