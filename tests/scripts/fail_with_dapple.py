"""A run in which one rank raises at step 1: ``fail_with_dapple.py DIR START_METHOD FAIL_RANK``.

With ``popen`` Lightning's subprocess launcher re-runs this file for the other ranks; with
``spawn`` the ranks are started by Lightning's multiprocessing launcher. What reaches
stderr is what a user sees."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

import lightning_dapple  # noqa: E402,F401
from lightning_toys import MLPModule, mlp_loader  # noqa: E402

PLAN = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}

if __name__ == "__main__":
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    directory, start_method, fail_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    trainer = Trainer(
        strategy=DappleStrategy(plan=PLAN, timeout_s=60, start_method=start_method),
        accelerator="cpu", devices=2, precision="64-true", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=directory,
    )
    trainer.fit(MLPModule(fail_at_step=1, fail_rank=fail_rank).double(), mlp_loader(3))
