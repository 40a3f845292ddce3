"""transformers' MoE families under HybridParallelPlugin(ep_size=...): tiny random Mixtral and Qwen2-MoE (4 experts,
top-2, fp32) on 4 real gloo ranks follow the one-process curve within 1e-4 over 5 steps at ep2×dp2 and ep4, also
with experts starved of tokens; the all-to-all bytes counted equal the routing's; the gathered state dict has
transformers' names and shapes and equals the one-process model's; LoRA (peft, attention) trains under ep2 with only
its adapters moving; ep2 × pp2 (Mixtral, Qwen2-MoE, Qwen3-MoE; 1F1B and GPipe; starved too) follows it too; with the
families' own aux loss on (``output_router_logits=True``) ep2×dp2 follows one process averaging it over the same
split of the batch, and pipelines refuse it. One distributed world; every case runs inside the rank function."""

import functools
from functools import partial

import pytest
import torch
import torch.distributed as dist
from support.dist import run_distributed
from support.engine import assert_follows, batch
from support.hf import LR, SEED, loop, pipeline_loop

transformers = pytest.importorskip("transformers")
if not getattr(transformers.MixtralConfig(), "base_model_ep_plan", None):  # the floor, 5.5
    pytest.skip(f"transformers {transformers.__version__} gives Mixtral no base_model_ep_plan, which expert "
                "parallelism reads (docs/moe.md, 'Which transformers')", allow_module_level=True)

WORLD, STEPS, CLIP, E, TOP_K = 4, 5, 0.5, 4, 2
STARVED = [1, 2]  # experts a router hook keeps out of every token's choice in the "starved" runs
FAMILIES = ("mixtral", "qwen2_moe")
# layout -> (ep_size, tp_size); under tp the attention is split by the model's own plan and the experts stay whole
# on each tp rank, the EP groups cut per tp coordinate
LAYOUTS = {"ep2xdp2": (2, 1), "ep4": (4, 1), "ep2xtp2": (2, 2)}
# ep2 x dp2 under zero_stage=2; starved: Mixtral experts 1 and 2 (one of each EP rank's), Qwen2-MoE experts 2 and 3
# (every expert of EP rank 1: its experts module runs the zero-row forward, its FSDP2 unit still reduces)
ZERO2, ZERO2_STARVED = "ep2xdp2-zero2", {"mixtral": True, "qwen2_moe": (2, 3)}
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
# the families' load-balancing loss on: weighted well above the default 1e-3, so that adding it over each rank's tokens
# and over the whole batch (or not at all) give curves further apart than the 1e-4 the tests hold them to
AUX_COEF = 0.1
# ep2 x pp2 runs beyond Mixtral under 1F1B: (family, pp_style, starved experts: False, True for STARVED, or a tuple);
# Qwen2-MoE's (2, 3) are every expert of EP rank 1 (its stage's experts module runs the zero-row forward)
PP_RUNS = [("qwen2_moe", "1f1b", False), ("qwen3_moe", "1f1b", False), ("qwen2_moe", "gpipe", (2, 3)),
           ("mixtral", "gpipe", True)]


def _starve(gate, args, out, experts=STARVED):
    """The router's top-k again with ``experts`` masked out (softmax, renormalised as the family does)."""
    logits = out[0]
    masked = logits.clone()
    masked[:, list(experts)] = -1e4
    top, idx = torch.topk(torch.softmax(masked.float(), -1), gate.top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def build(family: str, starve=False, aux: bool = False):
    """A tiny random model of ``family`` (hidden 64, 2 layers, every MLP an MoE of 4 experts, top-2); ``starve``:
    True starves ``STARVED``, a tuple those experts; ``aux``: the family's own load-balancing loss on (``AUX_COEF``)."""
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  vocab_size=256, max_position_embeddings=64, num_experts_per_tok=TOP_K)
    if aux:
        common.update(output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    torch.manual_seed(SEED)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=E, **common))
    elif family == "qwen3_moe":  # no shared expert, top-k weights renormalised
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=E,
                                                   norm_topk_prob=True, **common))
    else:  # a shared expert and its gate beside the routed ones; top-k weights not renormalised
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=32, num_experts=E, **common))
    if starve:
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(_starve if starve is True else partial(_starve, experts=starve))
    return model


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED + 1)  # the adapters' initialisation, alike in both runs
    return get_peft_model(model, LoraConfig(**LORA))


