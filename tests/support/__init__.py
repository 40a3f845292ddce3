"""What the tests share: helpers importable from every test module and from the ranks they start.

``tests/`` is on ``sys.path`` (pytest puts the folder of the root ``conftest.py`` there, and the
processes a test starts inherit the path), so a test imports ``from support.dist import ...``.

* ``support.dist``: ``run_distributed``, a function on N real gloo processes (``preload=True``: forked
  from a server that imported torch, the engine and transformers once);
* ``support.engine``: the tiny GPT, a fixed data stream, a plain-torch reference, ``lm_loss``,
  ``train_step`` (backward, clip, step, zero_grad: booster or plain torch);
* ``support.hf``: tiny transformers models of each family, and the loops the HF tests compare
  (``loop``, ``pipeline_loop``) and the memory tests measure (``measured_run``);
* ``support.collectives``: ``CollectiveChecker``, the device and route rules of every collective;
* ``support.gemini``: Gemini's training loop and its plain-AdamW reference;
* ``support.llama``: a Llama-style model the engine has never seen (the model contract's);
* ``support.widgets``: event streams with known answers and figure look-ups for the widgets.

Fixtures shared by several modules (a 2-rank cluster) live in ``tests/conftest.py``.
"""

from pathlib import Path

#: The repository root (scripts, docs, tutorials and the source folders are read from it).
ROOT = Path(__file__).resolve().parents[2]
