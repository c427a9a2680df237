"""Data parallelism with ZeRO stages 0-3 (passes/shard.py, glmc/parallel.py) in two processes
(gloo): every stage trains the GLM example to eager PyTorch's losses and parameters on the
global batch; state is sharded where the stage says; DCP checkpoints save on two ranks and
resume; bad input is a typed error, not a hang. One process group runs every part (process
start-up dominates); each test reads its part's result."""
from __future__ import annotations

import contextlib

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import glmc
from glmc.analysis.memory import simulate
from glmc.compiler.passmanager import PassContext
from glmc.errors import CommError, ConfigError, InputError
from glmc.ir.graph import MeshSpec
from glmc.ir.plans import Layout
from glmc.parallel.data import Parallel, load_checkpoint, save_checkpoint
from glmc.passes.shard import ShardPass
from glmc.trace.capture import split_batch
from tests.distributed import result, run_parts, slow_readers, spawn
from tests.models import CASES, eager_losses

STEPS = 3
BUCKET_MB = 0.02  #: small buckets: the tiny GLM's 13 parameters travel in several collectives


def _case(name: str = "glm"):
    model, batch, loss_fn, opt = CASES[name].make()
    ref_model = copy.deepcopy(model)
    ref_opt = type(opt)(ref_model.parameters(), **_hyper(opt))
    return (model, batch, loss_fn, opt), (ref_model, ref_opt)


def _hyper(opt: torch.optim.Optimizer) -> dict:
    group = opt.param_groups[0]
    keys = ("lr", "betas", "eps", "weight_decay")
    return {k: group[k] for k in keys if k in group}


def _recomputed(trainer: Any) -> int:
    """How many values the recompute pass rematerializes (0 when it did not run)."""
    runs = [p for p in trainer.report.compiles[-1].history if p.name == "recompute"]
    return sum(p.stats.recomputed for p in runs if p.stats is not None)


def _gathers(graph: Any) -> dict[str, int]:
    """All-gathers of the step by phase (ZeRO-3: the forward's, and the backward's)."""
    from glmc.ir.graph import TrainGraph
    out: dict[str, int] = {}
    for n in graph.compute_nodes():
        if "all_gather" in str(n.target):
            phase = TrainGraph.info(n).phase.value
            out[phase] = out.get(phase, 0) + 1
    return out


def _stage_part(stage: int, precision: str | None = None, fusion: bool = False,
                memory_budget: str | None = None, backend: str = "eager",
                measure: bool = True, clip: float | None = None):
    def part(rank: int, out: Path) -> dict:
        (model, batch, loss_fn, opt), (ref_model, ref_opt) = _case()
        ref = eager_losses(ref_model, batch, loss_fn, ref_opt, STEPS, clip=clip)
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend=backend,
                                precision=precision, fusion=fusion, predict=False,
                                measure=measure, clip_grad_norm=clip,
                                memory_budget=memory_budget,
                                parallel={"zero": stage, "bucket_mb": BUCKET_MB})
        args, kwargs = split_batch(batch)
        losses = [trainer.step(*args, **kwargs).item() for _ in range(STEPS)]
        params, state = trainer.parallel.full_state(model, opt)
        names = {id(p): n for n, p in ref_model.named_parameters()}
        ref_state = {f"{k}:{names[id(p)]}": v for p, st in ref_opt.state.items()
                     for k, v in st.items()}
        return {"losses": losses, "ref": ref,
                "params": {k: v for k, v in params.items()},
                "ref_params": {n: p.detach() for n, p in ref_model.named_parameters()},
                "state": state, "ref_state": ref_state,
                "local_state_numel": sum(t.numel() for st in opt.state.values()
                                         for t in st.values() if t.dim() > 0),
                "local_param_numel": sum(p.numel() for p in model.parameters()),
                "measured": trainer.report.compiles[-1].measured,
                "recomputed": _recomputed(trainer),
                "gathers": _gathers(trainer.graph),
                "peak": simulate(trainer.graph.graph).peak_bytes,
                "plan": trainer.parallel.plan}
    return part


