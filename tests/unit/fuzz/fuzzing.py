"""Shared hypothesis settings and byte mutators for the fuzz targets.

Fast form (inside ``make test``): ``FAST_EXAMPLES`` inputs per target, seconds in all.
Long form: ``BOLTSTREAM_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest -p no:cacheprovider tests/unit/fuzz``
(or ``make fuzz``); the count applies to every target. No example database is written (runs are
reproducible from the printed ``@reproduce_failure`` / falsifying example instead), and there is no
per-example deadline: a hang is caught by pytest-timeout, a slow input by ``SLOW_S`` in the targets (CPU time where the work runs in the test thread).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FAST_EXAMPLES = 300
ENV = "BOLTSTREAM_FUZZ_EXAMPLES"


def examples(fast: int = FAST_EXAMPLES) -> int:
    """How many inputs each target runs: ``$BOLTSTREAM_FUZZ_EXAMPLES`` or the fast default."""
    raw = os.environ.get(ENV)
    if not raw:
        return fast
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"{ENV} must be an integer, got {raw!r}") from None


def fuzz_settings(fast: int = FAST_EXAMPLES) -> settings:
    return settings(
        max_examples=examples(fast),
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )


#: Any JSON value, with the numbers and strings that break parsers more often than random ones do.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62) | st.floats() | st.sampled_from([5e-324, 1e-300])
    | st.text(max_size=40) | st.sampled_from(["", "5", "-1", "ab" * 16, "cd" * 8, "1e400", "SPAN_KIND_CLIENT"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    """A valid input damaged the ways real corruption damages it: bit flips, byte overwrites,
    truncation, insertion, deletion, duplicated slices, and splices of two inputs."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "set", "truncate", "insert", "delete", "dup", "splice")))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and pos < len(data):
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and pos < len(data):
            data[pos] = draw(st.sampled_from((0x00, 0x01, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255)))))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "dup":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 32))]
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            data[pos:] = other[draw(st.integers(0, len(other))):]
    return bytes(data)
