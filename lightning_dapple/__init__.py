"""lightning_dapple: DAPPLE hybrid pipeline/data-parallel training for PyTorch Lightning.

The package follows the pipeline of the DAPPLE paper (shared/papers/dapple-ppopp21.txt):
``profile`` (per-layer costs) -> ``plan`` (section 4: partition, replication, placement)
-> ``schedule`` (sections 3 and 5.3: action lists) -> ``simulate`` (ground-truth timing of a
schedule) -> ``execute`` (multi-process interpreter of a schedule) -> ``strategy``
(Lightning glue).
"""
from lightning_dapple.errors import DappleConfigError

__all__ = ["DappleConfigError"]
__version__ = "0.1.0"
