"""Hierarchical all-reduce (passes/shard.py `hierarchical=`) on a simulated 2-node x 2-rank
topology in four processes (gloo), and the choice the communication model makes for it; the
compress pass's warm-up. The structural and cost-model tests run without processes."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch

import glmc
from glmc.analysis.comm import choose_allreduce, get_link
from glmc.compiler.passmanager import PassContext
from glmc.errors import ConfigError
from glmc.ir.graph import GRAD_BUCKET, MeshSpec, TrainGraph
from glmc.parallel.data import Parallel
from glmc.passes.shard import ShardPass
from tests.distributed import result, run_parts, spawn
from tests.models import CASES, eager_losses

STEPS = 3
BUCKET_MB = 0.02  #: several buckets on the tiny GLM
MESH_2x2 = MeshSpec((2, 2), ("node", "local"), flattened=(("dp", ("node", "local")),))
#: the simulated topology: a fast link inside a node, a slow one between nodes; and one
#: uniform link whose per-collective cost (50 us) outweighs the 2 ring steps it saves
INTRA, SLOW_INTER, UNIFORM = "5us:10GBps:10us", "200us:0.05GBps:10us", "5us:10GBps:50us"


def _hyper(opt: torch.optim.Optimizer) -> dict:
    group = opt.param_groups[0]
    keys = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")
    return {k: group[k] for k in keys if k in group}


def _topology_part(case: str, stage: int):
    def part(rank: int, out: Path) -> dict:
        found = {}
        for mode in ("auto", "off"):
            model, batch, loss_fn, opt = CASES[case].make()
            ref_model = copy.deepcopy(model)
            ref_opt = type(opt)(ref_model.parameters(), **_hyper(opt))
            trainer = glmc.optimize(
                model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager", fusion=False,
                predict=False, measure=False,
                parallel={"zero": stage, "bucket_mb": BUCKET_MB, "nodes": 2,
                          "hierarchical": mode, "intra_link": INTRA, "inter_link": SLOW_INTER})
            losses = [trainer.step(*batch).item() for _ in range(STEPS)]
            params, _ = trainer.parallel.full_state(model, opt)
            kinds = [(TrainGraph.info(n).comm.collective, TrainGraph.info(n).comm.mesh_dim)
                     for n in trainer.graph.compute_nodes()
                     if TrainGraph.info(n).comm is not None
                     and TrainGraph.info(n).comm.collective != "wait_tensor"]
            found[mode] = {"losses": losses, "params": params, "kinds": kinds,
                           "buckets": trainer.parallel.plan.grad_buckets,
                           "mesh": (trainer.parallel.nodes, trainer.parallel.per_node)}
            if mode == "auto":
                found["ref"] = eager_losses(ref_model, batch, loss_fn, ref_opt, STEPS)
                found["ref_params"] = {n: p.detach() for n, p in ref_model.named_parameters()}
        return found
    return part


def _worker(rank: int, port: int, out: str, runs: list[tuple[str, int]]) -> None:
    run_parts(rank, port, 4, out, [(f"{c}{s}", _topology_part(c, s)) for c, s in runs])


def _check_hierarchical_equals_flat(out: Path, case: str, stage: int) -> None:
    for rank in range(4):
        r = result(out, f"{case}{stage}", rank)
        hier, flat = r["auto"], r["off"]
        assert hier["mesh"] == (2, 2)
        # auto chose hierarchical for every gradient bucket on the slow inter-node link
        assert hier["buckets"] and all(b.hierarchical for b in hier["buckets"])
        assert not any(b.hierarchical for b in flat["buckets"])
        assert ("reduce_scatter_tensor", "local") in hier["kinds"]
        assert ("all_reduce", "node") in hier["kinds"]
        assert ("all_gather_into_tensor", "local") in hier["kinds"]
        assert all(dim == "dp" for _, dim in flat["kinds"])
        # the same sums in another order: fp32 rounding apart, the same training
        torch.testing.assert_close(hier["losses"], flat["losses"], rtol=1e-5, atol=0)
        for name, p in flat["params"].items():
            torch.testing.assert_close(hier["params"][name], p, rtol=1e-5, atol=1e-7, msg=name)
        # and both train like one process on the global batch
        torch.testing.assert_close(hier["losses"], r["ref"], rtol=1e-4, atol=0)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(hier["params"][name], ref, rtol=1e-4, atol=1e-6,
                                       msg=name)


def test_hierarchical_all_reduce_on_2_nodes_x_2_equals_the_flat_one(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path), [("mlp", 0)], nprocs=4)
    _check_hierarchical_equals_flat(tmp_path, "mlp", 0)


@pytest.mark.slow  # four processes compiling the GLM twice each: ~80 s per stage on 2 cores
def test_hierarchical_all_reduce_on_the_glm_under_zero_0_and_1(tmp_path: Path) -> None:
    spawn(_worker, str(tmp_path), [("glm", 0), ("glm", 1)], nprocs=4)
    for stage in (0, 1):
        _check_hierarchical_equals_flat(tmp_path, "glm", stage)


# ---- the pass and the model, without processes -------------------------------------------------

@functools.lru_cache(maxsize=1)
def _captured_glm() -> TrainGraph:
    model, batch, loss_fn, opt = CASES["glm"].make()
    return glmc.capture(model, batch, loss_fn, opt)


def _glm() -> TrainGraph:
    """A fresh copy of the GLM example's step (captured once: capture dominates)."""
    return _captured_glm().copy()