@functools.lru_cache(maxsize=None)  # several tests compare with the same run; callers only read it
def reference(family: str, starve=False, lora: bool = False, aux=None):
    """One process, whole batches, plain torch AdamW + clip: (losses, gradient norms, final state). ``aux``: the
    family's load-balancing loss on, over the whole batch (``"whole"``) or each of ``WORLD`` row slices of it
    (``"split"``: the step's loss the mean of the slices' losses, as dp's ranks compute it)."""
    model = build(family, starve, aux=aux is not None)
    if lora:
        model = _with_lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def split_loss(model, s):
        parts = [batch(s, r, WORLD)[0].contiguous() for r in range(WORLD)]
        return sum(model(input_ids=x, labels=x).loss for x in parts) / WORLD

    losses, norms = loop(model, opt, steps=STEPS, clip=CLIP, loss_of=split_loss if aux == "split" else None)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _a2a_formula(tokens, ep_group, d: int) -> int:
    """Bytes this rank's all-to-alls carry in one step, from every EP rank's routing (``tokens``: per MoE layer
    this rank's assignments to each global expert): rows sent to other ranks' experts and rows returned to them,
    forward and backward, 4 bytes per element, plus the int64 counts to the other ranks (docs/moe.md)."""
    me, p = dist.get_rank(ep_group), dist.get_world_size(ep_group)
    per, total = E // p, 0
    for layer in tokens:
        mine = torch.tensor(layer)
        every = [torch.zeros_like(mine) for _ in range(p)]
        dist.all_gather(every, mine, group=ep_group)
        local = slice(me * per, (me + 1) * per)
        sent = int(mine.sum() - mine[local].sum())
        recv = sum(int(every[q][local].sum()) for q in range(p) if q != me)
        total += 2 * (sent + recv) * d * 4 + E * 8 * (p - 1) // p
    return total


def _run(rank, world, family, ep, starve, lora, save=None, tp=1, zero=0, aux=False):
    from peft import LoraConfig

    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.models.hf import moe as hf_moe
    from colossal_lab.engine.moe.parallel import COMM
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(ep_size=ep, tp_size=tp, zero_stage=zero)
    booster = Booster(plugin=plugin)
    model = build(family, starve, aux=aux)
    if lora:
        torch.manual_seed(SEED + 1)
        model = booster.enable_lora(model, lora_config=LoraConfig(**LORA))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, *_ = booster.boost(model, opt)
    inner = model.stage_modules[0].inner
    losses, norms, counted, formula, tokens = [], [], [], [], []
    events = []
    unsubscribe = telemetry.subscribe(events.append)
    for s in range(STEPS):
        COMM.reset()
        step_losses, step_norms = loop(model, opt, booster, steps=1, first=s, clip=CLIP,
                                         split=(plugin.dp_rank, plugin.dp_size))
        losses += step_losses
        norms += step_norms
        tok = list(hf_moe.tokens_per_expert(inner).values())
        tokens.append(tok)
        counted.append(COMM.total)
        formula.append(_a2a_formula(tok, plugin.ep_group, 64))
    unsubscribe()
    load = [(e.rank, e.step, e.layer, list(e.tokens), e.dropped) for e in events if isinstance(e, telemetry.ExpertLoad)]
    local = {n: tuple(p.shape) for n, p in inner.named_parameters() if ".experts." in n}
    placed = {n: (p.to_local().shape[0], p.device_mesh.size()) for n, p in inner.named_parameters()
              if hasattr(p, "device_mesh")}  # ZeRO-2: this rank's rows of each FSDP2 shard, over how many ranks
    state = model.full_state_dict()  # a collective: every rank gathers; rank 0 sends it home
    if save:  # transformers' layout: every expert gathered into its slot of the grouped weights
        booster.save_model(model, save, shard=True, size_per_shard=0.05)
    out = dict(losses=losses, norms=norms, counted=counted, formula=formula, tokens=tokens, local=local,
               labels=sorted(COMM.bytes), load=load, state=state if rank == 0 else None, placed=placed,
               before=before if rank == 0 else None)
    plugin.close()
    return out


