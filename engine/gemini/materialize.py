"""Parameter values for chunks, produced one chunk at a time — so a lazy model never exists in RAM.

``ParamSource.value(info)`` materialises a meta parameter's owning module on demand (the
module's own init rules, ``engine.lazy.materialize_module``) and keeps its values only until the
chunk is written to its home; ``bind`` makes the original ``nn.Parameter`` a view of its chunk, so
the user's optimizer stays valid. See docs/gemini.md, ``materialize.py`` row.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..lazy import Loader, default_init, materialize_module
from .chunk import TensorInfo


class ParamSource:
    def __init__(self, model: nn.Module, state_dict_loader: Optional[Loader] = None):
        self.model = model
        self.loader = state_dict_loader
        self.init = default_init(model)
        self._owners: Dict[int, List[Tuple[str, nn.Module]]] = {}
        for mname, m in model.named_modules():
            for p in m._parameters.values():
                if p is not None:
                    self._owners.setdefault(id(p), []).append((mname, m))
        self._pending: Dict[int, torch.Tensor] = {}

    def value(self, info: TensorInfo) -> torch.Tensor:
        """The parameter's values (CPU, its own dtype); materialises its module if it is meta."""
        p = info.param
        if not p.is_meta:
            return p.detach()
        if id(p) not in self._pending:
            mname, module = self._owners[id(p)][0]
            self._materialize(mname, module)
        return self._pending.pop(id(p))

    def _materialize(self, mname: str, module: nn.Module) -> None:
        originals = dict(module._parameters)
        materialize_module(module, mname, torch.device("cpu"), self.loader, self.init, memo={})
        for pname, orig in originals.items():
            new = module._parameters[pname]
            if orig is not None and orig.is_meta and new is not orig:
                self._pending[id(orig)] = new.detach()
                module._parameters[pname] = orig  # the module keeps the object the optimizer holds

    def finish(self, device: torch.device) -> None:
        """Materialise meta buffers of modules that own no parameter (e.g. GPT's rotary tables)."""
        for mname, m in self.model.named_modules():
            if any(b is not None and b.is_meta for b in m._buffers.values()):
                params = dict(m._parameters)
                m._parameters.clear()  # buffers only: its parameters are already in chunks
                try:
                    materialize_module(m, mname, device, self.loader, self.init, memo={})
                finally:
                    m._parameters.update(params)
        self._pending.clear()


def bind(info: TensorInfo, view: torch.Tensor) -> None:
    """Make ``info.param`` a view of its chunk (same Python object, new storage).

    The parameter shares the chunk's storage but keeps a version counter of its own, whatever
    way it was built: the chunk manager refills ``chunk.full`` in place (host→device copy, NVMe
    staging copy, all-gather) with the values it had, and that refill must not count as an
    in-place change of a parameter whose views autograd saved for backward. ``p.data = view``
    keeps the parameter's counter; a meta parameter cannot take ``.data``, so it is swapped for
    a Parameter over ``view.data``, which aliases the storage with a fresh counter (a Parameter
    over ``view`` itself would share the chunk buffer's counter).
    """
    p = info.param
    if p.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(view.data, requires_grad=p.requires_grad))
    else:
        p.data = view
