"""colossal_lab.engine: Booster, plugins, Gemini, pipelines, checkpoints, telemetry, models."""