def _run_pp(rank, world, family, style="1f1b", starve=False):
    """ep2 × pp2 (``style``, 2 microbatches): each stage's two dp ranks form its EP group. A step's loss is the mean
    of the dp replicas' last-stage losses, as one process's over the whole batch."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(ep_size=2, pp_size=2, num_microbatches=2, pp_style=style)
    booster = Booster(plugin=plugin)
    model = build(family, starve)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))

    def batch_of(s):
        x = batch(s, plugin.dp_rank, plugin.dp_size)[0].contiguous()
        return {"input_ids": x, "labels": x}

    from colossal_lab.engine import telemetry

    events = []
    unsubscribe = telemetry.subscribe(events.append)
    losses, norms = pipeline_loop(model, opt, booster, steps=STEPS, clip=CLIP, batch_of=batch_of)
    unsubscribe()
    total = torch.tensor([0.0 if loss is None else loss for loss in losses])
    dist.all_reduce(total)
    plugin.close()
    load = [(e.step, e.layer, sum(e.tokens)) for e in events if isinstance(e, telemetry.ExpertLoad)]
    starved = [e.tokens for e in events if isinstance(e, telemetry.ExpertLoad)]  # this rank's per expert, per step
    local = {n: tuple(p.shape) for n, p in model.stage_modules[0].inner.named_parameters() if ".experts." in n}
    return {"losses": (total / plugin.dp_size).tolist(), "norms": norms, "load": load, "tokens": starved,
            "local": local, "assignments": batch_of(0)["input_ids"].numel() * TOP_K}


def _load(rank, world, path, ep):
    """A fresh model, every weight scrambled, boosted at ``ep`` and loaded from ``path``: its whole state."""
    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    plugin = HybridParallelPlugin(ep_size=ep)
    booster = Booster(plugin=plugin)
    model = build("mixtral")
    torch.manual_seed(123)
    for p in model.parameters():
        p.data.normal_()
    model, *_ = booster.boost(model)
    booster.load_model(model, path)
    state = model.full_state_dict()
    plugin.close()
    return state if rank == 0 else None


GEMINI = "gemini_ep2xdp2"  # GeminiPlugin(ep_size=2): Gemini's dp is the world, so ep2 x dp2 on 4 ranks
IDLE = [2, 3]  # every expert of EP rank 1 under ep2: with these starved that rank receives no row at any step


def _idle(gate, args, out):
    """``_starve`` with experts ``IDLE`` masked out instead (softmax, renormalised as the family does)."""
    logits = out[0]
    masked = logits.clone()
    masked[:, IDLE] = -1e4
    top, idx = torch.topk(torch.softmax(masked.float(), -1), gate.top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def _build_idle(family: str):
    model = build(family)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(_idle)
    return model


def _run_gemini(rank, world, family, starve, save=None, idle=False):
    """5 steps under ``GeminiPlugin(ep_size=2, precision="fp32")``: dense chunks over the 4 ranks, this rank's
    expert slices in chunks of their own over its expert-dp pair. The same record as ``_run`` (its bytes and load
    events checked by the tests that read every entry) plus the chunk layout; with ``save``: ``save_model`` in
    transformers' layout, the whole batch's logits at that point, and the state after one more step and a
    ``load_model`` of those files. ``idle``: experts ``IDLE`` starved instead (EP rank 1 gets no row)."""
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.models.hf import moe as hf_moe
    from colossal_lab.engine.moe.parallel import COMM
    from colossal_lab.engine.plugins import GeminiPlugin

    plugin = GeminiPlugin(ep_size=2, precision="fp32")
    booster = Booster(plugin=plugin)
    model = _build_idle(family) if idle else build(family, starve)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses, norms, counted, formula, tokens, events = [], [], [], [], [], []
    unsubscribe = telemetry.subscribe(events.append)
    for s in range(STEPS):
        COMM.reset()
        step_losses, step_norms = loop(model, opt, booster, steps=1, first=s, clip=CLIP, split=(rank, world))
        losses += step_losses
        norms += step_norms
        tok = list(hf_moe.tokens_per_expert(model.module).values())
        tokens.append(tok)
        counted.append(COMM.total)
        formula.append(_a2a_formula(tok, plugin.ep_group, 64))
    unsubscribe()
    load = [(e.rank, e.step, e.layer, list(e.tokens), e.dropped) for e in events if isinstance(e, telemetry.ExpertLoad)]
    chunks = [([i.name for i in c.infos], c.world) for c in model.manager.chunks]
    local = {i.name: tuple(i.shape) for c in model.manager.chunks for i in c.infos if ".experts." in i.name}
    state = model.state_dict()  # a collective: each chunk gathered over its group, every expert over the EP group
    out = dict(losses=losses, norms=norms, counted=counted, formula=formula, tokens=tokens, local=local,
               labels=sorted(COMM.bytes), load=load, chunks=chunks, state=state if rank == 0 else None)
    if save:
        moments = opt.state_dict()  # a collective: every expert's AdamW moments gathered over the EP group
        booster.save_model(model, save, shard=True, size_per_shard=0.05)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batch(0, rank, world)[0].contiguous()).logits
        model.train()
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits.contiguous())
        loop(model, opt, booster, steps=1, first=STEPS, clip=CLIP, split=(rank, world))  # moves every weight
        moved = model.state_dict()
        booster.load_model(model, save)
        loaded = model.state_dict()
        if rank == 0:
            out.update(logits=torch.cat(parts), moved=moved, loaded=loaded,
                       moments={k: v for k, v in moments.items() if ".experts." in k and "exp_avg" in k})
    plugin.close()
    return out


def _rank(rank, world, path):
    out = {}
    for family in FAMILIES:
        for layout, (ep, tp) in LAYOUTS.items():
            for starve in (False, True):
                save = path + "_" + layout if family == "mixtral" and not starve and layout != "ep4" else None
                out[(family, layout, starve)] = _run(rank, world, family, ep, starve, lora=False, save=save, tp=tp)
    out["loaded_ep4"] = _load(rank, world, path + "_ep2xdp2", 4)
    out[("mixtral", "ep2xdp2", "lora")] = _run(rank, world, "mixtral", 2, False, lora=True)
    out[("mixtral", "ep2xdp2", "zero1")] = _run(rank, world, "mixtral", 2, False, lora=False, zero=1)
    for family, starved in ZERO2_STARVED.items():  # ZeRO-2: the experts over their expert-dp group, the rest over dp
        for starve in (False, starved):
            save = path + "_" + ZERO2 if family == "mixtral" and not starve else None
            out[(family, ZERO2, starve)] = _run(rank, world, family, 2, starve, lora=False, save=save, zero=2)
    out["ep2xpp2"] = _run_pp(rank, world, "mixtral")  # losses and norms only
    for family, style, starve in PP_RUNS:
        out[("pp", family, style, starve)] = _run_pp(rank, world, family, style, starve)
    for family in FAMILIES:  # the families' own aux loss, over each rank's tokens
        out[(family, "ep2xdp2", "aux")] = _run(rank, world, family, 2, False, lora=False, aux=True)
    for family in FAMILIES:
        for starve in (False, True):
            save = path + "_gemini" if family == "mixtral" and not starve else None
            out[(family, GEMINI, starve)] = _run_gemini(rank, world, family, starve, save)
    out[("mixtral", GEMINI, "idle")] = _run_gemini(rank, world, "mixtral", False, idle=True)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_moe") / "mixtral"


@pytest.fixture(scope="module")
def runs(saved):
    return run_distributed(_rank, WORLD, str(saved), timeout=600, preload=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_follows_one_process(runs, family):
    for starve in (False, True):
        ref, ref_norms, ref_state = reference(family, starve)
        for layout, (ep, tp) in LAYOUTS.items():
            for rank, per in enumerate(runs):
                r = per[(family, layout, starve)]
                assert_follows((family, layout, starve, rank), r["losses"], r["norms"], ref, ref_norms)
                # this rank kept E / ep experts of each layer's grouped weights
                assert r["local"] and all(shape[0] == E // ep for shape in r["local"].values())
                rows = 8 * tp // WORLD * 32  # this rank's tokens per step: batch 8 × 32 over the dp ranks
                assert len(r["tokens"][0]) == 2 and all(sum(t) == rows * TOP_K for s in r["tokens"] for t in s)
                if starve:  # the starved experts got no token from any rank at any step, and still the curve agreed
                    assert all(t[e] == 0 for s in r["tokens"] for t in s for e in STARVED)
                else:
                    assert all(t[e] > 0 for s in r["tokens"] for t in s for e in range(E))
            state = runs[0][(family, layout, starve)]["state"]  # every expert gathered into its slot, HF names
            assert state.keys() == ref_state.keys()
            assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in ref_state.items()}
            diff = {k: (state[k] - v).abs().max().item() for k, v in ref_state.items()}
            assert max(diff.values()) < 1e-4, (family, layout, starve, sorted(diff.items(), key=lambda kv: -kv[1])[:3])


def test_all_to_all_bytes_equal_routing(runs):
    for per in runs:
        for key, r in per.items():
            if key in ("loaded_ep4", "ep2xpp2") or key[0] == "pp":
                continue
            assert r["counted"] == r["formula"], key
            assert min(r["counted"]) > 0 and r["labels"] == ["combine", "counts", "dispatch"], key


def test_expert_load_events(runs):
    """One ExpertLoad per MoE layer per step on every rank, with the tokens its router sent to each expert."""
    for rank, per in enumerate(runs):
        for key, r in per.items():
            if key in ("loaded_ep4", "ep2xpp2") or key[0] == "pp" or key[2] in ("lora", "zero1"):
                continue
            load = r["load"]
            assert [e[:3] for e in load] == [(rank, s, f"model.layers.{b}.mlp") for s in range(STEPS)
                                             for b in range(2)], key
            assert [e[3] for e in load] == [list(t) for step in r["tokens"] for t in step], key
            assert not any(e[4] for e in load)  # dropless


def test_zero1_under_ep2(runs):
    """ZeRO-1 (non-expert state over dp, expert state over expert-dp) on Mixtral at ep2×dp2: the same curve."""
    ref, ref_norms, _ = reference("mixtral")
    for rank, per in enumerate(runs):
        r = per[("mixtral", "ep2xdp2", "zero1")]
        assert_follows(("zero1", rank), r["losses"], r["norms"], ref, ref_norms)


@pytest.mark.parametrize("family", list(ZERO2_STARVED))
def test_zero2_under_ep2(runs, family):
    """ZeRO-2 (FSDP2) at ep2 x dp2: each experts module's slice sharded over its expert-dp group (2 ranks, one
    expert row each), the dense weights over the 4 dp ranks; with and without starved experts the one-process curve
    within 1e-4 over 5 steps, and the gathered state equals the one-process model's."""
    for starve in (False, ZERO2_STARVED[family]):
        ref, ref_norms, ref_state = reference(family, starve)
        for rank, per in enumerate(runs):
            r = per[(family, ZERO2, starve)]
            assert_follows((family, ZERO2, starve, rank), r["losses"], r["norms"], ref, ref_norms)
            experts = {n: v for n, v in r["placed"].items() if ".experts." in n}
            assert len(experts) == 4 and set(experts.values()) == {(1, 2)}, experts  # 2 layers x 2 grouped weights
            dense = {n: v for n, v in r["placed"].items() if n not in experts}
            assert dense and all(mesh == WORLD for _, mesh in dense.values()), dense
            if starve:  # no token reached the starved experts from any rank at any step
                assert all(t[e] == 0 for s in r["tokens"] for t in s for e in (STARVED if starve is True else starve))
        state = runs[0][(family, ZERO2, starve)]["state"]
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in ref_state.items()}
        assert max((state[k] - v).abs().max().item() for k, v in ref_state.items()) < 1e-4


