"""Which torch pipeline schedule runs, and the checks that reject a bad one up front.

Every ``pp_style`` is one of ``torch.distributed.pipelining``'s schedule classes (docs/hybrid.md,
``pp_style``), so the action order is torch's. What we add is validation *before* any process group
exists, with errors that name the argument and a valid choice (torch raises deep inside a
schedule's ``__init__``, after the mesh was built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

PP_STYLES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
#: Styles that run several stages per rank through torch's ``_PipelineScheduleRuntime``.
MULTI_STAGE_STYLES = ("interleaved", "zb", "zbv")


@dataclass(frozen=True)
class ScheduleSpec:
    """A validated choice: style, ranks in the pipeline, chunks per rank, microbatches."""

    style: str
    pp_size: int
    num_model_chunks: int
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_model_chunks

    def stage_indices(self, pp_rank: int) -> List[int]:
        """Global stage indices held by pipeline rank ``pp_rank`` (chunk order)."""
        p, v = self.pp_size, self.num_model_chunks
        if self.style == "zbv":
            return [pp_rank, 2 * p - 1 - pp_rank]
        return [pp_rank + c * p for c in range(v)]

    def schedule_class(self):
        from torch.distributed import pipelining as P

        return {
            "gpipe": P.ScheduleGPipe,
            "1f1b": P.Schedule1F1B,
            "interleaved": P.ScheduleInterleaved1F1B,
            "zb": P.ScheduleInterleavedZeroBubble,
            "zbv": P.ScheduleZBVZeroBubble,
        }[self.style]


def validate_schedule(pp_style: str, pp_size: int, num_model_chunks: int,
                      num_microbatches: Optional[int]) -> None:
    """Raise ``ValueError`` naming the argument and a valid choice; touches no process group."""
    if pp_style not in PP_STYLES:
        raise ValueError(f"HybridParallelPlugin(pp_style={pp_style!r}): unknown style; "
                         f"choose one of {PP_STYLES}")
    if not isinstance(num_model_chunks, int) or num_model_chunks < 1:
        raise ValueError(f"HybridParallelPlugin(num_model_chunks={num_model_chunks!r}): must be an int >= 1")
    if pp_style == "zbv" and num_model_chunks != 2:
        raise ValueError(f"HybridParallelPlugin(pp_style='zbv', num_model_chunks={num_model_chunks}): "
                         "the V schedule needs exactly two chunks per rank; set num_model_chunks=2")
    if pp_style in ("gpipe", "1f1b") and num_model_chunks != 1:
        raise ValueError(f"HybridParallelPlugin(pp_style={pp_style!r}, num_model_chunks={num_model_chunks}): "
                         "one chunk per rank only; use num_model_chunks=1, or pp_style='interleaved' "
                         "for several chunks per rank")
    if num_microbatches is None or pp_size == 1:
        return
    m = num_microbatches
    if pp_style == "1f1b" and m < pp_size:
        raise ValueError(f"HybridParallelPlugin(num_microbatches={m}): 1F1B needs at least as many "
                         f"microbatches as pipeline stages; use num_microbatches >= pp_size={pp_size}")
    if pp_style in ("interleaved", "zb"):
        rounds = max(1, m // pp_size)
        if m % rounds:
            ok = [k for k in range(1, 4 * pp_size + 1) if k % max(1, k // pp_size) == 0]
            raise ValueError(f"HybridParallelPlugin(num_microbatches={m}): pp_style={pp_style!r} runs "
                             f"microbatches in rounds of pp_size={pp_size}; use a multiple of pp_size "
                             f"or fewer than pp_size (e.g. one of {ok})")
