"""Pipeline parallelism: the partition pass (cost-balanced cut), schedules as DAGs (torch's
generators), the zero-bubble backward split, and the GLM example trained on two gloo processes
under every schedule against one eager process."""
from __future__ import annotations

import dataclasses
import itertools
import random
import re
from pathlib import Path

import pytest
import torch

import glmc
from glmc.compiler.inplace import compiled_step
from glmc.compiler.passmanager import PassContext
from glmc.errors import ConfigError, InputError, PassError
from glmc.ir.graph import OutputKind
from glmc.parallel.executor import run_rank
from glmc.parallel.pipeline import build_program, measured_timeline, microbatch_leaves
from glmc.passes import parse_pipeline
from glmc.passes.partition import PartitionPass, balanced_cut, plan_partition, step_blocks
from glmc.planning.schedule import Action, ActionKind, from_torch, simulate
from tests.distributed import result, run_parts, spawn
from tests.models import CASES, RTOL, eager_losses

STEPS = 2
MICROBATCHES = 4
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zbh1": 1, "interleaved": 2}  #: name -> stages per rank


@pytest.fixture(scope="module")
def glm_graph() -> glmc.TrainGraph:
    model, batch, loss_fn, opt = CASES["glm"].make()
    return glmc.capture(model, batch, loss_fn, opt)


# ---- the solver -------------------------------------------------------------------------------

def _brute(times: list[float], stages: int) -> float:
    n = len(times)
    best = float("inf")
    for cut in itertools.combinations(range(1, n), stages - 1):
        b = (0, *cut, n)
        best = min(best, max(sum(times[b[i]:b[i + 1]]) for i in range(stages)))
    return best


def test_balanced_cut_is_optimal_on_random_chains() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n, s = rng.randint(2, 9), rng.randint(1, 4)
        if s > n:
            continue
        times = [rng.uniform(0.1, 5) for _ in range(n)]
        cut = balanced_cut([times] * s, [0.0] * n, s)
        b = (0, *cut, n)
        got = max(sum(times[b[i]:b[i + 1]]) for i in range(s))
        assert got == pytest.approx(_brute(times, s))


def test_balanced_cut_balances_time_on_heterogeneous_stages() -> None:
    fast, slow = [1.0] * 6, [3.0] * 6  # stage 1's device is 3x slower
    assert balanced_cut([fast, slow], [0.0] * 6, 2) == (5,)  # 5 fast vs 1 slow: 5 s vs 3 s
    assert balanced_cut([fast, fast], [0.0] * 6, 2) == (3,)


def test_more_stages_than_blocks_is_a_typed_error() -> None:
    with pytest.raises(ConfigError, match="3 stages need at least as many blocks"):
        balanced_cut([[1.0, 1.0]] * 3, [0.0, 0.0], 3)


# ---- the pass on the GLM example --------------------------------------------------------------

def test_partition_pass_plans_the_glm_step(glm_graph: glmc.TrainGraph) -> None:
    assert step_blocks(glm_graph) == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    (p,) = parse_pipeline("partition{stages=2,microbatches=4,schedule=1f1b}")
    res = p.run(glm_graph, PassContext())
    plan = res.stats
    assert not res.changed and glm_graph.meta["partition"] is plan
    assert plan.cut == (2,)
    assert [s.blocks for s in plan.stages] == [("embed", "blocks.0"), ("blocks.1", "norm", "head")]
    assert plan.imbalance < 1.15
    assert [s.in_flight for s in plan.stages] == [2, 1]  # 1F1B: S - s microbatches
    assert plan.stages[0].send_bytes == 1 * 32 * 64 * 4  # x of one microbatch
    gpipe = plan_partition(glm_graph, 2, 4, "gpipe")
    assert [s.in_flight for s in gpipe.stages] == [4, 4]
    assert gpipe.stages[0].peak_bytes > plan.stages[0].peak_bytes
    zb = plan_partition(glm_graph, 2, 4, "zbh1")
    assert zb.bubble < plan.bubble
    section = plan.report_section(None)
    assert section.title == "Pipeline partition"


def test_a_link_prices_boundary_transfers(glm_graph: glmc.TrainGraph) -> None:
    from glmc.analysis.comm import get_link
    link = get_link("200us:0.05GBps:30us")
    free = plan_partition(glm_graph, 2, 4, "1f1b")
    priced = plan_partition(glm_graph, 2, 4, "1f1b", link=link)
    assert priced.cut == free.cut and priced.link == link.to_dict() and free.link is None
    spans = priced.timeline.spans
    nbytes = priced.stages[0].send_bytes
    recv = spans[Action(1, ActionKind.RECV_F, 0)]
    assert recv[2] - recv[1] == pytest.approx(200e-6 + nbytes / 0.05e9)
    send = spans[Action(0, ActionKind.SEND_F, 0)]
    assert send[2] - send[1] == pytest.approx(30e-6)
    assert all(e - s == 0 for a, (_, s, e) in free.timeline.spans.items()
               if a.kind.value.startswith(("SEND", "RECV")))
    assert priced.bubble > free.bubble  # waiting for transfers is idle time
    assert priced.timeline.makespan > free.timeline.makespan


def test_heterogeneous_profiles_balance_predicted_time(glm_graph: glmc.TrainGraph) -> None:
    plan = plan_partition(glm_graph, 2, 4, "1f1b", ["h100", "kunpeng920"])
    assert {s.profile for s in plan.stages} == {"NVIDIA H100 SXM5",
                                                "Huawei Kunpeng 920-6426 (64 cores)"}
    assert plan.imbalance <= 1.1
    with pytest.raises(PassError, match="1 profiles for 2 stages"):
        PartitionPass(stages=2, profiles="h100").run(glm_graph, PassContext())


# ---- schedules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,per_rank", list(SCHEDULES.items()))
def test_schedules_from_torch_generators_verify(name: str, per_rank: int) -> None:
    sched = from_torch(name, 2, 4, per_rank)
    stages = 2 * per_rank
    sched.verify(stages, {(s, s + 1) for s in range(stages - 1)})
    for r in range(2):  # every rank's compute actions, each once
        acts = [a for a in sched.rank_actions(r) if a.kind is not ActionKind.UPDATE
                and a.kind.value in "FBIW"]
        assert len(acts) == len(set(acts)) == (3 if name == "zbh1" else 2) * 4 * per_rank


def test_predicted_bubbles_follow_theory() -> None:
    K = ActionKind
    unit = {K.F: 1.0, K.B: 2.0, K.I: 1.0, K.W: 1.0}
    bubble = {name: simulate(from_torch(name, 2, 4, v), lambda a: unit.get(a.kind, 0.0) / v
                             ).bubble() for name, v in SCHEDULES.items()}
    assert bubble["gpipe"] == pytest.approx(1 / 5)  # (p-1) / (m+p-1)
    assert bubble["1f1b"] == pytest.approx(1 / 5)
    assert bubble["zbh1"] < bubble["1f1b"] / 2
    assert bubble["interleaved"] < bubble["1f1b"]
    assert [str(a) for a in from_torch("1f1b", 2, 4).rank_actions(0)][:6] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0"]


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(InputError, match="3 microbatches do not divide the batch of 4 rows"):
        microbatch_leaves((torch.zeros(4, 2),), 3)


def test_blocks_are_layer_list_items_at_any_depth() -> None:
    from glmc.passes.partition import block_names, owner
    flat = ["embed.weight", "blocks.0.attn.wq.weight", "blocks.1.mlp.w1.bias", "head.weight",
            "pos"]
    assert block_names(flat) == {"embed.weight": "embed", "blocks.0.attn.wq.weight": "blocks.0",
                                 "blocks.1.mlp.w1.bias": "blocks.1", "head.weight": "head",
                                 "pos": "pos"}
    hf = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
          "model.layers.11.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert list(block_names(hf).values()) == ["model.embed_tokens", "model.layers.0",
                                              "model.layers.11", "model.norm", "lm_head"]
    # the longest block wins: `model.layers.1` is not `model.layers.11`'s, `model` is last
    blocks = ["model", "model.layers.1", "model.layers.11"]
    assert owner("model.layers.11.mlp", blocks) == "model.layers.11"
    assert owner("model.layers.1", blocks) == "model.layers.1"
    assert owner("model.rotary_emb", blocks) == "model"
    assert owner("lm_head", blocks) is None


