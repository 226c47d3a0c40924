"""Start ``reliability_job.py`` as a job the way users do -- one Lightning script (its
subprocess launcher starts the other ranks) or two torchrun "nodes" on this host -- in a
session of its own, so the tests can find and kill every process the job started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).with_name("reliability_job.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    procs: list[subprocess.Popen]
    out: Path
    started: float

    def wait(self, timeout_s: float) -> tuple[list[int | None], str, float]:
        """Exit codes (None: still running at the deadline), stdout+stderr, seconds taken."""
        deadline = self.started + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        elapsed = time.monotonic() - self.started
        codes = [proc.poll() for proc in self.procs]
        text = "".join(Path(f"{self.out}/log{i}.txt").read_text(errors="replace") for i in range(len(self.procs)))
        return codes, text, elapsed

    def kill(self) -> None:
        """End whatever is left of the job (its sessions), also stopped processes."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def start(cfg: dict, out: Path, launcher: str = "lightning", port: int | None = None) -> Job:
    """Write the config and start the job: ``lightning`` (one script) or ``torchrun`` (two
    agents, ``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1:``port``)."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "job.json"
    config.write_text(json.dumps({**cfg, "out": str(out)}))
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK"):
        env.pop(key, None)
    if launcher == "lightning":
        commands = [[sys.executable, str(JOB), str(config)]]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        commands = [
            [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0", str(JOB), str(config)]
            for node in (0, 1)
        ]
    procs = []
    for index, command in enumerate(commands):
        log = open(out / f"log{index}.txt", "w")
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=out, env=env, start_new_session=True))
    return Job(procs, out, time.monotonic())


def session_processes(job: Job) -> list[int]:
    """Pids still alive in the job's sessions (zombies excluded)."""
    sessions = {proc.pid for proc in job.procs}
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        if session in sessions and state != "Z":
            alive.append(int(entry.name))
    return alive


def drain(job: Job, limit_s: float) -> list[int]:
    """The job's processes still alive ``limit_s`` after its start, polled until none is.

    Under Lightning's subprocess launcher rank 0 may exit before the ranks it started have
    finished their own exit; a process left at the deadline is one that did not end."""
    while session_processes(job) and time.monotonic() - job.started < limit_s:
        time.sleep(0.2)
    return session_processes(job)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
