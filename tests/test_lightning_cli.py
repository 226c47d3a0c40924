"""The strategy under LightningCLI (jsonargparse): configured by class path from YAML or flags,
its DDP-only inherited arguments accepted at their defaults and refused when set."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.ddp_options import ddp_defaults

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the test extra)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def test_ddp_options_at_their_defaults_are_accepted() -> None:
    """What a config system writes out for every inherited argument: each at DDPStrategy's
    (or DistributedDataParallel's) default, so none asks for anything."""
    defaults = {k: v for k, v in ddp_defaults().items() if k not in ("start_method", "accelerator", "parallel_devices", "cluster_environment",
                                                                         "checkpoint_io", "precision_plugin", "process_group_backend")}
    assert {"find_unused_parameters", "ddp_comm_hook", "timeout", "broadcast_buffers"} <= set(defaults)
    strategy = DappleStrategy(micro_batches=2, **defaults)
    assert strategy.timeout_s == 120.0 and strategy._timeout == timedelta(seconds=120)


@pytest.mark.parametrize(("option", "value"), [("find_unused_parameters", True), ("bucket_cap_mb", 50), ("timeout", timedelta(seconds=60)), ("dim", 1)])
def test_a_ddp_option_set_to_another_value_is_still_refused(option: str, value: object) -> None:
    with pytest.raises(DappleConfigError, match=f"DappleStrategy\\({option}=...\\).*Fix: remove {option}"):
        DappleStrategy(**{option: value})


def test_print_config_shows_only_the_strategy_arguments(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_cli.py"), "fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--print_config"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "class_path: lightning_dapple.DappleStrategy" in result.stdout and "micro_batches: 2" in result.stdout
    for ddp_only in ("find_unused_parameters", "ddp_comm_hook", "bucket_cap_mb", "broadcast_buffers"):
        assert ddp_only not in result.stdout


@pytest.mark.timeout(300)
def test_lightning_cli_trains_from_the_yaml_on_two_processes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_cli.py"), "fit", "--config", str(EXAMPLES / "lightning_cli.yaml"), "--trainer.max_steps=3"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final train_loss" in result.stdout, result.stdout[-2000:]
    assert "dapple stage 1" in result.stderr + result.stdout  # two stages: the strategy ran the pipeline
    assert list(tmp_path.glob("outputs/lightning_cli/lightning_logs/version_*/dapple_plan.json"))
