"""Each Triton kernel against what torch gives for the same call, as measured on a GPU.

One record per (op, shape class, device): ``ratio`` is torch's median time over ours at the shape
``bench/kernels.py`` times (> 1: our kernel is faster). The dispatcher (:mod:`.earned`) uses a Triton
kernel with ``backend=None`` only on a device whose record says ``ratio >= 1``. ``bench/kernels.py --record
FILE`` on a GPU writes these records for that device; they are pasted here with the run's date and commit
(docs/gpu.md keeps the run's table).
"""

from __future__ import annotations

RECORDS = [
    # one H200 (141 GB), 2026-11-23, main at 8c15819, bench/kernels.py (docs/gpu.md, "first contact")
    {"op": "flash_attention", "klass": "any", "device": "NVIDIA H200", "ratio": 0.894,
     "baseline": "F.scaled_dot_product_attention", "when": "2026-11-23 8c15819"},
    {"op": "fused_adamw", "klass": "any", "device": "NVIDIA H200", "ratio": 0.638,
     "baseline": "torch.optim.AdamW(fused=True)", "when": "2026-11-23 8c15819"},
    {"op": "int8_linear", "klass": "decode", "device": "NVIDIA H200", "ratio": 0.386,
     "baseline": "bf16 F.linear, M=1 (M=8: 0.659)", "when": "2026-11-23 8c15819"},
]
