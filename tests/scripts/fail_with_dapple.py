"""A run in which one rank raises at step 1: ``fail_with_dapple.py DIR START_METHOD FAIL_RANK [KIND]``.

KIND ``runtime`` (the default) raises a RuntimeError; ``refusal`` raises a DappleConfigError
in the last stage's part of the step, as the strategy's own refusals found there do (the
loss check, a second ``self(...)`` call): only that rank knows it; ``hook:NAME`` raises a
RuntimeError from the Lightning hook NAME (a callback's, or the module's
``configure_optimizers``) on FAIL_RANK only.

With ``popen`` Lightning's subprocess launcher re-runs this file for the other ranks; with
``spawn`` the ranks are started by Lightning's multiprocessing launcher. What reaches
stderr is what a user sees."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402

import lightning_dapple  # noqa: E402,F401
from lightning_dapple.errors import DappleConfigError  # noqa: E402
from lightning_toys import MLPModule, mlp_loader  # noqa: E402

PLAN = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


class RefusingMLP(MLPModule):
    """Refuses its step past ``self(...)`` on one rank, as a last-stage check would."""

    def training_step(self, batch, batch_idx):
        out = self(batch[0])
        if batch_idx == self.fail_at_step and self.global_rank == self.fail_rank:
            raise DappleConfigError("training_step", f"deliberate refusal at step {batch_idx}", "do not refuse")
        return (out - batch[1]).pow(2).mean()


class FailingHook(Callback):
    """Raises from one Lightning hook, on one rank."""

    def __init__(self, hook: str, rank: int) -> None:
        self.rank = rank
        setattr(self, hook, self._fail)

    def _fail(self, trainer, *args, **kwargs) -> None:
        if trainer.global_rank == self.rank:
            raise RuntimeError(f"deliberate failure in a hook on rank {self.rank}")


class FailingOptimizers(MLPModule):
    def configure_optimizers(self):
        if self.global_rank == self.fail_rank:
            raise RuntimeError(f"deliberate failure in a hook on rank {self.fail_rank}")
        return super().configure_optimizers()


if __name__ == "__main__":
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    directory, start_method, fail_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "runtime"
    model_class = {"refusal": RefusingMLP, "hook:configure_optimizers": FailingOptimizers}.get(kind, MLPModule)
    hook = kind.partition(":")[2] if kind.startswith("hook:") and kind != "hook:configure_optimizers" else None
    trainer = Trainer(
        strategy=DappleStrategy(plan=PLAN, timeout_s=60, start_method=start_method),
        accelerator="cpu", devices=2, precision="64-true", max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=directory, callbacks=[FailingHook(hook, fail_rank)] if hook else [],
    )
    fail_at_step = 1 if kind in ("runtime", "refusal") else None
    trainer.fit(model_class(fail_at_step=fail_at_step, fail_rank=fail_rank).double(), mlp_loader(3))
