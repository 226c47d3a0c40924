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
from lightning_dapple.execute import wires
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