def tied_glm():
    """The GLM example with its LM head tied to the embedding (as GPT-2, Qwen2-tied)."""
    model, batch, loss_fn, opt = CASES["glm"].make()
    untied, model.head.weight = model.head.weight, model.embed.weight
    for group in opt.param_groups:  # no state yet: the example's groups, less the old head
        group["params"] = [p for p in group["params"] if p is not untied]
    return model, batch, loss_fn, opt


TIED_CUT = [["embed", "blocks.0"], ["blocks.1", "norm", "head"]]


def test_gradient_sync_is_in_the_predicted_step() -> None:
    """Replicas' all-reduce (or ZeRO-1's reduce-scatter + all-gather) and the tied copies'
    all-reduce, priced on the link, lengthen each stage's UPDATE in the predicted schedule."""
    from glmc.passes.partition import with_sync

    from glmc.analysis.comm import LinkProfile, collective_seconds
    from glmc.parallel.pipeline import sync_seconds
    link = LinkProfile("test", 1e-4, 1e8, "made up")
    model, batch, loss_fn, opt = tied_glm()
    pipe = build_program(model, opt, loss_fn, batch, TIED_CUT, 2)
    tie = model.embed.weight.numel() * 4
    alone = sync_seconds(pipe, 1, 0, link)  # one replica: only the tied copies talk
    assert alone == [pytest.approx(collective_seconds("all_reduce", tie, 2, link))] * 2
    replicas = sync_seconds(pipe, 2, 0, link)
    zero1 = sync_seconds(pipe, 2, 1, link)
    for s, sm in enumerate(pipe.stages):
        own = sum(p.numel() * 4 for n, p in sm.module.named_parameters()) - tie
        assert replicas[s] == pytest.approx(
            collective_seconds("all_reduce", tie, 4, link)
            + collective_seconds("all_reduce", own, 2, link))
        assert zero1[s] > collective_seconds("all_reduce", tie, 4, link)
    graph = glmc.capture(model, batch, loss_fn, opt)
    plan = plan_partition(graph, 2, 2, "1f1b", cut=[2])
    synced = with_sync(plan, replicas, link=None)
    assert [p.sync_s for p in synced.stages] == replicas
    grown = synced.timeline.makespan - plan.timeline.makespan  # the last update to end
    assert min(replicas) - 1e-9 <= grown <= max(replicas) + 1e-9
    assert synced.stages[0].seconds == pytest.approx(plan.stages[0].seconds + replicas[0])


def test_tied_weights_cut_apart_are_one_shared_parameter() -> None:
    model, batch, loss_fn, opt = tied_glm()
    pipe = build_program(model, opt, loss_fn, batch, TIED_CUT, 2)
    assert pipe.program.shared == (((0, "embed.weight"), (1, "head.weight")),)
    assert "stage 0 embed.weight = stage 1 head.weight" in pipe.program.code()
    # one process running both copies without summing their gradients: refused, not wrong
    with pytest.raises(ConfigError, match="stages 0, 1 hold a parameter shared"):
        run_rank(pipe.program, {s: pipe.stages[s].module for s in (0, 1)},
                 dict(enumerate(pipe.optimizers)), microbatch_leaves(batch, 2))
    # two copies on one rank (interleaved: stages 1 and 3 on rank 1) cannot be kept apart
    model, batch, loss_fn, opt = CASES["glm"].make()
    pipe = build_program(model, opt, loss_fn, batch, _stage_blocks("interleaved"), 2,
                         "interleaved", 2)
    tie = ((1, "blocks.0.norm1.weight"), (3, "norm.weight"))
    with pytest.raises(ConfigError, match=r"stages \[1, 3\] share the parameter "
                                          r"'blocks.0.norm1.weight' \(tied weights\) and would "
                                          "run on one rank"):
        dataclasses.replace(pipe.program, shared=(tie,)).verify()
    with pytest.raises(PassError, match="stage 2 has no parameter 'norm.weight'"):
        dataclasses.replace(pipe.program, shared=((tie[0], (2, "norm.weight")),)).verify()
    with pytest.raises(PassError, match="must name one shape and dtype"):  # 64 vs (256, 64)
        dataclasses.replace(pipe.program, shared=(((0, "embed.weight"), tie[1]),)).verify()
    from glmc.parallel.pipeline import PipelineTrainer
    with pytest.raises(ConfigError, match="ZeRO stage 2 with a pipeline"):
        PipelineTrainer(pipe, zero=2)  # refused before any process group is needed


def test_split_backward_is_the_backward(glm_graph: glmc.TrainGraph) -> None:
    model, batch, loss_fn, opt = CASES["glm"].make()
    pipe = build_program(model, opt, loss_fn, batch, [["embed", "blocks.0"],
                                                      ["blocks.1", "norm", "head"]], 2, "zbh1")
    stage = pipe.program.stages[1]
    i_graph, w_graph = stage.split
    n = lambda g: len(list(g.compute_nodes()))  # noqa: E731
    assert n(i_graph) + n(w_graph) == n(stage.backward)  # nothing computed twice
    assert {o.kind for o in i_graph.outputs} == {OutputKind.SEND, OutputKind.SAVED}
    assert {o.kind for o in w_graph.outputs} == {OutputKind.GRADIENT}
    assert n(pipe.program.stages[0].split[0]) == 0  # stage 0 sends no gradient back


# ---- two processes: every schedule against eager ------------------------------------------------

def _stage_blocks(name: str) -> list[list[str]]:
    if SCHEDULES[name] == 2:  # 4 virtual stages on 2 ranks
        return [["embed"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]
    return [["embed", "blocks.0"], ["blocks.1", "norm", "head"]]


def _pipeline_part(rank: int, name: str, blocks: list[list[str]] | None = None,
                   make=CASES["glm"].make) -> dict:
    model, batch, loss_fn, opt = make()
    pipe = build_program(model, opt, loss_fn, batch, blocks or _stage_blocks(name),
                         MICROBATCHES, name, SCHEDULES[name])
    sched = pipe.program.schedule
    local = [s for s in range(sched.num_stages) if sched.rank_of(s) == rank]
    losses, spans = [], []
    for _ in range(STEPS):
        spans = []
        losses.append(run_rank(pipe.program, {s: pipe.stages[s].module for s in local},
                               {s: pipe.optimizers[s] for s in local},
                               microbatch_leaves(batch, MICROBATCHES), spans=spans))
    names = {n for s in local for n, _ in pipe.stages[s].module.named_parameters()}
    return {"losses": [[float(v) for v in ls] for ls in losses], "spans": spans,
            "state": {k: v for k, v in model.state_dict().items() if k in names}}


def _trainer_part(rank: int, out: Path) -> dict:
    """The CLI's path: rank 0 plans (on the measured link), every rank trains, then measures."""
    from glmc.parallel.pipeline_report import pipeline_report, write_report
    from glmc.parallel.pipeline import pipeline_trainer
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, MICROBATCHES, "1f1b")
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    measured = trainer.measure(*batch, steps=2)
    data = pipeline_report(trainer.pipeline.plan, measured, trainer.pipeline)
    if trainer.last:
        write_report(data, str(out / "pipeline-report"))
    return {"losses": [float(v) for v in losses if v is not None], "data": data,
            "last": trainer.last}


def _plan_part(rank: int, out: Path) -> dict:
    """glmc.optimize given a pipeline plan and no optimizer (a FILE with only `model` and
    `example_inputs`): the PipelineTrainer with the default optimizer, AdamW(lr=1e-3), as one
    process (issue 36 item 1: `stage_optimizer` read `None.param_groups`)."""
    from glmc.parallel.plan import ParallelPlan
    model, batch, loss_fn, _ = CASES["glm"].make()
    ref_model = CASES["glm"].make()[0]
    ref = eager_losses(ref_model, batch, loss_fn,
                       torch.optim.AdamW(ref_model.parameters(), lr=1e-3), STEPS)
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, backend="eager",
                            parallel=ParallelPlan(pp=2, microbatches=MICROBATCHES))
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    # issue 36 item 5: gradient accumulation on a pipeline plan, 2 x (MICROBATCHES / 2)
    acc_model = CASES["glm"].make()[0]
    acc = glmc.optimize(acc_model, batch, loss_fn=loss_fn, backend="eager",
                        parallel=ParallelPlan(pp=2, microbatches=MICROBATCHES // 2,
                                              accumulate=2))
    acc_losses = [acc.step(*batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None], "ref": ref,
            "acc": [float(v) for v in acc_losses if v is not None], "last": trainer.last}