def _accumulate_part(rank: int, out: Path) -> dict:
    """4 micro-batches per rank and step: eager PyTorch on the whole (8-row) batch; then
    the same trainer with 2 micro-batches of a 4-row batch: no recompile (same micro shape)."""
    (model, batch, loss_fn, opt), (ref_model, ref_opt) = _case()
    ids, labels = batch
    big = (torch.cat([ids, ids.flip(0)]), torch.cat([labels, labels.flip(0)]))
    ref = eager_losses(ref_model, big, loss_fn, ref_opt, STEPS)
    trainer = glmc.optimize(model, big, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            fusion=False, predict=False,
                            parallel={"zero": 2, "accumulate": 4, "bucket_mb": BUCKET_MB})
    losses = [trainer.step(*big).item() for _ in range(STEPS)]
    trainer.parallel.accumulate = 2
    trainer.step(*batch)
    params, _ = trainer.parallel.full_state(model, opt)
    return {"losses": losses, "ref": ref, "compiles": len(trainer.report.compiles),
            "params": params, "ref_params": {n: p.detach() for n, p in
                                             ref_model.named_parameters()}}


def _compress_part(rank: int, out: Path) -> dict:
    """Each compression method on the GLM example, 4 steps; error-feedback state saved and
    restored through DCP."""
    found = {}
    for method, stage in (("bf16", 2), ("sign", 0), ("sign_block", 1), ("topk", 1),
                          ("powersgd", 0)):
        (model, batch, loss_fn, opt), _ = _case()
        compress = {"method": "sign", "block": 64} if method == "sign_block" else \
            {"method": method, "min_numel": 256}
        if method == "powersgd":
            compress["seed"] = 7
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                                fusion=False, predict=False, measure=False,
                                parallel={"zero": stage, "bucket_mb": BUCKET_MB,
                                          "compress": compress})
        first_q = {k: v.clone() for k, v in trainer.parallel.comm_state.items()
                   if k.startswith("psgd_q:")}
        losses = [trainer.step(*batch).item() for _ in range(4)]
        stats = next(r.stats for r in trainer.report.compiles[-1].history
                     if r.name == "compress")
        found[method] = {"losses": losses, "ratio": stats.ratio,
                         "state": sorted(trainer.parallel.comm_state)}
        if first_q:  # the initial Q comes from the given seed
            q = next(iter(first_q.values()))
            drawn = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
            found[method]["seeded"] = bool(torch.equal(q, drawn))
        if method == "sign":
            save_checkpoint(trainer, str(out / "ckpt-sign"))
            residual = trainer.parallel.comm_state["ef:0"].clone()
            trainer.parallel.comm_state["ef:0"].zero_()
            load_checkpoint(trainer, str(out / "ckpt-sign"))
            found[method]["restored"] = bool(torch.equal(trainer.parallel.comm_state["ef:0"],
                                                         residual))
            found[method]["nonzero"] = bool(residual.abs().sum() > 0)
    return found


def _checkpoint_part(rank: int, out: Path) -> dict:
    """Train 2 steps, save, train 2 more; a fresh trainer loads the checkpoint and repeats
    those 2 steps. A stale staging directory from an interrupted save does not matter."""
    ckpt = out / "ckpt"
    (model, batch, loss_fn, opt), _ = _case()
    args, kwargs = split_batch(batch)
    options = dict(backend="eager", fusion=False, predict=False, measure=False,
                   parallel={"zero": 3, "bucket_mb": BUCKET_MB})
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, **options)
    for _ in range(2):
        trainer.step(*args, **kwargs)
    if rank == 0:
        (out / "ckpt.saving").mkdir(exist_ok=True)  # what an interrupted save leaves
    dist.barrier()
    save_checkpoint(trainer, str(ckpt))
    after = [trainer.step(*args, **kwargs).item() for _ in range(2)]
    (model2, _, _, opt2), _ = _case()
    fresh = glmc.optimize(model2, batch, loss_fn=loss_fn, optimizer=opt2, **options)
    load_checkpoint(fresh, str(ckpt))
    resumed = [fresh.step(*args, **kwargs).item() for _ in range(2)]
    return {"after": after, "resumed": resumed, "files": sorted(p.name for p in ckpt.iterdir())}


def _errors_part(rank: int, out: Path) -> dict:
    (model, batch, loss_fn, opt), _ = _case("mlp")
    x, y = batch
    found = {}
    try:  # 5 rows do not split over 2 ranks
        glmc.optimize(model, (x[:5], y[:5]), loss_fn=loss_fn, optimizer=opt, backend="eager",
                      parallel=0)
    except InputError as e:
        found["indivisible"] = str(e)
    # rank 1 trains another model: both ranks get a typed error before any step
    (model, batch, loss_fn, opt), _ = _case("mlp" if rank == 0 else "cnn")
    try:
        glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager", parallel=1)
    except ConfigError as e:
        found["mismatch"] = str(e)
    return found


