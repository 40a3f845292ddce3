"""colossal_lab.engine: Booster, plugins, Gemini, pipelines, checkpoints, telemetry, models."""

from .booster import Booster

__all__ = ["Booster"]