def _sharded(**options) -> tuple[TrainGraph, ShardPass]:
    graph = _glm()
    p = ShardPass(stage=0, bucket_mb=BUCKET_MB, **options)
    p.run(graph, PassContext(mesh=MESH_2x2))
    return graph, p


def test_the_model_picks_hierarchical_on_a_slow_inter_node_link_and_flat_on_a_uniform_one(
        ) -> None:
    slow, _ = _sharded(intra_link=INTRA, inter_link=SLOW_INTER)
    buckets = slow.meta["sharding"].grad_buckets
    assert len(buckets) > 1 and all(b.hierarchical for b in buckets)
    for b in buckets:
        assert b.predicted["hierarchical_s"] < b.predicted["flat_s"]
    uniform, _ = _sharded(intra_link=UNIFORM, inter_link=UNIFORM)
    buckets = uniform.meta["sharding"].grad_buckets
    assert not any(b.hierarchical for b in buckets)
    for b in buckets:
        assert b.predicted["flat_s"] < b.predicted["hierarchical_s"]
    # the formulas: flat 6 ring steps + 1 call, hierarchical 1 + 2 + 1 steps + 3 calls; both
    # move 1.5 B / beta over the link they cross
    link = get_link(UNIFORM)
    c = choose_allreduce(4000, 2, 2, link, link)
    assert c.flat_seconds == pytest.approx(50e-6 + 6 * 5e-6 + 1.5 * 4000 / 10e9)
    assert c.hierarchical_seconds == pytest.approx(3 * 50e-6 + 4 * 5e-6 + 1.5 * 4000 / 10e9)


def test_hierarchical_bucket_is_reduce_scatter_all_reduce_all_gather() -> None:
    graph, _ = _sharded(hierarchical="on", intra_link=UNIFORM, inter_link=UNIFORM)
    n_buckets = len(graph.meta["sharding"].grad_buckets)
    colls = [n for n in graph.compute_nodes() if TrainGraph.info(n).comm is not None
             and TrainGraph.info(n).comm.collective != "wait_tensor"]
    grads = [n for n in colls if GRAD_BUCKET in n.meta]
    assert len(grads) == n_buckets
    for first in grads:  # each bucket: the three collectives, each reading the last's wait
        rs = first
        ar = next(iter(next(iter(rs.users)).users))
        ag = next(iter(next(iter(ar.users)).users))
        steps = [(TrainGraph.info(n).comm.collective, TrainGraph.info(n).comm.mesh_dim)
                 for n in (rs, ar, ag)]
        assert steps == [("reduce_scatter_tensor", "local"), ("all_reduce", "node"),
                         ("all_gather_into_tensor", "local")]
        assert rs.args[0].meta["val"].numel() % 2 == 0  # padded to the node's ranks
    # the loss is averaged over every rank, flat
    assert sum(TrainGraph.info(n).comm.mesh_dim == "dp" for n in colls) == 1
    off, _ = _sharded(hierarchical="off", intra_link=INTRA, inter_link=SLOW_INTER)
    assert not any(b.hierarchical for b in off.meta["sharding"].grad_buckets)


def test_the_step_prediction_prices_sub_group_collectives_on_their_own_ranks() -> None:
    from glmc.analysis.comm import LinkProfile, collective_seconds, estimate_comm
    graph, _ = _sharded(hierarchical="on", intra_link=UNIFORM, inter_link=UNIFORM)
    link = LinkProfile("test", 1e-5, 1e9, "made up")
    est = estimate_comm(graph.graph, {}, 4, link)  # 4 ranks in all; "local"/"node" have 2
    flat = {n.name for n in graph.compute_nodes() if TrainGraph.info(n).comm is not None
            and TrainGraph.info(n).comm.mesh_dim == "dp"}
    assert len(est.timeline) == 3 * len(graph.meta["sharding"].grad_buckets) + 1  # + the loss
    for entry in est.timeline:
        ranks = 4 if entry["node"] in flat else 2
        assert entry["end_s"] - entry["start_s"] == pytest.approx(
            collective_seconds(entry["kind"], entry["bytes"], ranks, link))


