"""A misspelled or unknown key in a plan is an error that names the nearest valid key."""
from __future__ import annotations

import json

import pytest

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import load_plan, plan_from_dict

GOOD = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1]}]}


def test_a_good_plan_loads() -> None:
    assert plan_from_dict(GOOD).micro_batches == 2


def test_misspelled_plan_key_names_the_nearest() -> None:
    bad = dict(GOOD)
    bad["micro_batch"] = bad.pop("micro_batches")
    bad["micro_batches"] = 2
    with pytest.raises(DappleConfigError, match=r"plan\.micro_batch: is not a known key.*'micro_batches'"):
        plan_from_dict(bad)
    with pytest.raises(DappleConfigError, match="'schedule'"):
        plan_from_dict({**GOOD, "schedul": "gpipe"})


def test_misspelled_stage_key_and_unknown_key(tmp_path) -> None:  # noqa: ANN001
    stages = [{"layers": [0, 2], "devices": [0], "warmpu": 1}, {"layers": [2, 4], "devices": [1]}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**GOOD, "stages": stages}))
    with pytest.raises(DappleConfigError, match=r"stages\[0\]\.warmpu.*'warmup'"):
        load_plan(path)
    with pytest.raises(DappleConfigError, match="valid keys: global_batch_size"):
        plan_from_dict({**GOOD, "zzzz": 1})
