"""A ``Trainer(strategy="dapple")`` job for the reliability tests, configured by the JSON
file in argv[1]. Lightning's subprocess launcher re-runs this file for ranks 1..; under
torchrun every rank runs it. What the tests break is chosen in the config:

* ``kill``: {"rank", "step", "signal"} -- that rank sends itself SIGKILL/SIGSTOP in the
  middle of that step (at its second micro-batch forward);
* ``crash_save``: {"save", "point"} -- rank 0 kills the whole job (its process group) during
  the n-th checkpoint write: "mid-write" (half the bytes written) or "before-rename";
* ``bad``: {"step", "kind"} -- batch ``step`` has the wrong shape or dtype, a NaN target,
  or the last batch is short;
* ``slow_rank_zero``: seconds -- rank 0 works that long alone inside planning (at its first
  forward of layer 0 with autograd on, profiling under ``plan="auto"``) and inside every
  checkpoint write;
* ``kill_planning``: rank 0 sends itself SIGKILL there instead.

Rank 0 writes ``losses.json`` (loss per global step), ``pids/<rank>`` for every rank, and
with ``final`` every rank joins writing ``final.ckpt`` after fit.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_dapple  # noqa: E402,F401
import toy_models  # noqa: E402
from lightning_toys import LossRecorder, MLPModule  # noqa: E402


class JobModule(MLPModule):
    """The tests' MLP, optionally with dropout after each hidden block and a per-step StepLR."""

    def __init__(self, dropout: float = 0.0, scheduler: bool = False) -> None:
        super().__init__()
        if dropout:
            *blocks, head = list(self.layers)
            self.layers = nn.Sequential(*(nn.Sequential(b, nn.Dropout(dropout)) for b in blocks), head)
        self.scheduler = scheduler

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5), "interval": "step"}}


def batches(count: int, rows: int, bad: dict | None) -> list:
    """The tests' MLP batches; ``bad`` spoils one."""
    data = [tuple(t.double() for t in toy_models.mlp_batch(step, rows)) for step in range(count)]
    if bad:
        k, kind = bad["step"], bad["kind"]
        x, y = data[k]
        if kind == "shape":
            data[k] = (torch.cat([x, x[:, :1]], dim=1), y)
        elif kind == "dtype":
            data[k] = ((x * 10).long(), y)
        elif kind == "nan":
            data[k] = (x, torch.full_like(y, float("nan")))
        elif kind == "short":
            data[k] = (x[:1], y[:1])
    return data


def loader(cfg: dict) -> DataLoader:
    data = batches(cfg.get("batches", 3), cfg.get("rows", 12), cfg.get("bad"))
    if cfg.get("resumable"):
        from torch.utils.data import TensorDataset

        from lightning_dapple.strategy.resume import ResumableDataLoader

        xs, ys = zip(*data)
        dataset = TensorDataset(torch.cat(xs), torch.cat(ys))
        return ResumableDataLoader(dataset, batch_size=cfg.get("rows", 12), shuffle=True, seed=7)
    return DataLoader(data, batch_size=None)


class Sabotage(Callback):
    """Records pids; arms the configured kill on the victim rank's first local layer."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.calls = 0

    def on_train_start(self, trainer, pl_module) -> None:
        pids = Path(self.cfg["out"]) / "pids"
        pids.mkdir(exist_ok=True)
        (pids / str(trainer.global_rank)).write_text(f"{os.getpid()} {os.environ.get('MASTER_PORT', '')}")
        if self.cfg.get("topology"):
            write_topology(trainer, Path(self.cfg["out"]) / "topology.json")
        kill = self.cfg.get("kill")
        if not kill or trainer.global_rank != kill["rank"]:
            return
        strategy = trainer.strategy
        layer = pl_module.layers[strategy.held_layers[0]]

        def hook(module, args):
            if trainer.global_step == kill["step"]:
                self.calls += 1
                if self.calls == 2:
                    (Path(self.cfg["out"]) / "killed_at").write_text(repr(time.time()))
                    os.kill(os.getpid(), getattr(signal, "SIG" + kill["signal"]))

        layer.register_forward_pre_hook(hook)

    def setup(self, trainer, pl_module, stage) -> None:
        """Before the strategy plans: arm rank 0's long work or death inside planning."""
        slow, kill = self.cfg.get("slow_rank_zero"), self.cfg.get("kill_planning")
        if trainer.global_rank != 0 or not (slow or kill):
            return
        calls = {"count": 0}

        def hook(module, args):
            if not torch.is_grad_enabled():  # set-up's forward check runs without autograd
                return
            calls["count"] += 1
            if calls["count"] == 1:
                if kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(slow)

        pl_module.layers[0].register_forward_pre_hook(hook)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 0 and self.cfg.get("slow_rank_zero"):
            time.sleep(self.cfg["slow_rank_zero"])

    def on_fit_start(self, trainer, pl_module) -> None:
        crash = self.cfg.get("crash_save")
        if crash and trainer.global_rank == 0:
            arm_crash(crash["save"], crash["point"])


