"""What a desk review of the NCCL paths predicted, caught where the mechanism shows on a CPU:
subgroups wait as long as the default group, a mixed-backend group is read the same way by
the collective's device and by its wait, and only NCCL's own dtypes travel as themselves."""
from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_dapple.execute import groups as groups_module
from lightning_dapple.execute.transfer import wires
from lightning_dapple.execute.groups import build_groups, collective_device
from lightning_dapple.execute.process_groups import default_timeout, subgroup
from lightning_dapple.plan.plan import plan_from_dict

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dapple"


def test_every_subgroup_the_package_makes_carries_a_timeout() -> None:
    """``new_group`` without a timeout gets torch's default (10 or 30 minutes), not the
    strategy's ``timeout_s``: every call passes one or goes through ``subgroup``."""
    bare = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "process_groups.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "new_group":
                if not any(keyword.arg == "timeout" for keyword in node.keywords):
                    bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert bare == []


def test_subgroups_take_the_default_groups_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=77))
    assert default_timeout() == timedelta(seconds=77)
    made: list[dict] = []
    original = dist.new_group

    def recording(*args, **kwargs):
        made.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    subgroup([0])
    build_groups(plan_from_dict({"global_batch_size": 2, "micro_batches": 1, "stages": [{"layers": [0, 1], "devices": [0]}]}))
    assert made and all(kwargs.get("timeout") == timedelta(seconds=77) for kwargs in made)


@pytest.mark.parametrize(("backend", "device", "expected"), [
    ("cpu:gloo,cuda:nccl", torch.device("cuda", 0), torch.device("cuda", 0)),
    ("cpu:gloo,cuda:nccl", torch.device("cpu"), torch.device("cpu")),
    ("gloo", torch.device("cuda", 0), torch.device("cpu")),
    ("nccl", torch.device("cuda", 0), torch.device("cuda", 0)),
])
def test_a_collectives_device_and_its_wait_read_a_mixed_backend_alike(monkeypatch, backend, device, expected) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert collective_device(None, device) == expected
    assert wires.waits_on_device(device, None) == (expected.type == "cuda")
    assert groups_module.collective_device(None, device).type == ("cuda" if wires.waits_on_device(device) else "cpu")


def test_only_nccls_own_dtypes_travel_as_themselves() -> None:
    typed = wires.NcclWire.typed
    assert typed(torch.float32) and typed(torch.bfloat16) and typed(torch.int64) and typed(torch.uint8)
    assert not typed(torch.int16) and not typed(torch.bool) and not typed(torch.complex64)


