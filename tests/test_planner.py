"""The planner (glmc/parallel/planner.py, search.py, cluster.py; `glmc plan`): plans of tiny
models on small clusters, the spelling, typed errors, and Megatron-LM's published runs
(Narayanan et al., SC'21, Table 1) predicted from models built on the meta device."""
from __future__ import annotations

import dataclasses
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

import glmc
from glmc.errors import ConfigError
from glmc.frontend.cli import main
from glmc.parallel.cluster import Cluster
from glmc.parallel.planner import KEYS, PlanPoint, parse_spelling, price_workload
from glmc.parallel.search import evaluate, search

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 4, hidden: int = 128, heads: int = 4, batch: int = 8,
           seq: int = 64) -> tuple[torch.nn.Module, dict]:
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=heads, vocab_size=512, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model, batch = _llama()
    cluster = Cluster.parse("1x4:h100-80g")
    work = price_workload(model, batch, device=cluster.groups[0].device, tps=(1, 2, 4))
    return work, cluster


def test_the_spelling_round_trips_and_bad_spellings_are_typed_errors() -> None:
    p = PlanPoint(2, 2, 1, 1, 4, "1f1b", 1, "full", "bf16")
    q = PlanPoint(2, 1, 4, 1, 1, "zbh1", 1, "none", "bf16", compress="bf16", cut=(1, 2, 4))
    assert q.spelling().endswith(",compress=bf16,cut=1/2/4")
    for point in (p, q):
        assert PlanPoint(**parse_spelling(point.spelling())) == point
    assert list(parse_spelling(p.spelling())) == [k for k in KEYS if k != "cut"]
    for bad, match in (("dp=2,foo=1", "keys"), ("tp=two", "whole number"), ("zero=4", "0-3"),
                       ("schedule=zigzag", "one of"), ("dp", "KEY=VALUE"),
                       ("cut=2/1", "increasing"), ("cut=1/x", "increasing")):
        with pytest.raises(ConfigError, match=match):
            parse_spelling(bad)


def test_clusters_parse_and_unknown_devices_are_typed_errors() -> None:
    c = Cluster.parse("2x8:h100-80g+2x8:a100-40g")
    assert c.devices == 32 and c.per_node == 8 and c.heterogeneous
    assert c.spelling() == "2x8:h100-80g+2x8:a100-40g"
    assert Cluster.parse("128x8:a100-80g", inter="roce-200g").groups[0].device.inter.name == \
        "roce-200g"
    with pytest.raises(ConfigError, match="unknown device profile 'tpu-v9'"):
        Cluster.parse("1x8:tpu-v9")
    with pytest.raises(ConfigError, match="NODESxPER_NODE:DEVICE"):
        Cluster.parse("eight h100s")


def test_the_clustered_capture_prices_every_layer(tiny: tuple) -> None:
    """Two layers are captured and the rest are copies; sharding halves a layer's weights
    and work and adds its all-reduces (2 forward, 2 backward)."""
    work, _ = tiny
    assert work.layers == 4 and work.layer_list == "model.layers"
    one, two = (next(p for p in work.parts[t] if p.name == "layer 0") for t in (1, 2))
    assert len([p for p in work.parts[1] if p.name.startswith("layer ")]) == 4
    assert one.params / 2 < two.params < one.params * 0.51  # norms stay whole
    assert not one.tp_bytes
    assert sorted(ph for ph, _ in two.tp_bytes) == ["backward", "backward", "forward", "forward"]
    assert two.forward_s < one.forward_s
    assert one.forward_flops == pytest.approx(two.forward_flops, rel=0.05)  # norms: t copies


def test_search_ranks_fitting_plans_by_time_and_is_reproducible(tiny: tuple) -> None:
    work, cluster = tiny
    plans = search(work, cluster)
    again = search(work, cluster)
    assert [p.point for p in plans] == [p.point for p in again]
    assert {p.point.devices for p in plans} == {4}
    assert {(p.point.tp, p.point.pp) for p in plans} >= {(1, 1), (2, 1), (4, 1), (1, 2),
                                                         (2, 2), (1, 4)}
    fits = [p for p in plans if p.fits]
    assert fits and plans[:len(fits)] == fits
    assert [p.step_s for p in fits] == sorted(p.step_s for p in fits)
    for p in plans:
        assert p.step_s == pytest.approx(sum(p.breakdown.values()))
        assert 0 < p.mfu < 1 and p.hardware_tflops >= p.model_tflops
        assert (p.breakdown["tp_comm"] > 0) == (p.point.tp > 1)
        assert (p.breakdown["bubble"] > 0) == (p.point.pp > 1)


def test_memory_follows_zero_and_recompute(tiny: tuple) -> None:
    work, cluster = tiny
    base = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    mem = {z: evaluate(PlanPoint(**{**base.__dict__, "zero": z}), work, cluster).memory
           for z in range(4)}
    assert mem[1]["optimizer"] * 4 == pytest.approx(mem[0]["optimizer"], rel=0.01)
    # ZeRO-2 reduce-scatters bucket by bucket as the backward makes them: at the busiest
    # block it holds what the backward made so far whole up to a bucket, the rest as shards
    # (bench_planner, GLM dp=2: ZeRO-2 120.2 MiB measured, 120.2 by the whole-step
    # simulation, ZeRO-0 138.3: the same in-step peak, the optimizer state halved)
    params = sum(c.params for c in work.parts[1])
    assert 0 < mem[2]["gradients"] <= mem[1]["gradients"] <= params * 4
    small = evaluate(PlanPoint(**{**base.__dict__, "zero": 2, "bucket": params * 4 / 16 / 2**20}),
                     work, cluster).memory  # 16 buckets
    assert small["gradients"] < mem[1]["gradients"]
    assert mem[3]["parameters"] < mem[2]["parameters"]
    full = evaluate(PlanPoint(**{**base.__dict__, "recompute": "full"}), work, cluster)
    none = evaluate(base, work, cluster)
    # pipelined (gradients accumulate over micro-batches): the backward is the peak, where
    # full recompute keeps each layer's output only
    staged = PlanPoint(1, 1, 4, 0, 1, "1f1b", 1, "none", "bf16")
    assert evaluate(PlanPoint(**{**staged.__dict__, "recompute": "full"}), work, cluster
                    ).memory["activations"] < evaluate(staged, work, cluster
                                                       ).memory["activations"]
    # data parallel, ZeRO-0: the update sets the peak, so full recompute (the pass's rule:
    # every layer made again) costs its forward once more and lowers no peak
    assert full.peak_bytes == none.peak_bytes and none.breakdown["recompute"] == 0
    m = work.sequences // (base.dp * base.microbatch)
    again = sum(base.microbatch * c.forward_s + c.overhead_s / 3  # the step as compiled
                for c in work.parts_on(work.device, 1, staged=False)
                if c.name.startswith("layer"))
    assert full.breakdown["recompute"] == pytest.approx(m * again, rel=1e-6) and again > 0
    # selective: between the two in memory and in recompute time (the layers' matmul
    # outputs kept, their pointwise ops, norms and softmax made again)
    sel = {k: evaluate(PlanPoint(**{**staged.__dict__, "recompute": k}), work, cluster)
           for k in ("none", "selective", "full")}
    acts = {k: v.memory["activations"] for k, v in sel.items()}
    rec = {k: v.breakdown["recompute"] for k, v in sel.items()}
    assert acts["full"] < acts["selective"] < acts["none"], acts
    assert rec["none"] == 0 < rec["selective"] < rec["full"], rec
    assert sel["none"].hardware_tflops * sel["none"].step_s < \
        sel["selective"].hardware_tflops * sel["selective"].step_s < \
        sel["full"].hardware_tflops * sel["full"].step_s
    layer = next(c for c in work.parts[1] if c.name.startswith("layer "))
    assert layer.out_bytes < layer.selective_bytes < layer.saved_bytes
    assert 0 < layer.selective_flops < 0.2 * layer.forward_flops  # no matmul made again
    gpipe = evaluate(PlanPoint(1, 1, 4, 0, 1, "gpipe", 1, "none", "bf16"), work, cluster)
    f1b1 = evaluate(PlanPoint(1, 1, 4, 0, 1, "1f1b", 1, "none", "bf16"), work, cluster)
    assert gpipe.memory["activations"] > f1b1.memory["activations"]


