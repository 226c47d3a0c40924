"""A run in which one rank raises in a Lightning hook before the strategy's set-up:
``fail_before_setup.py DIR START_METHOD HOOK FAIL_RANK`` (HOOK: prepare_data, setup or
configure_model). With ``popen`` Lightning's subprocess launcher re-runs this file for the
other ranks; what reaches stderr is what a user sees. Every process leaves its pid in
DIR/pids, so the test can see that none outlives the run."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

import lightning_dapple  # noqa: E402,F401
from lightning_toys import MLPModule, mlp_loader  # noqa: E402

PLAN = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


class FailingModule(MLPModule):
    """Raises in ``hook`` on ``fail_rank`` only."""

    def __init__(self, hook: str, fail_rank: int) -> None:
        super().__init__()
        self.hook = hook
        self.fail_rank = fail_rank

    def _maybe_fail(self, hook: str) -> None:
        if hook == self.hook and self.trainer.global_rank == self.fail_rank:
            raise ValueError(f"deliberate failure in {hook} on rank {self.fail_rank}")

    def prepare_data(self) -> None:
        self._maybe_fail("prepare_data")

    def setup(self, stage: str) -> None:
        self._maybe_fail("setup")

    def configure_model(self) -> None:
        self._maybe_fail("configure_model")


if __name__ == "__main__":
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    directory, start_method, hook, fail_rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    (Path(directory) / "pids").mkdir(exist_ok=True)
    (Path(directory) / "pids" / str(os.getpid())).touch()
    trainer = Trainer(
        strategy=DappleStrategy(plan=PLAN, timeout_s=60, start_method=start_method),
        accelerator="cpu", devices=2, precision="64-true", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=directory,
    )
    trainer.fit(FailingModule(hook, fail_rank).double(), mlp_loader(3))