def _hf_part(rank: int, out: Path, schedule: str = "1f1b") -> dict:
    """transformers' GLM (torch.fx cannot trace it: the torch.export path), a keyword batch,
    its layers nested at `model.layers.N`; rank 0 plans the cut."""
    from glmc.parallel.pipeline import pipeline_trainer
    from tests.models import BACKEND_CASES
    model, batch, loss_fn, opt = BACKEND_CASES["hf_glm"]()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, 2, schedule, SCHEDULES[schedule])
    losses = [trainer.step(**batch) for _ in range(STEPS)]
    names = {n for s in trainer.local for n, _ in trainer.pipeline.stages[s].module
             .named_parameters()}
    return {"losses": [float(v) for v in losses if v is not None],
            "blocks": [list(s.blocks) for s in trainer.pipeline.plan.stages],
            "state": {k: v for k, v in model.state_dict().items() if k in names}}


def _tied_part(rank: int, out: Path, schedule: str) -> dict:
    """The tied GLM on PipelineTrainer: the copies' gradients summed between the ranks."""
    from glmc.parallel.pipeline import PipelineTrainer
    model, batch, loss_fn, opt = tied_glm()
    trainer = PipelineTrainer(build_program(model, opt, loss_fn, batch, TIED_CUT,
                                            MICROBATCHES, schedule), timeout_s=120)
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    names = {n for s in trainer.local for n, _ in trainer.pipeline.stages[s].module
             .named_parameters()} | {"embed.weight", "head.weight"}  # one tensor: the copy
    return {"losses": [float(v) for v in losses if v is not None],
            "state": {k: v for k, v in model.state_dict().items() if k in names}}


def _inductor_part(rank: int, out: Path, schedule: str, backend: str = "inductor") -> dict:
    """Every graph a rank runs compiled by Inductor in its write-back form, the stages' forwards
    fused (attention, norms, gated MLP)."""
    from glmc.parallel.pipeline import PipelineTrainer
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = PipelineTrainer(build_program(model, opt, loss_fn, batch, _stage_blocks(schedule),
                                            MICROBATCHES, schedule, fusion=True,
                                            backend=backend),  # planned for what runs it
                              timeout_s=300, backend=backend)
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    names = {n for s in trainer.local for n, _ in trainer.pipeline.stages[s].module
             .named_parameters()}
    compiled = [compiled_step(g) for s in trainer.local
                for g in trainer.runnable.stages[s].graphs().values()]
    fused = [str(n.target) for s in trainer.local
             for n in trainer.pipeline.program.stages[s].forward.graph.nodes
             if n.op == "call_function" and str(n.target).startswith(
                 ("glmc.", "aten._scaled_dot_product"))]
    return {"losses": [float(v) for v in losses if v is not None], "fused": sorted(fused),
            "backends": sorted({c.backend for c in compiled if c is not None}),
            "state": {k: v for k, v in model.state_dict().items() if k in names}}


def _bf16_part(rank: int, out: Path) -> dict:
    """Every stage's forward under glmc's bf16 dtype assignment, the backward re-derived."""
    from glmc.parallel.pipeline import PipelineTrainer
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = PipelineTrainer(build_program(model, opt, loss_fn, batch, _stage_blocks("1f1b"),
                                            MICROBATCHES, "1f1b", precision="bf16"),
                              timeout_s=120)
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None],
            "mm_dtypes": _mm_dtypes(trainer),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _mm_dtypes(trainer) -> list[str]:
    """The dtypes of the matmuls in this rank's stages' forward and backward graphs."""
    stages = [trainer.pipeline.program.stages[s] for s in trainer.local]
    return sorted({str(n.meta["val"].dtype) for st in stages for g in (st.forward, st.backward)
                   for n in g.graph.nodes
                   if n.op == "call_function" and "mm" in str(n.target)})


def _fp16_part(rank: int, out: Path, init_scale: float = 2.0 ** 16, schedule: str = "1f1b",
               blocks: list[list[str]] | None = None, dp: int = 1, zero: int = 0,
               make=CASES["glm"].make) -> dict:
    """fp16 stages: one loss scale across the stages, every rank's overflow check combined.
    With a huge `init_scale` the first steps overflow: every rank skips its update; steps
    run until one applies (at most 40), then one more. `dp` replicas of the pipeline (each
    stage built for its slice of the batch, in 4 / dp microbatches), `zero=1`: their
    optimizer state sharded."""
    from glmc.parallel.pipeline import PipelineTrainer
    from glmc.trace.scaler import SCALE, LossScaling
    model, batch, loss_fn, opt = make()
    rows = tuple(t[: len(t) // dp] for t in batch)  # one replica's slice: what a stage sees
    trainer = PipelineTrainer(build_program(model, opt, loss_fn, rows,
                                            blocks or _stage_blocks(schedule),
                                            MICROBATCHES // dp, schedule, SCHEDULES[schedule],
                                            precision="fp16",
                                            loss_scaling=LossScaling(init_scale)),
                              timeout_s=120, dp=dp, zero=zero)
    names = {n for s in trainer.local for n, _ in trainer.pipeline.stages[s].module
             .named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items() if k in names}
    losses, scales, unchanged = [], [], True
    while len(losses) < 40 and (len(losses) < STEPS or trainer.skipped == len(losses)):
        unchanged &= all(torch.equal(v, before[k]) for k, v in model.state_dict().items()
                         if k in names)  # so far only skipped steps
        losses.append(trainer.step(*batch))
        scales.append(float(trainer.scaler[SCALE]))
    losses.append(trainer.step(*batch))
    return {"losses": [float(v) for v in losses if v is not None],
            "mm_dtypes": _mm_dtypes(trainer), "unchanged_while_skipped": unchanged,
            "scales": scales, "skipped": trainer.skipped,
            "state": {k: v for k, v in model.state_dict().items() if k in names}}


def _budget_part(rank: int, out: Path) -> dict:
    """ZB-H1 under `min` through pipeline_trainer: every stage planned by glmc's recompute
    pass with its in-flight microbatches, its I/W split over the recomputing backward."""
    from glmc.parallel.pipeline import pipeline_trainer
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, MICROBATCHES, "zbh1",
                               memory_budget="min")
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None],
            "rematerialized": [s.recomputed for s in trainer.pipeline.recompute],
            "in_flight": [b.multiplicity for b in trainer.pipeline.budgets]}


def _dead_part(rank: int, out: Path) -> dict:
    """Rank 1 dies after building its pipeline; rank 0's step must fail typed, not hang."""
    import os

    from glmc.errors import CommError
    from glmc.parallel.pipeline import pipeline_trainer
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, MICROBATCHES, "1f1b")
    if rank == 1:
        os._exit(0)  # as a crashed process does: no word to the others
    try:
        trainer.step(*batch)
    except CommError as e:
        return {"error_text": str(e)}
    return {"error_text": None}


def _hf_tied_part(rank: int, out: Path) -> dict:
    """transformers' Qwen2 with tied embeddings (torch.export path), cut by the planner."""
    from glmc.parallel.pipeline import pipeline_trainer
    from tests.zoo import ZOO
    model, batch, loss_fn, opt = ZOO["qwen2_tied"].make()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, 2, "1f1b", timeout_s=120)
    losses = [trainer.step(**batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None],
            "shared": trainer.pipeline.program.shared, "state": model.state_dict()}


