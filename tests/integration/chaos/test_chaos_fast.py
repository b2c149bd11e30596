"""The fast form of ``make chaos``: two fault scenarios on the real pipeline end with lost = 0 and
duplicated = 0 at the learner (see chaos_scenarios.py for what runs and how it is reconciled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.config import Settings
from tests.integration.chaos.chaos_scenarios import HEADER, run_scenario


# Killing a stream worker meets the open failure docs/streams.md describes (and
# tests/integration/streams/test_stream_crash.py reruns once for): now and then the restarted worker's faust
# recovery raises ConsistencyError, a changelog offset it applied above the high watermark Tansu reports.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", [pytest.param("sigkill-stream-worker", marks=pytest.mark.flaky(reruns=1)),
                                      "sigkill-learner"])
async def test_fault_loses_and_duplicates_nothing(scenario: str, settings: Settings, settings_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    result = await run_scenario(scenario, settings, settings_env, tmp_path)
    print(f"\n{HEADER}\n{result.row()}  ({result.seconds:.0f}s)")
    assert result.recovery_s is not None
    assert (result.lost, result.duplicated, result.unexpected) == (0, 0, 0), result
    assert result.samples_trained == result.expected_samples
