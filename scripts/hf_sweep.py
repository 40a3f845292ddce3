"""Every causal-LM family transformers ships, under tp2 / sp / cp2 / pp2 on 2 gloo ranks: a checker.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` it builds a tiny random fp32
model from the family's own default config, shrunk through the config's own attribute names (hidden 64,
4 heads, 2 key/value heads, head dim 16, MLP 128, 4 layers, vocabulary 256, 4 experts of which 2 routed, dropout
and router jitter off (both random in training: the ranks and one process would draw differently);
:data:`OVERRIDES` only where generic shrinking cannot work), and runs it under ``HybridParallelPlugin``
with ``tp_size=2``, ``tp_size=2, sequence_parallel=True``, ``cp_size=2`` (ring) and ``pp_size=2`` (1F1B, 2
microbatches) against the same loop in one process (``support.hf.family_loop``: 3 steps of SGD, clip 0.1,
the loop of ``tests/hybrid/test_hf_families.py``). Each (family, mode) ends as

- ``follows``: loss and gradient norm within 1e-4 relative of one process at every step, on both ranks (or,
  said in the table with both distances, judged after the worlds in this process: as close to the same loop in
  fp64 as one process in fp32 is, where
  a family's tiny random curve is so ill-conditioned that rounding alone parts fp32 from fp64 by more);
- ``refused``: a ``ValueError`` from the plugin or ``boost`` (before any step), or at the first forward before
  its collectives, naming the reason;
- ``FAILS``: anything else (a crash, a wrong curve, a hang);

and a family it cannot build tiny offline (multimodal, encoder-decoder wrappers, a config or model that does not
construct, a single-process loop that does not run) is ``skipped`` with the reason. It prints a table and writes
JSON (``--json``).

Speed: the ranks fork from a server that imported torch, the engine and transformers once
(``support.dist.run_distributed(preload=True)``) and one 2-rank world runs many families in turn. After every
case the ranks compare outcomes through the rendezvous store (not gloo): a case that failed on one rank only, or
a rank that does not report within ``--case-timeout`` seconds, ends the world (the collectives may be out of
step), as does a case still running after that long (a watchdog thread records it and exits the rank), and the
next world starts at the next family; each rank appends its records to a file as it goes, so a
world that dies loses only the case it was in.

Run: ``.venv/bin/python scripts/hf_sweep.py [--families llama,gpt2] [--modes tp2,pp2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support.hf (the loop), support.dist (the launcher)

STEPS, LR, CLIP, ROWS, T, REL = 3, 3.0, 0.1, 2, 16, 1e-4
LAYERS = 4
MAX_PARAMS = 20_000_000
MODES = {"tp2": dict(tp_size=2), "sp": dict(tp_size=2, sequence_parallel=True),
         "cp2": dict(cp_size=2, cp_mode="ring"), "pp2": dict(pp_size=2, num_microbatches=2)}

# the config's own names for each size, and the tiny value (one size, many spellings across families)
SIZES = (
    (64, ("hidden_size", "n_embd", "d_model", "n_embed", "hidden_dim", "word_embed_proj_dim", "embed_dim",
          "emb_dim")),
    (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "n_attn_heads",
        "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_moe_experts", "index_n_heads")),
    (2, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
        "num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")),
    (LAYERS, ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")),
    (128, ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
          "mlp_hidden_size", "dense_intermediate_size")),
    (32, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
         "moe_ffn_hidden_size", "q_lora_rank", "kv_lora_rank", "expert_ffn_hidden_size",
         "shared_experts_intermediate_size")),
    (256, ("vocab_size",)),
    (16, ("head_dim", "attention_head_dim", "kv_channels", "v_head_dim", "index_head_dim")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim")),
    (1, ("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
         "zero_expert_num", "num_expert_group")),
)
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")

#: per-family fields generic shrinking cannot get right (by ``model_type``): sizes whose default is None (the
#: model reads them unguarded), per-layer lists whose default length is the full model's, validators that tie
#: sizes together, and inputs the model needs set before a forward
OVERRIDES = {
    "gptj": {"rotary_dim": 8},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "nemotron": {"num_key_value_heads": 2},
    # its validator: key/value heads = attention heads; its sliding layers' own full-size attention dropped
    "dots3_note_text": {"num_key_value_heads": 4, "per_layer_config": {}},
    # its token indexer's sizes default to None (QSA off would leave the indexed layers unbuilt)
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2, "hc_lowrank": 16, "ple_embed_dim": 64, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]},  # one entry per layer, in pairs
    "mamba2": {"num_heads": 8, "n_groups": 1},  # its validator: hidden * expand = heads * head_dim
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2)},
    # two hybrid layers (they share one attention block, tied across them)
    "zamba": {"layers_block_type": ["mamba", "hybrid"] * (LAYERS // 2), "attention_hidden_size": 128,
              "mamba_dt_rank": 8},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"] * (LAYERS // 2)},
    # per-layer lists (MLP widths, activation sparsity) and key/value sharing sized for its 35 layers
    "gemma3n_text": {"intermediate_size": [128] * LAYERS, "layer_types": ["sliding_attention", "full_attention"] *
                     (LAYERS // 2), "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                     "laurel_rank": 8},
    # no axial positions (their shape must multiply to the sequence); chunks shorter than the sequence
    "reformer": {"axial_pos_embds": False, "attn_layers": ["local", "lsh"] * (LAYERS // 2), "attention_head_size": 16,
                 "feed_forward_size": 128, "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 2,
                 "hash_seed": 0},  # LSH rotations drawn from a fixed seed: the same on every rank
    "xmod": {"default_language": "en_XX"},  # its forward refuses a call with no language set
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}

#: families no tiny config can make a standalone causal LM, with the precise reason
SKIPS = {
    "gemma4_assistant": "a speculative-decoding assistant, not a standalone causal LM: every layer reads the "
                        "key/values of a target model (its config sets num_kv_shared_layers = num_hidden_layers; "
                        "its default config fails its own validator)",
}

#: Multi-head latent attention (DeepSeek's MLA, named by ``kv_lora_rank``): keys and values are expanded per head
#: from the latent, so key/value heads stay equal to the heads, and ``head_dim`` (the rotary part's width) stays
#: ``qk_rope_head_dim`` where the default config ties them
MLA = "kv_lora_rank"


def tiny_config(model_type: str):
    """The family's default config, rebuilt with every size it names shrunk (derived fields such as
    ``layer_types`` recomputed by the config itself); raises ``SkipFamily`` for what cannot run tiny here."""
    from transformers import AutoConfig

    if model_type in SKIPS:
        raise SkipFamily(SKIPS[model_type])
    base = AutoConfig.for_model(model_type)
    if getattr(base, "is_encoder_decoder", False):
        raise SkipFamily("an encoder-decoder config (its causal LM is the decoder half; not a target of the sweep)")
    subs = list(getattr(base, "sub_configs", None) or {})
    if subs:
        raise SkipFamily(f"multimodal or composite config ({', '.join(sorted(subs))}): its *_text family, where "
                         "transformers has one, is swept instead")
    fields = base.to_dict()
    kw = {}
    for value, names in SIZES:
        for name in names:
            if isinstance(fields.get(name), int) and not isinstance(fields.get(name), bool) and fields[name] > value:
                kw[name] = value
    for name, v in fields.items():  # other vocabularies (Gemma 3n / 4's per-layer inputs)
        if name.startswith("vocab_size") and isinstance(v, int) and v > 256:
            kw[name] = 256
    if isinstance(fields.get("hidden_size_per_layer_input"), int) and fields["hidden_size_per_layer_input"] > 16:
        kw["hidden_size_per_layer_input"] = 16  # 0 means none (Gemma 4's assistant requires 0)
    if "head_dim" in fields and fields["head_dim"] is None:  # read unguarded by some (Ministral, Hunyuan)
        kw["head_dim"] = 16
    if fields.get(MLA) is not None:
        if fields.get("num_key_value_heads") == fields.get("num_attention_heads"):
            kw["num_key_value_heads"] = kw.get("num_attention_heads", fields.get("num_attention_heads"))
        if fields.get("head_dim") is not None and fields.get("head_dim") == fields.get("qk_rope_head_dim"):
            kw["head_dim"] = kw.get("qk_rope_head_dim", fields["qk_rope_head_dim"])
    for name in POSITIONS:
        if isinstance(fields.get(name), int) and fields[name] > 64:
            kw[name] = 64
    for name, v in fields.items():
        if isinstance(v, float) and ("dropout" in name or "pdrop" in name or "drop_path" in name or "jitter" in name):
            kw[name] = 0.0
        if name.endswith("_token_id") and isinstance(v, int) and v >= 256:
            kw[name] = 0
        if name.endswith("_token_id") and isinstance(v, list):
            kw[name] = [t for t in v if t < 256] or 0
    if "sliding_window" in fields and isinstance(fields["sliding_window"], int):
        kw["sliding_window"] = 4096  # longer than any sequence here: a window with nothing to cut
    if "is_decoder" in fields:  # an encoder family's causal-LM head (BERT-like) runs as a decoder
        kw["is_decoder"] = True
    kw.update(use_cache=False, **OVERRIDES.get(model_type, {}))
    kw = {k: v for k, v in kw.items() if v is not None}
    drop = [k for k, v in OVERRIDES.get(model_type, {}).items() if v is None]
    cfg = AutoConfig.for_model(model_type, **kw)
    for k in drop:
        if hasattr(cfg, k):
            setattr(cfg, k, None)
    return cfg


class SkipFamily(Exception):
    """A family the sweep cannot build tiny and offline; the message is the reason."""


def build(model_type: str, seed: int = 11):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float()


def _reference(model_type, dtype=None):
    """The loop in one process (in ``dtype`` when given: fp64, to tell rounding from a fault)."""
    import torch
    from support import hf

    model = build(model_type) if dtype is None else build(model_type).to(dtype)
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise SkipFamily(f"{n} parameters after shrinking: a size this config names in a way the sweep does not know")
    return hf.family_loop(model, torch.optim.SGD(model.parameters(), lr=LR), steps=STEPS, clip=CLIP, rows=ROWS,
                          length=T)


#: how the engine's refusals begin (a ValueError from the model's own code, "not enough values to unpack", is not one)
REFUSALS = ("HybridParallelPlugin(", "pipeline parallelism", "tensor parallelism", "tp plan entry", "pipeline_stage")


def _named(e: Exception) -> bool:
    return isinstance(e, ValueError) and str(e).startswith(REFUSALS)


def _close(a, b):
    return all(x is None or y is None or abs(x - y) <= REL * max(abs(y), 1e-12) for x, y in zip(a, b))


def _case(model_type, mode, ref):
    """One (family, mode) on this rank: a record ``{"status", "detail"}``."""
    import torch
    from support import hf

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    try:
        plugin = HybridParallelPlugin(**MODES[mode])
        booster = Booster(plugin=plugin)
        model = build(model_type)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt, *_ = booster.boost(model, opt)
    except Exception as e:  # noqa: BLE001 - every failure but a named refusal is the sweep's finding
        if _named(e):
            return {"status": "refused", "detail": str(e)}
        return {"status": "FAILS", "detail": f"at boost: {type(e).__name__}: {e}"[:600],
                "trace": traceback.format_exc()[-2000:]}
    try:
        losses, norms = hf.family_loop(model, opt, booster, steps=STEPS, clip=CLIP, rows=ROWS, length=T,
                                       pipelined=mode == "pp2")
    except Exception as e:  # noqa: BLE001
        if _named(e):  # refused at the first forward, before its collectives
            return {"status": "refused", "detail": f"at the forward: {e}"}
        return {"status": "FAILS", "detail": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-2000:]}
    finally:
        try:
            plugin.close()
        except Exception:  # noqa: BLE001
            pass
    if not (_close(losses, ref[0]) and _close(norms, ref[1])):  # judged against fp64 by the parent (_rejudge)
        return {"status": "FAILS", "detail": f"wrong curve: losses {losses} norms {norms} vs {ref[0]} {ref[1]}",
                "run": [losses, norms], "ref": ref}
    return {"status": "follows", "detail": ""}


def _spread(run, exact) -> float:
    """The largest relative distance of a run's losses and norms from the fp64 run's."""
    return max(abs(x - y) / max(abs(y), 1e-12) for a, b in zip(run, exact) for x, y in zip(a, b) if x is not None)


def _within_noise(run, ref, exact) -> bool:
    """A run that misses the fp32 reference by more than ``REL`` but sits as close to the fp64 run as one
    process in fp32 does (within 3x, or ``REL``): the family's curve is ill-conditioned at this size (rounding
    grows over the steps), not parted by a fault. The table says so, with both distances."""
    return _spread(run, exact) <= 3 * max(_spread(ref, exact), REL)


def _watchdog(path, fam, mode, seconds):
    """A timer that, should the case still run after ``seconds`` (both ranks stuck in a collective, or a
    case far too slow), records it as FAILS and ends this rank's process: the launcher then ends the world."""
    import threading

    def fire():
        with open(path, "a") as f:
            f.write(json.dumps({"family": fam, "mode": mode, "status": "FAILS",
                                "detail": f"timeout: the case ran past {seconds:.0f} s"}) + "\n")
        os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _world(rank, world, families, modes, out_dir, case_timeout):
    """Rank function: every (family, mode) in turn; records appended to ``out_dir/rank<r>.jsonl``."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for fam in families:
        try:
            ref = _reference(fam)
        except SkipFamily as e:
            rec = {"family": fam, "skipped": str(e)}
        except Exception as e:  # noqa: BLE001
            rec = {"family": fam, "skipped": f"does not build or train in one process: {type(e).__name__}: {e}"[:400]}
        else:
            rec = {"family": fam, "ref": ref, "modes": {}}
        with open(path, "a") as f:
            f.write(json.dumps({**rec, "mode": None}) + "\n")
        if "skipped" in rec:
            continue
        for mode in modes:
            t1 = time.monotonic()
            watchdog = _watchdog(path, fam, mode, case_timeout)
            out = _case(fam, mode, ref)
            watchdog.cancel()
            out["seconds"] = round(time.monotonic() - t1, 2)
            with open(path, "a") as f:
                f.write(json.dumps({"family": fam, "mode": mode, **out}) + "\n")
            # compare outcomes through the store: a one-sided failure leaves the collectives out of step
            key = f"sweep/{fam}/{mode}"
            store.set(f"{key}/{rank}", out["status"])
            try:
                store.wait([f"{key}/{1 - rank}"], timedelta(seconds=case_timeout))
                other = store.get(f"{key}/{1 - rank}").decode()
            except Exception:  # noqa: BLE001 - the other rank is stuck (in a collective of a group with no
                other = None  # deadline we can reach): exit without a report, so the launcher ends the world now
            if other is None or (other != out["status"] and "FAILS" in (other, out["status"])):
                os._exit(3)  # the records are on disk; the collectives may be out of step, so no further case
    dist.barrier()
    return "done"


def _merge(records):
    """Per family: ``{"skipped": reason}`` or ``{mode: {"status", "detail", "seconds"}}`` from both ranks."""
    out = {}
    for rank, recs in enumerate(records):
        for r in recs:
            fam = out.setdefault(r["family"], {})
            if r["mode"] is None:
                if "skipped" in r:
                    fam["skipped"] = r["skipped"]
                continue
            prev = fam.get(r["mode"])
            if prev is None or (r["status"] == "FAILS" and prev["status"] != "FAILS"):
                fam[r["mode"]] = {k: r[k] for k in ("status", "detail", "seconds", "run", "ref") if k in r}
            if prev is not None and prev["status"] != r["status"] and "FAILS" not in (prev["status"], r["status"]):
                fam[r["mode"]] = {"status": "FAILS", "detail": f"ranks disagree: {prev['status']} / {r['status']}"}
    for fam, res in out.items():  # a case one rank finished and the other did not (stuck in a collective)
        for mode, r in res.items():
            ranks = [i for i, recs in enumerate(records) if any(x["family"] == fam and x["mode"] == mode
                                                                 for x in recs)]
            if mode != "skipped" and len(ranks) < len(records) and r["status"] != "FAILS":
                res[mode] = {"status": "FAILS", "detail": f"only rank {ranks} finished ({r['status']}: "
                                                          f"{r['detail'][:200]}); the other was stuck"}
    return out


def _read(out_dir):
    recs = []
    for r in range(2):
        p = os.path.join(out_dir, f"rank{r}.jsonl")
        recs.append([json.loads(line) for line in open(p)] if os.path.exists(p) else [])
    return recs


def sweep(families, modes, case_timeout: float = 90.0, log=print, results=None):
    """Every family under every mode; returns ``{family: result}`` (see :func:`_merge`); ``results``: those
    already swept (kept, not run again)."""
    from support.dist import run_distributed

    results = dict(results or {})
    todo = [f for f in families if f not in results]
    while todo:
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                run_distributed(_world, 2, todo, modes, out_dir, case_timeout, preload=True,
                                timeout=case_timeout * (len(modes) + 1) * len(todo) + 60)
                err = None
            except (RuntimeError, TimeoutError) as e:
                err = str(e)
            got = _merge(_read(out_dir))
        for fam, res in got.items():
            results[fam] = res
        # the family the world was in when it ended: its unreported modes fail, the sweep goes on after it
        done = [f for f in todo if f in got and ("skipped" in got[f] or all(m in got[f] for m in modes))]
        for fam in todo:
            if fam in done:
                continue
            # a family that started and did not finish; or, when none started, the first (so the sweep moves on).
            # A world that ended right after a finished family (its last case ran past the watchdog, or failed on
            # one rank only) blames no other: the rest run in the next world
            if fam in got or not done:
                res = results.setdefault(fam, {})
                for m in modes:
                    res.setdefault(m, {"status": "FAILS", "detail": "the world ended in this case: "
                                       + (err or "outcomes differed across ranks or a rank did not report")[-600:]})
                break
        finished = set(done) | {f for f in todo if f in results}
        todo = [f for f in todo if f not in finished]
        log(f"[sweep] {len(results)}/{len(families)} families, {len(todo)} to go")
    return results


def _rejudge(results, log=print):
    """A wrong curve is judged once more, in this process, against the same loop in fp64 (out of the ranks: an
    fp64 run there would keep the other rank waiting in a collective): "follows (fp32 noise)" when the run sits
    as close to fp64 as one process in fp32 does."""
    import torch

    for fam, res in results.items():
        for mode, r in res.items():
            if not isinstance(r, dict) or "run" not in r:
                continue
            run, ref = r.pop("run"), r.pop("ref")
            try:
                exact = _reference(fam, torch.float64)
            except Exception as e:  # noqa: BLE001 - a family that runs in fp32 only (grouped_mm on CPU)
                r["detail"] += f" (no fp64 run to compare: {type(e).__name__})"
                continue
            r["detail"] += f" (fp64: {exact[0]} {exact[1]})"
            if _within_noise(run, ref, exact):
                r.update(status="follows", detail=f"within fp32 noise: one process in fp32 parts from fp64 by "
                                                  f"{_spread(ref, exact):.1e}, this run by {_spread(run, exact):.1e}")
            log(f"[sweep] {fam} {mode}: {r['status']} against fp64")


def table(results, modes) -> str:
    rows = [f"| family | {' | '.join(modes)} |", "|---|" + "---|" * len(modes)]
    for fam, res in results.items():
        if "skipped" in res:
            rows.append(f"| {fam} | skipped: {res['skipped'][:120]} |" + " |" * (len(modes) - 1))
            continue
        cells = []
        for m in modes:
            r = res.get(m, {"status": "?", "detail": ""})
            cells.append(f"{r['status']}: {r['detail'][:90]}" if r.get("detail") else r["status"])
        rows.append(f"| {fam} | " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(rows)


#: a few words for each refusal the engine gives (matched in its message), for the compact table
SHORT = (("does not hand x back", "base forward does more than its modules"),
         ("not one layer list", "no single layer list"), ("names no nn.ModuleList", "pp plan names no layer list"),
         ("computes its loss itself", "own loss is not loss_function"),
         ("cannot cut its residual stream", "residual stream cannot be cut"),
         ("registered after its layer list", "post module runs twice"),
         ("is not cut by tensor parallelism", "blocks tp cannot cut"),
         ("built-in plan does not cut", "config flag tp cannot cut"), ("issue 31", "MoE (issue 31)"),
         ("carries no tensor-parallel plan", "no tp plan"),
         ("no config.base_model_pp_plan", "no pp plan"), ("AttentionInterface", "no attention registry"),
         ("one value per attention head", "per-head parameter"), ("attention sinks", "attention sinks"),
         ("softcap", "soft-capping"), ("sliding_window", "sliding window"), ("take input_ids", "layers read ids"),
         ("closes them outside itself", "region in MoE block closed outside it (sp)"),
         ("no later sibling closes", "column region unpaired (sp)"),
         ("no sibling before it opens", "row region unpaired (sp)"), ("opens again before", "column regions nest (sp)"),
         ("neither torch's row-parallel", "closing region holds other layers (sp)"), ("not causal", "not causal"),
         ("attention dropout", "attention dropout"), ("names a parameter", "per-parameter style"),
         ("does not divide", "heads do not divide"), ("takes no **kwargs", "forward takes no **kwargs"),
         ("mixes tokens outside attention", "token mixing outside attention"), ("moe_", "MoE (issue 31)"),
         ("grouped_gemm", "MoE (issue 31)"), ("ep_router", "MoE (issue 31)"),
         ("experts stay whole", "MoE experts under sp"), ("do not run beside sequence parallelism", "ep with sp"),
         ("beyond an expert's capacity", "expert capacity (sp)"), ("router aux loss", "router aux loss (sp)"),
         ("directly inside the MoE block", "cut layer in MoE block (sp)"),
         ("activation_sparsity", "statistics over cut features"),
         ("hidden_size_per_layer_input", "per-layer embeddings"), ("hc_mult", "hyper-connections"),
         ("original_hidden_states", "layers take the embedding output"), ("prev_", "layers take the previous one's"),
         ("config.layer_types names", "layer types (indexed / linear attention)"))


def short(r: dict) -> str:
    """A compact cell: ``follows``, ``refused: <reason>``, ``FAILS: <what>``."""
    if r["status"] == "follows":
        return "follows (fp32 noise)" if r.get("detail") else "follows"
    if r["status"] == "refused":
        style = __import__("re").search(r"style '(\w+)' \(", r["detail"])
        for words, label in SHORT:
            if words in r["detail"]:
                return f"refused: {label}"
        return f"refused: style {style.group(1)}" if style else f"refused: {r['detail'][:40]}"
    what = "wrong curve" if r["detail"].startswith("wrong curve") else r["detail"].split(":")[0][:40]
    return f"FAILS: {what}"


def markdown(results, modes) -> str:
    """The compact table docs/hf.md carries: one row per family, a few words per cell."""
    rows = [f"| family | {' | '.join(modes)} |", "|---|" + "---|" * len(modes)]
    for fam, res in results.items():
        if "skipped" in res:
            why = res["skipped"]
            reason = (f"does not run tiny in one process ({why.split(': ')[1]})" if "one process" in why
                      else why.split(" (")[0].split(":")[0])
            rows.append(f"| {fam} | skipped: {reason[:70]} |" + " |" * (len(modes) - 1))
        else:
            rows.append(f"| {fam} | " + " | ".join(short(res[m]) for m in modes) + " |")
    return "\n".join(rows)


def summary(results, modes) -> dict:
    counts = {m: {"follows": 0, "refused": 0, "FAILS": 0} for m in modes}
    skipped = 0
    for res in results.values():
        if "skipped" in res:
            skipped += 1
            continue
        for m in modes:
            counts[m][res[m]["status"]] = counts[m].get(res[m]["status"], 0) + 1
    return {"families": len(results), "skipped": skipped, "modes": counts}


def all_families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", help="comma-separated model_types (default: every causal-LM family)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the compact table (docs/hf.md's) here")
    ap.add_argument("--case-timeout", type=float, default=90.0, help="seconds a rank may wait for the other")
    ap.add_argument("--resume", help="a JSON this script wrote: its families are kept, not run again")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    import transformers

    families = args.families.split(",") if args.families else all_families()
    unknown = [f for f in families if f not in all_families()]
    if unknown:
        ap.error(f"--families: {unknown} are not causal-LM model_types of transformers {transformers.__version__}")
    t0 = time.monotonic()
    done = {}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            prev = json.load(f)
        if prev["modes"] != modes:
            ap.error(f"--resume: {args.resume} swept modes {prev['modes']}, not {modes}")
        done = {k: v for k, v in prev["results"].items() if k in families}
    results = sweep(families, modes, args.case_timeout, log=lambda s: print(s, file=sys.stderr, flush=True),
                    results=done)
    results = {f: results[f] for f in families if f in results}
    _rejudge(results, log=lambda s: print(s, file=sys.stderr, flush=True))
    wall = time.monotonic() - t0
    print(table(results, modes))
    summ = summary(results, modes)
    print(json.dumps(summ))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, modes) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
                       "wall_s": round(wall, 1), "modes": modes, "summary": summ, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
