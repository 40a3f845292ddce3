"""Booster plugins: DDP, ZeRO-1/2, Gemini, hybrid parallel."""
