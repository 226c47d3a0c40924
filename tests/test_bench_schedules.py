"""The chunked mode of ``benchmarks/bench_schedules.py`` compares like with like.

Its step-time ratios mean something only if every variant trains the same model the same
way: lightning_dapple's ``interleaved`` and ``zbv`` and ``torch.distributed.pipelining``'s
``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble`` must place the same blocks on the
same ranks (torch derives its placement from its own rules) and produce the gradients of one
process. The script, run as users run it at a tiny width on 4 ranks, must finish, and its
JSON must show every variant's first-step loss equal and its parameters after one step those
of one process (which the script also asserts), and the two executors of the same 1F1B
schedule stashing the same bytes on every rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"interleaved", "zbv", "torch-Interleaved1F1B", "torch-ZBVZeroBubble", "dapple", "torch-1F1B"}


@pytest.mark.timeout(420)
def test_chunked_variants_train_as_one_process(tmp_path: Path) -> None:
    out = tmp_path / "chunked.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_schedules.py"), "--ranks", "4", "--chunks", "2"]
    command += ["--width", "16", "--steps", "7", "--block", "1", "--warmup", "1", "--timeout", "300", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"]["8"]
    assert set(rows) == VARIANTS
    change = rows["dapple"]["largest_param_change"]
    assert change > 0
    for name, row in rows.items():
        assert row["first_loss_diff_vs_dapple"] <= 1e-5, (name, row["first_loss"])
        # the tolerance tells apart a gradient off by a factor, which moves a parameter by a
        # large part of the step's change
        assert row["param_tolerance"] < 0.01 * change, (name, row["param_tolerance"], change)
        assert row["param_diff_after_one_step"] <= row["param_tolerance"], (name, row["param_diff_after_one_step"])
        assert len(row["peak_stash_view_bytes_per_rank"]) == 4 and min(row["peak_stash_view_bytes_per_rank"]) > 0, name
    assert rows["dapple"]["peak_stash_view_bytes_per_rank"] == rows["torch-1F1B"]["peak_stash_view_bytes_per_rank"]
    assert set(data["pairs"]["8"]) == {"interleaved/torch-Interleaved1F1B", "zbv/torch-ZBVZeroBubble", "dapple/torch-1F1B"}
    # 16 blocks, 8 stages of 2: rank r holds stages r and r + 4 (interleaved) or 7 - r (V)
    interleaved = [[2 * r, 2 * r + 1, 2 * r + 8, 2 * r + 9] for r in range(4)]
    v = [sorted([2 * r, 2 * r + 1, 14 - 2 * r, 15 - 2 * r]) for r in range(4)]
    straight = [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    for names, blocks in (
        (("interleaved", "torch-Interleaved1F1B"), interleaved), (("zbv", "torch-ZBVZeroBubble"), v), (("dapple", "torch-1F1B"), straight)
    ):
        for name in names:
            assert rows[name]["blocks_per_rank"] == blocks, (name, rows[name]["blocks_per_rank"])