def _convnext_part(rank: int, out: Path) -> dict:
    """transformers' ConvNeXt: its convolutions return channels-last weight gradients for
    contiguous weights; the update must see them in the weights' layout."""
    from glmc.parallel.pipeline import pipeline_trainer
    from tests.models import eager_losses
    from tests.zoo import ZOO
    model, batch, loss_fn, opt = ZOO["convnext"].make()
    ref_model, _, _, ref_opt = ZOO["convnext"].make()
    ref = eager_losses(ref_model, batch, loss_fn, ref_opt, STEPS)
    trainer = pipeline_trainer(model, opt, loss_fn, batch, 2, "1f1b", timeout_s=120)
    losses = [trainer.step(**batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None], "ref": ref}


def _worker(rank: int, port: int, out: str, names: list[str], slow: bool = False) -> None:
    run_parts(rank, port, 2, out, [(name, lambda r, _, n=name: _pipeline_part(r, n))
                                   for name in names]
              + [(f"hf_{name}", lambda r, o, n=name: _hf_part(r, o, n)) for name in names
                 if slow or name == "1f1b"]
              + [(f"tied_{name}", lambda r, o, n=name: _tied_part(r, o, n)) for name in names
                 if SCHEDULES[name] == 1 and (slow or name == "1f1b")]
              + ([("hf_tied", _hf_tied_part)] if slow else [])
              + ([("inductor_zbh1", lambda r, o: _inductor_part(r, o, "zbh1")),
                  ("fp16_interleaved", lambda r, o: _fp16_part(r, o, schedule="interleaved"))]
                 if slow else [])
              + [("fused_1f1b", lambda r, o: _inductor_part(r, o, "1f1b", "eager")),
                 ("bf16", _bf16_part), ("fp16", _fp16_part),
                 ("fp16_overflow", lambda r, o: _fp16_part(r, o, 2.0 ** 40)),
                 ("budget", _budget_part)]
              + ([("convnext", _convnext_part)] if _has_transformers() else [])
              + [("trainer", _trainer_part), ("plan", _plan_part),
                 ("dead", _dead_part)])  # "dead" kills rank 1


def _has_transformers() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformers") is not None


DEFAULT = ["1f1b", "zbh1"]  #: gpipe and interleaved (4 stages to capture) run under -m slow
#: the transformers and tied-weight parts run 1F1B by default (ZB-H1 is covered by the plain
#: and Inductor parts), every schedule under -m slow
SLOW_VARIANTS = ["zbh1", "gpipe"]


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
                ) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    # the slow parts only when a slow test of this file was selected (`-m slow`; the
    # default run's `-m 'not slow'` names the marker too)
    slow = any(item.get_closest_marker("slow") for item in request.session.items
               if item.path == request.path)
    spawn(_worker, str(out), DEFAULT + (["gpipe", "interleaved"] if slow else []), slow)
    return out


@pytest.fixture(scope="module")
def eager() -> tuple[list[float], dict]:
    model, batch, loss_fn, opt = CASES["glm"].make()
    losses = eager_losses(model, batch, loss_fn, opt, STEPS)
    return losses, model.state_dict()


@pytest.mark.parametrize("name", [*DEFAULT, *(pytest.param(n, marks=pytest.mark.slow)
                                               for n in ("gpipe", "interleaved"))])
def test_two_ranks_match_one_process(name: str, distributed: Path, eager: tuple) -> None:
    want_losses, want_state = eager
    got = [result(distributed, name, r) for r in range(2)]
    last = got[1]["losses"]  # the last stage lives on rank 1 for every schedule here
    assert got[0]["losses"] == [[]] * STEPS
    means = [sum(ls) / len(ls) for ls in last]
    assert means == pytest.approx(want_losses, rel=RTOL)
    state = {**got[0]["state"], **got[1]["state"]}
    assert set(state) == {k for k in want_state if not k.endswith(("cos", "sin"))}
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5,
                                   msg=lambda m: f"{name} {k}: {m}")
    timeline = measured_timeline_of(got)
    assert 0.0 <= timeline.bubble() < 1.0


def measured_timeline_of(got: list[dict]):
    from glmc.parallel.pipeline import StepTrace
    return measured_timeline([StepTrace(r, g["spans"]) for r, g in enumerate(got)], 2)


@pytest.mark.parametrize("name", ["1f1b", *(pytest.param(n, marks=pytest.mark.slow)
                                             for n in ("zbh1", "gpipe", "interleaved"))])
def test_transformers_glm_pipelines_through_torch_export(name: str, distributed: Path) -> None:
    pytest.importorskip("transformers")
    from tests.models import BACKEND_CASES
    model, batch, loss_fn, opt = BACKEND_CASES["hf_glm"]()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(distributed, f"hf_{name}", r) for r in range(2)]
    blocks = got[0]["blocks"]
    assert len(blocks) == 2 * SCHEDULES[name]
    assert [b for bs in blocks for b in bs] == ["model.embed_tokens", "model.layers.0",
                                                "model.layers.1", "model.norm", "lm_head"]
    assert got[1]["losses"] == pytest.approx(want, rel=RTOL)
    state = {**got[0]["state"], **got[1]["state"]}
    assert set(state) == {n for n, _ in model.named_parameters()}  # each on one rank
    for k, v in state.items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=RTOL, atol=1e-5, msg=k)


@pytest.mark.parametrize("part", [  # Inductor compiles 4 graphs per rank: ~40 s in CI
    pytest.param("inductor_zbh1", marks=pytest.mark.slow), "fused_1f1b"])
def test_fused_stages_train_like_one_process(part: str, distributed: Path,
                                            eager: tuple) -> None:
    """The stages' forwards fused (SDPA, RMSNorm, SwiGLU, on eager the LM head + loss;
    backward re-derived), on eager (1F1B) and with every graph (forward, I, W, update: ZB-H1)
    compiled by Inductor."""
    want_losses, want_state = eager
    got = [result(distributed, part, r) for r in range(2)]
    want = ["inductor"] if part.startswith("inductor") else []
    assert got[0]["backends"] == got[1]["backends"] == want
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    # the final norm, the LM head and the loss sit on stage 1; the loss pattern is left to
    # Inductor's own kernels (no memory budget), fused on eager
    loss = [] if part.startswith("inductor") else ["glmc.linear_cross_entropy.default"]
    for rank, extra in ((0, ["glmc.rms_norm.default"] * 2),
                        (1, ["glmc.rms_norm.default"] * 3 + loss)):
        assert got[rank]["fused"] == sorted([sdpa, "glmc.gated.default", *extra])
    assert got[1]["losses"] == pytest.approx(want_losses, rel=RTOL)
    state = {**got[0]["state"], **got[1]["state"]}
    assert set(state) == {k for k in want_state if not k.endswith(("cos", "sin"))}
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5, msg=k)


def test_stages_under_a_budget_train_like_one_process(distributed: Path, eager: tuple) -> None:
    got = [result(distributed, "budget", r) for r in range(2)]
    assert got[1]["losses"] == pytest.approx(eager[0], rel=RTOL)
    assert got[0]["in_flight"] == [2, 1]  # 2 stages, 1F1B's warm-up depth (ZB-H1: the same)
    assert all(n > 0 for n in got[0]["rematerialized"])  # every stage recomputes


def test_bf16_stages_match_the_single_process_bf16_step(distributed: Path) -> None:
    """precision=bf16 on every stage: matmuls run in bf16 (forward and the re-derived
    backward) from fp32 parameters; the losses follow glmc's one-process bf16 step (the same
    dtype assignment) and stay near the fp64 reference."""
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            fusion=False, precision="bf16")
    want = [trainer.step(*batch).item() for _ in range(STEPS)]
    model, batch, loss_fn, opt = CASES["glm"].make()
    model.double()
    opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items()
                                           if k != "decoupled_weight_decay"})
    fp64 = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(distributed, "bf16", r) for r in range(2)]
    for g in got:
        assert g["mm_dtypes"] == ["torch.bfloat16"] and g["param_dtypes"] == ["torch.float32"]
    assert got[1]["losses"] == pytest.approx(want, rel=1e-3)
    assert got[1]["losses"] == pytest.approx(fp64, rel=1e-2)
    assert got[1]["losses"] != pytest.approx(fp64, rel=1e-7)  # really computed in bf16


