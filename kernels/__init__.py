"""Triton kernels, each beside its plain-torch reference, behind one dispatch rule."""