def write_topology(trainer, path: Path) -> None:
    """Every rank joins; rank 0 writes the launch shape, rank -> node map and placement."""
    from lightning_dapple.execute.topology import placement_lines, report_placement

    strategy = trainer.strategy
    topology = report_placement(strategy.cluster_environment, strategy.num_nodes, strategy.num_processes, strategy.plan)
    if trainer.global_rank == 0:
        lines = placement_lines(trainer.strategy.plan, topology)
        shape = topology.shape
        path.write_text(json.dumps({"nodes": shape.nodes, "per_node": shape.per_node, "source": shape.source, "node_of_rank": list(topology.node_of_rank), "lines": lines}))


def arm_crash(save_number: int, point: str) -> None:
    """Kill every rank (the job's process group) at ``point`` of the n-th checkpoint write."""
    from lightning_dapple import atomic_files
    from lightning_dapple.strategy import checkpoint

    state = {"count": 0, "armed": False}
    real_save, real_replace = torch.save, os.replace
    real_write = checkpoint.AtomicCheckpointIO.save_checkpoint

    def die() -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def write(self, *args, **kwargs):
        state["count"] += 1
        state["armed"] = state["count"] == save_number
        return real_write(self, *args, **kwargs)

    def save(obj, stream, *args, **kwargs):
        if state["armed"] and point == "mid-write":
            import io

            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            stream.write(buffer.getvalue()[: buffer.tell() // 2])
            stream.flush()
            die()
        return real_save(obj, stream, *args, **kwargs)

    def replace(src, dst):
        if state["armed"] and point == "before-rename":
            die()
        return real_replace(src, dst)

    checkpoint.AtomicCheckpointIO.save_checkpoint = write
    checkpoint.torch.save = save
    atomic_files.os.replace = replace


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(cfg["out"])
    torch.set_num_threads(1)
    seed_everything(cfg.get("seed", 0), verbose=False)
    from lightning_dapple.strategy import DappleStrategy

    callbacks = [Sabotage(cfg), LossRecorder(str(out / "losses.json"))]
    if cfg.get("ckpt"):
        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=cfg["ckpt"]["every"], save_top_k=-1, save_last=cfg["ckpt"].get("last", False)))
    trainer = Trainer(
        strategy=DappleStrategy(plan=cfg["plan"], timeout_s=cfg.get("timeout_s", 60), **cfg.get("strategy", {})),
        accelerator="cpu", devices=cfg["devices"], num_nodes=cfg.get("num_nodes", 1), precision="64-true",
        max_steps=cfg["steps"], gradient_clip_val=0.5, logger=False, enable_checkpointing=bool(cfg.get("ckpt")),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), callbacks=callbacks,
    )
    model = JobModule(cfg.get("dropout", 0.0), cfg.get("scheduler", False))
    if cfg.get("double", True):
        model = model.double()  # else float32, converted by precision="64-true" as users leave it
    trainer.fit(model, loader(cfg), ckpt_path=cfg.get("resume"))
    if cfg.get("final"):
        trainer.save_checkpoint(str(out / "final.ckpt"))


if __name__ == "__main__":
    main()