def test_fp16_stages_share_one_loss_scale(distributed: Path) -> None:
    """precision=fp16 on every stage: fp16 matmuls, the backward seeded with the loss scale;
    the losses follow glmc's one-process fp16 step (dynamic loss scaling in the graph). With
    an initial scale of 2^40 the first backwards overflow: both ranks skip their updates
    (the parameters stay bit-equal), back the scale off alike and train on once it fits."""
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            fusion=False, precision="fp16")
    want = [trainer.step(*batch).item() for _ in range(STEPS + 1)]
    got = [result(distributed, "fp16", r) for r in range(2)]
    for g in got:
        assert g["mm_dtypes"] == ["torch.float16"]
        assert g["skipped"] == 0 and g["scales"] == [2.0 ** 16] * STEPS
    assert got[1]["losses"] == pytest.approx(want, rel=1e-3)
    fp32 = eager_losses(*CASES["glm"].make(), STEPS + 1)
    assert got[1]["losses"] != pytest.approx(fp32, rel=1e-7)  # really computed in fp16
    over = [result(distributed, "fp16_overflow", r) for r in range(2)]
    skipped = over[0]["skipped"]
    for g in over:
        assert g["unchanged_while_skipped"] and g["skipped"] == skipped
        assert g["scales"] == [2.0 ** (39 - i) for i in range(skipped)] + [2.0 ** (40 - skipped)]
    assert 1 <= skipped < 40  # backed off until the gradients fit, then trained
    # until the first update applies, every step computes the first step's loss again
    assert over[1]["losses"][:skipped + 1] == [got[1]["losses"][0]] * (skipped + 1)
    assert over[1]["losses"][skipped + 1] != got[1]["losses"][0]


@pytest.mark.slow  # the fixture's fp16 interleaved part runs under -m slow
def test_fp16_interleaved_stages_share_one_loss_scale(distributed: Path) -> None:
    """fp16 with 4 virtual stages on 2 ranks (each rank runs two stages' backwards before its
    overflow check): glmc's one-process fp16 losses."""
    want = _fp16_reference(CASES["glm"].make, STEPS + 1)
    got = [result(distributed, "fp16_interleaved", r) for r in range(2)]
    for g in got:
        assert g["mm_dtypes"] == ["torch.float16"] and g["skipped"] == 0
    assert got[0]["losses"] == [] and got[1]["losses"] == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("name", ["1f1b", *(pytest.param(n, marks=pytest.mark.slow)
                                             for n in SLOW_VARIANTS)])
def test_tied_weights_across_stages_train_like_one_process(name: str, distributed: Path) -> None:
    """Embedding on stage 0, the LM head reading the same weight on stage 1: each rank
    updates its copy with the summed gradient, so both copies stay equal to eager's one."""
    model, batch, loss_fn, opt = tied_glm()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(distributed, f"tied_{name}", r) for r in range(2)]
    assert got[1]["losses"] == pytest.approx(want, rel=RTOL)
    want_state = model.state_dict()
    for r in (0, 1):  # each rank's copy (both names on both ranks: one tensor in the model)
        for k in ("embed.weight", "head.weight"):
            torch.testing.assert_close(got[r]["state"][k], want_state[k], rtol=RTOL, atol=1e-5,
                                       msg=lambda m: f"rank {r} {k}: {m}")
    state = {**got[0]["state"], **got[1]["state"]}
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5, msg=k)


@pytest.mark.slow
def test_transformers_tied_embeddings_pipeline_through_torch_export(distributed: Path) -> None:
    pytest.importorskip("transformers")
    from tests.zoo import ZOO
    model, batch, loss_fn, opt = ZOO["qwen2_tied"].make()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(distributed, "hf_tied", r) for r in range(2)]
    assert got[0]["shared"] == (((0, "lm_head.weight"), (1, "lm_head.weight")),)
    assert got[1]["losses"] == pytest.approx(want, rel=RTOL)
    for r in (0, 1):  # both ranks' copies of the shared weight
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            torch.testing.assert_close(got[r]["state"][k], model.state_dict()[k], rtol=RTOL,
                                       atol=1e-5, msg=lambda m: f"rank {r} {k}: {m}")


def test_actions_are_data() -> None:
    assert str(Action(1, ActionKind.I, 3)) == "1I3"


def test_trainer_measures_its_pipeline_and_writes_a_report(distributed: Path,
                                                           eager: tuple) -> None:
    got = [result(distributed, "trainer", r) for r in range(2)]
    assert [g["last"] for g in got] == [False, True]
    assert got[1]["losses"] == pytest.approx(eager[0], rel=RTOL)
    data = got[1]["data"]
    assert data["link"]["name"] == "measured-gloo"  # transfers priced on this host's link
    assert data["link"]["corun"] >= 1.0  # measured with it: ranks computing at once
    assert len(data["link"]["corun_stream"]) == 5  # and by working set
    assert all(f >= 1.0 for f in data["link"]["corun_stream"].values())
    assert data["link"]["wake_s"] >= 0.0
    pred = {e["action"]: e for e in data["predicted_timeline"]}
    assert pred["1RECV_F0"]["end_s"] > pred["1RECV_F0"]["start_s"]
    assert {e["action"] for e in data["measured_timeline"]} == set(pred)
    for b in data["bubble"].values():
        assert 0.0 <= b < 1.0
    assert data["measured_imbalance"] >= 1.0  # busiest rank over the mean
    # the schedule model itself: measured action times replayed reproduce the measured step
    # (its receives' waiting derived again) within a generous bound on this shared machine
    assert abs(data["bubble"]["replayed"] - data["bubble"]["measured"]) < 0.05
    for r in data["ranks"]:  # measured from the allocator: the state plus the step's peak
        assert r["measured_peak_bytes"] > r["measured_state_bytes"] > 0
        assert 0.5 < r["planned_peak_bytes"] / r["measured_peak_bytes"] < 2.0
        # the stage graphs walked through the schedule: within 8% here (1-4% measured)
        assert r["predicted_peak_bytes"] == pytest.approx(r["measured_peak_bytes"], rel=0.08)
    html = (distributed / "pipeline-report" / "report.html").read_text()
    assert html.count("<svg") == 1 and "Memory per rank" in html and "Bubble predicted" in html
    for name in ("report.json", "pipeline-trace.json", "pipeline-predicted.json"):
        assert (distributed / "pipeline-report" / name).stat().st_size > 100
    # a stage under a budget: its budget and what the recompute pass did, printed and drawn
    from glmc.parallel.pipeline_report import summary
    from glmc.report.html import render_pipeline_html
    assert all(st["budget"] is None and st["remat"] is None for st in data["stages"])
    data["stages"][0].update(budget="min", remat={"rematerialized": 7, "extra_seconds": 0.002,
                                                  "predicted_peak": 3 * 2 ** 20})
    assert "budget min: 7 values recomputed, +2.00 ms, joint-graph peak 3.00 MiB" in \
        summary(data)
    assert "min: 7 values (+2.00 ms), joint-graph peak 3.0" in render_pipeline_html(data)
    assert data["ranks"][0]["budget_bytes"] is None
    data["ranks"][0]["budget_bytes"] = data["ranks"][0]["measured_peak_bytes"] // 2
    assert "(budget " in summary(data) and "MiB: 100.0% over)" in summary(data)


# ---- pp x dp: four processes, two replicas of a two-stage pipeline ---------------------------------

def _ppdp_part(rank: int, out: Path, zero: int = 0) -> dict:
    from glmc.parallel.pipeline import pipeline_trainer
    from glmc.planning.schedule import predicted_peaks
    model, batch, loss_fn, opt = CASES["glm"].make()
    trainer = pipeline_trainer(model, opt, loss_fn, batch, 2, "1f1b", dp=2, zero=zero)
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    names = {n for s in trainer.local for n, _ in trainer.pipeline.stages[s].module
             .named_parameters()}
    from glmc.compiler.inplace import inplace_module
    in_place = [any("fused_adam_" in str(n.target) for n in
                    inplace_module(trainer.runnable.stages[s].update).graph.nodes)
                for s in trainer.local]
    exp_avg = {n: trainer.pipeline.optimizers[s].state[p]["exp_avg"].clone()
               for s in trainer.local for n, p in trainer.pipeline.stages[s].module
               .named_parameters()}
    return {"losses": [float(v) for v in losses if v is not None], "replica": trainer.replica,
            "last": trainer.last, "state": {k: v for k, v in model.state_dict().items()
                                            if k in names},
            "exp_avg": exp_avg, "predicted": predicted_peaks(trainer.pipeline.program),
            "in_place": in_place}


