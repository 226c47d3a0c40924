"""Plans: the data model (plan.py) and the planners that produce it."""
from lightning_dapple.plan.plan import (
    Plan,
    Prediction,
    StagePlan,
    load_plan,
    plan_from_dict,
)

__all__ = ["Plan", "Prediction", "StagePlan", "load_plan", "plan_from_dict"]