def _channels_last_part(rank: int, out: Path) -> dict:
    """A convolutional model in channels-last layout (parameters, input, and so the weight
    gradients: ConvNeXt's case) under every stage: the buckets flatten copies of them."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(8, 8, 2, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(8, 4)).to(memory_format=torch.channels_last)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last),
             torch.randint(0, 4, (4,), generator=g))
    ref_model, ref_opt = make()
    found = {"ref": eager_losses(ref_model, batch, nn.CrossEntropyLoss(), ref_opt, STEPS),
             "strided": ref_model[2].weight.is_contiguous(memory_format=torch.channels_last)
             and not ref_model[2].weight.is_contiguous()}
    for stage in (0, 1, 2, 3):
        model, opt = make()
        trainer = glmc.optimize(model, batch, loss_fn=nn.CrossEntropyLoss(), optimizer=opt,
                                backend="eager", fusion=False, predict=False, measure=False,
                                parallel={"zero": stage, "bucket_mb": BUCKET_MB})
        found[stage] = [trainer.step(*batch).item() for _ in range(STEPS)]
    return found


def _profiled_part(rank: int, out: Path) -> dict:
    """The user profiles rank 0's steps with torch.profiler (a second profiler cannot start
    on its thread): glmc's measurement of the communication waits steps aside on every rank,
    with a warning, and training goes on."""
    from torch.profiler import ProfilerActivity, profile
    (model, batch, loss_fn, opt), _ = _case("mlp")
    trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            predict=False, parallel={"zero": 1})
    losses = []
    with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext():
        for _ in range(8):  # the wait-measuring calls 3, 5 and 7 among them
            losses.append(trainer.step(*batch).item())
    record = trainer.report.compiles[-1]
    return {"losses": losses, "warnings": list(record.warnings),
            "measured": dict(record.measured or {})}


def _worker(rank: int, port: int, out: str, slow: bool = False) -> None:
    parts = [(f"stage{s}", _stage_part(s, fusion=s == 2)) for s in (0, 1, 2, 3)]
    parts += [("stage3_bf16", _stage_part(3, "bf16", measure=False)),
              ("stage3_recompute", _stage_part(3, memory_budget="min")),
              # the plan itself: no measured retry (which may recompute to meet the budget)
              ("stage3_keep", _stage_part(3, memory_budget="1.0", measure=False)),
              ("checkpoint", _checkpoint_part),
              ("accumulate", _accumulate_part), ("compress", _compress_part),
              ("channels_last", _channels_last_part),
              # max_norm well below the gradients' norm: the clip changes every step
              # (ZeRO-2's by default: its ranks' squared norms all-reduced)
              ("stage2_clip", _stage_part(2, clip=0.05)),
              ("errors", _errors_part), ("profiled", _profiled_part)]
    if slow:  # ZeRO-0 and ZeRO-1 clip the whole averaged gradients on every rank
        parts += [(f"stage{s}_clip", _stage_part(s, clip=0.05)) for s in (0, 1)]
    run_parts(rank, port, 2, out, parts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    spawn(_worker, str(out), slow_readers(request, "runs"))
    return out


# ---- numerics ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # stage 2 with fusion composed on top
def test_every_zero_stage_trains_like_one_process_on_the_global_batch(runs: Path,
                                                                      stage: int) -> None:
    _check_like_one_process(runs, f"stage{stage}")


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 2])
def test_gradient_clipping_on_data_parallel_steps_matches_torch(runs: Path, stage: int) -> None:
    """`clip_grad_norm=` on 2 ranks: ZeRO-0 and ZeRO-1 (every rank reads the whole averaged
    gradients) and ZeRO-2 (each its rows: the squared local norms all-reduced) train like
    eager PyTorch with `clip_grad_norm_` on the global batch."""
    _check_like_one_process(runs, f"stage{stage}_clip")


def test_channels_last_parameters_and_gradients_shard_like_one_process(runs: Path) -> None:
    r = result(runs, "channels_last", 0)
    assert r["strided"]  # the model really holds channels-last weights
    for stage in (0, 1, 2, 3):
        torch.testing.assert_close(r[stage], r["ref"], rtol=1e-5, atol=0, msg=f"stage {stage}")


def _inductor_worker(rank: int, port: int, out: str, stage: int) -> None:
    run_parts(rank, port, 2, out, [(f"stage{stage}_inductor",
                                    _stage_part(stage, fusion=True, backend="inductor"))])


@pytest.mark.slow  # an Inductor compile on each of 2 processes: ~1-2 min on 2 cores
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inductor_compiles_the_sharded_step_like_one_process(tmp_path: Path,
                                                             stage: int) -> None:
    """Every ZeRO stage + fusion on Inductor: the functional collectives compiled into the
    step with the fused update in place, the losses, parameters and state those of eager
    PyTorch (ZeRO-3's in-place update once referenced the loss's late all-reduce wait before
    it existed)."""
    spawn(_inductor_worker, str(tmp_path), stage)
    _check_like_one_process(tmp_path, f"stage{stage}_inductor")


def _check_like_one_process(runs: Path, part: str) -> None:
    for rank in (0, 1):
        r = result(runs, part, rank)
        # every rank reports the global batch's loss
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-4, atol=0)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        for key, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][key].to(ref.dtype), ref, rtol=1e-4,
                                       atol=1e-7, msg=key)


def test_recompute_composes_with_stage_3(runs: Path) -> None:
    """The recompute pass after the shard pass: under "min" it recomputes activations with
    every bucket gathered again for the backward (the rule); under a fractional budget (1.0,
    the whole peak) it plans gathers with activations and keeps the forward's gathered
    parameters (no backward gather) at a higher predicted peak. Both train as eager on the
    global batch."""
    plain = result(runs, "stage3", 0)
    assert plain["gathers"]["backward"] > 0  # no budget: gathered again (reshard after forward)
    for rank in (0, 1):
        low, keep = result(runs, "stage3_recompute", rank), result(runs, "stage3_keep", rank)
        assert keep["gathers"].get("backward", 0) == 0 and keep["recomputed"] == 0
        assert keep["peak"] > plain["peak"]  # what keeping the gathered parameters costs
        assert low["recomputed"] > 0 and low["peak"] < plain["peak"]
        assert low["gathers"]["backward"] >= plain["gathers"]["backward"]
        assert keep["gathers"]["forward"] == low["gathers"]["forward"] == \
            plain["gathers"]["forward"]
        for r in (low, keep):
            torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-4, atol=0)
            for name, ref in r["ref_params"].items():
                torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6,
                                           msg=name)


def test_one_budget_plans_gathers_and_activations_together() -> None:
    """ZeRO-3 on a 2-rank mesh (one process: the plan, not the run), a budget 15% above the
    smallest peak with every bucket gathered again: with the forward's gathered parameters
    kept for the backward and priced as a gather again (reshard=budget), the recompute pass
    meets the budget and gathers fewer buckets again than the rule (reshard=always) does."""
    from glmc.passes.recompute import RecomputePass

    model, batch, loss_fn, opt = CASES["glm"].make()
    step = glmc.capture(model, batch, loss_fn, opt)
    ctx = PassContext(mesh=MeshSpec((2,), ("dp",)))

    def plan(reshard: str, budget: str) -> tuple[int, int]:
        g = step.copy()
        ShardPass(stage=3, bucket_mb=BUCKET_MB, reshard=reshard, link="100us:1GBps").run(g, ctx)
        stats = RecomputePass(budget=budget).run(g, ctx).stats
        return stats.predicted_peak, _gathers(g).get("backward", 0)

    budget = int(plan("always", "min")[0] * 1.15)
    always, joint = plan("always", str(budget)), plan("budget", str(budget))
    assert always[0] <= budget and joint[0] <= budget
    assert joint[1] < always[1]
    with pytest.raises(ConfigError, match="reshard must be 'always' or 'budget'"):
        ShardPass(stage=3, reshard="bogus").run(step.copy(), ctx)


def test_buckets_gathered_again_for_the_backward_are_prefetched() -> None:
    """Every kept ZeRO-3 bucket "recomputed" by gathering it again (the recompute pass's
    rewrite; here all of them) is issued once the bucket before it has arrived and before
    that bucket is read (one ahead, as the shard pass prefetches the forward's), not right
    before its own reader; its wait stays right before its first reader."""
    from glmc.passes.recompute import rewrite

    from glmc.ir.graph import REGATHER_S, Phase, TrainGraph, comm_ops, is_collective, is_comm
    from glmc.ir.target import EAGER

    model, batch, loss_fn, opt = CASES["glm"].make()
    g = glmc.capture(model, batch, loss_fn, opt)
    ShardPass(stage=3, bucket_mb=BUCKET_MB, reshard="budget", link="100us:1GBps").run(
        g, PassContext(mesh=MeshSpec((2,), ("dp",))))
    kept = {n.name for n in g.graph.nodes if REGATHER_S in n.meta}
    rewrite(g, kept, EAGER, prefetch=True)
    g.verify()
    pos = {n: i for i, n in enumerate(g.graph.nodes)}
    again = [n for n in g.graph.nodes if is_collective(n) and TrainGraph.info(n).phase is
             Phase.BACKWARD and comm_ops()[n.target] == "all_gather_into_tensor"]
    assert 3 <= len(again) <= len(kept)  # a bucket no backward op reads is not gathered
    waits = [next(u for u in c.users if is_comm(u)) for c in again]
    first = [min(pos[u] for u in w.users) for w in waits]
    for j in range(1, len(again)):
        assert pos[waits[j - 1]] < pos[again[j]] < first[j - 1]  # issued one ahead
    nodes = list(g.graph.nodes)
    for w, f in zip(waits, first):  # between a wait and its reader: only the next issue
        assert all(n in again for n in nodes[pos[w] + 1:f])
    assert all(pos[w] > pos[c] + 1 for w, c in zip(waits[1:], again[1:]))  # not adjacent


def test_bf16_composes_with_stage_3(runs: Path) -> None:
    r = result(runs, "stage3_bf16", 0)
    # bf16 compute against fp32 eager: the precision pass's own tolerance for 3 steps
    torch.testing.assert_close(r["losses"], r["ref"], rtol=2e-2, atol=0)


def test_sharding_cuts_per_rank_state_as_the_stage_says(runs: Path) -> None:
    full = result(runs, "stage0", 0)
    for stage in (1, 2, 3):
        r = result(runs, f"stage{stage}", 0)
        # per-element optimizer state: half per rank (+ padding rows)
        assert r["local_state_numel"] <= full["local_state_numel"] / 2 * 1.05
        assert r["measured"]["persistent_bytes"] < full["measured"]["persistent_bytes"]
    assert result(runs, "stage2", 0)["local_param_numel"] == full["local_param_numel"]
    assert result(runs, "stage3", 0)["local_param_numel"] <= full["local_param_numel"] / 2 * 1.05


def test_buckets_follow_the_backward_and_the_bucket_size(runs: Path) -> None:
    plan = result(runs, "stage2", 0)["plan"]
    assert len(plan.grad_buckets) > 1
    assert all(b.collective == "reduce_scatter_tensor" for b in plan.grad_buckets)
    # the LM head's gradient is the first the backward produces
    assert plan.grad_buckets[0].params[0] == "head.weight"
    limit = BUCKET_MB * 2**20
    assert all(b.nbytes <= limit or len(b.params) == 1 for b in plan.grad_buckets)


def test_accumulating_four_micro_batches_equals_the_big_batch(runs: Path) -> None:
    r = result(runs, "accumulate", 0)
    torch.testing.assert_close(r["losses"], r["ref"][:len(r["losses"])], rtol=1e-4, atol=0)
    assert r["compiles"] == 1  # k changed from 4 to 2 with the micro-batch shape unchanged


def test_compression_cuts_the_bytes_on_the_wire_and_still_trains(runs: Path) -> None:
    found = result(runs, "compress", 0)
    ref = result(runs, "stage0", 0)["ref"]
    # bf16 transfer: rounding-level change of the average gradient
    torch.testing.assert_close(found["bf16"]["losses"][:STEPS], ref, rtol=1e-3, atol=0)
    assert found["bf16"]["ratio"] == 2.0
    assert found["sign"]["ratio"] >= 16  # 1 bit per element + an fp32 scale per tensor
    assert 16 <= found["sign_block"]["ratio"] < found["sign"]["ratio"]  # a scale per 64
    assert found["topk"]["ratio"] >= 25  # 1% of the values + their int32 indices
    assert found["powersgd"]["ratio"] >= 8  # rank 4
    for method in ("sign", "sign_block", "topk", "powersgd"):
        losses = found[method]["losses"]
        assert losses[-1] < losses[0], method  # the loss still falls
    assert any(k.startswith("psgd_q:") for k in found["powersgd"]["state"])
    assert found["powersgd"]["seeded"]  # seed=7: the initial Q torch.randn draws from it


def test_error_feedback_state_is_checkpointed(runs: Path) -> None:
    sign = result(runs, "compress", 1)["sign"]
    assert sign["nonzero"] and sign["restored"]


# ---- checkpoints -------------------------------------------------------------------------------

def test_dcp_checkpoint_resumes_to_the_same_losses(runs: Path) -> None:
    r = result(runs, "checkpoint", 0)
    assert r["resumed"] == r["after"]
    assert ".metadata" in r["files"]


def _one_rank_worker(rank: int, port: int, out: str) -> None:
    def part(rank: int, out: Path) -> dict:
        (model, batch, loss_fn, opt), _ = _case()
        args, kwargs = split_batch(batch)
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                                fusion=False, predict=False, measure=False,
                                parallel={"zero": 3, "bucket_mb": BUCKET_MB})
        load_checkpoint(trainer, str(out / "ckpt"))
        return {"resumed": [trainer.step(*args, **kwargs).item() for _ in range(2)]}
    run_parts(rank, port, 1, out, [("one_rank", part)])


def test_a_two_rank_checkpoint_loads_on_one_rank(runs: Path) -> None:
    spawn(_one_rank_worker, str(runs), nprocs=1)
    after = result(runs, "checkpoint", 0)["after"]
    torch.testing.assert_close(result(runs, "one_rank", 0)["resumed"], after, rtol=1e-5, atol=0)


# ---- bad input ---------------------------------------------------------------------------------

def test_indivisible_batch_and_mismatched_ranks_are_typed_errors(runs: Path) -> None:
    for rank in (0, 1):
        r = result(runs, "errors", rank)
        assert "multiple of 2" in r["indivisible"]
        assert "ranks [1]" in r["mismatch"]


def test_the_users_profiler_on_one_rank_leaves_the_waits_unmeasured(runs: Path) -> None:
    for rank in (0, 1):
        r = result(runs, "profiled", rank)
        assert len(r["losses"]) == 8 and r["losses"][-1] < r["losses"][0]
        assert "exposed_comm_seconds" not in r["measured"]
        assert sum("communication waits not measured" in w for w in r["warnings"]) == 3


def _dead_rank_worker(rank: int, port: int, out: str) -> None:
    def part(rank: int, out: Path) -> dict:
        (model, batch, loss_fn, opt), _ = _case("mlp")
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                                fusion=False, predict=False, measure=False, parallel=0)
        if rank == 1:
            torch.save({"exited": True}, out / "dead1.pt")
            os._exit(0)  # dies without a word, as a crashed process does
        try:
            trainer.step(*batch)
            trainer.step(*batch)
        except CommError as e:
            return {"error_text": str(e)}
        return {"error_text": None}
    run_parts(rank, port, 2, out, [("dead", part)])


def test_a_dead_rank_is_a_typed_error_on_the_others_not_a_hang(tmp_path: Path) -> None:
    spawn(_dead_rank_worker, str(tmp_path))
    text = result(tmp_path, "dead", 0)["error_text"]
    assert text is not None and "rank 0 of 2" in text and "another rank" in text


def test_parallel_without_a_process_group_says_how_to_launch(monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    model, batch, loss_fn, opt = CASES["mlp"].make()
    with pytest.raises(ConfigError, match="--nproc"):
        glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, parallel=2)


def test_parallel_options_are_checked() -> None:
    assert Parallel.of(2) == Parallel(zero=2)
    assert Parallel.of({"zero": 3, "bucket_mb": 8}).bucket_mb == 8
    with pytest.raises(ConfigError, match="zero must be"):
        Parallel.of(4)
    with pytest.raises(ConfigError, match="unknown option"):
        Parallel.of({"stage": 1})


def test_shard_pass_needs_a_mesh() -> None:
    model, batch, loss_fn, opt = CASES["mlp"].make()
    graph = glmc.capture(model, batch, loss_fn, opt)
    with pytest.raises(ConfigError, match="data-parallel mesh"):
        ShardPass(stage=2).run(graph, PassContext())
    ShardPass(stage=2).run(graph, PassContext(mesh=MeshSpec((2,), ("dp",))))
    assert graph.meta["sharding"].layouts  # the optimizer state is stored sharded


def test_layout_pads_rows_and_reassembles() -> None:
    lay = Layout((5, 3), 2)
    assert lay.local_shape == (3, 3) and lay.valid_rows(1) == 2
    full = torch.arange(15.0).reshape(5, 3)
    shards = [lay.local(full, r) for r in range(2)]
    assert shards[1][2].eq(0).all()  # a padding row
    assert torch.equal(lay.full(shards), full)
    scalar = Layout((), 2)
    assert torch.equal(scalar.full([scalar.local(torch.tensor(7.0), r) for r in range(2)]),
                       torch.tensor(7.0))


# ---- communication model -----------------------------------------------------------------------

def test_a_measured_link_prices_each_kind_by_its_own_timings() -> None:
    """A calibrated link: at its rank count each kind is read off its own timed points
    (log-log between them, bandwidth past the largest); at other counts its per-kind fit;
    kinds it did not time use the link's figures. The fit recovers a ring formula."""
    from glmc.analysis.comm import LinkProfile, _fit, collective_seconds
    pts = ((1 << 20, 1e-3), (4 << 20, 16e-3))
    link = LinkProfile("m", 1e-5, 1e9, "made up", kinds=(("all_gather_into_tensor", 2e-5, 5e8),),
                       points=(("all_gather_into_tensor", pts),), ranks=2)
    ag = "all_gather_into_tensor"
    assert collective_seconds(ag, 1 << 20, 2, link) == pytest.approx(1e-3)
    assert collective_seconds(ag, 2 << 20, 2, link) == pytest.approx(4e-3)  # t ~ B^2 here
    assert collective_seconds(ag, 512, 2, link) == pytest.approx(1e-3)
    assert collective_seconds(ag, 6 << 20, 2, link) == pytest.approx(16e-3 + 0.5 * (2 << 20) / 5e8)
    assert collective_seconds(ag, 4 << 20, 4, link) == pytest.approx(3 * 2e-5 + 0.75 * (4 << 20)
                                                                     / 5e8)
    assert collective_seconds("all_reduce", 4 << 20, 2, link) == pytest.approx(
        2e-5 + (4 << 20) / 1e9)
    sizes = [4 << 10, 1 << 20, 16 << 20]
    times = [collective_seconds("reduce_scatter_tensor", b, 4,
                                LinkProfile("t", 3e-5, 2e9, "")) for b in sizes]
    latency, bandwidth = _fit("reduce_scatter_tensor", 4, sizes, times)
    assert (latency, bandwidth) == (pytest.approx(3e-5), pytest.approx(2e9))


def test_contention_slows_the_compute_a_collective_overlaps() -> None:
    """With `contention` c, each second of compute beside a collective in flight costs 1 + c:
    reported as contention seconds, in the step time, not as exposed waiting."""
    import torch.fx as fx

    from glmc.analysis.comm import LinkProfile, estimate_comm
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.zeros(250_000)
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    mid = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    g.output((wait, mid))
    free, shared = (LinkProfile("l", 0.0, 1e9, "", contention=c) for c in (0.0, 0.5))
    seconds = {mid.name: 0.5e-3}  # the all-reduce: 1 MB over 2 ranks at 1 GB/s = 1 ms
    a, b = (estimate_comm(g, seconds, 2, link) for link in (free, shared))
    assert a.exposed_seconds == pytest.approx(0.5e-3) and a.contention_seconds == 0.0
    assert b.contention_seconds == pytest.approx(0.25e-3)
    assert b.exposed_seconds == pytest.approx(0.25e-3)  # the slowed compute waited less
    assert b.step_seconds == pytest.approx(a.step_seconds)  # 1 ms of link either way


def test_alpha_beta_formulas_and_the_topology_choice() -> None:
    from glmc.analysis.comm import LINKS, LinkProfile, choose_allreduce, collective_seconds
    link = LinkProfile("test", 1e-5, 1e9, "made up")
    # ring all-reduce: 2(N-1) alpha + 2(N-1)/N B/beta
    assert collective_seconds("all_reduce", 8_000_000, 4, link) == pytest.approx(
        6 * 1e-5 + 1.5 * 8e-3)
    assert collective_seconds("all_gather_into_tensor", 8_000_000, 4, link) == pytest.approx(
        3 * 1e-5 + 0.75 * 8e-3)
    assert collective_seconds("all_reduce", 8_000_000, 1, link) == 0.0
    # 2 nodes x 2 over a slow inter-node link: hierarchical wins by far; on one link both move
    # the same bytes (1.5 B / beta), hierarchical saving only latency steps
    slow = choose_allreduce(16 << 20, 2, 2, LINKS["nvlink4"], LINKS["ethernet-25g"])
    assert slow.best == "hierarchical" and slow.hierarchical_seconds < slow.flat_seconds / 2
    same = choose_allreduce(1 << 30, 2, 2, LINKS["nvlink4"], LINKS["nvlink4"])
    assert same.hierarchical_seconds == pytest.approx(same.flat_seconds, rel=0.01)


def test_exposed_communication_is_what_compute_does_not_hide() -> None:
    """A collective issued early and waited for late is hidden by the compute in between."""
    from glmc.analysis.comm import LinkProfile, estimate_comm
    model, batch, loss_fn, opt = CASES["mlp"].make()
    graph = glmc.capture(model, batch, loss_fn, opt)
    ShardPass(stage=0, bucket_mb=0.001).run(graph, PassContext(mesh=MeshSpec((2,), ("dp",))))
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    slow = LinkProfile("slow", 1e-3, 1e6, "made up")
    free = estimate_comm(graph.graph, {n: 0.0 for n in names}, 2, slow)
    busy = estimate_comm(graph.graph, {n: 1.0 for n in names}, 2, slow)
    assert free.exposed_seconds == pytest.approx(free.comm_seconds)  # nothing to hide behind
    assert busy.exposed_seconds < free.exposed_seconds
    assert busy.collectives == free.collectives > 1


def test_all_gather_staging_lives_until_the_transfer_ends() -> None:
    """gloo frees an all-gather's staging copy when the transfer ends: with compute to hide
    behind, the model ends it at the node during which the transfer is predicted done, not
    at the wait; a transfer that cannot end before its wait keeps it to the wait."""
    from glmc.analysis.comm import LinkProfile, estimate_comm
    from glmc.analysis.memory import simulate
    model, batch, loss_fn, opt = CASES["mlp"].make()
    graph = glmc.capture(model, batch, loss_fn, opt)
    ShardPass(stage=3, bucket_mb=0.001).run(graph, PassContext(mesh=MeshSpec((2,), ("dp",))))
    names = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    nodes = {n.name: n for n in graph.graph.nodes}
    fast = estimate_comm(graph.graph, {n: 1.0 for n in names}, 2,
                         LinkProfile("fast", 1e-9, 1e15, "made up"))
    slow = estimate_comm(graph.graph, {n: 1.0 for n in names}, 2,
                         LinkProfile("slow", 1e3, 1.0, "made up"))
    gathers = [n for n in names if nodes[n].target is
               torch.ops._c10d_functional.all_gather_into_tensor.default]
    early = [g for g in gathers if not fast.done_at[g].startswith("wait")]
    assert early, "no all-gather was issued ahead of its wait"
    for g in gathers:
        (wait,) = [u.name for u in nodes[g].users
                   if u.target is torch.ops._c10d_functional.wait_tensor.default]
        assert slow.done_at[g] == wait
    temporaries = {name: sum(live["temporaries"] for _, live in
                             simulate(graph.graph, done_at=est.done_at).timeline)
                   for name, est in (("fast", fast), ("slow", slow))}
    assert temporaries["slow"] == sum(live["temporaries"]
                                      for _, live in simulate(graph.graph).timeline)
    assert temporaries["fast"] < temporaries["slow"]


# ---- transformers' GLM (slow: builds the HF model in both processes) ----------------------------

def _hf_worker(rank: int, port: int, out: str) -> None:
    def part(stage: int):
        def run(rank: int, out: Path) -> dict:
            from glmc.frontend.workload import load_workload
            from tests.models import EXAMPLES
            w = load_workload(str(EXAMPLES / "hf_glm.py"))
            ref_model = copy.deepcopy(w.model)
            ref_opt = type(w.optimizer)(ref_model.parameters(), **_hyper(w.optimizer))
            ref = eager_losses(ref_model, w.example_inputs, w.loss_fn, ref_opt, STEPS)
            trainer = glmc.optimize(w.model, w.example_inputs, loss_fn=w.loss_fn,
                                    optimizer=w.optimizer, backend="eager", predict=False,
                                    parallel={"zero": stage, "bucket_mb": 1})
            args, kwargs = split_batch(w.example_inputs)
            losses = [trainer.step(*args, **kwargs).item() for _ in range(STEPS)]
            params, _ = trainer.parallel.full_state(w.model, w.optimizer)
            return {"losses": losses, "ref": ref, "params": params,
                    "ref_params": {n: p.detach() for n, p in ref_model.named_parameters()}}
        return run
    run_parts(rank, port, 2, out, [(f"hf{stage}", part(stage)) for stage in range(4)])


@pytest.mark.slow
def test_transformers_glm_trains_like_one_process_under_every_zero_stage(tmp_path: Path
                                                                         ) -> None:
    pytest.importorskip("transformers")
    spawn(_hf_worker, str(tmp_path))
    for part in ("hf0", "hf1", "hf2", "hf3"):
        r = result(tmp_path, part, 0)
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-4, atol=0)
        for name, ref in r["ref_params"].items():
            # atol: parameters with an exactly-zero true gradient (k_proj.bias under softmax)
            # get rounding-noise updates that Adam scales to lr size (README, Numerics)
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-4, msg=name)
