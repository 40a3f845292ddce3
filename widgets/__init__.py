"""ipywidgets/plotly views that turn telemetry events into pictures."""
