"""colossal_lab.engine: Booster, plugins, Gemini, pipelines, checkpoints, telemetry, models."""

# Booster is imported lazily: `from colossal_lab.engine import telemetry` (widgets, the relay)
# must not pay for importing torch.
__all__ = ["Booster"]


def __getattr__(name):
    if name == "Booster":
        from .booster import Booster

        return Booster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
