"""Train with Trainer(strategy="dapple") from a script: Lightning's subprocess launcher
re-runs this file for ranks 1-3. Rank 0 writes the result to the path in argv[1]."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

import lightning_dapple  # noqa: E402,F401
from lightning_toys import MLPModule, mlp_loader, single_device_run  # noqa: E402

PLAN = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1, 2]}, {"layers": [4, 5], "devices": [3]}]}

if __name__ == "__main__":
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    model = MLPModule().double()
    trainer = Trainer(
        strategy=DappleStrategy(plan=PLAN, timeout_s=60),
        accelerator="cpu", devices=4, precision="64-true", max_steps=3, gradient_clip_val=0.5,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(Path(sys.argv[1]).parent),
    )
    trainer.fit(model, mlp_loader(3))
    loss = float(trainer.callback_metrics["train_loss"])
    predictions = trainer.predict(model, mlp_loader(2))
    if trainer.global_rank == 0:
        reference, _ = single_device_run(3, clip=0.5, return_model=True)
        state, expected = model.state_dict(), reference.state_dict()
        diff = max(float((state[k] - expected[k]).abs().max()) for k in expected)
        with torch.no_grad():
            pred_diff = max(float((got - reference(x)).abs().max()) for (x, _), got in zip(mlp_loader(2), predictions))
        result = {"max_diff": diff, "loss": loss, "prediction_batches": len(predictions), "prediction_diff": pred_diff}
        Path(sys.argv[1]).write_text(json.dumps(result))
