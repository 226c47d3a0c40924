"""The hardware a plan is made for: machines x devices, two link speeds, device memory.

DAPPLE's evaluation (Table 2) distinguishes hierarchical clusters (8 V100 per machine on
NVLink, 25 Gbit/s between machines: config A) from flat ones (one V100 per machine, 25 or
10 Gbit/s: configs B and C). Global rank ``r`` lives on machine ``r // devices_per_machine``.

Communication costs used by the planner and the simulator live here, so both price a
transfer the same way:

* ``p2p_ms`` -- split-concat transfer of one micro-batch boundary between two device sets
  (DAPPLE 5.2.2). Each machine's network link is shared by all its devices, so bytes that
  leave or enter a machine are charged against that machine's link; bytes that stay on a
  machine are charged per device against the intra-machine link.
* ``allreduce_ms`` -- ring AllReduce of a stage's gradients among its replicas (DAPPLE 4.1,
  AR(P_s, g_s)): 2(r-1)/r of the bytes over the slowest link of the ring.

``shared_cores`` describes CPU processes: the cores that all devices (processes) of one
machine share. The paper's devices are GPUs, each computing on its own; processes that
outnumber their cores compute in turns, which the simulator prices
(``simulate.cores``).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf

from lightning_dapple.errors import DappleConfigError, require

GIB = 1024**3


@dataclass(frozen=True)
class Cluster:
    """Topology and speeds. Bandwidths in Gbit/s as in the paper's Table 2."""

    machines: int
    devices_per_machine: int
    intra_bandwidth_gbps: float = 300.0
    inter_bandwidth_gbps: float = 25.0
    device_memory_gib: float = 16.0
    optimizer_state_factor: float = 2.0
    latency_ms: float = 0.0
    name: str = "custom"
    # CPU cores the devices of one machine share (CPU processes); None: each device computes on its own
    shared_cores: int | None = None
    # fixed cost of one AllReduce call over 2 devices; None: latency_ms, the fixed cost of one transfer
    allreduce_latency_ms: float | None = None
    # what each device beyond 2 adds to that fixed cost
    allreduce_latency_per_rank_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("machines", "devices_per_machine"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"cluster.{name}",
                f"must be a positive integer, got {value!r}",
                "give at least one machine with at least one device",
            )
        for name in ("intra_bandwidth_gbps", "inter_bandwidth_gbps", "device_memory_gib"):
            value = getattr(self, name)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"cluster.{name}",
                f"must be a positive number, got {value!r}",
                "set a positive bandwidth (Gbit/s) or memory size (GiB)",
            )
        value = self.shared_cores
        require(
            value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
            "cluster.shared_cores",
            f"must be a positive integer or null, got {value!r}",
            "give the number of CPU cores the processes of one machine share, or null for devices with their own compute (GPUs)",
        )
        for name in ("optimizer_state_factor", "latency_ms", "allreduce_latency_ms", "allreduce_latency_per_rank_ms"):
            value = getattr(self, name)
            if value is None and name == "allreduce_latency_ms":
                continue
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                f"cluster.{name}",
                f"must be a number >= 0, got {value!r}",
                "use 2.0 for fp32 Adam, 0 for plain SGD" if name == "optimizer_state_factor" else "give milliseconds (0: none)",
            )

    def ring_latency_ms(self, replicas: int) -> float:
        """The fixed cost of one AllReduce over ``replicas`` devices: ``allreduce_latency_ms``
        (else ``latency_ms``) plus ``allreduce_latency_per_rank_ms`` per device beyond 2."""
        base = self.latency_ms if self.allreduce_latency_ms is None else self.allreduce_latency_ms
        return base + self.allreduce_latency_per_rank_ms * max(replicas - 2, 0)

    @property
    def num_devices(self) -> int:
        return self.machines * self.devices_per_machine

    @property
    def device_memory_bytes(self) -> float:
        return self.device_memory_gib * GIB

    def machine_of(self, rank: int) -> int:
        return rank // self.devices_per_machine

    def bytes_per_ms(self, gbps: float) -> float:
        return gbps * 1e9 / 8 / 1e3

    def ring_bandwidth_gbps(self, ranks: Sequence[int]) -> float:
        """Slowest link of a ring over ``ranks``: the network if it spans machines (it does
        when its lowest and highest ranks lie on different machines)."""
        if len(ranks) > 1 and self.machine_of(min(ranks)) != self.machine_of(max(ranks)):
            return self.inter_bandwidth_gbps
        return self.intra_bandwidth_gbps

    def allreduce_ms(self, num_bytes: float, ranks: Sequence[int]) -> float:
        """Ring AllReduce time of ``num_bytes`` among ``ranks`` (0 for a single device)."""
        replicas = len(ranks)
        if replicas <= 1 or num_bytes <= 0:
            return 0.0
        volume = 2.0 * (replicas - 1) / replicas * num_bytes
        return volume / self.bytes_per_ms(self.ring_bandwidth_gbps(ranks)) + self.ring_latency_ms(replicas)

    def p2p_ms(self, num_bytes: float, senders: Sequence[int], receivers: Sequence[int]) -> float:
        """Time to move one micro-batch boundary of ``num_bytes`` from ``senders`` to ``receivers``.

        Rows are split evenly over senders and over receivers (split-concat, DAPPLE 5.2.2);
        each sender/receiver pair moves the rows both hold. Cross-machine bytes share each
        machine's network link; intra-machine bytes are charged per device.
        """
        if num_bytes <= 0:
            return 0.0
        pieces = split_concat_pieces(len(senders), len(receivers))
        network_out: dict[int, float] = {}
        network_in: dict[int, float] = {}
        local_out: dict[int, float] = {}
        local_in: dict[int, float] = {}
        for (i, j), fraction in pieces.items():
            src, dst = senders[i], receivers[j]
            if src == dst:
                continue
            size = fraction * num_bytes
            if self.machine_of(src) != self.machine_of(dst):
                network_out[self.machine_of(src)] = network_out.get(self.machine_of(src), 0.0) + size
                network_in[self.machine_of(dst)] = network_in.get(self.machine_of(dst), 0.0) + size
            else:
                local_out[src] = local_out.get(src, 0.0) + size
                local_in[dst] = local_in.get(dst, 0.0) + size
        network = max([*network_out.values(), *network_in.values(), 0.0]) / self.bytes_per_ms(self.inter_bandwidth_gbps)
        local = max([*local_out.values(), *local_in.values(), 0.0]) / self.bytes_per_ms(self.intra_bandwidth_gbps)
        if network == 0.0 and local == 0.0:
            return 0.0
        return max(network, local) + self.latency_ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_concat_pieces(senders: int, receivers: int) -> dict[tuple[int, int], float]:
    """Fraction of a micro-batch that sender ``i`` passes to receiver ``j``.

    Both sides cut the micro-batch into equal contiguous shares; a pair exchanges the
    overlap of their shares (DAPPLE 5.2.2 split-concat).
    """
    pieces: dict[tuple[int, int], float] = {}
    for i in range(senders):
        lo_i, hi_i = i / senders, (i + 1) / senders
        for j in range(receivers):
            lo = max(lo_i, j / receivers)
            hi = min(hi_i, (j + 1) / receivers)
            if hi > lo + 1e-12:
                pieces[(i, j)] = hi - lo
    return pieces


