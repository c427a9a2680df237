"""Hierarchical all-reduce (passes/shard.py `hierarchical=`) on a simulated 2-node x 2-rank
topology in four processes (gloo), and the choice the communication model makes for it; the
compress pass's warm-up. The structural and cost-model tests run without processes."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import glmc
from glmc.comm import choose_allreduce, get_link
from glmc.errors import ConfigError
from glmc.ir import GRAD_BUCKET, MeshSpec, TrainGraph
from glmc.parallel import Parallel
from glmc.passes.shard import ShardPass
from glmc.passmanager import PassContext
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

def _sharded(**options) -> tuple[TrainGraph, ShardPass]:
    model, batch, loss_fn, opt = CASES["glm"].make()
    graph = glmc.capture(model, batch, loss_fn, opt)
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