def _ppdp_tied_part(rank: int, out: Path) -> dict:
    """The tied GLM, 2 stages x 2 replicas: the copies sum over all four ranks, / 2."""
    from glmc.parallel.pipeline import PipelineTrainer
    model, batch, loss_fn, opt = tied_glm()
    half = tuple(t[: len(t) // 2] for t in batch)  # one replica's rows: what a stage sees
    trainer = PipelineTrainer(build_program(model, opt, loss_fn, half, TIED_CUT, 2),
                              timeout_s=120, dp=2)
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    return {"losses": [float(v) for v in losses if v is not None],
            "state": {k: v for k, v in model.state_dict().items()}}


def _ppdp_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 4, out, [("ppdp", _ppdp_part), ("ppdp_tied", _ppdp_tied_part),
                                   ("ppdp_zero", lambda r, o: _ppdp_part(r, o, zero=1))])


def test_pp_x_dp_on_four_processes_matches_one_process(tmp_path: Path, eager: tuple) -> None:
    spawn(_ppdp_worker, str(tmp_path), nprocs=4)
    got = [result(tmp_path, "ppdp", r) for r in range(4)]
    assert [(g["replica"], g["last"]) for g in got] == [(0, False), (0, True), (1, False),
                                                         (1, True)]
    want_losses, want_state = eager
    for g in got:  # both replicas' last stages report the global-batch loss
        assert g["losses"] == (pytest.approx(want_losses, rel=RTOL) if g["last"] else [])
    state = {**got[0]["state"], **got[1]["state"]}
    assert set(state) == {k for k in want_state if not k.endswith(("cos", "sin"))}
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5)
    for r in (0, 1):  # the replicas hold the same parameters: averaged gradients, same update
        for k, v in got[r]["state"].items():
            torch.testing.assert_close(got[r + 2]["state"][k], v, rtol=0, atol=0)
    # ZeRO-1 over the replicas: the same training, each replica keeping half of every
    # optimizer state row-wise (its padded rows), and a lower predicted peak on every rank
    plain = got
    zero = [result(tmp_path, "ppdp_zero", r) for r in range(4)]
    for g, p in zip(zero, plain):
        assert g["losses"] == (pytest.approx(want_losses, rel=RTOL) if g["last"] else [])
        for k, v in g["state"].items():
            torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5, msg=k)
        for k, v in g["exp_avg"].items():
            full = p["exp_avg"][k]
            rows = -(-full.shape[0] // 2) if full.dim() else 1
            assert v.shape[0] == rows and v.shape[1:] == full.shape[1:], k
            mine = full.reshape(-1, *full.shape[1:])[g["replica"] * rows:][:rows]
            torch.testing.assert_close(v[: len(mine)], mine, rtol=RTOL, atol=1e-6, msg=k)
        assert all(z < q for z, q in zip(g["predicted"], p["predicted"])), \
            (g["predicted"], p["predicted"])
        assert g["in_place"] == [True]  # the sharded update's AdamW ran in place
    for r in (0, 1):
        for k, v in zero[r]["state"].items():
            torch.testing.assert_close(zero[r + 2]["state"][k], v, rtol=0, atol=0)
    # tied weights over pp x dp: every rank's copy of the shared weight equals eager's
    model, batch, loss_fn, opt = tied_glm()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(tmp_path, "ppdp_tied", r) for r in range(4)]
    assert got[1]["losses"] == got[3]["losses"] == pytest.approx(want, rel=RTOL)
    for r, g in enumerate(got):
        torch.testing.assert_close(g["state"]["head.weight"], model.head.weight.detach(),
                                   rtol=RTOL, atol=1e-5, msg=lambda m: f"rank {r}: {m}")


FOUR = [["embed"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]  #: one stage per rank


def _four_worker(rank: int, port: int, out: str, names: list[str]) -> None:
    run_parts(rank, port, 4, out, [(name, lambda r, _, n=name: _pipeline_part(r, n, FOUR))
                                   for name in names]
              + [(f"hf_{name}", lambda r, o, n=name: _hf_part(r, o, n)) for name in names])


def deep_glm():
    """The GLM example with 6 layers: 9 blocks, enough for 8 virtual stages."""
    from tests.models import example_module
    mod = example_module("glm.py")
    cfg = dataclasses.replace(mod.CONFIGS["tiny"], layers=6)
    torch.manual_seed(0)
    model = mod.GLM(cfg)
    return (model, mod.make_batch(cfg), None,
            torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1))


EIGHT = [["embed"], *([f"blocks.{i}"] for i in range(6)), ["norm", "head"]]


def _interleaved_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 4, out, [("interleaved", lambda r, _: _pipeline_part(
        r, "interleaved", EIGHT, deep_glm))])


@pytest.mark.slow
def test_interleaved_on_four_processes_matches_one_process(tmp_path: Path) -> None:
    """8 virtual stages on 4 ranks (rank r: stages r and r + 4), 4 microbatches."""
    spawn(_interleaved_worker, str(tmp_path), nprocs=4)
    model, batch, loss_fn, opt = deep_glm()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    got = [result(tmp_path, "interleaved", r) for r in range(4)]
    means = [sum(ls) / len(ls) for ls in got[3]["losses"]]
    assert means == pytest.approx(want, rel=RTOL)
    state = {k: v for g in got for k, v in g["state"].items()}
    assert set(state) == {k for k in model.state_dict() if not k.endswith(("cos", "sin"))}
    for k, v in state.items():
        torch.testing.assert_close(v, model.state_dict()[k], rtol=RTOL, atol=1e-5, msg=k)


@pytest.mark.slow  # 4 processes by default in the pp x dp test; 41 s here
@pytest.mark.parametrize("names", [["1f1b", "zbh1"], ["gpipe"]])
def test_four_stages_on_four_processes_match_one_process(names: list[str], tmp_path: Path,
                                                         eager: tuple) -> None:
    pytest.importorskip("transformers")  # the parts include transformers' GLM
    spawn(_four_worker, str(tmp_path), names, nprocs=4)
    want_losses, want_state = eager
    for name in names:
        got = [result(tmp_path, name, r) for r in range(4)]
        assert [g["losses"] for g in got[:3]] == [[[]] * STEPS] * 3
        means = [sum(ls) / len(ls) for ls in got[3]["losses"]]
        assert means == pytest.approx(want_losses, rel=RTOL), name
        state = {k: v for g in got for k, v in g["state"].items()}
        assert set(state) == {k for k in want_state if not k.endswith(("cos", "sin"))}
        for k, v in state.items():
            torch.testing.assert_close(v, want_state[k], rtol=RTOL, atol=1e-5,
                                       msg=lambda m: f"{name} {k}: {m}")
    # transformers' GLM (the torch.export path) cut by the planner into 4 stages
    from tests.models import BACKEND_CASES
    model, batch, loss_fn, opt = BACKEND_CASES["hf_glm"]()
    want = eager_losses(model, batch, loss_fn, opt, STEPS)
    for name in names:
        got = [result(tmp_path, f"hf_{name}", r) for r in range(4)]
        assert len(got[0]["blocks"]) == 4 and all(got[0]["blocks"]), got[0]["blocks"]
        assert [g["losses"] for g in got[:3]] == [[]] * 3
        assert got[3]["losses"] == pytest.approx(want, rel=RTOL), name
        state = {k: v for g in got for k, v in g["state"].items()}
        assert set(state) == {n for n, _ in model.named_parameters()}  # each on one rank
        for k, v in state.items():
            torch.testing.assert_close(v, model.state_dict()[k], rtol=RTOL, atol=1e-5,
                                       msg=lambda m: f"hf {name} {k}: {m}")


