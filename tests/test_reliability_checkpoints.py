"""Crash-safe checkpoints: a job killed while a checkpoint is written keeps the previous
checkpoint complete and loadable, never offers a half-written file as "last", and its
files are readable like Lightning's own (0644 under the usual umask).

The write is interrupted at each point of ``AtomicCheckpointIO.save_checkpoint`` in a
forked process (no ranks needed: only rank 0 writes), and once in a real 2-rank job whose
every process is killed while ``last.ckpt`` is half written; that job then resumes from
"last" to the single-process parameters.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from lightning_dapple import atomic_files
from lightning_dapple.strategy import checkpoint
from lightning_dapple.strategy.checkpoint import AtomicCheckpointIO
from lightning_toys import single_device_run
from scripts.reliability_launch import session_processes, start

POINTS = ["mid-write", "before-fsync", "before-rename", "after-rename"]
TWO_STAGES = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _die_at(point: str) -> None:
    """In the forked writer: end the process abruptly at ``point`` of the save."""
    real_save = torch.save

    def half_save(obj, stream, *args, **kwargs):
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        stream.write(buffer.getvalue()[: buffer.tell() // 2])
        stream.flush()
        os._exit(9)

    die = lambda *args, **kwargs: os._exit(9)  # noqa: E731
    if point == "mid-write":
        checkpoint.torch.save = half_save
    elif point == "before-fsync":
        atomic_files.os.fsync = die
    elif point == "before-rename":
        atomic_files.os.replace = die
    elif point == "after-rename":
        atomic_files.fsync_directory = die


def _lightning_last_candidates(directory: Path) -> list[str]:
    """The files ``ckpt_path="last"`` chooses among (ModelCheckpoint._find_last_checkpoints)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".ckpt" and re.match(r"^last(-(\d+))?", p.stem))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", POINTS)
def test_a_write_killed_at_any_point_keeps_a_complete_checkpoint(tmp_path: Path, point: str) -> None:
    old = {"state_dict": {"w": torch.arange(6.0, dtype=torch.float64)}, "global_step": 1}
    new = {"state_dict": {"w": torch.arange(6.0, dtype=torch.float64) * 2 + torch.randn(6, dtype=torch.float64)}, "global_step": 2}
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(old, target)
    pid = os.fork()
    if pid == 0:  # the writer: dies inside the save
        try:
            _die_at(point)
            AtomicCheckpointIO().save_checkpoint(new, target)
        finally:
            os._exit(3)  # reached only if the save did not die where it should
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    expected = new if point == "after-rename" else old
    loaded = torch.load(target, weights_only=True)
    assert loaded["global_step"] == expected["global_step"]
    assert torch.equal(loaded["state_dict"]["w"], expected["state_dict"]["w"])
    assert _lightning_last_candidates(tmp_path) == ["last.ckpt"]  # a leftover temporary is no candidate
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()
    AtomicCheckpointIO().save_checkpoint(new, target)  # the next save clears what the crash left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.timeout(30)
def test_checkpoint_files_get_the_mode_open_would_give(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        AtomicCheckpointIO().save_checkpoint({"x": torch.zeros(1)}, tmp_path / "a.ckpt")
        os.umask(0o002)
        AtomicCheckpointIO().save_checkpoint({"x": torch.zeros(1)}, tmp_path / "b.ckpt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.ckpt").stat().st_mode) == 0o644  # as Lightning's own (not mkstemp's 0600)
    assert stat.S_IMODE((tmp_path / "b.ckpt").stat().st_mode) == 0o664


@pytest.mark.timeout(300)
def test_job_killed_while_writing_last_resumes_from_the_previous_one(tmp_path: Path) -> None:
    """Checkpoints at steps 2 and 4 (each: the step file, then last.ckpt); every rank is
    killed half-way into the step-4 last.ckpt. "last" is still step 2's, complete; a run
    resumed from it reaches the single-process parameters after 4 steps."""
    cfg = {"plan": TWO_STAGES, "devices": 2, "steps": 4, "batches": 2, "ckpt": {"every": 2, "last": True}}
    job = start({**cfg, "crash_save": {"save": 4, "point": "mid-write"}}, tmp_path / "run")
    try:
        codes, text, _ = job.wait(200)
    finally:
        job.kill()
    assert codes == [-9], text[-3000:]
    assert not session_processes(job)
    directory = tmp_path / "run" / "ckpt"
    assert _lightning_last_candidates(directory) == ["last.ckpt"]
    last = torch.load(directory / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2
    from scripts.reliability_job import JobModule

    JobModule().double().load_state_dict(last["state_dict"])  # complete: strict load
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]  # the killed write's temporary
    for path in directory.glob("*.ckpt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()

    job = start({**cfg, "resume": "last"}, tmp_path / "run")
    try:
        codes, text, _ = job.wait(200)
    finally:
        job.kill()
    assert codes == [0], text[-3000:]
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    final = torch.load(directory / "last.ckpt", weights_only=False)
    assert final["global_step"] == 4
    reference, _ = single_device_run(2, clip=0.5, epochs=2)
    assert max(float((final["state_dict"][k] - reference[k]).abs().max()) for k in reference) < 1e-10
