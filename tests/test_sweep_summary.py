"""The sweep summary of ``dapple-train -m`` on hand-made result records: the simulated step
beside the measured one and their ratio, the sentence for a simulator whose fastest run is
not the measured fastest, the ``tuning`` column, and one summary per sweep directory laid
out as ``multirun/<time>/<job>_<recipe>/``. (A real two-recipe sweep: tests/test_recipes.py.)"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lightning_dapple.app import summary
from lightning_dapple.app.run_results import plan_record, simulator_advice
from lightning_dapple.app.summary import (
    SUMMARY_COLUMNS,
    SweepSummary,
    collect_results,
    ranking_note,
    summarize,
    tuning_label,
    write_summary,
)
from lightning_dapple.plan.plan import Plan, StagePlan

TUNING = {
    "steps": 3,
    "cached": False,
    "chosen": "2 stages",
    "simulator_choice": "data parallel",
    "candidates": [
        {"label": "data parallel", "simulated_ms": 18.0, "measured_ms": 60.2},
        {"label": "2 stages", "simulated_ms": 21.5, "measured_ms": 48.6},
    ],
}


def _result(job: int, recipe: str, measured: float | None, simulated: float | None, status: str = "ok", **plan: Any) -> dict[str, Any]:
    return {
        "job": job,
        "overrides": [f"recipe={recipe}", "trainer.max_steps=3"],
        "status": status,
        "plan": {"kind": "pipeline", "micro_batches": 4, "schedule": "dapple", **plan},
        "median_step_ms": measured,
        "simulated_step_ms": simulated,
        "peak_stash_bytes": 1024,
        "peak_memory_bytes_per_rank": [3 << 20, 5 << 20],
        "metrics": {"train_loss": 2.345678},
        "steps": 3,
        "run_dir": f"/sweep/{job}_{recipe}",
        "error": None if status == "ok" else "bad",
    }


def test_rows_carry_the_simulated_step_and_the_ratio(tmp_path: Path) -> None:
    rows = summarize([_result(0, "bert_tiny", 48.6, 20.0), _result(1, "gnmt_tiny", 30.0, None)])
    assert rows[0]["simulated_step_ms"] == 20.0
    assert rows[0]["measured_over_simulated"] == 2.43  # 48.6 / 20.0, two decimals
    assert rows[1]["simulated_step_ms"] is None and rows[1]["measured_over_simulated"] is None
    assert rows[0]["overrides"] == "recipe=bert_tiny"  # only the keys that differ name the run
    assert rows[0]["peak_memory_bytes"] == 5 << 20  # the largest rank's
    assert summarize([{**_result(2, "vgg_tiny", 1.0, 1.0), "peak_memory_bytes_per_rank": None}])[0]["peak_memory_bytes"] is None
    write_summary(rows, tmp_path / "summary.csv")
    written = list(csv.DictReader((tmp_path / "summary.csv").read_text().splitlines()))
    assert tuple(written[0]) == SUMMARY_COLUMNS
    assert (written[0]["simulated_step_ms"], written[0]["measured_over_simulated"]) == ("20.0", "2.43")
    assert (written[1]["simulated_step_ms"], written[1]["measured_over_simulated"]) == ("", "")


def test_the_sentence_appears_when_the_simulator_picks_another_fastest_run() -> None:
    rows = summarize([_result(0, "bert_tiny", 48.6, 21.5), _result(1, "gnmt_tiny", 60.2, 18.0)])
    assert ranking_note(rows) == "The simulator ranks job 1 fastest (18.00 ms simulated); measured, job 0 is fastest (48.60 ms)."


@pytest.mark.parametrize(
    "results",
    [
        pytest.param([_result(0, "bert_tiny", 48.6, 18.0), _result(1, "gnmt_tiny", 60.2, 21.5)], id="same fastest"),
        pytest.param([_result(0, "bert_tiny", 48.6, 18.0), _result(1, "gnmt_tiny", 60.2, 18.0)], id="tied in the simulator"),
        # the measured fastest has no simulated figure, and a failed run does not count
        pytest.param([_result(0, "bert_tiny", 10.0, None), _result(1, "gnmt_tiny", 60.2, 18.0), _result(2, "vgg_tiny", 70.0, 30.0)], id="unranked"),
        pytest.param([_result(0, "bert_tiny", 10.0, 40.0, status="error"), _result(1, "gnmt_tiny", 60.2, 18.0), _result(2, "vgg_tiny", 70.0, 30.0)], id="failed"),
        pytest.param([_result(0, "bert_tiny", 48.6, 18.0)], id="one run"),
    ],
)
def test_no_sentence_when_the_rankings_agree_or_cannot_be_compared(results: list[dict[str, Any]]) -> None:
    assert ranking_note(summarize(results)) is None


def test_the_tuning_column_says_what_measuring_kept_or_changed() -> None:
    assert tuning_label(None) == ""
    assert tuning_label(TUNING) == "measured 2 stages over data parallel"
    assert tuning_label({**TUNING, "chosen": "data parallel"}) == "kept data parallel"
    rows = summarize([_result(0, "bert_tiny", 48.6, 21.5, tuning=TUNING), _result(1, "gnmt_tiny", 60.2, 18.0)])
    assert [row["tuning"] for row in rows] == ["measured 2 stages over data parallel", ""]


def test_plan_record_carries_the_tuning_record(tmp_path: Path) -> None:
    stages = (StagePlan(layers=(0, 2), devices=(0,)), StagePlan(layers=(2, 4), devices=(1,)))
    plan = Plan(global_batch_size=8, micro_batches=4, stages=stages)
    (tmp_path / "plain.json").write_text(json.dumps(plan.to_dict()))
    (tmp_path / "tuned.json").write_text(json.dumps({**plan.to_dict(), "extra": {"tuning": TUNING}}))
    assert "tuning" not in plan_record(tmp_path / "plain.json")
    assert plan_record(tmp_path / "tuned.json")["tuning"] == TUNING


def test_a_run_whose_simulator_was_off_is_told_how_to_measure_instead(tmp_path: Path) -> None:
    stages = (StagePlan(layers=(0, 2), devices=(0,)), StagePlan(layers=(2, 4), devices=(1,)))
    planned = {**Plan(global_batch_size=8, micro_batches=4, stages=stages, planner="dapple").to_dict()}
    (tmp_path / "planned.json").write_text(json.dumps(planned))
    (tmp_path / "manual.json").write_text(json.dumps({**planned, "planner": "manual"}))
    (tmp_path / "tuned.json").write_text(json.dumps({**planned, "extra": {"tuning": TUNING}}))

    def run(plan: str, executor_ms: float, simulated_ms: float = 10.0) -> dict[str, Any]:
        return {"plan": plan_record(tmp_path / plan), "median_phase_ms": {"executor": executor_ms}, "simulated_step_ms": simulated_ms}

    advice = simulator_advice(run("planned.json", 21.0))
    assert "2.10 x the simulated step" in advice and "strategy.tune_steps=N" in advice
    assert "0.50 x" in simulator_advice(run("planned.json", 5.0))
    assert simulator_advice(run("planned.json", 11.4)) == ""  # within 15 %
    assert simulator_advice(run("manual.json", 21.0)) == ""  # the user chose the plan
    assert simulator_advice(run("tuned.json", 21.0)) == ""  # the plan was measured already


def test_one_summary_lists_every_job_of_a_sweep_dir(tmp_path: Path, monkeypatch, capsys) -> None:
    """Jobs of two recipes in ``<sweep>/<job>_<recipe>/`` (read from disk: no in-memory records)."""
    monkeypatch.setattr(summary, "RESULTS", [])
    sweep = tmp_path / "multirun" / "2025-01-01_00-00-00"
    for result in (_result(1, "gnmt_tiny", 60.2, 18.0), _result(0, "bert_tiny", 48.6, 21.5, tuning=TUNING)):
        run_dir = sweep / f"{result['job']}_{result['overrides'][0].partition('=')[2]}"
        run_dir.mkdir(parents=True)
        (run_dir / "result.json").write_text(json.dumps(result))
    assert [r["job"] for r in collect_results(sweep)] == [0, 1]
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [row["overrides"] for row in rows] == ["recipe=bert_tiny", "recipe=gnmt_tiny"]
    sentence = "The simulator ranks job 1 fastest (18.00 ms simulated); measured, job 0 is fastest (48.60 ms)."
    text = (sweep / "summary.txt").read_text()
    assert "step ms (simulated)" in text and "measured / simulated" in text
    assert text.rstrip().endswith(sentence)
    assert sentence in capsys.readouterr().out.replace("\n", " ")
