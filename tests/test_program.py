"""Programs across devices: an SPMD step with functional collectives, and a two-stage pipeline.

Each program is built by hand, verified, printed, run through cleanup, and then run in two
processes (gloo on CPU) against single-process eager training.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import glmc
from glmc.compiler.inplace import run_step
from glmc.compiler.passmanager import PassContext
from glmc.errors import PassError
from glmc.ir.graph import CommInfo, MeshSpec, OutputKind, Phase, Role, TrainGraph
from glmc.ir.program import (UNBOUND, SpmdProgram, StagedProgram, all_reduce_gradients, comm_nodes,
                             insert_collective, link)
from glmc.parallel.executor import run_stage
from glmc.passes.cleanup import CleanupPass
from glmc.planning.schedule import Action, ActionKind, gpipe
from glmc.trace.stages import capture_stage
from tests.distributed import result, run_parts, spawn

MESH = MeshSpec((2,), ("dp",), "cpu")
LR = 0.1
STEPS = 2


# ---- launching ---------------------------------------------------------------------------------

def _worker(rank: int, port: int, out: str) -> None:
    """Both programs in one pair of processes (process start-up dominates the test time)."""
    run_parts(rank, port, 2, out, [("spmd", lambda r, _: _spmd_part(r)),
                                   ("pipeline", lambda r, _: _pipeline_part(r))])


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("distributed")
    spawn(_worker, str(out))
    return out


_result = result


# ---- (a) SPMD: data parallelism by all-reduced gradients ---------------------------------------

def _linear() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def _dp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)


def _spmd_program(model: nn.Module, opt: torch.optim.Optimizer) -> SpmdProgram:
    graph = glmc.capture(model, _dp_batch(0, 0), F.mse_loss, opt)
    all_reduce_gradients(graph, MESH, "dp", "avg")
    return SpmdProgram(graph, MESH)


def _comm_snapshot(graph: TrainGraph) -> list:
    return [(n.name, n.target, tuple(map(str, n.args)), graph.info(n).comm)
            for n in comm_nodes(graph)]


def test_spmd_program_verifies_prints_and_survives_cleanup() -> None:
    program = _spmd_program(*_linear())
    program.verify()
    graph = program.graph
    colls = [n for n in comm_nodes(graph) if graph.info(n).comm.collective == "all_reduce"]
    assert len(colls) == 2  # weight and bias gradients
    for c in colls:
        (wait,) = c.users
        assert graph.info(wait).comm == CommInfo("wait_tensor", "dp")
        assert all(graph.info(u).phase is Phase.OPTIMIZER for u in wait.users)
        assert repr(graph.info(c.args[0]).spec.placements) == "(Partial(avg),)"
        assert c.args[-1] == UNBOUND + "dp"
    text = str(program)
    assert "all_reduce(" in text and "over 'dp': (Partial(avg)) -> (Replicate())" in text
    assert "torch.ops._c10d_functional.wait_tensor.default" in text
    before = _comm_snapshot(graph)
    CleanupPass().run(graph, PassContext())
    assert _comm_snapshot(graph) == before
    program.verify()


def test_spmd_verify_rejects_malformed_communication() -> None:
    program = _spmd_program(*_linear())
    coll = next(n for n in comm_nodes(program.graph) if program.graph.info(n).comm is not None)
    info = program.graph.info(coll)
    coll.meta["glmc"] = info.replace(comm=None)
    with pytest.raises(PassError, match="needs CommInfo"):
        program.verify()
    coll.meta["glmc"] = info.replace(comm=CommInfo("all_reduce", "tp", "avg"))
    with pytest.raises(PassError, match="no dim 'tp'"):
        program.verify()
    coll.meta["glmc"] = info
    program.verify()
    with pytest.raises(PassError, match="needs Shard"):  # a gather of a Partial value
        insert_collective(program.graph, coll.args[0], "all_gather_into_tensor", MESH, "dp")


def _spmd_part(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = _linear()
    program = _spmd_program(model, opt)
    program.verify()
    step = program.bind(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    reduces = [n for n in comm_nodes(step)
               if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert reduces and all(not str(n.args[-1]).startswith(UNBOUND) for n in reduces)
    assert all(n.args[-1] == UNBOUND + "dp" for n in comm_nodes(program.graph)
               if n.target is torch.ops._c10d_functional.all_reduce.default)
    for s in range(STEPS):
        run_step(step, model, opt, _dp_batch(rank, s))
    return {"state": model.state_dict()}


def test_spmd_two_ranks_match_eager_averaged_gradients(distributed: Path) -> None:
    model, opt = _linear()
    for s in range(STEPS):
        grads = []
        for rank in range(2):
            model.zero_grad()
            x, y = _dp_batch(rank, s)
            F.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    for rank in range(2):
        got = _result(distributed, "spmd", rank)["state"]
        for name, want in model.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# ---- (b) a two-stage pipeline, GPipe ------------------------------------------------------------

MICROBATCHES = 2


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)


def _microbatches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _full_batch(step)
    return list(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)))


def _staged(model: nn.Sequential) -> tuple[StagedProgram, list, list]:
    """Stage 0: Linear + ReLU sends "h"; stage 1: Linear + MSE loss."""
    mods = [model[:2], model[2:]]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in mods]
    x, y = _microbatches(0)[0]
    h = mods[0](x).detach()
    stages = (capture_stage(0, mods[0], opts[0], [(0, x)], send=("h",)),
              capture_stage(1, mods[1], opts[1], [("h", h)], loss_fn=F.mse_loss, target=(1, y)))
    boundaries = link(stages)
    return StagedProgram(stages, boundaries, gpipe(2, MICROBATCHES, {(0, 1)})), mods, opts


def test_staged_program_verifies_prints_and_survives_cleanup() -> None:
    program, _, _ = _staged(_mlp())
    program.verify()
    assert {(b.name, b.src_stage, b.dst_stage, b.spec.shape) for b in program.boundaries} == \
        {("h", 0, 1, (2, 8)), ("grad:h", 1, 0, (2, 8))}
    text = str(program)
    assert "h: stage 0 -> stage 1 [2, 8] float32" in text
    assert "grad:h: stage 1 -> stage 0 (gradient)" in text
    assert "# ---- stage 1: backward (B) ----" in text and "mse_loss_backward" in text
    assert "# schedule stage 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0UPDATE" \
        in text
    for stage in program.stages:
        for graph in stage.graphs().values():
            CleanupPass().run(graph, PassContext())
    assert link(program.stages) == program.boundaries
    program.verify()


def test_staged_verify_rejects_bad_boundaries_and_schedules() -> None:
    program, _, _ = _staged(_mlp())
    wrong = [dataclasses.replace(b, spec=dataclasses.replace(b.spec, shape=(3, 8)))
             if b.name == "h" else b for b in program.boundaries]
    with pytest.raises(PassError, match="boundary 'h'"):
        StagedProgram(program.stages, tuple(wrong), program.schedule).verify()
    schedule = gpipe(2, MICROBATCHES, {(0, 1)})
    schedule.dag.remove_node(Action(1, ActionKind.B, 1))
    with pytest.raises(PassError, match="lacks actions"):
        StagedProgram(program.stages, program.boundaries, schedule).verify()
    schedule = gpipe(2, MICROBATCHES, {(0, 1)})
    schedule.dag.add_edge(Action(1, ActionKind.UPDATE), Action(0, ActionKind.F, 0))
    with pytest.raises(PassError, match="cycle"):
        StagedProgram(program.stages, program.boundaries, schedule).verify()


def test_gpipe_schedule_is_data() -> None:
    schedule = gpipe(3, 2, {(0, 1), (1, 2)})
    assert nx.is_directed_acyclic_graph(schedule.dag)
    assert [str(a) for a in schedule.actions(1)] == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1",
        "1RECV_B0", "1B0", "1SEND_B0", "1RECV_B1", "1B1", "1SEND_B1", "1UPDATE"]
    schedule.verify(3, {(0, 1), (1, 2)})


def test_stage_graphs_have_typed_signatures() -> None:
    program, _, _ = _staged(_mlp())
    s0, s1 = program.stages
    assert [(s.role, s.target) for s in s0.forward.inputs] == [
        (Role.PARAMETER, "0.weight"), (Role.PARAMETER, "0.bias"), (Role.INPUT, "input:0")]
    assert s1.forward.outputs[0].kind is OutputKind.LOSS
    assert (Role.GRADIENT, "") in [(s.role, s.target) for s in s1.backward.inputs]
    assert {(o.kind, o.target) for o in s1.backward.outputs} >= {(OutputKind.SEND, "grad:h")}
    for stage in program.stages:
        for phase, graph in stage.graphs().items():
            assert all(graph.info(n).phase is phase and graph.info(n).stage == stage.index
                       for n in graph.compute_nodes())


def _pipeline_part(rank: int) -> dict:
    program, mods, opts = _staged(_mlp())
    program.verify()
    losses = [run_stage(program, rank, mods[rank], opts[rank], _microbatches(s))
              for s in range(STEPS)]
    return {"state": mods[rank].state_dict(), "losses": losses}


def test_two_stage_gpipe_matches_eager_full_batch(distributed: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want_losses = []
    for s in range(STEPS):
        opt.zero_grad()
        x, y = _full_batch(s)
        loss = F.mse_loss(model(x), y)  # = the mean of the equal-sized microbatches' losses
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    got = {r: _result(distributed, "pipeline", r) for r in range(2)}
    state = {**got[0]["state"], **got[1]["state"]}
    for name, want in model.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    assert got[0]["losses"] == [[], []]
    got_losses = [torch.stack(ls).mean().item() for ls in got[1]["losses"]]
    assert got_losses == pytest.approx(want_losses, abs=1e-6)


def test_stages_with_frozen_parameters_or_inert_sends_are_typed_errors() -> None:
    """What glmc's pipeline does not support yet fails at capture with a GlmcError that says
    so (before: a KeyError from the update's state, a RuntimeError from autograd)."""
    from glmc.errors import CaptureError, ConfigError
    from glmc.trace.stages import capture_stage
    x = torch.randn(4, 8)
    frozen = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    frozen[0].bias.requires_grad_(False)  # as Whisper's positions
    opt = torch.optim.AdamW(frozen.parameters(), lr=LR)
    with pytest.raises(ConfigError, match=r"frozen parameters \['0.bias'\]"):
        capture_stage(0, frozen, opt, [(0, x)], send=("h",))

    class MaskToo(nn.Module):  # sends a value made from the batch alone, as T5's mask
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), (x > 0).float()
    mod = MaskToo()
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    with pytest.raises(CaptureError, match=r"sends \['mask'\] across the cut"):
        capture_stage(0, mod, opt, [(0, x)], send=("h", "mask"))
