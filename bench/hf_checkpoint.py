"""Host RAM per rank when loading a transformers checkpoint into tp2: our sliced load vs a full state dict.

    python bench/hf_checkpoint.py [--tp 2] [--hidden 512] [--layers 4] [--vocab 16000] [--shard-mb 20]

A random Llama (fp32, untied head) is written by transformers' ``save_pretrained`` (sharded). Each
contender runs in fresh processes (``--tp`` ranks, gloo, CPU): the model is built on the meta device
(``lazy_init``), boosted with ``HybridParallelPlugin(tp_size=tp)`` (each rank allocates its shards,
uninitialised), then loaded:

* ours: ``booster.load_model``'s HF path (``checkpoint_io/hf.py``), each rank reading its slices with
  ``safe_open(...).get_slice``;
* full: the whole state dict read on every rank (``load_state_dict_shards``), then each rank's slice
  copied in with ``distribute_tensor`` (what a loader without slicing does).

Three figures per rank: bytes read from the files (exact: ours counts what ``get_slice`` returned;
full is every tensor's bytes); peak anonymous RSS growth during the load (``RssAnon`` of
``/proc/self/status`` sampled every millisecond by a thread, minus its value before: the process's
own memory, which is what the load allocates); and peak total RSS growth (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``, minus ``VmRSS`` before), which also counts the file pages that
safetensors' mmap maps in (page cache, shared by the ranks and reclaimable; a column slice of a
tensor whose rows are shorter than a page maps every page of it). Both RSS figures include touching
the rank's own shard (first writes into the uninitialised storage ``to_empty`` gave it). One JSON line
per contender and rank, then a side-by-side table with the ratio full / ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


class _AnonPeak:
    """The highest ``RssAnon`` seen while the block runs, sampled every millisecond."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _status("RssAnon"), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                       vocab_size=args.vocab, max_position_embeddings=128, tie_word_embeddings=False)


def _full_load(model, path) -> int:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from colossal_lab.engine.checkpoint_io import load_state_dict_shards

    sd = load_state_dict_shards(path)
    hf = model.stage_modules[0].inner
    with torch.no_grad():
        for n, t in hf.state_dict(keep_vars=True).items():
            if n in sd:
                src = sd[n]
                if isinstance(t, DTensor):
                    t.copy_(distribute_tensor(src, t.device_mesh, t.placements))
                else:
                    t.copy_(src)
    return sum(t.numel() * t.element_size() for t in sd.values())


def _worker(rank, world, port, args, path, mode, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        from transformers import AutoModelForCausalLM

        from colossal_lab.engine import Booster
        from colossal_lab.engine.checkpoint_io.hf import load_hf
        from colossal_lab.engine.lazy import lazy_init
        from colossal_lab.engine.pipeline.checkpoint import _hf_view
        from colossal_lab.engine.plugins import HybridParallelPlugin

        with lazy_init():
            model = AutoModelForCausalLM.from_config(_config(args))
        model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=world)).boost(model)
        dist.barrier()
        _reset_peak()
        before, anon = _status("VmRSS"), _status("RssAnon")
        with _AnonPeak() as sampler:
            read = load_hf(_hf_view(model), path).bytes_read if mode == "ours" else _full_load(model, path)
        peak = _status("VmHWM") - before
        q.put((rank, {"mode": mode, "rank": rank, "bytes_read": read, "peak_anon_growth": sampler.peak - anon,
                      "peak_rss_growth": peak}))
    except BaseException:
        import traceback

        q.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _launch(world, args, path, mode):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, world, store.port, args, path, mode, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = {}
    for _ in range(world):
        rank, res = q.get(timeout=1200)
        if isinstance(res, str):
            raise SystemExit(f"bench/hf_checkpoint.py: rank {rank} ({mode}) failed:\n{res}")
        out[rank] = res
    for p in ps:
        p.join(timeout=30)
    return [out[r] for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shard-mb", type=int, default=20)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(args))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, max_shard_size=f"{args.shard_mb}MB")
        del model
        rows = {mode: _launch(args.tp, args, d, mode) for mode in ("ours", "full")}
    mb = 2 ** 20
    for mode in rows:
        for r in rows[mode]:
            print(json.dumps({**r, "model_bytes": total}))
    print(f"\nmodel: {total / mb:.1f} MiB fp32; tp={args.tp}; per rank, MiB", file=sys.stderr)
    keys = ("bytes_read", "peak_anon_growth", "peak_rss_growth")
    print("| rank | " + " | ".join(f"{k}: ours | full | full/ours" for k in keys) + " |", file=sys.stderr)
    print("|---" * (1 + 3 * len(keys)) + "|", file=sys.stderr)
    for o, f in zip(rows["ours"], rows["full"]):
        cells = [f"{o[k] / mb:.1f} | {f[k] / mb:.1f} | {f[k] / max(o[k], 1):.2f}" for k in keys]
        print(f"| {o['rank']} | " + " | ".join(cells) + " |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