def _fp16_four_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 4, out, [
        ("ppdp_zero", lambda r, o: _fp16_part(r, o, dp=2, zero=1)),
        ("ppdp_zero_overflow", lambda r, o: _fp16_part(r, o, 2.0 ** 40, dp=2, zero=1)),
        ("ppdp_tied", lambda r, o: _fp16_part(r, o, blocks=TIED_CUT, dp=2, make=tied_glm)),
        ("zbh1_four", lambda r, o: _fp16_part(r, o, schedule="zbh1", blocks=FOUR))])


def _fp16_reference(make, steps: int) -> list[float]:
    """glmc's one-process fp16 step (dynamic loss scaling in the graph) on the global batch."""
    model, batch, loss_fn, opt = make()
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            fusion=False, precision="fp16")
    return [trainer.step(*batch).item() for _ in range(steps)]


@pytest.mark.slow  # 4 processes, four pipelines: ~70 s on 2 cores
def test_fp16_stages_compose_with_pp_x_dp_zero1_tied_weights_and_zbh1(tmp_path: Path) -> None:
    """fp16 stages with 2 replicas and ZeRO-1 (the overflow check combined over all four
    ranks: every stage of both replicas skips alike), with weights tied across stages and
    replicated, and under ZB-H1 on four stages: each trains to glmc's one-process fp16
    losses, the replicas bit-equal."""
    spawn(_fp16_four_worker, str(tmp_path), nprocs=4)
    want = _fp16_reference(CASES["glm"].make, STEPS + 1)
    want_tied = _fp16_reference(tied_glm, STEPS + 1)
    for part, lasts in (("ppdp_zero", (1, 3)), ("ppdp_tied", (1, 3)), ("zbh1_four", (3,))):
        got = [result(tmp_path, part, r) for r in range(4)]
        assert all(g["mm_dtypes"] == ["torch.float16"] for g in got[1:])  # stage 0 may be
        assert got[0]["mm_dtypes"] in ([], ["torch.float16"])  # the embedding alone
        for r, g in enumerate(got):
            assert g["skipped"] == 0, (part, r)
            assert g["losses"] == ([] if r not in lasts else pytest.approx(
                want if part != "ppdp_tied" else want_tied, rel=1e-3)), (part, r)
        if part != "zbh1_four":
            _replicas_bit_equal(got)
    over = [result(tmp_path, "ppdp_zero_overflow", r) for r in range(4)]
    skipped = over[0]["skipped"]
    assert 1 <= skipped < 40
    for g in over:
        assert g["unchanged_while_skipped"] and g["skipped"] == skipped
        assert g["scales"] == [2.0 ** (39 - i) for i in range(skipped)] + [2.0 ** (40 - skipped)]
    _replicas_bit_equal(over)
    plain = result(tmp_path, "ppdp_zero", 1)["losses"]
    for r in (1, 3):  # both replicas' last stages: the first step's loss until one applies
        assert over[r]["losses"][:skipped + 1] == [plain[0]] * (skipped + 1)
        assert over[r]["losses"][skipped + 1] != plain[0]


def _replicas_bit_equal(got: list[dict]) -> None:
    """Ranks r and r + 2 (the same stage of replicas 0 and 1) hold the same parameters."""
    for r in (0, 1):
        assert got[r]["state"].keys() == got[r + 2]["state"].keys() != set()
        for k, v in got[r]["state"].items():
            torch.testing.assert_close(got[r + 2]["state"][k], v, rtol=0, atol=0)


# ---- per-stage memory budgets ------------------------------------------------------------------

def test_a_stage_under_a_budget_saves_less_and_trains_like_eager(glm_graph) -> None:
    """glmc's recompute pass plans the stage's joint graph with its in-flight microbatches:
    the forward saves less, the backward recomputes, the losses stay eager PyTorch's."""
    from glmc.analysis.memory import stage_saved_bytes
    from glmc.parallel.pipeline import StageBudget
    blocks = step_blocks(glm_graph)
    sizes = {}
    for budget in (None, StageBudget("min", 2)):
        model, batch, loss_fn, opt = CASES["glm"].make()
        pipe = build_program(model, opt, loss_fn, batch, [blocks], 2, "1f1b",
                             budgets=[budget])
        sizes[budget] = stage_saved_bytes(pipe.program.stages[0])
    stats = pipe.recompute[0]
    assert stats.recomputed > 0 and stats.predicted_peak < stats.baseline_peak
    assert sizes[budget] < 0.5 * sizes[None]  # recomputed in the backward instead
    losses = [float(torch.stack(run_rank(pipe.program, {0: pipe.stages[0].module},
                                         {0: pipe.optimizers[0]},
                                         microbatch_leaves(batch, 2))).mean())
              for _ in range(STEPS)]
    assert losses == pytest.approx(eager_losses(*CASES["glm"].make(), STEPS), rel=RTOL)


def test_full_recompute_makes_a_stages_layers_again_from_their_inputs() -> None:
    """`full` on a stage's joint graph (which names no modules: its nodes are placed in the
    blocks of the parameters they are made from): each layer's values are made again in the
    backward, what a layer hands to the next block is kept; the losses stay eager PyTorch's."""
    from glmc.parallel.pipeline import StageBudget
    from glmc.trace.step import joint_to_traingraph
    from glmc.passes.recompute import _blocks
    model, batch, loss_fn, opt = CASES["glm"].make()
    seen = {}
    real = joint_to_traingraph

    def spy(gm):  # the blocks the recompute pass sees
        graph = real(gm)
        seen.setdefault("blocks", _blocks(graph))
        return graph
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("glmc.passes.recompute.joint_to_traingraph", spy)
        pipe = build_program(model, opt, loss_fn, batch, [["embed", "blocks.0", "blocks.1"]],
                             2, "1f1b", budgets=[StageBudget("full", 2)])
    assert seen["blocks"] == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    stats = pipe.recompute[0]
    assert stats.solver == "full" and stats.recomputed > 0
    made = {name for name, _, _ in stats.recomputed_values}
    kept = {name for name, _, _ in stats.kept_values}
    assert any(n.startswith(("mm", "addmm", "bmm")) for n in made)  # matmuls made again
    assert any(n.startswith("embedding") for n in kept)  # outside the layers
    losses = [float(torch.stack(run_rank(pipe.program, {0: pipe.stages[0].module},
                                         {0: pipe.optimizers[0]},
                                         microbatch_leaves(batch, 2))).mean())
              for _ in range(STEPS)]
    assert losses == pytest.approx(eager_losses(*CASES["glm"].make(), STEPS), rel=RTOL)