def test_zero2_checkpoint_loads_in_one_process(runs, saved):
    """``save_model`` under ep2 x dp2 with ZeRO-2 (DTensor slices of slices) writes what ``from_pretrained`` loads
    into one process: every weight equal to the gathered state, logits equal to the one-process model's."""
    from transformers import AutoModelForCausalLM

    state = runs[0][("mixtral", ZERO2, False)]["state"]
    loaded = AutoModelForCausalLM.from_pretrained(saved.parent / f"{saved.name}_{ZERO2}")
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    one = build("mixtral")
    one.load_state_dict(reference("mixtral")[2])
    x = batch(0)[0].contiguous()
    with torch.no_grad():
        got, want = loaded(input_ids=x).logits, one(input_ids=x).logits
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_ep2_by_pp2_follows_one_process(runs):
    ref, ref_norms, _ = reference("mixtral")
    for rank, per in enumerate(runs):
        r = per["ep2xpp2"]
        assert_follows(("mixtral", "ep2xpp2", rank), r["losses"], r["norms"], ref, ref_norms)


def test_ep2_by_pp2_expert_load_counts_only_the_training_forwards(runs):
    """Under a pipeline each stage's layer reports one ExpertLoad per step holding exactly this rank's assignments
    (its rows x tokens x top-k over the microbatches): torch's shape-inference forward of a stage's first step is
    not a training forward and adds nothing."""
    stages = set()
    for rank, per in enumerate(runs):
        r = per["ep2xpp2"]
        layer = r["load"][0][1]  # the one MoE layer of this rank's stage
        stages.add(layer)
        assert r["load"] == [(s, layer, r["assignments"]) for s in range(STEPS)], (rank, r["load"])
    assert stages == {"model.layers.0.mlp", "model.layers.1.mlp"}


