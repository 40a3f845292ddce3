"""colossal-lab: train, fine-tune and serve large models from a notebook."""
__version__ = "0.1.0"