def test_a_stage_saves_no_more_than_autograd() -> None:
    """Each stage's joint graph is cleaned up before it is split: the GLM's `Dropout(p=0)`
    copy of the attention weights was saved beside the weights themselves."""
    from glmc.analysis.memory import storage_bytes
    from glmc.planning.schedule import _saved_roots
    model, batch, loss_fn, opt = CASES["glm"].make()
    blocks = [["embed", "blocks.0"], ["blocks.1", "norm", "head"]]
    pipe = build_program(model, opt, loss_fn, batch, blocks, 2, "1f1b")
    st, sm = pipe.program.stages[0], pipe.stages[0]
    roots = set(_saved_roots(st, forward_only=True).values())
    ours = sum(storage_bytes(r.meta["val"]) for r in roots if r.op != "placeholder")
    leaves = microbatch_leaves(batch, 2)[0]
    known = {t.untyped_storage().data_ptr() for t in [*sm.module.parameters(), *leaves]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sm.module(*[leaves[a] for a in sm.args])
    assert 0 < ours <= sum(saved.values())


class _Shift(torch.nn.Module):
    """Adds its parameter's sum: that parameter's gradient is an expanded cotangent."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.sum()


def test_microbatch_gradients_sum_in_place_where_the_backward_owns_them() -> None:
    """The second microbatch's gradients are summed into the first's storage when the
    backward made it (as autograd's AccumulateGrad does); an expanded gradient gets a fresh
    sum, which the memory prediction counts. The sums are eager PyTorch's gradients."""
    from glmc.compiler.inplace import batch_values
    from glmc.parallel.executor import _StageRun
    from glmc.planning.schedule import _StageMemory, fresh_gradients
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), _Shift())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    loss_fn = torch.nn.functional.mse_loss
    pipe = build_program(model, opt, loss_fn, batch, [["0", "2"]], 2, "gpipe")
    st = pipe.program.stages[0]
    assert fresh_gradients(st.backward) == {"0.weight", "0.bias"}
    assert _StageMemory.of(st).largest_grad == 16 * 16 * 4  # 2.p's sum is a fresh tensor
    run = _StageRun(pipe.program, 0, pipe.stages[0].module, pipe.optimizers[0], [0],
                    [batch_values(b) for b in microbatch_leaves(batch, 2)])
    backwards = [a for a in pipe.program.schedule.actions(0) if a.kind is ActionKind.B]
    run.run(Action(0, ActionKind.F, 0))
    run.run(backwards[0])
    first = {n: g.data_ptr() for n, g in run.grads.items()}
    run.run(Action(0, ActionKind.F, 1))
    run.run(backwards[1])
    assert {n for n, g in run.grads.items() if g.data_ptr() == first[n]} == \
        {"0.weight", "0.bias"}
    model.zero_grad()
    loss_fn(model(batch[0]), batch[1]).backward()  # the mean over both microbatches
    for n, p in model.named_parameters():
        torch.testing.assert_close(run.grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_loss_scaling_without_fp16_stages_is_a_typed_error(glm_graph) -> None:
    from glmc.trace.scaler import LossScaling
    model, batch, loss_fn, opt = CASES["glm"].make()
    with pytest.raises(ConfigError, match="loss_scaling is for fp16 stages; precision is bf16"):
        build_program(model, opt, loss_fn, batch, [step_blocks(glm_graph)], 2, "gpipe",
                      precision="bf16", loss_scaling=LossScaling())


def test_a_stage_that_cannot_fit_its_budget_is_a_typed_error_naming_it(glm_graph) -> None:
    from glmc.errors import BudgetError
    from glmc.parallel.pipeline import StageBudget
    model, batch, loss_fn, opt = CASES["glm"].make()
    with pytest.raises(BudgetError, match=r"pipeline: stage 0 \(2 microbatches in flight\): "
                                          r"recompute: .* raise the budget to at least"):
        build_program(model, opt, loss_fn, batch, [step_blocks(glm_graph)], 2, "gpipe",
                      budgets=[StageBudget(None, 2, activation_bytes=1)])


def test_budget_per_rank_becomes_each_stages_budget(glm_graph) -> None:
    from glmc.errors import BudgetError
    from glmc.parallel.pipeline import StageBudget, stage_budgets
    plan = plan_partition(glm_graph, 2, 4, "1f1b")
    s0, s1 = plan.stages
    assert stage_budgets(plan, None, 2) == [None, None]
    assert stage_budgets(plan, "min", 2) == [StageBudget("min", s0.in_flight),
                                             StageBudget("min", s1.in_flight)]
    assert [b.spec for b in stage_budgets(plan, 0.5, 2)] == ["0.5", "0.5"]
    assert s0.in_flight == 2 and s1.in_flight == 1  # 1F1B on 2 stages
    budget = s0.state_bytes + 10 * 2 ** 20
    got = stage_budgets(plan, budget, 2)
    assert got[0] == StageBudget(None, 2, 10 * 2 ** 20)  # one stage per rank: all of the rest
    assert got[1].activation_bytes == budget - s1.state_bytes
    assert got[0].pass_budget() == f"+{10 * 2 ** 20}B"
    two = stage_budgets(plan, 2 * budget, 1)  # both stages on one rank share its rest
    rest = 2 * budget - s0.state_bytes - s1.state_bytes
    assert sum(b.activation_bytes for b in two) == pytest.approx(rest, abs=2)
    assert [b.activation_bytes for b in stage_budgets(plan, "+8MiB", 2)] == [8 * 2 ** 20] * 2
    with pytest.raises(BudgetError, match=r"rank 0 \(stage 0\) needs more than .* MiB"):
        stage_budgets(plan, s0.state_bytes, 2)


def test_a_dead_stage_is_a_typed_error_naming_the_rank_and_action(distributed: Path) -> None:
    text = result(distributed, "dead", 0)["error_text"]
    assert text is not None and "pipeline: rank 0 (stages 0)" in text
    # the first exchange with the dead rank fails: its send or a receive, by timing
    assert re.search(r"failed in action 0(SEND_F|RECV_B)\d with stage 1 on rank 1", text)


def test_a_given_cut_is_predicted_not_chosen(glm_graph) -> None:
    chosen = plan_partition(glm_graph, 2, 4, "1f1b")
    equal = plan_partition(glm_graph, 2, 4, "1f1b", cut="equal")
    assert equal.cut == (2,)  # 5 blocks in 2 stages: round(5 / 2) = 2
    assert plan_partition(glm_graph, 2, 4, "1f1b", cut=(1,)).imbalance >= chosen.imbalance
    with pytest.raises(ConfigError, match=r"cut \(5,\) does not split 5 blocks"):
        plan_partition(glm_graph, 2, 4, "1f1b", cut=(5,))


def test_channels_last_gradients_update_like_one_process(distributed: Path) -> None:
    """ConvNeXt (transformers) under 1F1B on 2 processes equals one eager process: its
    channels-last weight gradients reach the fused update in the weights' layout (they were
    read element by element in the wrong order: the loss after one update 2.197 vs 2.080)."""
    pytest.importorskip("transformers")
    r = result(distributed, "convnext", 1)  # the last stage holds the loss
    torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)


def test_a_pipeline_plan_without_an_optimizer_trains_with_the_default(distributed: Path) -> None:
    """The defaults of a workload are resolved in one place for every strategy: a pipeline
    plan with no optimizer trains as one process does with AdamW(lr=1e-3)."""
    got = [result(distributed, "plan", r) for r in range(2)]
    assert [g["last"] for g in got] == [False, True]
    assert got[0]["losses"] == []
    torch.testing.assert_close(got[1]["losses"], got[1]["ref"], rtol=RTOL, atol=0)
    # --accumulate 2 on a pipeline plan: the same step as one process over the whole batch
    torch.testing.assert_close(got[1]["acc"], got[1]["ref"], rtol=RTOL, atol=0)


def test_stages_run_the_default_pipeline_through_the_pass_manager() -> None:
    """Every stage runs glmc's passes through a pass manager (no side doors): the default
    pipeline's fusion and precision on its forward program, cleanup and recompute on its joint
    graph, each recorded with the stage, the graph it rewrote and its time; and the report
    lists them per stage."""
    from glmc.parallel.pipeline import StageBudget
    from glmc.parallel.pipeline_report import pass_times
    model, batch, loss_fn, opt = CASES["glm"].make()
    pipe = build_program(model, opt, loss_fn, batch, TIED_CUT, 2, fusion=True,
                         precision="bf16", budgets=[StageBudget("min", 2), None])
    got = {s: [(r.name, r.form) for r in pipe.passes if r.stage == s] for s in (0, 1)}
    assert got[0] == [("fusion", "forward"), ("precision", "forward"), ("cleanup", "joint"),
                      ("recompute", "joint")]
    assert got[1] == [("fusion", "forward"), ("precision", "forward"), ("cleanup", "joint")]
    assert all(r.seconds > 0 and not r.skipped for r in pipe.passes)
    assert pipe.recompute[0] is not None and pipe.recompute[1] is None
    fused = next(r for r in pipe.passes if r.stage == 1 and r.name == "fusion")
    assert fused.changed and fused.stats["loss"] == 1  # a budget anywhere: the loss fused
    text = pass_times([{"name": r.name, "form": r.form, "skipped": r.skipped,
                        "seconds": r.seconds} for r in pipe.passes if r.stage == 0])
    assert text.startswith("fusion (forward) ") and "recompute (joint) " in text


def test_the_pipeline_report_lists_each_stages_passes(distributed: Path) -> None:
    from glmc.parallel.pipeline_report import summary
    data = result(distributed, "trainer", 1)["data"]
    for st in data["stages"]:
        assert [(p["name"], p["form"]) for p in st["passes"]] == [("cleanup", "joint")]
        assert all(p["seconds"] > 0 for p in st["passes"])
    assert "passes: cleanup (joint) " in summary(data)