def test_topology_options_are_typed_errors() -> None:
    def mlp() -> TrainGraph:
        model, batch, loss_fn, opt = CASES["mlp"].make()
        return glmc.capture(model, batch, loss_fn, opt)
    with pytest.raises(ConfigError, match="2-D data-parallel mesh"):
        ShardPass(hierarchical="on").run(mlp(), PassContext(mesh=MeshSpec((4,), ("dp",))))
    with pytest.raises(ConfigError, match="stages 0-1"):
        ShardPass(stage=2, hierarchical="on").run(mlp(), PassContext(mesh=MESH_2x2))
    with pytest.raises(ConfigError, match="ALPHAus:BETAGBps"):
        ShardPass(inter_link="fast").run(mlp(), PassContext(mesh=MESH_2x2))
    with pytest.raises(ConfigError, match="hierarchical must be"):
        Parallel.of({"hierarchical": "yes"})
    with pytest.raises(ConfigError, match="nodes must be"):
        Parallel.of({"nodes": 0})
    with pytest.raises(ConfigError, match="does not combine"):
        Parallel.of({"hierarchical": "on", "compress": "sign"})


# ---- compression warm-up ---------------------------------------------------------------------

def _warmup_part(backend: str):
    def part(rank: int, out: Path) -> dict:
        return _warmup(rank, out, backend)
    return part


def _warmup(rank: int, out: Path, backend: str) -> dict:
    """Uncompressed, and PowerSGD / sign with 2 warm-up steps, 4 steps each on the MLP."""
    from glmc.parallel.data import load_checkpoint, save_checkpoint
    found = {}
    for name, compress in (("dense", None),
                           ("powersgd", {"method": "powersgd", "min_numel": 256,
                                         "warmup_steps": 2}),
                           ("sign", {"method": "sign", "warmup_steps": 2})):
        model, batch, loss_fn, opt = CASES["mlp"].make()
        parallel = {"zero": 0, "bucket_mb": BUCKET_MB}
        if compress is not None:
            parallel["compress"] = compress
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend=backend,
                                fusion=False, predict=False, measure=False, parallel=parallel)
        losses, residuals = [], []
        for _ in range(4):
            losses.append(trainer.step(*batch).item())
            residuals.append(float(sum(v.abs().sum() for k, v in
                                       trainer.parallel.comm_state.items()
                                       if k.startswith("ef:"))))
        r = {"losses": losses, "residuals": residuals, "compiles": len(trainer.report.compiles),
             "state": {k: v.clone() for k, v in trainer.parallel.comm_state.items()}}
        if name == "sign":  # the step counter is checkpointed with the residuals
            save_checkpoint(trainer, str(out / f"ckpt-warmup-{backend}"))
            trainer.parallel.comm_state["compress:step"].zero_()
            load_checkpoint(trainer, str(out / f"ckpt-warmup-{backend}"))
            r["restored_step"] = float(trainer.parallel.comm_state["compress:step"])
        found[name] = r
    return found


def _warmup_worker(rank: int, port: int, out: str, backend: str) -> None:
    run_parts(rank, port, 2, out, [(f"warmup-{backend}", _warmup_part(backend))])


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_warmup_steps_send_the_first_gradients_uncompressed(tmp_path: Path, backend: str) -> None:
    spawn(_warmup_worker, str(tmp_path), backend, nprocs=2)
    for rank in (0, 1):
        r = result(tmp_path, f"warmup-{backend}", rank)
        dense = r["dense"]["losses"]
        for method in ("powersgd", "sign"):
            got = r[method]
            # steps 1-2 (and the loss of step 3, computed before its update) are the
            # uncompressed run's; from step 4 on the compressed updates show
            torch.testing.assert_close(got["losses"][:3], dense[:3], rtol=1e-6, atol=0,
                                       msg=method)
            assert abs(got["losses"][3] - dense[3]) > 1e-4 * abs(dense[3]), method
            # error feedback starts with compression: no residual before step 3
            assert got["residuals"][:2] == [0.0, 0.0] and got["residuals"][2] > 0, method
            assert float(got["state"]["compress:step"]) == 4.0
            assert got["compiles"] == 1, method  # one compiled step holds both branches
        assert r["sign"]["restored_step"] == 4.0


# ---- pricing and the warm-up's structure, without processes --------------------------------------