@pytest.mark.parametrize("family, style, starve", PP_RUNS)
def test_ep2_by_pp2_families_and_schedules(runs, family, style, starve):
    """ep2 × pp2 beyond Mixtral under 1F1B: Qwen2-MoE (its shared expert beside the routed ones) and Qwen3-MoE under
    1F1B, Qwen2-MoE with every expert of EP rank 1 starved and Mixtral with experts 1 and 2 starved under GPipe: the
    one-process curve within 1e-4 over 5 steps on every rank; each rank holds E/2 experts of its stage's layer, which
    reports one ExpertLoad a step with this rank's assignments, none to a starved expert."""
    ref, ref_norms, _ = reference(family, starve)
    for rank, per in enumerate(runs):
        r = per[("pp", family, style, starve)]
        assert_follows((family, style, starve, rank), r["losses"], r["norms"], ref, ref_norms)
        assert len(r["local"]) == 2 and all(shape[0] == E // 2 for shape in r["local"].values()), r["local"]
        assert [n for _, _, n in r["load"]] == [r["assignments"]] * STEPS
        if starve:
            assert all(t[e] == 0 for t in r["tokens"] for e in (STARVED if starve is True else starve))


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_under_ep2_follows_the_same_split(runs, family):
    """``output_router_logits=True`` at ep2×dp2: each rank's forward adds the family's load-balancing loss over its
    own tokens (as Colossal-AI's and Megatron's default do, per rank and microbatch), so the run follows one process
    whose loss is the mean over the same 4 row slices of (LM loss + coef × aux) within 1e-4 over 5 steps, the state
    too; it is told apart from the aux loss over the whole batch and from no aux loss (each > 1e-4 away)."""
    ref, ref_norms, ref_state = reference(family, aux="split")
    for rank, per in enumerate(runs):
        r = per[(family, "ep2xdp2", "aux")]
        assert_follows((family, "aux", rank), r["losses"], r["norms"], ref, ref_norms)
    for other in (reference(family, aux="whole"), reference(family)):
        close = r["losses"] == pytest.approx(other[0], rel=1e-4) and r["norms"] == pytest.approx(other[1], rel=1e-4)
        assert not close, (family, r["losses"], other[0], r["norms"], other[1])
    state = runs[0][(family, "ep2xdp2", "aux")]["state"]
    assert max((state[k] - v).abs().max().item() for k, v in ref_state.items()) < 1e-4


def test_lora_under_ep2(runs):
    """peft adapters on the attention of a Mixtral under ep2×dp2: the one-process PEFT curve, only adapters moved."""
    ref, ref_norms, ref_state = reference("mixtral", lora=True)
    for rank, per in enumerate(runs):
        r = per[("mixtral", "ep2xdp2", "lora")]
        assert_follows(("lora", rank), r["losses"], r["norms"], ref, ref_norms)
    r = runs[0][("mixtral", "ep2xdp2", "lora")]
    state, before = r["state"], r["before"]
    assert state.keys() == ref_state.keys()
    moved = {k for k in state if not torch.equal(state[k], before[k])}
    assert moved and all("lora_" in k for k in moved), sorted(moved)[:4]
    assert all(k in moved for k in state if "lora_A" in k)  # every adapter trained
    assert max((state[k] - v).abs().max().item() for k, v in ref_state.items()) < 1e-4


@pytest.mark.parametrize("layout", ["ep2xdp2", "ep2xtp2"])
def test_checkpoint_in_transformers_layout(runs, saved, layout):
    """``save_model`` at ep2×dp2 and ep2×tp2 writes what ``from_pretrained`` loads (names, shapes, every expert in
    its slot, several safetensors files); the ep2×dp2 files load into ep4 with every weight equal."""
    from transformers import AutoModelForCausalLM

    state = runs[0][("mixtral", layout, False)]["state"]
    where = saved.parent / f"{saved.name}_{layout}"
    assert len(list(where.glob("*.safetensors"))) > 1 and (where / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(where).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert loaded["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * 32, 64)
    if layout == "ep2xdp2":
        at_ep4 = runs[0]["loaded_ep4"]
        assert at_ep4.keys() == state.keys() and all(torch.equal(at_ep4[k], v) for k, v in state.items())


def test_refused_before_any_group():
    """Bad layouts fail at boost, before a process group exists, naming what works."""
    from support.hf import llama

    from colossal_lab.engine import Booster
    from colossal_lab.engine.plugins import HybridParallelPlugin

    cases = [(HybridParallelPlugin(ep_size=3), build("mixtral"), r"ep_size in \[1, 2, 4\]"),
             (HybridParallelPlugin(ep_size=2, tp_size=2, sequence_parallel=True), build("qwen2_moe"),
              "sequence_parallel=False"),
             (HybridParallelPlugin(ep_size=2), llama(), "has no MoE block"),
             # the families' aux loss under a pipeline: the last stage lacks the earlier stages' router logits
             (HybridParallelPlugin(ep_size=2, pp_size=2, num_microbatches=2), build("mixtral", aux=True),
              r"output_router_logits=True.*set config.output_router_logits=False under pp_size > 1, or use pp_size=1"),
             (HybridParallelPlugin(pp_size=2, num_microbatches=2), build("qwen2_moe", aux=True),
              "output_router_logits=False")]
    for plugin, model, match in cases:
        with pytest.raises(ValueError, match=match):
            Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))
        assert not dist.is_initialized()
    # an ep plan with styles not run here (Gemma 4's colwise / rowwise entries): refused under ep only; at ep_size=1
    # the model runs its own experts (the sweep found Gemma 4 refused under cp2 for its ep plan)
    from support.hf import from_config

    from colossal_lab.engine.plugins.hybrid.experts import check_expert_parallel

    gemma4 = from_config("gemma4_text", layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256)
    with pytest.raises(ValueError, match="has style 'colwise'"):
        check_expert_parallel(gemma4, HybridParallelPlugin(ep_size=2), world=4)
    check_expert_parallel(gemma4, HybridParallelPlugin(cp_size=2), world=2)
    from peft import LoraConfig

    booster = Booster(plugin=HybridParallelPlugin(ep_size=2))  # LoRA on the grouped expert weights themselves
    model = booster.enable_lora(build("mixtral"), lora_config=LoraConfig(
        r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with pytest.raises(ValueError, match="target the attention"):
        booster.boost(model, torch.optim.AdamW(model.parameters()))
    assert not dist.is_initialized()


@pytest.mark.parametrize("family", FAMILIES)
def test_gemini_ep2_follows_one_process(runs, family):
    """GeminiPlugin(ep_size=2) at ep2 x dp2: losses and gradient norms within 1e-4 of one process at every step
    on every rank, with and without starved experts (no token from any rank at any step); each rank holds E/2
    experts, in chunks of their own over its expert-dp pair (2 ranks), every other parameter in chunks over the 4
    ranks; the gathered state has transformers' names and shapes and equals the one-process model's."""
    for starve in (False, True):
        ref, ref_norms, ref_state = reference(family, starve)
        for rank, per in enumerate(runs):
            r = per[(family, GEMINI, starve)]
            assert_follows((family, GEMINI, starve, rank), r["losses"], r["norms"], ref, ref_norms)
            assert r["local"] and all(shape[0] == E // 2 for shape in r["local"].values())
            assert len(r["tokens"][0]) == 2 and all(sum(t) == 8 // WORLD * 32 * TOP_K for s in r["tokens"] for t in s)
            if starve:
                assert all(t[e] == 0 for s in r["tokens"] for t in s for e in STARVED)
            else:
                assert all(t[e] > 0 for s in r["tokens"] for t in s for e in range(E))
            expert = [w for names, w in r["chunks"] if all(".experts." in n for n in names)]
            dense = [w for names, w in r["chunks"] if not any(".experts." in n for n in names)]
            assert expert and dense and len(expert) + len(dense) == len(r["chunks"])
            assert set(expert) == {WORLD // 2} and set(dense) == {WORLD}
        state = runs[0][(family, GEMINI, starve)]["state"]
        assert state.keys() == ref_state.keys()
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in ref_state.items()}
        diff = {k: (state[k] - v).abs().max().item() for k, v in ref_state.items()}
        assert max(diff.values()) < 1e-4, (family, starve, sorted(diff.items(), key=lambda kv: -kv[1])[:3])


def test_gemini_ep2_rank_without_rows_follows_one_process(runs):
    """Experts 2 and 3 starved: EP rank 1 of each pair receives no row at any step, its expert chunks still reduce
    a (zero) gradient every step (no hang), and the curve and the state are still one process's."""
    model = _build_idle("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref, ref_norms = loop(model, opt, steps=STEPS, clip=CLIP)
    for rank, per in enumerate(runs):
        r = per[("mixtral", GEMINI, "idle")]
        assert_follows(("idle", rank), r["losses"], r["norms"], ref, ref_norms)
        assert all(t[e] == 0 for s in r["tokens"] for t in s for e in IDLE)
    state = runs[0][("mixtral", GEMINI, "idle")]["state"]
    assert max((state[k] - v).abs().max().item() for k, v in model.state_dict().items()) < 1e-4


def test_gemini_ep2_checkpoint_in_transformers_layout(runs, saved):
    """``save_model`` under GeminiPlugin(ep_size=2) writes what ``from_pretrained`` loads in one process (every
    expert in its slot, several files), whose logits are the distributed model's; ``load_model`` of those files
    (each rank reading its own experts' rows of its shard) brings the model back after another step."""
    from transformers import AutoModelForCausalLM

    r = runs[0][("mixtral", GEMINI, False)]
    where = saved.parent / f"{saved.name}_gemini"
    assert len(list(where.glob("*.safetensors"))) > 1 and (where / "model.safetensors.index.json").exists()
    one = AutoModelForCausalLM.from_pretrained(where).eval()
    loaded = one.state_dict()
    assert loaded.keys() == r["state"].keys() and all(torch.equal(loaded[k], v) for k, v in r["state"].items())
    assert loaded["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * 32, 64)
    with torch.no_grad():
        logits = one(input_ids=batch(0)[0].contiguous()).logits
    assert (logits - r["logits"]).abs().max().item() < 1e-5 * logits.abs().max().item()
    assert any(not torch.equal(r["moved"][k], v) for k, v in r["state"].items() if ".experts." in k)
    assert all(torch.equal(r["loaded"][k], v) for k, v in r["state"].items())
    # the optimizer's full state holds every expert's moments, the one-process AdamW's
    model = build("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loop(model, opt, steps=STEPS, clip=CLIP)
    ref = {f"state.{n}.{m}": opt.state[p][m] for n, p in model.named_parameters() if ".experts." in n
           for m in ("exp_avg", "exp_avg_sq")}
    assert r["moments"].keys() == ref.keys()
    for k, v in ref.items():
        assert r["moments"][k].shape == v.shape and (r["moments"][k] - v).abs().max() <= 1e-4 * v.abs().max(), k


def test_gemini_ep_refused_before_any_group(monkeypatch):
    """GeminiPlugin(ep_size=...) on a transformers model: what it cannot split is refused at boost, before any
    process group and before anything is cut, naming what works."""
    from peft import LoraConfig, get_peft_model
    from support.hf import llama

    from colossal_lab.engine.plugins import GeminiPlugin

    monkeypatch.setenv("WORLD_SIZE", "6")
    three = GeminiPlugin(ep_size=3, precision="fp32")  # divides the world, not the experts
    monkeypatch.setenv("WORLD_SIZE", "4")
    four = GeminiPlugin(ep_size=4, precision="fp32")
    lora = get_peft_model(build("mixtral"), LoraConfig(r=2, target_modules=[], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    cases = [(three, 6, build("qwen2_moe"), r"ep_size=3\): 4 experts \(model.layers.0.mlp.experts\) do not divide "
              r"over 3 ranks; use an ep_size in \[1, 2, 4\]"),
             (four, 4, llama(), r"LlamaForCausalLM has no MoE block.*set ep_size=1"),
             (four, 4, lora, r"ep_size=4\): .*experts \(ParamWrapper\).*LoRA adapters on the grouped expert weights.*"
              r"set ep_size=1")]
    for plugin, world, model, match in cases:
        monkeypatch.setattr(type(plugin), "dp_size", property(lambda self, w=world: w))
        shapes = {k: tuple(p.shape) for k, p in model.named_parameters()}
        with pytest.raises(ValueError, match=match):
            plugin.configure(model, torch.optim.AdamW(model.parameters()), None, None, None)
        assert {k: tuple(p.shape) for k, p in model.named_parameters()} == shapes  # nothing cut
    assert not dist.is_initialized()
