"""Profiles: per-layer costs, read from JSON or PipeDream graph text, or measured."""
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict

__all__ = ["LayerProfile", "ModelProfile", "load_profile", "profile_from_dict"]