def _compressed(method: str, bucket_mb: float = BUCKET_MB, **options
                ) -> tuple[TrainGraph, object]:
    from glmc.passes.compress import CompressPass
    graph = _glm()
    ctx = PassContext(profile="generic-cpu", mesh=MeshSpec((2,), ("dp",)))
    ShardPass(stage=0, bucket_mb=bucket_mb).run(graph, ctx)
    return graph, CompressPass(method=method, min_numel=256, **options).run(graph, ctx).stats


@pytest.mark.parametrize("method", ["bf16", "sign", "topk", "powersgd"])
def test_compression_is_priced_bytes_link_time_and_compute(method: str) -> None:
    _, stats = _compressed(method, bucket_mb=25, link="30us:3.125GBps")  # one bucket
    p = stats.price
    assert p is not None and "generic" in p.profile and p.link == "30us:3.125GBps"
    assert stats.wire_bytes < stats.dense_bytes
    # fewer bytes on a 25 GbE-like link: less predicted time than the dense all-reduce (with
    # many small buckets PowerSGD's two all-reduces each would make latency win instead)
    assert 0 < p.comm_seconds < p.dense_comm_seconds, method
    assert p.compute_seconds > 0  # the compress/decompress ops are priced, never free
    section = stats.report_section(None)
    assert f"{stats.wire_bytes:,}" in section.summary and "ms compute" in section.summary
    assert section.to_dict()["blocks"][1]["rows"][0][1:] == [stats.dense_bytes, stats.wire_bytes]


def test_warmup_is_one_step_with_a_branch_per_bucket() -> None:
    graph, stats = _compressed("sign", warmup_steps=3)
    conds = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == len(graph.meta["sharding"].grad_buckets) > 1
    for c in conds:
        warm, dense, compressed = c.args[0], *(getattr(graph.gm, a.target) for a in c.args[1:3])
        assert warm.target is torch.ops.aten.lt.Scalar and warm.args[1] == 3.0
        kinds = [n.target._opname for n in dense.graph.nodes if n.op == "call_function"
                 and "c10d" in str(n.target)]
        assert kinds == ["all_reduce", "wait_tensor"]  # the bucket's own collective
        kinds = [n.target._opname for n in compressed.graph.nodes if n.op == "call_function"
                 and "c10d" in str(n.target)]
        assert kinds.count("all_gather_into_tensor") == 2  # bits and scales
    assert any(s.target == "compress:step" for s in graph.inputs)
    assert stats.warmup_steps == 3
    # no dense collective runs outside the branches
    assert not any("all_reduce" in str(n.target) and "compress" in str(n.meta.get("glmc"))
                   for n in graph.graph.nodes)
    with pytest.raises(ConfigError, match="warmup_steps"):
        _compressed("sign", warmup_steps=-1)


def test_cli_topology_and_warmup_options_are_usage_errors_without_their_context(capsys) -> None:
    from glmc.frontend.cli import main
    for argv, says in ((["--compress-warmup", "3"], "--compress-warmup needs --compress"),
                       (["--zero", "0", "--compress", "topk", "--compress-block", "64"],
                        "--compress-block needs --compress sign"),
                       (["--nodes", "2"], "need --nproc or --zero"),
                       (["--nproc", "4", "--nodes", "3"], "does not divide --nproc 4"),
                       (["--zero", "0", "--inter-link", "fast"], "ALPHAus:BETAGBps"),
                       (["--zero", "2", "--hierarchical", "on"], "--zero 0 or 1")):
        with pytest.raises(SystemExit) as e:
            main(["compile", "examples/mlp.py", *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


def test_sign_blocks_send_one_scale_per_block() -> None:
    """sign{block=B}: each bucket's scales are ceil(n / B) fp32 values (a finer scale than one
    per tensor), the signs still n / 8 bytes; a block with another method is a typed error."""
    from glmc.passes.compress import CompressPass
    graph, stats = _compressed("sign", block=64)
    _, per_tensor = _compressed("sign")
    sizes = [b.nbytes // 4 for b in graph.meta["sharding"].grad_buckets]  # fp32 gradients
    scales = [n.args[0].meta["val"].numel() for n in graph.graph.nodes
              if "all_gather_into_tensor" in str(n.target)
              and n.args[0].meta["val"].dtype == torch.float32]
    assert len(sizes) > 1 and scales == [-(-n // 64) for n in sizes]
    assert stats.wire_bytes == sum(-(-n // 8) + 4 * -(-n // 64) for n in sizes)
    assert per_tensor.wire_bytes < stats.wire_bytes < stats.dense_bytes / 16
    with pytest.raises(ConfigError, match="block .* for method sign"):
        CompressPass(method="topk", block=64).run(_glm(), PassContext())
    with pytest.raises(ConfigError, match="seed .* whole number"):
        CompressPass(method="powersgd", seed=-1).run(_glm(), PassContext())