# -- torch below 2.5: the nccl wire's link set-up would hang --------------------------------


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.4.0"])
def test_the_nccl_wire_is_refused_on_torch_below_2_5_with_the_fix(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """On torch < 2.5 a two-rank group's first send may split from the default communicator,
    which every rank must join, while the wire connects one pair at a time: refused before
    training, with the upgrade named."""
    from lightning_dapple.errors import DappleConfigError

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(wires, "backend_for", lambda device, group=None: "nccl")
    monkeypatch.setattr(torch, "__version__", version)
    for wire in ("auto", "nccl"):
        with pytest.raises(DappleConfigError, match=r"upgrade torch to 2\.5 or later") as refused:
            wires.choose_wire(wire, cuda)
        assert len(str(refused.value).splitlines()) == 1 and version.split("+")[0] in str(refused.value)
    monkeypatch.setattr(torch, "__version__", "2.5.0+cu124")
    assert wires.choose_wire("auto", cuda) == "nccl" and wires.choose_wire("nccl", cuda) == "nccl"


def test_the_nccl_wire_over_gloo_runs_on_any_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU tests' nccl wire runs over gloo: no NCCL communicator, nothing to refuse."""
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    assert wires.choose_wire("nccl", torch.device("cpu")) == "nccl"


def test_the_torch_floor_and_the_nccl_minimum_are_stated_in_the_gpu_docs() -> None:
    """pyproject's torch floor stays below 2.5 (CPU and one-GPU runs work there); the GPU page
    says both, and that several GPUs under NCCL need 2.5."""
    import re

    root = PACKAGE.parent
    floor = re.search(r'"torch>=([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)
    assert tuple(int(part) for part in floor.split(".")[:2]) < wires.NCCL_LINKS_TORCH
    text = (root / "docs" / "gpus.md").read_text()
    assert f"torch>={floor}" in text and "torch 2.5" in text


# -- every process group waits as long as the default group -------------------------------


def _calls_missing_timeout(names: tuple[str, ...]) -> list[str]:
    """Calls of ``names`` without ``timeout=`` (``subgroup`` passes the default group's,
    read at run time: test_subgroups_take_the_default_groups_timeout)."""
    bare = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "process_groups.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in names and not any(keyword.arg == "timeout" for keyword in node.keywords):
                bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return bare


def test_every_group_the_package_opens_is_given_a_timeout() -> None:
    """Default groups (``init_process_group``, Lightning's ``_init_dist_connection``) and every
    ``new_group``: none left to torch's default (tests/test_nccl_communicators.py checks the
    values the executor's groups get at run time)."""
    assert _calls_missing_timeout(("init_process_group", "_init_dist_connection", "new_group")) == []


def test_new_group_is_called_only_by_subgroup_and_the_checkpoint_lanes() -> None:
    """Every other group goes through ``subgroup`` (the default group's timeout, watched by
    the failure channel); the two gloo lanes of checkpoints set their own (the part lane
    ``timeout_s``, the sharded writers at least that: a writer waits for the slowest)."""
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "new_group":
                callers.add(str(path.relative_to(PACKAGE)))
    assert callers == {"execute/process_groups.py", "strategy/part_stream.py", "strategy/sharded_checkpoint.py"}
    strategy = (PACKAGE / "strategy" / "checkpoint_hooks.py").read_text()
    assert "open_part_lane(ckpt.PartTurns(self.failure), timedelta(seconds=self.timeout_s))" in strategy


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_default_group_gets_the_strategys_timeout(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """``DappleStrategy(timeout_s=...)`` opens the default group with that timeout, under gloo
    (its own set-up) and NCCL (Lightning's DDP set-up)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import ddp as lightning_ddp

    from lightning_dapple.strategy import dapple_strategy
    from lightning_dapple.strategy.dapple_strategy import DappleStrategy

    opened: list[dict] = []
    record = lambda environment, chosen, **kwargs: opened.append({"backend": chosen, **kwargs})  # noqa: E731
    monkeypatch.setattr(dapple_strategy, "_init_dist_connection", record)
    monkeypatch.setattr(lightning_ddp, "_init_dist_connection", record)
    strategy = DappleStrategy(
        timeout_s=7, process_group_backend=backend, cluster_environment=LightningEnvironment(), parallel_devices=[torch.device("cpu")]
    )
    strategy.setup_distributed()
    assert [(entry["backend"], entry["timeout"]) for entry in opened] == [(backend, timedelta(seconds=7))]


# -- every wait watched ------------------------------------------------------------------------


def _channel(monkeypatch: pytest.MonkeyPatch):
    from lightning_dapple.execute.failure import FailureChannel

    channel = FailureChannel(0, timeout_s=30, store=dist.HashStore(), world_size=1)
    return channel


def test_making_a_group_marks_the_host_blocked_and_splits_under_nccl_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group being made waits for every rank (under NCCL a communicator split with no
    timeout of its own): the failure channel's rules apply meanwhile."""
    from lightning_dapple.execute import process_groups

    channel = _channel(monkeypatch)
    seen = []
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: seen.append(channel._waiting()))
    try:
        for backend in ("gloo", "nccl"):
            process_groups.subgroup([0, 1], backend=backend)
    finally:
        channel.close()
    assert [(w.bounded_here, "process group of ranks [0, 1]" in w.what) for w in seen] == [(False, True), (True, True)]
    assert channel._waiting() is None


def test_device_waits_mark_the_host_blocked_for_blocking_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``TORCH_NCCL_BLOCKING_WAIT=1`` ``Work.wait()`` blocks the host: the wait counts as
    blocked (bounded by the watchdog), and the event filed afterwards is watched as before."""

    class Work:
        def wait(self) -> None:
            seen.append(channel._waiting())

    class Event:
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return False

    channel = _channel(monkeypatch)
    seen: list = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    try:
        channel.wait_on_device([Work(), Work()], "a receive from rank 1", None)
        assert [(w.what, w.bounded_here) for w in seen] == [("a receive from rank 1", True)] * 2
        assert channel._blocking is None and channel._waiting().what == "a receive from rank 1"  # the event, watched
    finally:
        channel.close()


def test_lightnings_per_batch_sigterm_broadcast_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every batch, a collective the
    strategy does not issue: wrapped so that the host counts as blocked meanwhile."""
    from types import SimpleNamespace

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_dapple.strategy.reporting import SIGTERM_BROADCAST, watch_for_lightning_waits

    assert hasattr(_TrainingEpochLoop, SIGTERM_BROADCAST)  # the hook still exists in this Lightning

    class Loop:
        def _broadcast_sigterm_tensor(self) -> None:
            seen.append(channel._waiting())

    seen: list = []
    loop = Loop()
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), strategy=SimpleNamespace(root_device=torch.device("cpu")))
    channel = _channel(monkeypatch)
    try:
        watch_for_lightning_waits(trainer)
        watch_for_lightning_waits(trainer)  # once per loop
        loop._broadcast_sigterm_tensor()
    finally:
        channel.close()
    assert len(seen) == 1 and "SIGTERM broadcast" in seen[0].what and not seen[0].bounded_here
    assert channel._waiting() is None


def test_the_strategy_watches_lightnings_broadcast_from_its_set_up(tmp_path: Path) -> None:
    """A fit through the strategy leaves its training loop's SIGTERM broadcast watched."""
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dapple.strategy.dapple_strategy import DappleStrategy

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}]}
    loader = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=30), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(Net(), loader)
    loop = trainer.fit_loop.epoch_loop
    assert loop._dapple_watched and loop._broadcast_sigterm_tensor.__name__ == "watched_broadcast"
