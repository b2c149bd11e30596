"""The fast form of ``make chaos``: two fault scenarios on the real pipeline end with lost = 0 and
duplicated = 0 at the learner (see chaos_scenarios.py for what runs and how it is reconciled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.config import Settings
from tests.integration.chaos.chaos_scenarios import HEADER, run_scenario


@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario", ["sigkill-stream-worker", "sigkill-learner"])
async def test_fault_loses_and_duplicates_nothing(scenario: str, settings: Settings, settings_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    result = await run_scenario(scenario, settings, settings_env, tmp_path)
    print(f"\n{HEADER}\n{result.row()}  ({result.seconds:.0f}s)")
    assert result.recovery_s is not None
    assert (result.lost, result.duplicated, result.unexpected) == (0, 0, 0), result
    assert result.samples_trained == result.expected_samples