def test_a_memory_budget_is_priced_as_the_cheapest_mix_of_recompute_modes(tiny: tuple
                                                                          ) -> None:
    """`recompute=<budget>` (the recompute pass's spelling): on each rank the mix of none,
    selective and full on the lower hull of their (peak, recompute time) points that meets
    the budget — none above none's peak, full below full's, in between both between."""
    work, cluster = tiny
    base = PlanPoint(1, 1, 4, 0, 1, "1f1b", 1, "none", "bf16")  # activations set the peak
    at = {k: evaluate(dataclasses.replace(base, recompute=k), work, cluster)
          for k in ("none", "selective", "full")}

    def priced(budget: str, point: PlanPoint = base) -> object:
        spelling = point.spelling().replace("recompute=none", f"recompute={budget}")
        [p] = search(work, cluster, parse_spelling(spelling))
        assert PlanPoint(**parse_spelling(p.point.spelling())) == p.point
        assert p.point.recompute == budget
        return p
    lo, hi = at["full"].peak_bytes, at["none"].peak_bytes
    assert lo < hi
    assert priced(str(2 * hi)).breakdown["recompute"] == 0
    assert priced(str(2 * hi)).peak_bytes == hi and priced(str(2 * hi)).fits
    assert priced("1").peak_bytes == hi  # a share of 1: every activation kept
    low = priced(str(lo // 2))  # below full's peak: priced at the least peak (full's, at no
    # more recompute than full: a rank whose peak is not its activations stops sooner), and
    # it does not fit
    assert low.peak_bytes == lo and not low.fits
    assert 0 < low.breakdown["recompute"] <= at["full"].breakdown["recompute"]
    assert "below the least peak recompute reaches" in low.describe()
    mid = priced(str((lo + hi) // 2))
    assert lo < mid.peak_bytes < hi
    assert mid.peak_bytes == pytest.approx((lo + hi) / 2, rel=0.02)
    # the first stage recomputes (it holds the most micro-batches); the step waits on the
    # last one (the head), which does not
    assert mid.breakdown["recompute"] <= at["full"].breakdown["recompute"]
    assert at["none"].step_s <= mid.step_s <= at["full"].step_s
    assert at["none"].hardware_tflops * at["none"].step_s < mid.hardware_tflops * mid.step_s \
        < at["full"].hardware_tflops * at["full"].step_s
    state = at["none"].memory["parameters"] + at["none"].memory["optimizer"]
    share = priced("0.8")  # 80% of what the busiest rank holds above its state
    assert lo < share.peak_bytes == pytest.approx(state + 0.8 * (hi - state), rel=0.03)
    assert (priced("0.3").peak_bytes, priced("0.3").fits) == (lo, False)
    above = int(0.5 * (lo + hi)) - state - at["none"].memory["gradients"]  # a stage's state
    assert priced(f"+{above}B").peak_bytes == pytest.approx((lo + hi) / 2, rel=0.03)
    # data-parallel replicas whose update sets the peak: recompute frees nothing, none is
    # priced whatever the budget
    replicas = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    assert priced("0.1", replicas).breakdown["recompute"] == 0
    for bad in ("lots", "min", "-3"):
        with pytest.raises(ConfigError, match="memory budget"):
            parse_spelling(f"recompute={bad}")


def test_an_interleaved_rank_meets_a_share_on_each_of_its_stages(tiny: tuple) -> None:
    """The runtime takes a fraction of every pipeline stage's own activations: a stage of
    the head alone recomputes nothing, so any share below 1 is out of its reach (the pass
    refuses it), whatever the rank's other stage could free."""
    from glmc.passes.recompute import Budget
    from glmc.parallel.search import _stage_shares
    work, _ = tiny
    parts = work.parts[1]
    head = (parts[-1],)
    assert not head[0].name.startswith("layer")
    layers = tuple(c for c in parts if c.name.startswith("layer "))[:2]
    point = PlanPoint(1, 1, 2, 0, 1, "interleaved", 2, "0.8", "bf16")
    unmet = _stage_shares(point, [layers, head], 1, head, work, 8, Budget.parse("0.8"), False)
    assert len(unmet) == 1 and unmet[0][0] == 1 and unmet[0][1] < unmet[0][2]
    assert _stage_shares(point, [layers, head], 1, head, work, 8, Budget.parse("1"), False) == []


def test_full_recompute_under_tp_keeps_or_issues_again_its_all_reduces(tiny: tuple) -> None:
    """glmc's full rule keeps the layer's forward tensor-parallel all-reduce outputs it makes
    again from (the attention's; the MLP's only joins the kept output) and issues none
    again (the all-reduce time of no recompute);
    Megatron-LM's checkpointed layers keep the output alone and issue the forward all-reduces
    again in the backward (`Workload.recomputing_collectives`, the published runs' pricing)."""
    work, cluster = tiny
    point = PlanPoint(1, 2, 2, 0, 1, "1f1b", 1, "full", "bf16", cut=(2,))  # one cut for all
    none = evaluate(dataclasses.replace(point, recompute="none"), work, cluster)
    glmc_full = evaluate(point, work, cluster)
    megatron = evaluate(point, work.recomputing_collectives(), cluster)
    layer = next(c for c in work.parts[2] if c.name.startswith("layer "))
    forward = [n for phase, n in layer.tp_bytes if phase == "forward"]  # attention, MLP
    assert len(forward) == 2 and layer.kept("full") == layer.out_bytes + forward[0]
    assert glmc_full.breakdown["tp_comm"] == pytest.approx(none.breakdown["tp_comm"])
    assert megatron.breakdown["tp_comm"] > glmc_full.breakdown["tp_comm"]
    assert megatron.memory["activations"] < glmc_full.memory["activations"] < \
        none.memory["activations"]
    assert megatron.breakdown["recompute"] == pytest.approx(glmc_full.breakdown["recompute"])


def test_the_hull_of_recompute_modes_skips_a_mode_above_the_chord() -> None:
    from glmc.parallel.search import _hull_mix
    costly = [(100, 0.0, "none"), (90, 5.0, "selective"), (50, 6.0, "full")]
    assert _hull_mix(costly, 75) == (("none", 0.5), ("full", 0.5))
    cheap = [(100, 0.0, "none"), (60, 1.0, "selective"), (50, 6.0, "full")]
    assert _hull_mix(cheap, 80) == (("none", 0.5), ("selective", 0.5))
    assert _hull_mix(cheap, 55) == (("selective", 0.5), ("full", 0.5))
    assert (_hull_mix(cheap, 120), _hull_mix(cheap, 10)) == ("none", "full")


def test_fix_prices_plans_outside_the_search_and_rejects_impossible_ones(tiny: tuple) -> None:
    work, cluster = tiny
    z3 = search(work, cluster, parse_spelling("dp=2,tp=1,pp=2,zero=3,microbatch=1"))
    assert len(z3) == 1 and z3[0].point.zero == 3
    assert "ZeRO-3 with pipelining" in z3[0].point.runtime_gaps()[0]
    with pytest.raises(ConfigError, match="cluster 1x4:h100-80g has 4"):
        search(work, cluster, parse_spelling("dp=8,tp=1,pp=1,microbatch=1"))
    with pytest.raises(ConfigError, match="does not split"):
        search(work, cluster, parse_spelling("dp=4,tp=1,pp=1,microbatch=4"))


def test_glmc_plan_cli_and_api(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "meta_llama.py"
    f.write_text("import torch, transformers\n"
                 "cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, "
                 "num_hidden_layers=2, num_attention_heads=4, vocab_size=512, use_cache=False)\n"
                 "with torch.device('meta'):\n"
                 "    model = transformers.LlamaForCausalLM(cfg)\n"
                 "    ids = torch.zeros(8, 64, dtype=torch.long)\n"
                 "example_inputs = {'input_ids': ids, 'labels': ids}\n")
    out = tmp_path / "plans.json"
    assert main(["plan", str(f), "--cluster", "1x2:a100-40g", "--explain", "--json",
                 str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "plans priced" in text and "vs dp=" in text
    plans = json.loads(out.read_text())["plans"]
    assert {"spelling", "step_seconds", "tokens_per_second", "model_tflops_per_device",
            "hardware_tflops_per_device", "mfu", "peak_bytes_per_device", "fits"} <= \
        set(plans[0])
    model, batch = _llama(layers=2)  # 2 layers, 2 devices: the interfaces, not the search
    api = glmc.plan(model, batch, cluster="1x2:a100-40g", fix="tp=2")
    assert api and all(p.point.tp == 2 for p in api)
    f.write_text("")
    assert main(["plan", str(f), "--cluster", "1x1:a100-40g"]) == 1  # no model in FILE
    assert "neither" in capsys.readouterr().err
    # too small a device: an error naming the memory the smallest plan needs (3.8B parameters)
    f.write_text(f.read_text() or _FILE.format(hidden=4096, layers=32, heads=32))
    assert main(["plan", str(f), "--cluster", "1x1:a100-40g"]) == 1
    assert "no plan fits in 40.0 GiB per device; the smallest needs" in capsys.readouterr().out


_FILE = ("import torch, transformers\n"
         "cfg = transformers.LlamaConfig(hidden_size={hidden}, intermediate_size={hidden}, "
         "num_hidden_layers={layers}, num_attention_heads={heads}, vocab_size=512, "
         "use_cache=False)\n"
         "with torch.device('meta'):\n"
         "    model = transformers.LlamaForCausalLM(cfg)\n"
         "    ids = torch.zeros(4, 512, dtype=torch.long)\n"
         "example_inputs = {{'input_ids': ids, 'labels': ids}}\n")


# ---- Megatron-LM, Narayanan et al. SC'21, Table 1 ----------------------------------------------

#: parameters (B), hidden, layers, heads, TP, PP, GPUs, global batch -> TFLOP/s per GPU
MEGATRON = [(1.7, 2304, 24, 24, 1, 1, 32, 512, 137), (3.6, 3072, 30, 32, 2, 1, 64, 512, 138),
            (7.5, 4096, 36, 32, 4, 1, 128, 512, 142), (18.4, 6144, 40, 48, 8, 1, 256, 1024, 135),
            (39.1, 8192, 48, 64, 8, 2, 512, 1536, 138),
            (76.1, 10240, 60, 80, 8, 4, 1024, 1792, 140),
            (145.6, 12288, 80, 96, 8, 8, 1536, 2304, 148),
            (310.1, 16384, 96, 128, 8, 16, 1920, 2160, 155),
            (529.6, 20480, 105, 128, 8, 35, 2520, 2520, 163),
            (1008, 25600, 128, 160, 8, 64, 3072, 3072, 163)]


def megatron_row(row: tuple) -> tuple[float, object]:
    """glmc's predicted TFLOP/s per GPU for one published row, counted as the paper counts
    (96 B s l h^2 (1 + s/6h + V/16lh)), and the priced plan. The model: GPT-3 style (OPT
    blocks: LayerNorm, separate q/k/v with biases, GELU MLP of 4h; unfused attention as in
    2021), fp16, full recompute (each layer's tensor-parallel all-reduces issued again, as
    Megatron-LM's checkpointed layers do), interleaved 1F1B where pipelined, the gradient
    all-reduce after the backward (Megatron-LM of 2021 did not overlap it)."""
    _, h, layers, heads, tp, pp, gpus, gb, _ = row
    model, batch, cluster = megatron_workload(row)
    best = glmc.plan(model, batch, cluster=cluster, fix=published_plan(row), overlap=False,
                     recompute_collectives=True)[0]
    return megatron_flops(row) / best.step_s / gpus / 1e12, best


def megatron_workload(row: tuple) -> tuple[object, dict, str]:
    """The row's GPT model on the meta device, its global batch and cluster."""
    _, h, layers, heads, tp, pp, gpus, gb, _ = row
    cfg = transformers.OPTConfig(hidden_size=h, num_hidden_layers=layers, ffn_dim=4 * h,
                                 num_attention_heads=heads, vocab_size=51200,
                                 max_position_embeddings=2048, word_embed_proj_dim=h,
                                 activation_function="gelu", use_cache=False,
                                 attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(cfg)
        ids = torch.zeros(gb, 2048, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}, f"{gpus // 8}x8:a100-80g"


def published_plan(row: tuple) -> str:
    """The row's published configuration as a partial plan spelling (`--fix`): fp16, no
    gradient compression, full recompute, interleaved where pipelined."""
    tp, pp = row[4], row[5]
    return f"tp={tp},pp={pp},zero=0,recompute=full,precision=fp16,compress=none" + \
        (",schedule=interleaved" if pp > 1 else "")


def megatron_flops(row: tuple) -> float:
    """The paper's count of one step's FLOPs (recomputation included)."""
    _, h, layers, _, _, _, _, gb, _ = row
    s, v = 2048, 51200
    return 96 * gb * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def megatron_picks(row: tuple) -> dict:
    """glmc's own plan for the row's model, cluster and global batch (fp16, the gradient
    all-reduce not overlapped, as the published run) against the published configuration:
    free, and with the published full recompute kept."""
    model, batch, cluster = megatron_workload(row)
    plans = glmc.plan(model, batch, cluster=cluster, fix="precision=fp16", overlap=False,
                      recompute_collectives=True)
    out = {}
    for key, fix in (("published", published_plan(row)),
                     ("pick", "precision=fp16"), ("pick_full", "recompute=full,precision=fp16")):
        want = parse_spelling(fix)  # the best plan that matches, of one search
        found = [p for p in plans if all(getattr(p.point, k) == v for k, v in want.items())]
        p = found[0] if found else glmc.plan(model, batch, cluster=cluster, fix=fix,
                                             overlap=False, recompute_collectives=True)[0]
        out[key] = {"spelling": p.point.spelling(), "step_s": p.step_s, "fits": p.fits,
                    "tflops": megatron_flops(row) / p.step_s / row[6] / 1e12,
                    "peak_gib": p.peak_bytes / 2**30}
    return out


@pytest.mark.parametrize("row", [0, pytest.param(4, marks=pytest.mark.slow)])
def test_published_megatron_runs_are_predicted(row: int) -> None:
    """Row 0 (data parallel on 32 GPUs) in the default run; row 4 (tp=8, pp=2, interleaved)
    and every row (`test_every_published_megatron_row`) under -m slow."""
    predicted, plan = megatron_row(MEGATRON[row])
    assert predicted == pytest.approx(MEGATRON[row][-1], rel=0.15)
    assert plan.fits


@pytest.mark.slow
def test_every_published_megatron_row() -> None:
    """The issue's bar: every row within 15%, median within 10%, every row fits (measured
    2026-12-03: within 9%, median 4.8%)."""
    errors = []
    for row in MEGATRON:
        predicted, plan = megatron_row(row)
        errors.append(predicted / row[-1] - 1)
        assert plan.fits, row
    assert all(abs(e) <= 0.15 for e in errors), errors
    assert statistics.median(abs(e) for e in errors) <= 0.10, errors


@pytest.mark.slow  # a whole search at each row's scale (~70 s); row 0's --fix runs by default
@pytest.mark.parametrize("row", [0, 4])
def test_glmc_picks_a_plan_at_least_as_fast_as_the_published_one(row: int) -> None:
    """For the row's model, cluster and global batch, glmc's top plan is predicted at least
    as fast as the published configuration and fits — with full recompute kept too (then
    only the layout and micro-batches differ; benchmarks/megatron_picks.py prints all
    rows)."""
    picks = megatron_picks(MEGATRON[row])
    pub = picks["published"]
    for key in ("pick", "pick_full"):
        assert picks[key]["fits"] and picks[key]["step_s"] <= pub["step_s"] * 1.0001, picks
    assert "recompute=full" in picks["pick_full"]["spelling"]


# ---- the same paper's Table 2: ZeRO-3 without model parallelism vs PTD-P --------------------

#: parameters (B), hidden, layers, heads, TP, PP, GPUs, global batch, micro-batch, ZeRO stage
#: -> TFLOP/s per GPU (the 530B ZeRO-3 run used 640 GPUs and a batch of 2,560 on its first
#: row: it did not fit on 560 with micro-batches of 4)
MEGATRON_ZERO3 = [
    (174.6, 12288, 96, 96, 1, 1, 384, 1536, 4, 3, 144),
    (174.6, 12288, 96, 96, 1, 1, 768, 1536, 2, 3, 88),
    (174.6, 12288, 96, 96, 1, 1, 1536, 1536, 1, 3, 44),
    (529.6, 20480, 105, 128, 1, 1, 640, 2560, 4, 3, 138),
    (529.6, 20480, 105, 128, 1, 1, 1120, 2240, 2, 3, 98),
    (529.6, 20480, 105, 128, 1, 1, 2240, 2240, 1, 3, 48),
    (174.6, 12288, 96, 96, 8, 12, 384, 1536, 1, 0, 153),
    (174.6, 12288, 96, 96, 8, 12, 768, 1536, 1, 0, 149),
    (174.6, 12288, 96, 96, 8, 12, 1536, 1536, 1, 0, 141),
    (529.6, 20480, 105, 128, 8, 35, 560, 2240, 1, 0, 171),
    (529.6, 20480, 105, 128, 8, 35, 1120, 2240, 1, 0, 167),
    (529.6, 20480, 105, 128, 8, 35, 2240, 2240, 1, 0, 159)]


def zero3_row(row: tuple) -> tuple[float, object]:
    """glmc's predicted TFLOP/s per GPU for one Table 2 row (the paper's count) and the
    priced plan: its degrees, micro-batch and ZeRO stage fixed, fp16, full recompute. ZeRO-3
    (DeepSpeed's) overlaps its gradient reduce-scatter with the backward and prefetches
    parameters, and the bucket size is the planner's; PTD-P runs as in Table 1 (interleaved,
    the all-reduce after the backward)."""
    params, h, layers, heads, tp, pp, gpus, gb, mb, zero, published = row
    t1 = (params, h, layers, heads, tp, pp, gpus, gb, published)
    model, batch, cluster = megatron_workload(t1)
    fix = (f"dp={gpus // (tp * pp)},tp={tp},pp={pp},zero={zero},microbatch={mb},"
           "recompute=full,precision=fp16" + (",schedule=interleaved" if pp > 1 else ""))
    best = glmc.plan(model, batch, cluster=cluster, fix=fix, overlap=zero == 3,
                     recompute_collectives=True)[0]
    return megatron_flops(t1) / best.step_s / gpus / 1e12, best


@pytest.mark.parametrize("row", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_zero3_without_model_parallelism_is_predicted(row: int) -> None:
    """ZeRO-3 on 1,536 GPUs is bound by its parameter gathers over InfiniBand (44 TFLOP/s
    published); PTD-P on as many keeps 141."""
    predicted, plan = zero3_row(MEGATRON_ZERO3[row])
    assert plan.fits
    assert predicted == pytest.approx(MEGATRON_ZERO3[row][-1], rel=0.25)


@pytest.mark.slow
def test_every_row_of_table_2() -> None:
    """PTD-P rows within Table 1's 15%; ZeRO-3 rows within 30% (measured 2026-12-05:
    +9/+26/+23% at 175B, +5/-4/-1% at 530B); at every GPU count PTD-P predicted faster than
    ZeRO-3, and ZeRO-3's throughput per GPU falling as the GPUs grow at a fixed batch."""
    got = [zero3_row(r) for r in MEGATRON_ZERO3]
    for r, (predicted, plan) in zip(MEGATRON_ZERO3, got):
        assert plan.fits, r
        assert predicted == pytest.approx(r[-1], rel=0.15 if r[9] == 0 else 0.30), r
    for size in (0, 3):
        zero3 = [got[size + i][0] for i in range(3)]
        ptdp = [got[size + 6 + i][0] for i in range(3)]
        assert zero3[0] > zero3[1] > zero3[2]
        assert all(p > z for p, z in zip(ptdp, zero3))


def test_tensor_parallelism_across_nodes_is_priced_with_a_warning(tiny: tuple) -> None:
    """`--fix tp=4` on nodes of 2 devices: priced (its all-reduces on the inter-node ring,
    slower than inside a node of 4) with a warning; the search alone keeps tp in a node, and
    a group that splits nodes unevenly is a typed error."""
    work, inside = tiny
    across = Cluster.parse("2x2:h100-80g")
    with pytest.warns(UserWarning, match="tp=4 spans nodes of 2 devices"):
        plans = search(work, across, {"tp": 4})
    assert plans and all(p.point.tp == 4 for p in plans)
    point = plans[0].point
    assert plans[0].breakdown["tp_comm"] > evaluate(point, work, inside).breakdown["tp_comm"]
    assert all(p.point.tp <= 2 for p in search(work, across))
    with pytest.raises(ConfigError, match="unevenly"):
        evaluate(PlanPoint(3, 4, 1, 0, 1, "1f1b", 1, "none", "bf16"), work,
                 Cluster.parse("4x3:h100-80g"))


def test_a_heterogeneous_cluster_gets_an_uneven_split_faster_than_an_even_one() -> None:
    """Half H100, half A100-40GB: the stage on the faster devices takes more layers."""
    model, batch = _llama(layers=8, hidden=1024, heads=8, batch=8, seq=1024)
    cluster = Cluster.parse("1x2:h100-80g+1x2:a100-40g")
    work = price_workload(model, batch, device=cluster.groups[0].device, tps=(1,),
                          others=[cluster.groups[1].device])
    point = PlanPoint(2, 1, 2, 0, 4, "1f1b", 1, "none", "bf16")
    uneven = evaluate(point, work, cluster)
    even = evaluate(point, work, cluster, cut="equal")
    assert uneven.stage_devices == ("h100-80g", "a100-40g")
    assert uneven.stage_parts[0] > uneven.stage_parts[1]
    assert even.stage_parts == (5, 5)  # embedding + 4 layers, 4 layers + head
    assert uneven.step_s < even.step_s
    plans = search(work, cluster)
    assert plans and all(p.point.pp % 2 == 0 and p.point.virtual == 1 for p in plans)
    with pytest.raises(ConfigError, match="spans two device kinds"):
        evaluate(PlanPoint(2, 1, 2, 0, 4, "1f1b", 1, "none", "bf16"),
                 work, Cluster.parse("1x1:h100-80g+3x1:a100-40g"))


def test_compression_is_searched_and_priced(tiny: tuple) -> None:
    """The search tries dense and bf16 gradients for data-parallel replicas: bf16 sends half
    the bytes, adds its casts and error feedback's residual (an fp32 copy of the gradients)
    on each rank; sign (1 bit, all-gathered) is priced where a spelling fixes it, never
    picked; the low-rank and sparse methods are typed errors (not priced)."""
    work, _ = tiny
    cluster = Cluster.parse("4x1:h100-80g")  # data parallelism across nodes
    plans = search(work, cluster)
    assert {p.point.compress for p in plans if p.point.dp > 1 and p.point.pp == 1} == \
        {"none", "bf16"}
    assert {p.point.compress for p in plans if p.point.dp == 1 or p.point.pp > 1} == {"none"}
    base = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    dense, half, sign = (evaluate(PlanPoint(**{**base.__dict__, "compress": c}), work,
                                  cluster, overlap=False) for c in ("none", "bf16", "sign"))
    params = sum(c.params for c in work.parts[1])
    assert half.breakdown["dp_all_reduce"] < dense.breakdown["dp_all_reduce"]
    assert half.breakdown["compress"] > 0 and "compress" not in dense.breakdown
    assert half.memory["compression"] == params * 4 and "compression" not in dense.memory
    assert sign.breakdown["dp_all_gather"] > 0 and "dp_all_reduce" not in sign.breakdown
    assert sign.breakdown["compress"] > half.breakdown["compress"]  # 4 ranks' signs unpacked
    fixed = search(work, cluster, parse_spelling("compress=sign"))
    assert fixed and {p.point.compress for p in fixed} == {"sign"}
    assert all(p.point.dp > 1 for p in fixed)
    with pytest.raises(ConfigError, match="compress=powersgd is not priced"):
        search(work, cluster, parse_spelling("dp=4,tp=1,pp=1,microbatch=2,compress=powersgd"))
    piped = search(work, cluster, parse_spelling("dp=2,pp=2,compress=bf16"))
    assert piped and all("compression with pipelining" in " ".join(p.point.runtime_gaps())
                         for p in piped)


def test_precision_is_searched_where_the_device_offers_several() -> None:
    """On GPUs the search prices bf16 and fp16 from one capture (same bytes, same matmul
    rate) and fp16 pays its loss scaling's overflow check; a given precision is the only
    one priced; CPUs train in fp32."""
    from glmc.parallel.planner import price_precisions
    model, batch = _llama(layers=3)
    cluster = Cluster.parse("1x2:a100-80g")
    device = cluster.groups[0].device
    works = price_precisions(model, batch, device=device, precisions=device.searched, tps=(1,))
    assert [w.precision for w in works] == ["fp16", "bf16"] and works[0].parts is works[1].parts
    plans = search(works, cluster)
    assert {p.point.precision for p in plans} == {"bf16", "fp16"}
    by = {p.point.spelling(): p for p in plans}
    for p in plans:
        if p.point.precision == "bf16":
            twin = by[p.point.spelling().replace("precision=bf16", "precision=fp16")]
            assert twin.breakdown["update"] > p.breakdown["update"]
            assert twin.peak_bytes == p.peak_bytes
    assert plans[0].point.precision == "bf16"
    assert {p.point.precision for p in search(works, cluster, {"precision": "fp16"})} == \
        {"fp16"}
    with pytest.raises(ConfigError, match="priced at fp16, bf16"):
        search(works, cluster, {"precision": "fp32"})
    assert Cluster.parse("1x2:kunpeng920").groups[0].device.searched == ("fp32",)


def test_a_plan_spelling_becomes_the_flags_it_stands_for(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """`glmc compile FILE --plan SPELLING`: the launcher's flags (the GLM example's global
    batch is 4 sequences); bad spellings and conflicts are usage errors."""
    from glmc.frontend.cli import _parser
    from glmc.frontend.planning import apply_plan
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    glm = str(Path(__file__).resolve().parent.parent / "examples" / "glm.py")

    def flags(*argv: str) -> object:
        args = _parser()[0].parse_args(["compile", glm, *argv])
        apply_plan(args, list(argv))
        return args

    a = flags("--nproc", "2", "--plan", "dp=1,tp=2,pp=1,microbatch=4")
    assert (a.nproc, a.tp, a.pp, a.zero, a.accumulate) == (2, 2, None, 0, None)
    a = flags("--plan", "dp=1,tp=1,pp=2,microbatch=1,schedule=zbh1,recompute=full")
    assert (a.nproc, a.pp, a.microbatches, a.schedule, a.memory_budget) == \
        (2, 2, 4, "zbh1", "full")
    a = flags("--plan", "dp=1,tp=1,pp=2,microbatch=1,schedule=zbh1,cut=1")
    assert (a.pp, a.schedule, a.cut) == (2, "zbh1", "1")  # the runtime cuts there
    a = flags("--plan", "dp=2,microbatch=2,recompute=selective")
    assert (a.nproc, a.memory_budget) == (2, "selective")
    a = flags("--plan", "dp=2,microbatch=2,recompute=0.5")
    assert (a.nproc, a.memory_budget) == (2, "0.5")
    a = flags("--plan", "dp=2,zero=1,microbatch=1,precision=bf16")
    assert (a.nproc, a.zero, a.accumulate, a.precision) == (2, 1, 2, "bf16")
    a = flags("--plan", "dp=2,tp=2,zero=1,microbatch=1")
    assert (a.nproc, a.tp, a.zero, a.accumulate) == (4, 2, 1, 2)
    a = flags("--plan", "dp=1,tp=2,pp=2,microbatch=1")  # tensor-parallel pipeline stages
    assert (a.nproc, a.tp, a.pp, a.microbatches, a.zero) == (4, 2, 2, 4, 0)
    a = flags("--plan", "dp=2,zero=1,microbatch=2,compress=bf16")
    assert (a.nproc, a.zero, a.compress) == (2, 1, "bf16")
    for argv, match in ((("--nproc", "4", "--plan", "dp=2"), "--nproc is 4"),
                        (("--zero", "1", "--plan", "dp=2"), "not both"),
                        (("--plan", "dp=1,tp=2,pp=2,recompute=full,microbatch=1"),
                         "cannot run"),
                        (("--plan", "dp=8"), "smaller than dp=8"),
                        (("--plan", "dp=2,microbatch=2,cut=1"), "needs 0 starts"),
                        (("--plan", "dp=1,pp=2,microbatch=1,cut=1/2"), "needs 1 starts"),
                        (("--plan", "dp=1,pp=2,microbatch=1,compress=bf16"),
                         "compression with pipelining"),
                        (("--plan", "dp=2,precision=fp16", "--precision", "bf16"),
                         "trains in fp16")):
        with pytest.raises(ConfigError, match=match):
            flags(*argv)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="once, in glmc's launcher"):
        flags("--plan", "auto")


def test_plan_auto_reports_its_choice_and_the_runners_up(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    """`glmc compile FILE --plan auto` on one process: the launcher prints the chosen plan
    and the runners-up; the run's summary and report.json/html show the plan, its rank, its
    prediction against the measured step, and the runners-up."""
    import json

    from glmc.frontend.cli import main
    from glmc.frontend.planning import PLAN_CHOICE
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(PLAN_CHOICE, raising=False)
    glm = str(Path(__file__).resolve().parent.parent / "examples" / "glm.py")
    assert main(["compile", glm, "--plan", "auto", "--steps", "3", "--backend", "eager",
                 "--report-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"--plan auto: plan \d+ of \d+ for 1 local process", out), out
    assert re.search(r"plan \(--plan auto\): dp=1,tp=1,pp=1,\S+, rank \d+ of \d+ priced: "
                     r"predicted [0-9.]+ ms, measured [0-9.]+ ms", out), out
    data = json.loads((tmp_path / "report.json").read_text())
    plan = data["plan"]
    assert plan["runners_up"] and all(p["step_s"] >= plan["chosen"]["step_s"]
                                      for p in plan["runners_up"])
    assert "Parallel plan (--plan auto" in (tmp_path / "report.html").read_text()


def test_gradient_buckets_overlap_the_backward_that_produces_them(tiny: tuple) -> None:
    """Data-parallel synchronisation is replayed bucket by bucket on the link: a bucket's
    collective starts once the backward has produced it, one at a time, at the link's
    `progress` beside compute; only what is left when the backward ends is exposed. A model
    within one bucket (the bench's 19 MB of gradients in 25 MB) hides nothing."""
    from glmc.parallel.search import _bucket_runs, _buckets, _drain
    assert list(_buckets([10, 10, 10], 4, 80)) == [(1, 80), (2, 40)]
    assert list(_buckets([50], 4, 80)) == [(0, 80), (0, 80), (0, 40)]  # a block over a bucket
    assert list(_bucket_runs([50, 10], 4, 80)) == [(0, 80, 2), (1, 80, 1)]
    assert _drain([(0.0, 1.0, 1, 0.0)], 2.0, 1.0) == (0.0, 1.0)  # hidden
    assert _drain([(2.0, 1.0, 1, 0.0)], 2.0, 1.0) == (1.0, 0.0)  # produced last: all exposed
    assert _drain([(0.0, 1.0, 1, 0.0)], 1.0, 0.5) == (0.5, 1.0)  # half speed beside compute
    assert _drain([(0.0, 1.0, 1, 0.0)] * 2, 1.0, 1.0) == (1.0, 1.0)  # one at a time
    # a run of alike collectives is the same as each on its own: back to back where each is
    # ready before the one ahead is done, else each when it is ready
    for gap, progress in ((0.25, 0.5), (0.5, 1.0), (2.0, 0.5), (0.75, 0.5)):
        run = _drain([(0.5, 0.5, 6, gap)], 2.0, progress)
        alone = _drain([(0.5 + k * gap, 0.5, 1, 0.0) for k in range(6)], 2.0, progress)
        assert run == pytest.approx(alone), (gap, progress)
    import dataclasses
    work, _ = tiny
    # the tiny model's backward on an H100 is shorter than a collective's latency: give
    # every block a millisecond of backward so that there is something to hide behind; four
    # nodes, so that the link's bandwidth (not its latency) sets a collective's time
    cluster = Cluster.parse("4x1:h100-80g")

    def slow(parts: dict) -> dict:
        return {t: tuple(dataclasses.replace(c, backward_s=c.backward_s + 1e-3) for c in cs)
                for t, cs in parts.items()}
    work = dataclasses.replace(work, parts=slow(work.parts), whole=slow(work.whole))
    point = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    params = sum(c.params for c in work.parts[1])
    for buckets, hidden in ((1, False), (4, True)):
        sized = dataclasses.replace(point, bucket=(params * 4 // buckets + 1) / 2**20)
        after = evaluate(sized, work, cluster, overlap=False).breakdown["dp_all_reduce"]
        beside = evaluate(sized, work, cluster).breakdown["dp_all_reduce"]
        assert (beside < 0.5 * after) if hidden else beside == pytest.approx(after, rel=0.05)


def _with_device(cluster: Cluster, **changes: object) -> Cluster:
    """`cluster` (one group) with its device's fields `changes` replaced."""
    import dataclasses
    group = cluster.groups[0]
    return Cluster((dataclasses.replace(group, device=dataclasses.replace(group.device,
                                                                          **changes)),))


def test_processes_that_outnumber_the_cores_share_them(tiny: tuple,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cluster local` with more processes than cores: the cores are shared fairly, so
    four busy processes on two cores take twice as long (the measured 4-process runs on 2
    cores were 39% slower than predicted without it), while a pipeline that runs its stages
    one at a time (one micro-batch) leaves each a whole core (the bubble frees them)."""

    from glmc.parallel import cluster as cl
    from glmc.parallel.search import _shared
    monkeypatch.setattr(cl.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cl._host(2).share == 1.0 and cl._host(4).share == 0.5
    # four processes on two cores, one with 3 s of work: half a core each until the short
    # ones are done (2 s), then a whole core for the rest (2 s)
    assert _shared([1.0, 1.0, 1.0, 3.0], 2) == pytest.approx(4.0)
    assert _shared([1.0, 1.0], 2) == pytest.approx(1.0)
    work, cluster = tiny
    halved = _with_device(cluster, share=0.5)
    point = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    whole, shared = evaluate(point, work, cluster), evaluate(point, work, halved)
    busy = whole.breakdown["compute"] + whole.breakdown["update"]
    assert shared.breakdown["contention"] == pytest.approx(busy)
    assert whole.breakdown["contention"] == 0
    assert shared.step_s - whole.step_s >= busy * 0.999
    sequential = PlanPoint(1, 1, 4, 0, work.sequences, "1f1b", 1, "none", "bf16")
    assert evaluate(sequential, work, halved).step_s == \
        pytest.approx(evaluate(sequential, work, cluster).step_s)


def test_each_blocking_collective_waits_for_a_core_where_processes_outnumber_them(
        tiny: tuple) -> None:
    """`wake_s` (measured with the link where the processes outnumber the cores): every
    tensor-parallel all-reduce, pipeline send/receive and data-parallel collective the step
    waits for costs it once more; a host with a core per process pays nothing."""
    work, cluster = tiny
    woken = _with_device(cluster, wake_s=0.004)
    for point, key in ((PlanPoint(1, 2, 2, 0, 2, "1f1b", 1, "none", "bf16"), "tp_comm"),
                       (PlanPoint(1, 1, 4, 0, 2, "1f1b", 1, "none", "bf16"), "p2p"),
                       (PlanPoint(4, 1, 1, 3, 2, "1f1b", 1, "none", "bf16"), "dp_wake")):
        a, b = evaluate(point, work, cluster), evaluate(point, work, woken)
        extra = b.breakdown[key] - a.breakdown.get(key, 0.0)
        waits = extra / 0.004  # a whole number of waits (the slowest rank's)
        assert waits >= 1 and waits == pytest.approx(round(waits), abs=0.05), (key, waits)
        assert b.step_s > a.step_s
    tp = PlanPoint(1, 2, 2, 0, 2, "1f1b", 1, "none", "bf16")
    m = work.sequences // tp.microbatch
    allreduces = sum(len(c.tp_bytes) for c in work.parts[2] if c.name.startswith("layer "))
    extra = evaluate(tp, work, woken).breakdown["tp_comm"] - \
        evaluate(tp, work, cluster).breakdown["tp_comm"]
    assert extra <= m * allreduces * 0.004 + 1e-9  # the slowest stage's share of them


def test_processes_computing_at_once_slow_each_other(tiny: tuple) -> None:
    """A host whose processes slow each other when they compute at once (`corun`, measured
    with the link: shared caches and memory bandwidth, a virtual machine's cores): replicas
    compute together all the time and pay it on all their compute; a pipeline that runs one
    micro-batch through its stages, one stage at a time, pays little (its stages compute
    apart); a device of its own (corun 1) pays nothing."""
    work, cluster = tiny
    slowed = _with_device(cluster, corun=1.2)
    point = PlanPoint(4, 1, 1, 0, 2, "1f1b", 1, "none", "bf16")
    alone, together = evaluate(point, work, cluster), evaluate(point, work, slowed)
    busy = alone.breakdown["compute"] + alone.breakdown["update"]
    assert together.breakdown["contention"] == pytest.approx(0.2 * busy, rel=0.05)
    assert alone.breakdown["contention"] == 0
    sequential = PlanPoint(1, 1, 4, 0, work.sequences, "1f1b", 1, "none", "bf16")
    a, b = evaluate(sequential, work, cluster), evaluate(sequential, work, slowed)
    assert 0 < b.step_s / a.step_s - 1 < 0.1  # a quarter of the step computing together


def test_co_running_slows_each_op_by_its_working_set() -> None:
    """A host whose memory traffic slows with the working set while its processes compute
    at once (`corun_stream`, measured with the link) but whose in-cache compute does not
    (`corun` 1): the planner slows the step op by op, the head streaming the logits more
    than a layer of small activations (a pipeline on 2 processes: the layers' stage ran at
    its calibrated speed, the head's 1.24-1.33x slower), and replicas that compute at once
    pay it as contention; a flat curve at 1 costs nothing."""
    model, batch = _llama(hidden=64, seq=256)
    cluster = _with_device(Cluster.parse("1x2:kunpeng920"), corun=1.0,
                           corun_stream=((2**18, 1.0), (2**22, 1.5)))
    dev = cluster.groups[0].device
    work = price_workload(model, batch, device=dev, tps=(1,))
    layer, last = work.parts[1][1], work.parts[1][-1]
    assert layer.name == "layer 0" and last.name == "last"
    for c in (layer, last):  # the op list is the block's priced work, op by op
        assert sum(op[1] for op in c.work_ops if op[0] == "f") == pytest.approx(c.forward_s)
        assert sum(op[1] for op in c.work_ops if op[0] == "b") == pytest.approx(c.backward_s)
        assert all(0 <= op[2] <= op[1] for op in c.work_ops)

    def slowed(c: object) -> float:
        return c.corun_extra(dev, "fb", 8) / (8 * (c.forward_s + c.backward_s))
    assert 0 <= slowed(layer) < slowed(last) <= 0.5
    point = PlanPoint(2, 1, 1, 0, 4, "1f1b", 1, "none", "fp32")
    flat = _with_device(cluster, corun_stream=((2**18, 1.0),))
    assert evaluate(point, work, flat).breakdown["contention"] == 0
    assert evaluate(point, work, cluster).breakdown["contention"] > 0


@pytest.mark.parametrize("sequences", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_plans_peak_follows_the_whole_step_simulation(sequences: int) -> None:
    """One process, no pipeline: the planner's peak (one sequence's liveness, scaled to the
    micro-batch) within 3% of glmc's liveness simulation of the whole step compiled at that
    batch (which the c10 allocator confirms: test_cost_memory). The fused LM head's weight
    gradient (made in its forward) is the same for any micro-batch, and its logits chunk
    grows with the rows only up to a chunk (6% over at one sequence when both were scaled)."""
    from glmc.parallel.cluster import device_kind
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   vocab_size=4096, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 4096, (sequences, 256), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    trainer = glmc.optimize(model, batch, backend="eager", measure=False)
    simulated = trainer.report.compiles[-1].predicted["memory"]["peak_bytes"]
    cluster = Cluster.parse("1x1:host")
    work = price_workload(model, batch, device=device_kind("host"), tps=(1,))
    last = work.whole[1][-1]
    assert last.saved_fixed == 4096 * 128 * 4  # the head's fp32 weight gradient
    plan = evaluate(PlanPoint(1, 1, 1, 0, sequences, "1f1b", 1, "none", "fp32"), work, cluster)
    assert plan.peak_bytes == pytest.approx(simulated, rel=0.03)


@pytest.mark.parametrize("pp,schedule,microbatch", [  # ~25-50 s each: one by default
    pytest.param(2, "1f1b", 2, marks=pytest.mark.slow),
    pytest.param(2, "zbh1", 2, marks=pytest.mark.slow),  # ZB-H1's order: test_zbh1_memory_*
    pytest.param(4, "zbh1", 1, marks=pytest.mark.slow), (4, "1f1b", 2)])
def test_a_pipelines_rank_peaks_follow_the_runtimes_stage_graphs(pp: int, schedule: str,
                                                                 microbatch: int) -> None:
    """Each pipeline rank's predicted peak (the planner's cut, handed to the runtime as its
    spelling's `cut`) within 12% of the runtime's own simulation of the stage graphs it
    runs through the schedule (`predicted_peaks`, which the allocator confirms: 140.35 MiB
    measured / 138.35 on bench_planner's Llama `pp=4, zbh1`). ZB-H1 keeps every saved
    value and I's stash to the W (the planner kept only what W reads: 94.6 vs 140.3 MiB)."""
    from glmc.ir.blocks import step_blocks
    from glmc.parallel.cluster import device_kind
    from glmc.parallel.pipeline import build_program, layer_cut
    from glmc.planning.schedule import predicted_peaks
    from glmc.trace.capture import capture
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4,
                                   vocab_size=2048, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 2048, (8, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work = price_workload(model, batch, optimizer=optimizer, device=device_kind("host"),
                          tps=(1,))
    plan = evaluate(PlanPoint(1, 1, pp, 0, microbatch, schedule, 1, "none", "fp32"), work,
                    Cluster.parse(f"1x{pp}:host"))
    m = 8 // microbatch
    blocks = step_blocks(capture(model, {k: v[:microbatch] for k, v in batch.items()}, None,
                                 optimizer))
    bounds = (0, *layer_cut(model, blocks, "/".join(map(str, plan.point.cut)), pp),
              len(blocks))
    program = build_program(model, optimizer, None, batch,
                            [blocks[i:j] for i, j in zip(bounds, bounds[1:])], m, schedule)
    runtime = predicted_peaks(program.program)
    assert len(plan.rank_peaks) == pp
    for r, (ours, theirs) in enumerate(zip(plan.rank_peaks, runtime)):
        assert ours == pytest.approx(theirs, rel=0.12), (r, plan.rank_peaks, runtime)


def test_recompute_stops_once_the_peak_is_not_the_activations() -> None:
    """Where a rank's peak at full recompute is something else (the update, the head's
    logits), the recompute pass under a budget (`recompute=0.5`) stops making values
    again once that floor is reached; the planner prices the least share of the costlier
    mode whose true peak meets the target, not the proportion along the hull's segment."""
    from glmc.parallel.planner import as_mix
    from glmc.parallel.search import _hull_mix
    points = [(100, 0.0, "none"), (70, 30.0, "full")]  # full's 70: the update's floor

    def peak(how: object) -> int:  # the activations fall with the share made again
        return max(70, 100 - 60 * dict(as_mix(how)).get("full", 0.0))
    assert _hull_mix(points, 70) == "full"
    (a, wa), (b, wb) = _hull_mix(points, 70, peak)
    assert (a, b) == ("none", "full") and wb == pytest.approx(0.5, abs=1e-3)
    assert peak(((a, wa), (b, wb))) <= 70
    assert _hull_mix(points, 85) == (("none", 0.5), ("full", 0.5))  # the proportion
    assert _hull_mix(points, 85, peak)[1][1] == pytest.approx(0.25, abs=1e-3)  # the least
    assert _hull_mix(points, 100, peak) == "none"


def test_a_cut_spelt_in_layers_becomes_the_runtimes_block_indices() -> None:
    """`cut=1/2/4` (the layer each later stage starts at; 4 layers: the glue after them)
    as indices of the step's blocks; a cut that does not fit the stages is a typed error."""
    from glmc.parallel.pipeline import layer_cut
    model, _ = _llama()
    blocks = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm",
              "lm_head"]
    assert layer_cut(model, blocks, "1/2/4", 4) == (2, 3, 5)
    assert layer_cut(model, blocks, "0", 2) == (1,)  # the embedding alone
    for text, stages in (("1/2", 4), ("5", 2), ("2/1", 3)):
        with pytest.raises(ConfigError, match="cut"):
            layer_cut(model, blocks, text, stages)


def test_a_blocks_peak_scales_per_sequence_and_caps_a_chunked_workspace() -> None:
    from glmc.parallel.planner import PartCost, _frontier
    points = _frontier([(10, 0, -1), (9, 0, -1), (5, 8, 16), (5, 4, 16), (4, 8, 16)])
    assert points == ((10, 0, -1), (5, 8, 16))  # the others are beaten at every size
    c = PartCost("last", 0.0, 0.0, 0.0, 0, 3, 0, (), 0.0, 0.0, peaks=points, saved_fixed=7)
    assert [c.peak(b) for b in (1, 2, 4)] == [13, 26, 40]  # 5b + min(8b, 16) vs 10b
    assert c.held("none", 4) == 4 * 3 + 7


def test_zero3_on_gloo_holds_a_staged_copy_of_the_gather_in_flight(tiny: tuple) -> None:
    """gloo (CPU) stages an all-gather's output (glmc.analysis.opcost._comm_staging): a CPU
    rank's ZeRO-3 working set holds one more bucket of gathered parameters than a GPU's."""
    from glmc.parallel.search import _memory
    work, _ = tiny
    parts = work.parts_on(work.device, 1, False)
    p = PlanPoint(4, 1, 1, 3, 2, "1f1b", 1, "none", "bf16", bucket=0.25)
    gpu, cpu = (_memory(p, [parts], 0, parts, work, 1, "none", staged) for staged in (0, 1))
    params = sum(c.params for c in parts) * 2  # bf16
    assert cpu["working"] - gpu["working"] == min(int(0.25 * 2**20), params) > 0
    assert {k: v for k, v in cpu.items() if k != "working"} == \
        {k: v for k, v in gpu.items() if k != "working"}


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 2), (4, 8), (8, 16)])
def test_zbh1_memory_follows_torchs_order(pp: int, m: int) -> None:
    """The micro-batches a ZB-H1 rank holds (from its F to its W) and those waiting between
    their I and their W, as the planner counts them, against the runtime's schedule (torch's
    generator): both at most at the same moment."""
    from glmc.planning.schedule import ActionKind, from_torch
    from glmc.parallel.search import _in_flight, _waiting_w
    sched = from_torch("zbh1", pp, m)
    point = PlanPoint(1, 1, pp, 0, 1, "zbh1", 1, "none", "fp32")
    for rank in range(pp):
        held, waiting, seen = set(), set(), []
        for a in sched.rank_actions(rank):
            if a.kind is ActionKind.F:
                held.add(a.microbatch)
            elif a.kind is ActionKind.I:
                waiting.add(a.microbatch)
            elif a.kind is ActionKind.W:
                held.discard(a.microbatch)
                waiting.discard(a.microbatch)
            seen.append((len(held), len(waiting)))
        assert max(seen) == (_in_flight(point, rank, m), _waiting_w(point, rank, m))


def test_a_zero_bubble_stage_keeps_what_its_w_reads(tiny: tuple) -> None:
    """A micro-batch past its I keeps, beside what it saved, the values of I its W reads
    (its matmuls' output gradients, `stash_bytes`): priced on the ZB-H1 ranks only."""
    work, cluster = tiny
    layer = next(c for c in work.parts[1] if c.name.startswith("layer "))
    assert 0 < layer.stash_bytes < layer.saved_bytes + layer.peak(1)
    more = dataclasses.replace(work, parts={t: tuple(
        dataclasses.replace(c, stash_bytes=c.stash_bytes + 2**20) for c in parts)
        for t, parts in work.parts.items()})
    for schedule, grows in (("zbh1", True), ("1f1b", False)):
        point = PlanPoint(1, 1, 4, 0, 1, schedule, 1, "none", "bf16")
        before, after = (evaluate(point, w, cluster).peak_bytes for w in (work, more))
        assert (after > before) is grows, schedule
