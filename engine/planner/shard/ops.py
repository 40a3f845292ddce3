"""The ATen vocabulary the shard search reads off a ``torch.export`` graph: an op's name, its
output's shape and bytes, and which ops are views, pass-throughs, pointwise, or may carry a cut
tensor at all. Nodes are ``torch.fx`` nodes whose ``meta["val"]`` holds a fake tensor."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

# ops whose output shares its input's storage: no activation bytes of their own
VIEWS = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze", "alias", "detach",
         "transpose", "permute", "t", "select", "slice", "expand", "contiguous"}
# ops that hand their input's layout on unchanged (copies, casts, dropout)
PASS = {"dropout", "native_dropout", "to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach",
        "lift_fresh_copy"}
# export's bookkeeping nodes: they use a tensor without computing on it
IGNORED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}
# non-pointwise ops that can carry a cut tensor (each has a rule in .propagate)
FLEX = {"select", "slice", "stack", "cat", "scaled_dot_product_attention", "softmax", "_softmax", "log_softmax",
        "_log_softmax", "mean", "sum", "matmul", "bmm", "getitem", "transpose", "permute", "t"}
RESHAPES = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze"}


def opname(node) -> str:
    t = node.target
    name = getattr(getattr(t, "_overloadpacket", None), "__name__", None)
    return name or getattr(t, "__name__", str(t))


def shape(node) -> Optional[Tuple[int, ...]]:
    """The node's output shape, None for a non-tensor."""
    v = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def output_bytes(node) -> int:
    """Bytes of the node's output tensor (0 for a non-tensor)."""
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def tensor_args(node) -> List[Any]:
    return [a for a in node.all_input_nodes if shape(a) is not None]


def is_pointwise(node) -> bool:
    tags = getattr(node.target, "tags", ()) or ()
    return torch.Tag.pointwise in tags or opname(node) in PASS


def flexible(node) -> bool:
    """Whether the op may carry a cut tensor (else it needs its inputs whole)."""
    name = opname(node)
    return name in FLEX or name in RESHAPES or is_pointwise(node)


def activation_bytes(node) -> int:
    """Bytes the node's output adds to the activations kept for backward (0 for views, no-op
    casts and dropout at p=0)."""
    name = opname(node)
    if name in VIEWS or name in IGNORED:
        return 0
    if name in ("to", "_to_copy", "type_as") and node.all_input_nodes:
        a = node.all_input_nodes[0]
        va, vn = a.meta.get("val"), node.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vn, torch.Tensor) and va.dtype == vn.dtype:
            return 0
    if name == "dropout" and len(node.args) > 1 and node.args[1] == 0.0:
        return 0
    return output_bytes(node)
