"""Hydra configuration of ``dapple-train`` (YAML files, shipped inside the package).

``config.yaml`` is the primary config; the sub-folders are config groups. Recipes
(``recipe/*.yaml``) select a model, its data, the trainer and the cluster together.
The repository root's ``conf`` and ``recipes`` are symlinks to this folder and to
``recipe/``. The schema of every group is ``lightning_dapple.app.config``.
"""
