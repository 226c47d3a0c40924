"""The ``dapple-train`` application: Hydra recipes for DAPPLE's benchmark models.

* ``train``: the Hydra main (console script ``dapple-train``), validation, run outputs;
* ``config``: the structured configs (schema) registered in Hydra's ConfigStore;
* ``callbacks``: step timer, plan report, simulated and measured timelines;
* ``timelines``: drawing the measured per-rank F/B/W spans;
* ``summary``: per-run results and the sweep summary table (``report``: rich tables,
  atomic writes);
* ``recipe_profile``: layer profiles of the full-size recipes for planning without the
  hardware (the published V100 profiles in ``shared/profiles``, or a FLOP/byte estimate);
* ``table4``: those recipes planned beside DAPPLE's Table 4
  (``python -m lightning_dapple.app.table4``).

The YAML configuration lives in ``lightning_dapple/conf`` (recipes in ``conf/recipe``).
"""
