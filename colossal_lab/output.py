"""Show what each rank prints, live, under a label per *rank* (not per ipyparallel engine id).

ipyparallel's ``AsyncResult.stream_output`` labels output by engine id and publishes from its
IO thread, which loses the cell's parent header under ipykernel 7. Here the notebook's main
thread polls each rank's accumulated stdout/stderr (ipyparallel keeps them up to date in the
result metadata as they arrive) and, inside a kernel, keeps one display block per rank that it
updates in place; outside a kernel it prints new text line by line with a ``[rank r]`` prefix.
"""

from __future__ import annotations

import sys
import uuid
from typing import Dict, Optional


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and getattr(ip, "kernel", None) is not None
    except Exception:
        return False


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class RankOutput:
    """Relay of per-rank output for one cell; call ``poll()`` often and ``finish()`` once."""

    def __init__(self, ars: Dict[int, "object"], stream: bool = True):
        self.ars = ars
        self.stream = stream
        self.kernel = _in_kernel()
        self._key = uuid.uuid4().hex[:8]
        self._shown: Dict[int, str] = {}   # rank -> text last shown
        self._printed: Dict[int, int] = {}  # rank -> chars already printed (terminal mode)
        self._partial: Dict[int, str] = {}

    def _text(self, rank: int) -> str:
        ar = self.ars[rank]
        try:
            return (ar.stdout or "") + (ar.stderr or "")
        except Exception:
            return ""

    def _bundle(self, rank: int, text: str, result: Optional[str] = None) -> dict:
        body = text + (f"Out[rank {rank}]: {result}\n" if result else "")
        return {
            "text/plain": f"[rank {rank}]\n{body}",
            "text/html": (f"<div class='colossal-rank'><b>[rank {rank}]</b>"
                          f"<pre style='margin:0 0 0.5em 0'>{_html_escape(body)}</pre></div>"),
        }

    def _show(self, rank: int, text: str, result: Optional[str] = None) -> None:
        if self.kernel:
            from IPython.display import display, update_display

            did = f"colossal-{self._key}-rank{rank}"
            bundle = self._bundle(rank, text, result)
            if not self._shown:
                self._placeholders()
            if rank in self._shown:
                update_display(bundle, raw=True, display_id=did)
            else:
                display(bundle, raw=True, display_id=did)
            self._shown[rank] = text + (result or "")
        else:
            done = self._printed.get(rank, 0)
            new = self._partial.get(rank, "") + text[done:]
            self._printed[rank] = len(text)
            lines = new.split("\n")
            self._partial[rank] = lines.pop()  # keep an unfinished line for later
            for line in lines:
                print(f"[rank {rank}] {line}", file=sys.stdout)
            if result:
                if self._partial[rank]:
                    print(f"[rank {rank}] {self._partial.pop(rank)}")
                print(f"[rank {rank}] Out: {result}")
            sys.stdout.flush()

    def _placeholders(self) -> None:
        """Empty display blocks in rank order, so blocks stay sorted by rank whoever prints first."""
        from IPython.display import display

        for rank in sorted(self.ars):
            display({"text/plain": ""}, raw=True, display_id=f"colossal-{self._key}-rank{rank}")
            self._shown[rank] = ""

    def poll(self) -> None:
        if not self.stream:
            return
        if self.kernel and not self._shown:
            self._placeholders()
        for rank in sorted(self.ars):
            text = self._text(rank)
            if text and text != self._shown.get(rank) and (self.kernel or len(text) > self._printed.get(rank, 0)):
                self._show(rank, text)

    def finish(self) -> None:
        """Final output of every rank: remaining text, the cell's value, rich display outputs."""
        for rank in sorted(self.ars):
            ar = self.ars[rank]
            try:
                ar.wait_for_output(2)
            except Exception:
                pass
            text = self._text(rank)
            result = None
            try:
                er = ar.execute_result  # only set for execute() with a final expression
                if er:
                    result = er.get("data", {}).get("text/plain")
            except Exception:
                result = None
            if text or result:
                if self.kernel:
                    if text + (result or "") != self._shown.get(rank):
                        self._show(rank, text, result)
                else:
                    self._show(rank, text, result)
            if not self.kernel and self._partial.get(rank):
                print(f"[rank {rank}] {self._partial.pop(rank)}")
            try:
                outputs = ar.outputs or []
            except Exception:
                outputs = []
            if outputs and self.kernel:
                from IPython.display import display

                for out in outputs:
                    display({"text/plain": f"[rank {rank}] display:"}, raw=True)
                    display(out.get("data", {}), raw=True, metadata=out.get("metadata") or {})