V100 = {"device_memory_gib": 16.0, "intra_bandwidth_gbps": 300.0 * 8}  # NVLink ~300 GB/s

PRESETS: dict[str, Cluster] = {
    "paper-a": Cluster(2, 8, intra_bandwidth_gbps=V100["intra_bandwidth_gbps"], inter_bandwidth_gbps=25.0, device_memory_gib=16.0, name="paper-a"),
    "paper-b": Cluster(16, 1, intra_bandwidth_gbps=V100["intra_bandwidth_gbps"], inter_bandwidth_gbps=25.0, device_memory_gib=16.0, name="paper-b"),
    "paper-c": Cluster(16, 1, intra_bandwidth_gbps=V100["intra_bandwidth_gbps"], inter_bandwidth_gbps=10.0, device_memory_gib=16.0, name="paper-c"),
}

_SHORT_FORM = re.compile(r"^(\d+)x(\d+)$")


def cluster_from_dict(data: Any, source: str = "cluster") -> Cluster:
    require(isinstance(data, dict), source, "is not a mapping", "write the cluster as a JSON/YAML object (see docs/formats.md)")
    known = set(Cluster.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    require(not unknown, f"{source}.{unknown[0] if unknown else ''}", "is not a cluster field", f"use only {sorted(known)}")
    for name in ("machines", "devices_per_machine"):
        require(name in data, f"{source}.{name}", "is missing", "give machines and devices_per_machine")
    return Cluster(**data)


def load_cluster(spec: "str | Path | Cluster | dict[str, Any]", **overrides: Any) -> Cluster:
    """A preset name (paper-a/b/c), a short form 'MxD', a JSON/YAML file, or a mapping."""
    if isinstance(spec, Cluster):
        cluster = spec
    elif isinstance(spec, dict):
        cluster = cluster_from_dict(spec)
    else:
        text = str(spec)
        match = _SHORT_FORM.match(text)
        if text in PRESETS:
            cluster = PRESETS[text]
        elif match:
            cluster = Cluster(int(match.group(1)), int(match.group(2)), name=text)
        elif Path(text).is_file():
            cluster = _cluster_from_file(Path(text))
        else:
            raise DappleConfigError(
                "cluster",
                f"{text!r} is neither a preset, a 'MACHINESxDEVICES' form nor a file",
                f"use one of {sorted(PRESETS)}, a form like '2x8', or the path of a cluster JSON/YAML file",
            )
    overrides = {key: value for key, value in overrides.items() if value is not None}
    return replace(cluster, **overrides) if overrides else cluster


def _cluster_from_file(path: Path) -> Cluster:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            data = OmegaConf.to_container(OmegaConf.create(text))
        except Exception as exc:  # omegaconf raises several parser error types
            raise DappleConfigError(f"cluster {path.name}", f"is not valid YAML ({exc})", "fix the YAML syntax") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DappleConfigError(f"cluster {path.name}", f"is not valid JSON ({exc.msg} at line {exc.lineno})", "fix the JSON syntax") from None
    cluster = cluster_from_dict(data, source=f"cluster {path.name}")
    return cluster if cluster.name != "custom" else replace(cluster, name=path.stem)


# --------------------------------------------------------------------------- this machine

# Assumed link speeds of a detected machine (Gbit/s): these cannot be read from the
# driver; NVLink-class inside a GPU server, a 100 Gbit/s network between servers, and
# loopback-class figures for CPU processes. Pass cluster=... when they are known.
GPU_LINKS = {"intra_bandwidth_gbps": 2400.0, "inter_bandwidth_gbps": 100.0}
CPU_LINKS = {"intra_bandwidth_gbps": 40.0, "inter_bandwidth_gbps": 10.0}


def _host_memory_gib() -> float:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB


def detect_cluster(machines: int, devices_per_machine: int, accelerator: str = "auto") -> Cluster:
    """The cluster this process runs on: ``machines`` x ``devices_per_machine`` of this
    machine's devices.

    With CUDA (``accelerator`` "gpu"/"cuda", or "auto" when CUDA is available) the
    device memory is the smallest total memory among the GPUs the run uses and the name
    says which GPU it is; otherwise the CPU processes share the host's cores
    (``shared_cores``) and each gets an equal share of its memory. Link speeds are assumptions (``GPU_LINKS``/``CPU_LINKS``): the planner
    (DAPPLE 4) needs them, the driver does not report them.
    """
    import torch  # only here: the planning CLIs read clusters without loading torch

    require(machines >= 1 and devices_per_machine >= 1, "cluster", f"detected for {machines} x {devices_per_machine} devices", "use at least one device")
    wants_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if wants_gpu:
        count = torch.cuda.device_count()
        require(count >= 1, "trainer.accelerator", f"is {accelerator!r} but torch sees no CUDA device", "run on CPU (trainer.accelerator=cpu) or on a machine with GPUs")
        used = range(min(count, devices_per_machine))
        memory = min(torch.cuda.get_device_properties(index).total_memory for index in used) / GIB
        name = torch.cuda.get_device_name(0)
        return Cluster(machines, devices_per_machine, device_memory_gib=round(memory, 2), name=f"local-{name}", **GPU_LINKS)
    memory = _host_memory_gib() / devices_per_machine
    return Cluster(
        machines, devices_per_machine, device_memory_gib=round(max(memory, 0.5), 2), name="local-cpu", shared_cores=usable_cores(), **CPU_LINKS
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which its sibling processes share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
