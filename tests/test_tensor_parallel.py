"""Tensor parallelism (passes/tensor_parallel.py, glmc/parallel/tensor.py): the Megatron
layout found from the step's graph, DTensor propagation into a local program with
all-reduces, and two gloo processes training the GLM example (fused gate/up weight, grouped
query attention, rotary embeddings) to one process's losses and parameters."""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from glmc.passes.fusion import FusionPass
from glmc.passes.tensor_parallel import TensorParallelPass, seed_tiles

import glmc
from glmc.compiler.passmanager import PassContext
from glmc.errors import ConfigError
from glmc.ir.graph import MeshSpec, Role, TrainGraph, op_name
from glmc.ir.plans import Tile
from glmc.ir.program import comm_nodes
from glmc.parallel.plan import ParallelPlan
from glmc.trace.capture import capture, split_batch
from tests.distributed import result, run_parts, slow_readers, spawn
from tests.models import BACKEND_CASES, CASES, eager_losses, example_module

STEPS = 3
TP2 = MeshSpec((2,), ("tp",))  #: traced on a fake process group of 2 (no processes)


def _glm_graph() -> TrainGraph:
    model, batch, loss_fn, opt = CASES["glm"].make()
    return capture(model, batch, loss_fn, opt)


def test_the_megatron_layout_is_found_from_the_graph() -> None:
    """q/k/v and the fused gate/up are column parallel (gate/up as 2 interleaved parts, q/k/v
    biases with their weights), o and down row parallel, the LM head vocab-parallel into the
    loss and the embedding vocab-parallel (Megatron's); norms replicated. The step then has
    one all-reduce per attention and per MLP in the forward and one each in the backward (4
    per block), 4 for the loss and 1 for the embedding's output; the embedding's gradient
    needs none (each rank its own rows)."""
    graph = _glm_graph()
    tiles = seed_tiles(graph, 2, [])
    for b in (0, 1):
        p = f"blocks.{b}."
        for n in ("wq", "wk", "wv"):
            assert tiles[f"{p}attn.{n}.weight"] == Tile("column", 0, 1)
            assert tiles[f"{p}attn.{n}.bias"] == Tile("column", 0, 1)
        assert tiles[f"{p}attn.wo.weight"] == Tile("row", 1, 1)
        assert tiles[f"{p}mlp.gate_up.weight"] == Tile("column", 0, 2)
        assert tiles[f"{p}mlp.down.weight"] == Tile("row", 1, 1)
    assert tiles["head.weight"] == Tile("column", 0, 1)  # vocab-parallel into the loss
    assert tiles["embed.weight"] == Tile("column", 0, 1)  # vocab-parallel rows
    assert "norm.weight" not in tiles
    res = TensorParallelPass(size=2).run(graph, PassContext(mesh=TP2))
    assert res.stats.collectives == {"all_reduce": 13}
    # the report's section: the largest tensors' placements per rank, comm per kind
    from glmc.compiler.report_parts import ReportSection
    from glmc.report.html import _block
    section = ReportSection.from_dict(res.stats.report_section(None).to_dict())
    text, tensors, comm, units = section.blocks
    # the cost model's view of each unit: 2 blocks x (attention, MLP), the head, the table
    assert [row[:2] for row in units.rows] == [
        ("blocks.0.attn", "sharded"), ("blocks.0.mlp", "sharded"), ("blocks.1.attn", "sharded"),
        ("blocks.1.mlp", "sharded"), ("head.weight", "sharded"), ("embed.weight", "sharded")]
    assert ("head.weight", "(256, 64)", "(128, 64)", "column Shard(0)") in tensors.rows
    assert ("blocks.0.mlp.down.weight", "(64, 172)", "(64, 86)", "row Shard(1)") in \
        tensors.rows
    assert comm.rows[0][:2] == ("all_reduce", 13)
    assert "head.weight" in _block(tensors) and "13 all_reduce" in text.text
    phases = [TrainGraph.info(n).phase.value for n in comm_nodes(graph)
              if "all_reduce" in str(n.target)]
    # 2 per block each way; the vocab-parallel loss: 3 scalars per row forward (max, sum of
    # exponentials, the label's logit), the head input's gradient backward
    assert phases.count("forward") == 4 + 3 + 1 and phases.count("backward") == 4 + 1
    local = {TrainGraph.info(p).target: TrainGraph.info(p).spec.shape
             for p in graph.placeholders()}
    assert local["blocks.0.mlp.gate_up.weight"] == (172, 64)  # (2 x 172) / 2 ranks
    assert local["exp_avg:blocks.0.attn.wo.weight"] == (64, 32)
    assert local["head.weight"] == (128, 64)
    assert local["embed.weight"] == local["exp_avg:embed.weight"] == (128, 64)


@pytest.mark.slow  # a part of its own in the fixture; pins are unit-tested by default
def test_mixed_layouts_train_like_one_process(runs: Path) -> None:
    """Units kept whole beside sharded ones: the LM head and the embedding pinned whole with
    the blocks sharded (cross-entropy on whole logits: no loss-parallel rules): the losses,
    parameters and AdamW state of one process."""
    for rank in (0, 1):
        r = result(runs, "whole_vocab", rank)
        _like_one_process(r, state=True)
        assert r["local"]["head.weight"] == tuple(r["ref_params"]["head.weight"].shape)
        assert r["local"]["blocks.0.attn.wo.weight"] == (64, 32)
        # 4 per block, the head input's gradient stays whole: no loss or embedding reduction
        assert r["collectives"] == {"all_reduce": 8}
        assert [u[1] for u in r["units"]][-2:] == ["whole", "whole"]


@pytest.mark.slow  # the layout depends on this host's link; the choice is unit-tested above
def test_the_layout_choose_time_takes_trains_like_one_process(runs: Path) -> None:
    """The layout `choose=time` takes on this host's measured gloo link (whatever it is: the
    report's units say which): the losses, parameters and AdamW state of one process."""
    for rank in (0, 1):
        r = result(runs, "choose_time", rank)
        _like_one_process(r, state=True)
        sharded = {u[0] for u in r["units"] if u[1] == "sharded"}
        for unit, _, saved, comm, _ in r["units"]:
            assert (unit in sharded) == (float(saved) >= float(comm)), r["units"]


def test_the_cost_model_keeps_whole_the_units_sharding_would_slow() -> None:
    """`choose=time`: a unit is sharded only where the compute its shards save is predicted
    above its all-reduces on the tp link. On a link of 1 ms and 1 MB/s no unit pays (nothing
    sharded, no collective); on a link that costs nothing every unit does (Megatron's layout);
    the default (`layout`) shards every unit whatever the link. The cost model's figures are
    those of `unit_costs`."""
    from glmc.passes.tensor_parallel import unit_costs
    slow, free = "1000us:0.001GBps", "0.000001us:1000000GBps"
    captured = _glm_graph()  # captured once; each run rewrites a copy
    costs = {c.name: c for c in unit_costs(captured, 2, None, slow)}
    assert all(c.comm_s > c.saved_s > 0 for c in costs.values())
    assert costs["blocks.0.mlp"].state_bytes > 0  # half its weights and their gradients
    assert costs["embed.weight"].saved_s < costs["head.weight"].saved_s  # a lookup
    for link, choose, collectives in ((slow, "time", {}), (free, "time", {"all_reduce": 13}),
                                      (slow, "layout", {"all_reduce": 13})):
        res = TensorParallelPass(size=2, choose=choose, link=link).run(captured.copy(),
                                                                       PassContext(mesh=TP2))
        assert res.stats.collectives == collectives, (link, choose)
        layouts = {row[1] for row in res.stats.units}
        assert layouts == ({"whole"} if not collectives else {"sharded"})
    with pytest.raises(ConfigError, match="choose="):
        TensorParallelPass(size=2, choose="memory").run(captured.copy(),
                                                        PassContext(mesh=TP2))


def test_recompute_prices_issuing_a_tensor_parallel_all_reduce_again() -> None:
    """The tp pass marks each forward collective with its predicted seconds on its link
    (`REGATHER_S`); the recompute pass weighs issuing it again in the backward against
    keeping its output. On a slow link, selective recomputation makes no all-reduce again
    (unpriced, 7 of a 4-layer Llama's were: free in the model, 80 ms measured on gloo); a
    collective without a price is never made again."""
    from glmc.ir.graph import REGATHER_S, Phase, is_collective
    from glmc.passes.recompute import RecomputePass
    captured = _glm_graph()
    seconds = {}
    for link in ("1000us:0.001GBps", "0.000001us:1000000GBps"):
        g = captured.copy()
        TensorParallelPass(size=2, link=link).run(g, PassContext(mesh=TP2))
        marked = [n for n in g.compute_nodes() if is_collective(n)
                  and TrainGraph.info(n).phase is Phase.FORWARD]
        assert len(marked) == 8 and all(REGATHER_S in n.meta for n in marked)
        seconds[link] = sum(n.meta[REGATHER_S] for n in marked)
        if link.startswith("1000us"):
            res = RecomputePass(budget="selective").run(g, PassContext(mesh=TP2))
            made = [name for name, *_ in res.stats.recomputed_values]
            assert res.stats.recomputed > 0 and not any("all_reduce" in m for m in made), made
    assert seconds["1000us:0.001GBps"] > 1000 * seconds["0.000001us:1000000GBps"]
    g = captured.copy()
    TensorParallelPass(size=2, link="0.000001us:1000000GBps").run(g, PassContext(mesh=TP2))
    for n in g.compute_nodes():
        n.meta.pop(REGATHER_S, None)
    res = RecomputePass(budget="min").run(g, PassContext(mesh=TP2))
    assert not any("all_reduce" in name for name, *_ in res.stats.recomputed_values)


def test_a_foreach_update_runs_on_each_ranks_blocks() -> None:
    """The fusion pass's multi-tensor AdamW (`_foreach_mul`, `_foreach_addcdiv`, ...) on a
    vocabulary that does not divide (257 rows in blocks of 129 and 128): each rank updates
    its own blocks, index by index. Through DTensor's list rules it was refused here (the
    interleaved gate/up redistributed) and elsewhere gathered every parameter (66
    all-gathers in the planner's fp16 Megatron programs, 211 GiB of update priced)."""
    import dataclasses
    mod = example_module("glm.py")
    cfg = dataclasses.replace(mod.CONFIGS["tiny"], vocab=257)
    torch.manual_seed(0)
    model, batch = mod.GLM(cfg), mod.make_batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graph = capture(model, batch, None, opt)
    FusionPass(patterns="optimizer").run(graph, PassContext())  # as on Inductor
    assert any(op_name(n).startswith("_foreach_") for n in graph.graph.nodes)
    res = TensorParallelPass(size=2).run(graph, PassContext(mesh=TP2))
    assert res.stats.collectives == {"all_reduce": 13}
    local = {TrainGraph.info(p).target: TrainGraph.info(p).spec.shape
             for p in graph.placeholders()}
    assert local["exp_avg:head.weight"] == local["head.weight"] == (129, 64)


def test_pins_override_and_bad_pins_are_typed_errors() -> None:
    graph = _glm_graph()
    tiles = seed_tiles(graph, 2, [("blocks.*.mlp.*", "replicate"), ("head.weight", "replicate"),
                                  ("embed.weight", "column")])
    assert "blocks.0.mlp.gate_up.weight" not in tiles and "blocks.1.mlp.down.weight" not in tiles
    assert "head.weight" not in tiles and tiles["embed.weight"] == Tile("column", 0, 1)
    with pytest.raises(ConfigError, match="matches no parameter"):
        seed_tiles(graph, 2, [("nope.*", "row")])
    with pytest.raises(ConfigError, match="glob:column"):
        TensorParallelPass(plan="blocks.0.attn.wq.weight:diagonal").pins()
    with pytest.raises(ConfigError, match="does not divide"):
        seed_tiles(graph, 3, [])  # 4 heads x 16 do not split over 3 ranks
    with pytest.raises(ConfigError, match="--tp 2 with --nproc 3"):
        ParallelPlan(tp=2, nproc=3).validate()
    assert ParallelPlan(tp=2, nproc=4).degrees(4) == {"pp": 1, "dp": 2, "tp": 2}
    with pytest.raises(ConfigError, match="--zero 1 with --nproc 2"):
        ParallelPlan(tp=2, zero=1, nproc=2).validate()  # no replicas to shard over
    ParallelPlan(tp=2, zero=3, nproc=4).validate()  # dp=2 x tp=2
    ParallelPlan(tp=2, pp=2, nproc=4).validate()  # pp=2 x tp=2
    assert ParallelPlan(tp=2, pp=2, nproc=4).degrees(4) == {"pp": 2, "dp": 1, "tp": 2}
    ParallelPlan(tp=2, pp=2, nproc=8).validate()  # dp=2 x pp=2 x tp=2
    with pytest.raises(ConfigError, match="multiple of 4 processes"):
        ParallelPlan(tp=2, pp=2, nproc=6).validate()
    ParallelPlan(tp=2, pp=2, nproc=8, zero=1).validate()  # ZeRO-1 over dp=2 replicas
    with pytest.raises(ConfigError, match="--compress with tensor-parallel"):
        ParallelPlan(tp=2, pp=2, nproc=8, compress="bf16").validate()
    with pytest.raises(ConfigError, match="not compiled for a tensor-parallel mesh"):
        TensorParallelPass(size=2).run(graph, PassContext())
    # a pinned fused gate/up keeps its interleaved parts
    tiles = seed_tiles(graph, 2, [("blocks.0.mlp.gate_up.weight", "column")])
    assert tiles["blocks.0.mlp.gate_up.weight"] == Tile("column", 0, 2)


def test_sequence_parallelism_needs_whole_sequences_or_one_sequence() -> None:
    """The tokens are cut in tp contiguous blocks: whole sequences, or one sequence's
    positions; 3 sequences over 2 ranks are a typed error naming the dims."""
    model, batch, loss_fn, opt = BACKEND_CASES["glm"]()
    for rows in (1, 3):
        graph = capture(model, tuple(t[:rows] for t in batch), loss_fn, opt)
        run = functools.partial(TensorParallelPass(size=2, sequence=True).run, graph,
                                PassContext(mesh=MeshSpec((2,), ("tp",))))
        if rows == 3:
            with pytest.raises(ConfigError, match=r"batch \(3\) must divide by tp=2, or be "
                               "one sequence"):
                run()
        else:
            assert run().stats.collectives["reduce_scatter_tensor"] >= 8


class _Leaky(torch.nn.Module):
    """A fused linear whose output is split in two (gate, up) and also sliced: the slice
    crosses the interleaved parts."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Linear(8, 16, bias=False)
        self.out = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fused(x)
        gate, up = h.chunk(2, dim=-1)
        return (self.out(gate * up) + h[..., :8]).pow(2).mean()


def test_an_interleaved_weight_is_never_read_as_contiguous_blocks() -> None:
    """Redistributing a value in the interleaved layout would permute it silently: a typed
    error naming the op instead."""
    from glmc.errors import PassError
    model = _Leaky()
    graph = capture(model, (torch.randn(4, 8),), None,
                    torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert seed_tiles(graph, 2, [])["fused.weight"] == Tile("column", 0, 2)
    with pytest.raises(PassError, match="interleaved"):
        TensorParallelPass(size=2).run(graph, PassContext(mesh=TP2))


_CUMMAX = """import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16, bias=False)
        self.b = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = torch.cummax(self.a(x), -1).values  # no rule keeps the features sharded
        return self.b(h).pow(2).mean()


model = M()
example_inputs = (torch.randn(4, 8),)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def test_check_tp_lists_ops_without_a_sharding_rule(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """`glmc check FILE --tp N` shards the step on a mesh of no processes: the GLM example
    has a rule for every op; a cumulative max over a column-parallel output is gathered
    (forward and its backward's scatter), listed with the user's source line, and fails
    `--strict`; a head count that does not divide is the pass's typed error."""
    from glmc.frontend.cli import main
    root = Path(__file__).resolve().parents[1]
    assert main(["check", str(root / "examples" / "glm.py"), "--backend", "eager",
                 "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "every op has a sharding rule" in out and "blocks.0.attn.wo.weight: row Shard(1)" \
        in out
    assert re.search(r"blocks\.0\.mlp: sharded, saves [\d.]+ ms, costs [\d.]+ ms", out), out
    assert main(["check", str(root / "examples" / "glm.py"), "--backend", "eager", "--tp",
                 "2", "--tp-choose", "time", "--tp-link", "1000us:0.001GBps"]) == 0
    out = capsys.readouterr().out  # every unit kept whole on so slow a link
    assert "0 column- and 0 row-parallel" in out and "blocks.0.mlp: whole" in out, out
    (tmp_path / "cm.py").write_text(_CUMMAX)
    assert main(["check", str(tmp_path / "cm.py"), "--backend", "eager", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 op(s) without a sharding rule" in out, out
    assert re.search(r"cm\.py:11 in forward: cummax \(forward\): no sharding rule", out), out
    assert re.search(r"cm\.py:11 in forward: scatter_add \(backward\)", out), out
    assert main(["check", str(tmp_path / "cm.py"), "--backend", "eager", "--tp", "2",
                 "--strict"]) == 1
    assert main(["check", str(root / "examples" / "glm.py"), "--backend", "eager",
                 "--tp", "3"]) != 0
    assert "does not divide" in capsys.readouterr().err


def test_strict_refuses_ops_run_on_whole_operands(tmp_path: Path) -> None:
    from glmc.frontend.workload import load_workload
    (tmp_path / "cm2.py").write_text(_CUMMAX)
    w = load_workload(str(tmp_path / "cm2.py"))
    graph = capture(w.model, w.example_inputs, None, w.optimizer)
    with pytest.raises(ConfigError, match=r"(?s)strict=true.*cm2\.py:11 in forward: cummax"):
        TensorParallelPass(size=2, strict=True).run(graph, PassContext(mesh=TP2))


def test_tile_blocks_round_trip() -> None:
    w = torch.arange(24.0).reshape(4, 6)
    for tile in (Tile("column", 0, 1), Tile("row", 1, 1), Tile("column", 0, 2)):
        shards = [tile.local(w, r, 2) for r in range(2)]
        assert torch.equal(tile.full(shards), w)
    gate_up = Tile("column", 0, 2).local(w, 1, 2)  # rows 1 of gate (0-1) and 3 of up (2-3)
    assert torch.equal(gate_up, w[[1, 3]])


def _tp_part(backend: str, fusion: bool | None, case: str = "glm", sequence: bool = False,
             zero: int = 0, precision: str | None = None, clip: float | None = None,
             accumulate: int = 1, sgd: bool = False, rows: int | None = None,
             compress: Any = None, tp_plan: str = "", tp_choose: str = "layout"):
    def part(rank: int, out: Path) -> dict:
        from glmc.analysis.memory import simulate
        if case in BACKEND_CASES:
            model, batch, loss_fn, opt = BACKEND_CASES[case]()
        else:  # the zoo's transformers models
            from tests.zoo import ZOO
            model, batch, loss_fn, opt = ZOO[case].make()
        if rows is not None:  # the batch's first `rows` sequences
            batch = tuple(t[:rows] for t in batch)
        ref_model = copy.deepcopy(model)
        init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
        if clip is not None or sgd:  # SGD: its step scales with the (clipped) gradient;
            # Adam's turns rounding noise of a near-zero gradient into a step of up to lr
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        else:
            ref_opt = type(opt)(ref_model.parameters(), **{
                k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")})
        ref = eager_losses(ref_model, batch, loss_fn, ref_opt, STEPS, clip=clip)
        trainer = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend=backend,
                                fusion=fusion, predict=False, precision=precision,
                                clip_grad_norm=clip,
                                parallel={"tp": 2, "tp_sequence": sequence, "zero": zero,
                                          "accumulate": accumulate, "compress": compress,
                                          "tp_plan": tp_plan, "tp_choose": tp_choose})
        args, kwargs = split_batch(batch)
        losses = [trainer.step(*args, **kwargs).item() for _ in range(STEPS)]
        local = {n: tuple(p.shape) for n, p in model.named_parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        local.update({f"{k}:{names[id(p)]}": tuple(v.shape) for p, st in opt.state.items()
                      for k, v in st.items() if v.dim()})
        params, state = trainer.parallel.full_state(model, opt)
        names = {id(p): n for n, p in ref_model.named_parameters()}
        (tp,) = [h.stats for h in trainer.report.compiles[-1].history
                 if h.name == "tensor_parallel"]
        dtypes = sorted({str(n.meta["val"].dtype) for n in trainer.graph.compute_nodes()
                         if op_name(n) == "mm"})
        return {"losses": losses, "ref": ref, "params": params, "local": local,
                "passes": [h.name for h in trainer.report.compiles[-1].history],
                "mm_dtypes": dtypes, "init": init,
                "collectives": tp.collectives, "whole_ops": tp.whole_ops, "units": tp.units,
                "volume": tp.volume,
                # the most activation bytes (saved for the backward) live at once
                "activations": max(live.get("activations", 0) for _, live in
                                   simulate(trainer.graph.graph).timeline),
                "lr": opt.param_groups[0]["lr"],
                "ref_params": {n: p.detach() for n, p in ref_model.named_parameters()},
                "state": state, "ref_state": {f"{k}:{names[id(p)]}": v
                                              for p, st in ref_opt.state.items()
                                              for k, v in st.items()},
                "roles": sorted({TrainGraph.info(p).role.value
                                 for p in trainer.graph.placeholders()
                                 if TrainGraph.info(p).role is Role.PARAMETER})}
    return part


def _dropout_part(rank: int, out: Path, **config: Any) -> dict:
    """The GLM example with attention dropout 0.1 (on probabilities sharded by heads), or
    with other `config`."""
    mod = example_module("glm.py")
    cfg = dataclasses.replace(mod.CONFIGS["tiny"], **(config or {"dropout": 0.1}))
    torch.manual_seed(0)
    model, batch = mod.GLM(cfg), mod.make_batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_model = copy.deepcopy(model)
    ref = eager_losses(ref_model, batch, None, torch.optim.AdamW(ref_model.parameters(),
                                                                 lr=1e-3), STEPS)
    other = copy.deepcopy(model)
    reseeded = eager_losses(other, batch, None, torch.optim.AdamW(other.parameters(), lr=1e-3),
                            STEPS, seed=100)
    trainer = glmc.optimize(model, batch, optimizer=opt, backend="eager", fusion=None,
                            predict=False, parallel={"tp": 2})
    losses = []
    for i in range(STEPS):
        torch.manual_seed(i)  # as eager_losses seeds each step
        losses.append(trainer.step(*batch).item())
    params, _ = trainer.parallel.full_state(model, opt)
    (tp,) = [h.stats for h in trainer.report.compiles[-1].history if h.name == "tensor_parallel"]
    torch.manual_seed(rank)  # each rank its own seed: each would keep a block of other masks
    try:
        glmc.optimize(other, batch, optimizer=torch.optim.AdamW(other.parameters()),
                      backend="eager", predict=False, parallel={"tp": 2})
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {"losses": losses, "ref": ref, "reseeded": reseeded, "params": params,
            "refused": refused, "local": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "ref_params": {n: p.detach() for n, p in ref_model.named_parameters()},
            "collectives": tp.collectives,
            "dropouts": sum(op_name(n) == "native_dropout"
                            for n in trainer.graph.compute_nodes())}


def _checkpoint_part(rank: int, out: Path) -> dict:
    """tp=2 trains 2 steps and saves (glmc.save_checkpoint: DCP, each rank its blocks); a
    data-parallel ZeRO-1 trainer on the same 2 processes, built on another model, loads it
    and both take a third step."""
    model, batch, loss_fn, opt = BACKEND_CASES["glm"]()
    args, kwargs = split_batch(batch)
    tp = glmc.optimize(model, batch, loss_fn=loss_fn, optimizer=opt, backend="eager",
                       predict=False, parallel={"tp": 2})
    for _ in range(2):
        tp.step(*args, **kwargs)
    glmc.save_checkpoint(tp, str(out / "ckpt"))
    saved = tp.parallel.full_state(model, opt)
    other, _, _, other_opt = BACKEND_CASES["glm"]()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # not the saved values
    dp = glmc.optimize(other, batch, loss_fn=loss_fn, optimizer=other_opt, backend="eager",
                       predict=False, parallel={"zero": 1})
    glmc.load_checkpoint(dp, str(out / "ckpt"))
    loaded = dp.parallel.full_state(other, other_opt)
    return {"saved": saved, "loaded": loaded, "tp_loss": tp.step(*args, **kwargs).item(),
            "dp_loss": dp.step(*args, **kwargs).item()}


def _worker(rank: int, port: int, out: str, slow: bool = False) -> None:
    run_parts(rank, port, 2, out, [("eager", _tp_part("eager", False)),
                                   ("default", _tp_part("eager", None)),
                                   ("hf_glm", _tp_part("eager", None, "hf_glm")),
                                   ("sequence", _tp_part("eager", None, sequence=True)),
                                   ("bf16", _tp_part("eager", None, precision="bf16")),
                                   ("checkpoint", _checkpoint_part),
                                   ("dropout", _dropout_part)]
              + (_SLOW_PARTS if slow else []))


#: parts only the slow tests read (run when one of them is selected: `-m slow`)
_SLOW_PARTS = [("clip", _tp_part("eager", None, clip=0.5)),
               ("accumulate", _tp_part("eager", None, accumulate=2)),
               ("llama", _tp_part("eager", None, "llama", sgd=True)),
               ("whole_vocab", _tp_part(
                   "eager", None, tp_plan="head.weight:replicate;embed.weight:replicate")),
               ("hf_glm_sequence", _tp_part("eager", None, "hf_glm", sequence=True)),
               # one sequence, with SGD: under AdamW one weight in 10,000 (a rounding-noise
               # gradient) moved 2e-6 apart
               ("one", _tp_part("eager", None, rows=1, sgd=True)),
               ("one_sequence", _tp_part("eager", None, sequence=True, rows=1, sgd=True)),
               ("qwen2_tied", _tp_part("eager", None, "qwen2_tied", sgd=True)),
               ("odd_vocab", functools.partial(_dropout_part, vocab=257)),
               ("choose_time", _tp_part("eager", None, tp_choose="time"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    out = tmp_path_factory.mktemp("tp")
    spawn(_worker, str(out), slow_readers(request, "runs"))
    return out


@pytest.mark.parametrize("part", ["eager", "default"])  # default: glmc's default passes too
def test_two_ranks_train_like_one_process(runs: Path, part: str) -> None:
    """tp=2 on 2 gloo processes, each the whole batch: the losses, parameters and AdamW state
    of eager PyTorch on one process (to fp32 all-reduce order), the ranks holding half of
    each sharded weight."""
    for rank in (0, 1):
        r = result(runs, part, rank)
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        for key, ref in r["ref_state"].items():
            torch.testing.assert_close(r["state"][key].to(ref.dtype), ref, rtol=1e-4,
                                       atol=1e-7, msg=key)
        assert r["local"]["blocks.0.attn.wo.weight"] == (64, 32)
        assert r["local"]["blocks.1.mlp.gate_up.weight"] == (172, 64)
        assert r["local"]["embed.weight"] == (128, 64)  # vocab-parallel
        # Megatron's communication, with glmc's fused kernels too (attention run by heads)
        assert r["collectives"] == {"all_reduce": 13} and r["whole_ops"] == {}


@pytest.mark.slow  # 2 processes through the CLI; the API's tp=2 and sequence runs by default
@pytest.mark.parametrize("flags", [("--tp", "2"), ("--tp", "2", "--sequence-parallel")])
def test_glmc_compile_tp_trains_like_one_process(tmp_path: Path, flags: tuple) -> None:
    """`glmc compile FILE --nproc 2 --tp 2 [--sequence-parallel]` prints the losses of one
    process."""
    import re
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]

    def losses(*extra: str) -> list[float]:
        out = subprocess.run([sys.executable, "-m", "glmc", "compile", str(root / "examples" /
                                                                            "glm.py"),
                              "--steps", "3", "--backend", "eager", *extra],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert ("tensor_parallel changed" in out.stdout) == bool(extra), out.stdout[-2000:]
        return [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)", out.stdout,
                                             re.MULTILINE)]

    one, two = losses(), losses("--nproc", "2", *flags)  # (the pass's stats line)
    assert len(one) == 3
    torch.testing.assert_close(two, one, rtol=1e-5, atol=0)


def test_transformers_glm_trains_like_one_process(runs: Path) -> None:
    """transformers' GlmForCausalLM (fused gate_up_proj, partial rotary, its KV-cache
    concatenation in the graph) on tp=2: the Megatron layout (a vocab-parallel embedding and
    LM head), the losses and parameters of one process."""
    for rank in (0, 1):
        r = result(runs, "hf_glm", rank)
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        for name, ref in r["ref_params"].items():
            if name.endswith("k_proj.bias"):
                # softmax ignores a shift of every key by one vector: the key bias's gradient
                # is 0 up to rounding, which Adam scales to steps of up to lr either way
                assert (r["params"][name] - ref).abs().max() <= STEPS * r["lr"] * 1.001
                continue
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        assert r["collectives"] == {"all_reduce": 13} and r["whole_ops"] == {}
        assert r["local"]["model.embed_tokens.weight"][0] * 2 == \
            r["ref_params"]["model.embed_tokens.weight"].shape[0]
        assert r["local"]["model.layers.0.self_attn.o_proj.weight"][1] * 2 == \
            r["ref_params"]["model.layers.0.self_attn.o_proj.weight"].shape[1]


@pytest.mark.parametrize("part,base", [
    ("sequence", "default"),  # the rest: parts run only for the slow set
    pytest.param("hf_glm_sequence", "hf_glm", marks=pytest.mark.slow),
    pytest.param("one_sequence", "one", marks=pytest.mark.slow)])
def test_sequence_parallelism_trains_like_one_process(runs: Path, part: str, base: str) -> None:
    """`tp_sequence` (sequence parallelism) on the GLM example and transformers' GLM, and on
    a batch of one sequence (each rank a block of its positions, `Shard(1)` of [1, seq, ...]
    values): the losses, parameters and AdamW state of one process; each block's all-reduce
    becomes a reduce-scatter and an all-gather (only norm-weight and loss reductions stay
    all-reduces, a few KB), nothing runs on gathered operands, and the most activation
    memory a rank holds (predicted) is 10% or more below plain tp's (norms, residual adds and
    the linears' saved inputs on half the tokens)."""
    for rank in (0, 1):
        r, plain = result(runs, part, rank), result(runs, base, rank)
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        for name, ref in r["ref_params"].items():
            if name.endswith("k_proj.bias"):  # its gradient is rounding noise (above)
                continue
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        for key, ref in r["ref_state"].items():
            if "k_proj.bias" not in key:
                torch.testing.assert_close(r["state"][key].to(ref.dtype), ref, rtol=1e-4,
                                           atol=1e-7, msg=key)
        c = r["collectives"]
        assert c["reduce_scatter_tensor"] >= 8 and c["all_gather_into_tensor"] >= 8, c
        assert r["volume"]["all_reduce"] < 4096 < plain["volume"]["all_reduce"]
        assert r["whole_ops"] == {}
        assert r["activations"] < 0.9 * plain["activations"], (r["activations"],
                                                               plain["activations"])


def test_bf16_and_fusion_compose_with_tensor_parallelism(runs: Path) -> None:
    """The precision pass (bf16 matmuls, fp32 master weights and AdamW state) and the fusion
    pass before the tensor_parallel pass on 2 processes: the losses of fp32 eager PyTorch on
    one process within the precision pass's tolerance, the Megatron communication unchanged
    (the all-reduces of bf16 partial sums)."""
    for rank in (0, 1):
        r = result(runs, "bf16", rank)
        assert "torch.bfloat16" in r["mm_dtypes"], r["mm_dtypes"]
        torch.testing.assert_close(r["losses"], r["ref"], rtol=2e-2, atol=0)
        for name, ref in r["ref_params"].items():
            # Adam's steps from bf16 gradients: each weight's 3 updates against fp32's
            # (a key bias's gradient is rounding noise, above: not compared)
            moved, want = r["params"][name] - r["init"][name], ref - r["init"][name]
            if not name.endswith("wk.bias"):
                assert (moved - want).norm() <= 0.2 * want.norm(), name
        assert r["collectives"] == {"all_reduce": 13}
        assert r["local"]["blocks.0.attn.wo.weight"] == (64, 32)


@pytest.mark.slow  # 4 processes on the test machine's cores
@pytest.mark.parametrize("zero", [0, 2])
def test_gradient_clipping_on_replicas_of_tensor_parallel_groups(dp_tp_runs: Path,
                                                                 zero: int) -> None:
    """`clip_grad_norm=0.5` on dp=2 x tp=2 with SGD: the update reads the shard pass's flat
    buckets, which mix tp blocks and whole gradients; split as the update splits them, the
    blocks' squares summed over "tp", and under ZeRO-2 (each replica its rows) both kinds'
    over "dp" — eager `clip_grad_norm_`'s losses and parameters on one process."""
    for rank in range(4):
        r = result(dp_tp_runs, f"clip{zero}", rank)
        moved = max(float((r["ref_params"][n] - r["init"][n]).abs().max()) for n in r["init"])
        assert moved > 1e-3
        _like_one_process(r)


@pytest.mark.slow  # 4 processes on the test machine's cores
@pytest.mark.parametrize("zero", [0, 3])
def test_gradient_accumulation_on_replicas_of_tensor_parallel_groups(dp_tp_runs: Path,
                                                                     zero: int) -> None:
    """`accumulate=2` on dp=2 x tp=2: each replica's half batch in 2 micro-batches, the shard
    pass's running sums of its gradient buckets (of tp blocks), one reduction and update per
    step: the losses, parameters and AdamW state of one process on the whole batch."""
    for rank in range(4):
        r = result(dp_tp_runs, f"accumulate{zero}", rank)
        _like_one_process(r, noise="wk.bias", state=True)
        assert r["collectives"] == {"all_reduce": 13}


@pytest.mark.slow  # 4 processes on the test machine's cores
@pytest.mark.parametrize("zero", [0, 1])
def test_compressed_gradients_on_replicas_of_tensor_parallel_groups(dp_tp_runs: Path,
                                                                    zero: int) -> None:
    """`compress="bf16"` on dp=2 x tp=2 with SGD: the compress pass sends the shard pass's
    buckets of tp blocks over "dp" in bf16 (error feedback on). One process's losses (1e-5)
    and parameters to bf16's rounding: each within 1% of the distance it moved in 3 steps
    (measured 0.36%, bf16 keeps 8 bits: 2^-8 = 0.39%)."""
    for rank in range(4):
        r = result(dp_tp_runs, f"compress{zero}", rank)
        assert "compress" in r["passes"], r["passes"]
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        for name, ref in r["ref_params"].items():
            moved = float((ref - r["init"][name]).abs().max())
            assert moved > 0 and float((r["params"][name] - ref).abs().max()) <= 0.01 * moved, \
                name
        assert r["collectives"] == {"all_reduce": 13}



def _has_amx() -> bool:
    try:
        return "amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


#: seen 2026-12-06 on an Intel Xeon host with AMX (also before that day's changes): in the
#: dropout parts blocks.1.mlp.gate_up.weight leaves rtol 1e-4 of one process's (the losses
#: agree to 1e-5); not diagnosed yet (a oneDNN reduction order meeting AdamW's
#: normalisation of tiny gradients is the suspect). Passes on AVX2/AVX-512 AMD hosts.
_AMX_NOISE = pytest.mark.xfail(_has_amx(), strict=False,
                               reason="gate_up.weight beyond rtol 1e-4 on AMX hosts "
                                      "(undiagnosed, see _AMX_NOISE)")

def _like_one_process(r: dict, noise: str = "", state: bool = False) -> None:
    """A part's losses (rtol 1e-5) and parameters (rtol 1e-4; with `state`, AdamW's state
    too) equal one process's; names ending in `noise` are skipped (a key bias whose gradient
    is rounding noise, which Adam turns into steps of up to lr)."""
    torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
    for name, ref in r["ref_params"].items():
        if not (noise and name.endswith(noise)):
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
    for key, ref in (r["ref_state"].items() if state else ()):
        if not (noise and key.endswith(noise)):
            torch.testing.assert_close(r["state"][key].to(ref.dtype), ref, rtol=1e-4,
                                       atol=1e-7, msg=key)


@_AMX_NOISE
def test_dropout_on_sharded_values_draws_one_process_masks(runs: Path) -> None:
    """Attention dropout on probabilities sharded by heads: each rank keeps its heads' block
    of the mask one process draws (no communication added), so the losses and parameters are
    eager PyTorch's on one process under the same seeds — which another seed's masks are
    not."""
    for rank in (0, 1):
        r = result(runs, "dropout", rank)
        assert r["dropouts"] >= 2  # one per attention
        assert abs(r["reseeded"][-1] - r["ref"][-1]) > 1e-3  # the masks matter
        _like_one_process(r, noise="wk.bias")
        assert r["collectives"] == {"all_reduce": 13}
        assert "different generator states" in r["refused"]


@pytest.mark.slow  # a part of its own in the fixture (data-parallel clipping runs by default)
def test_gradient_clipping_sums_the_blocks_norms_over_the_ranks(runs: Path) -> None:
    """`clip_grad_norm=0.5` (active: the GLM example's gradient norm is larger) on tp=2 with
    SGD (whose step is the clipped gradient): the sharded gradients' squared norms
    all-reduced over "tp", the replicated ones' added once — eager PyTorch's
    `clip_grad_norm_` losses and parameters on one process. A norm of one rank's blocks
    alone would scale the steps differently."""
    for rank in (0, 1):
        r = result(runs, "clip", rank)
        moved = max(float((r["ref_params"][n] - r["init"][n]).abs().max()) for n in r["init"])
        assert moved > 1e-3  # SGD moved the weights: their equality below is not vacuous
        _like_one_process(r)
        assert r["collectives"] == {"all_reduce": 13}  # the pass's; clip adds one more


@pytest.mark.slow  # parts of their own in the fixture; transformers' GLM runs by default
@pytest.mark.parametrize("case", ["llama", "qwen2_tied"])
def test_zoo_llama_and_a_tied_embedding_train_like_one_process(runs: Path, case: str) -> None:
    """transformers' Llama and Qwen2 with the LM head tied to the embedding (one table,
    vocab-parallel for both uses) from the zoo, on tp=2: the Megatron layout found from the
    graph (13 all-reduces), the losses and parameters of one process. With SGD, as the zoo's
    rewritten-step modes: under AdamW a single element of thousands (a gradient that is
    rounding noise) moves up to lr either way, 1.6e-5 at most in a run here."""
    for rank in (0, 1):
        r = result(runs, case, rank)
        _like_one_process(r)
        assert r["collectives"] == {"all_reduce": 13} and r["whole_ops"] == {}
        table = r["ref_params"]["model.embed_tokens.weight"].shape[0]
        assert r["local"]["model.embed_tokens.weight"][0] * 2 == table


@pytest.mark.slow  # a part of its own in the fixture
def test_gradient_accumulation_on_tensor_parallel_ranks(runs: Path) -> None:
    """`accumulate=2` on tp=2: the batch in 2 micro-batches, each rank's gradient blocks
    summed (the accumulate pass after the tensor_parallel pass), one update: the losses,
    parameters and AdamW state of one process on the whole batch."""
    for rank in (0, 1):
        r = result(runs, "accumulate", rank)
        _like_one_process(r, noise="wk.bias", state=True)
        assert r["collectives"] == {"all_reduce": 13}


@_AMX_NOISE
@pytest.mark.slow  # a part of its own in the fixture (~20 s); the even cut runs by default
def test_a_vocabulary_that_does_not_divide_is_cut_unevenly(runs: Path) -> None:
    """A vocabulary of 257 on 2 ranks: the embedding and the LM head stay vocab-parallel in
    blocks of 129 and 128 rows (torch.chunk's and DTensor's cut; no padding), the loss-
    parallel cross-entropy and the row-local embedding backward on uneven blocks: the
    losses and parameters of one process, still 13 all-reduces."""
    for rank in (0, 1):
        r = result(runs, "odd_vocab", rank)
        _like_one_process(r, noise="wk.bias")
        rows = 129 if rank == 0 else 128
        assert r["local"]["head.weight"] == r["local"]["embed.weight"] == (rows, 64)
        assert r["collectives"] == {"all_reduce": 13}


def test_a_tp_checkpoint_holds_blocks_and_loads_on_other_plans(runs: Path) -> None:
    """DCP holds each rank's tensor-parallel blocks (a sharded weight is 2 chunks, not a
    gathered tensor), and the checkpoint loads unchanged into data parallelism (ZeRO-1,
    2 processes: the same state, then the same next loss as tp=2) and into one process
    (plain DCP on a fresh model's state_dict)."""
    import torch.distributed.checkpoint as dcp
    path = runs / "ckpt"
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert len(meta["model.blocks.0.attn.wo.weight"].chunks) == 2
    assert len(meta["optim.exp_avg:head.weight"].chunks) == 2
    assert len(meta["model.norm.weight"].chunks) == 1  # replicated: written once
    for rank in (0, 1):
        r = result(runs, "checkpoint", rank)
        for part in (0, 1):  # model, optimizer state
            assert r["saved"][part].keys() == r["loaded"][part].keys()
            for k, v in r["saved"][part].items():
                assert torch.equal(r["loaded"][part][k].to(v.dtype), v), k
        torch.testing.assert_close(r["dp_loss"], r["tp_loss"], rtol=1e-5, atol=0)
    model, _, _, _ = BACKEND_CASES["glm"]()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)  # one process
    saved = result(runs, "checkpoint", 0)["saved"][0]
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def _inductor_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 2, out, [("inductor", _tp_part("inductor", None))])


@pytest.mark.slow  # an Inductor compile on each of 2 processes
def test_inductor_compiles_the_tensor_parallel_step_like_one_process(tmp_path: Path) -> None:
    """The local program with its all-reduces compiled by Inductor (default passes): the
    losses and parameters of eager PyTorch on one process."""
    spawn(_inductor_worker, str(tmp_path))
    for rank in (0, 1):
        r = result(tmp_path, "inductor", rank)
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        assert r["collectives"] == {"all_reduce": 13}


def _dp_tp_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 4, out, [(f"zero{z}", _tp_part("eager", None, zero=z))
                                   for z in (0, 1, 2, 3)] +
              [(f"clip{z}", _tp_part("eager", None, zero=z, clip=0.5)) for z in (0, 2)] +
              [(f"accumulate{z}", _tp_part("eager", None, zero=z, accumulate=2))
               for z in (0, 3)] +
              [(f"compress{z}", _tp_part("eager", None, zero=z, compress="bf16", sgd=True))
               for z in (0, 1)])


@pytest.fixture(scope="module")
def dp_tp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp_tp")
    spawn(_dp_tp_worker, str(out), nprocs=4)
    return out


@pytest.mark.slow  # 4 processes on the test machine's cores
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_replicas_of_two_tensor_parallel_ranks_train_like_one_process(dp_tp_runs: Path,
                                                                          zero: int) -> None:
    """A 2-D mesh, dp=2 x tp=2 on 4 processes: each tensor-parallel pair trains its half of
    the global batch; the shard pass all-reduces the (local-block) gradients over "dp"
    (ZeRO-0), or shards each rank's blocks of the optimizer state (ZeRO-1), the gradients (2)
    and the parameters too (3) over "dp" — FSDP2 + TP's layout. The losses, parameters and
    AdamW state of one process on the whole batch."""
    for rank in range(4):
        r = result(dp_tp_runs, f"zero{zero}", rank)
        _like_one_process(r, state=True)
        assert r["collectives"] == {"all_reduce": 13}  # the tensor_parallel pass's own
        # a tp block (64, 32) of the output projection; its AdamW moment's rows over "dp"
        state = (32, 32) if zero else (64, 32)
        assert r["local"]["exp_avg:blocks.0.attn.wo.weight"] == state
        assert r["local"]["blocks.0.attn.wo.weight"] == ((32, 32) if zero == 3 else (64, 32))


# ---- tensor-parallel pipeline stages (pp x tp) ---------------------------------------------

def _pp_tp_part(case: str = "glm", schedule: str = "1f1b", sequence: bool = False,
                sgd: bool = False, dp: int = 1, tp_plan: str = "", zero: int = 0):
    """pp=2 x tp=2 on 4 processes: the model cut in 2 stages, each on a tensor-parallel pair
    (`pipeline_trainer(..., tp=2)`), 4 microbatches; against eager PyTorch on the whole
    batch in one process."""
    def part(rank: int, out: Path) -> dict:
        from glmc.parallel.pipeline import pipeline_trainer
        if case in BACKEND_CASES:
            model, batch, loss_fn, opt = BACKEND_CASES[case]()
        else:
            from tests.zoo import ZOO
            model, batch, loss_fn, opt = ZOO[case].make()
        ref_model = copy.deepcopy(model)
        if sgd:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        else:
            ref_opt = type(opt)(ref_model.parameters(), **{
                k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")})
        ref = eager_losses(ref_model, batch, loss_fn, ref_opt, STEPS)
        from glmc.trace.capture import batch_leaves
        rows = batch_leaves(split_batch(batch))[0].shape[0]
        trainer = pipeline_trainer(model, opt, loss_fn, batch, min(rows // dp, 4), schedule,
                                   2 if schedule == "interleaved" else 1, tp=2,
                                   sequence=sequence, timeout_s=120, dp=dp, tp_plan=tp_plan,
                                   zero=zero)
        args, kwargs = split_batch(batch)
        losses = [trainer.step(*args, **kwargs) for _ in range(STEPS)]
        stages = {s: trainer.pipeline.stages[s].module for s in trainer.local}
        local = {n: tuple(p.shape) for m in stages.values() for n, p in m.named_parameters()}
        for s_, m in stages.items():  # the optimizer state this rank keeps (numel)
            names = {id(p): n for n, p in m.named_parameters()}
            local.update({f"{k}:{names[id(p)]}": v.numel() for p, st in
                          trainer.pipeline.optimizers[s_].state.items()
                          for k, v in st.items() if v.dim()})
        with trainer.full_parameters():
            params = {n: p.detach().clone() for m in stages.values()
                      for n, p in m.named_parameters()}
        refs = dict(ref_model.named_parameters(remove_duplicate=False))  # a tied head too
        return {"losses": [float(v) for v in losses] if trainer.last else None, "ref": ref,
                "params": params, "local": local, "tp_rank": trainer.tp_rank,
                "lr": opt.param_groups[0]["lr"],
                "ref_params": {n: refs[n].detach() for n in params},
                "collectives": {r.stage: r.stats.collectives for r in trainer.pipeline.passes
                                if r.name == "tensor_parallel"},
                "whole_ops": {r.stage: r.stats.whole_ops for r in trainer.pipeline.passes
                              if r.name == "tensor_parallel"}}
    return part


def _pp_tp_checkpoint_part(rank: int, out: Path) -> dict:
    """pp=2 x tp=2: 2 steps, a DCP checkpoint of the trainer's `sharded_state_dict`, a third
    step; then a trainer over a perturbed copy of the model loads the checkpoint and takes
    the third step again."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from glmc.parallel.pipeline import pipeline_trainer

    def trainer(perturb: float) -> Any:
        model, batch, loss_fn, opt = BACKEND_CASES["glm"]()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb)
        return pipeline_trainer(model, opt, loss_fn, batch, 4, "1f1b", tp=2,
                                timeout_s=120), batch

    def params(tr: Any) -> dict:
        with tr.full_parameters():
            return {n: p.detach().clone() for s in tr.local
                    for n, p in tr.pipeline.stages[s].module.named_parameters()}

    path = out / "pp_tp_ckpt"
    first, batch = trainer(0.0)
    for _ in range(2):
        first.step(*batch)
    state = first.sharded_state_dict()
    layout = state.pop("layout")
    dcp.save(state, checkpoint_id=str(path))
    loss = first.step(*batch)
    dist.barrier()
    second, _ = trainer(0.01)
    state = second.sharded_state_dict()
    kinds = sorted({type(v).__name__ for v in state["model"].values()})
    assert state.pop("layout") == layout
    dcp.load(state, checkpoint_id=str(path))
    second.load_sharded(state)
    again = second.step(*batch)
    return {"loss": None if loss is None else float(loss),
            "again": None if again is None else float(again),
            "params": params(first), "params_again": params(second), "kinds": kinds,
            "layout": layout}


def _stage_agree_part(rank: int, out: Path) -> dict:
    """pp=2 x tp=2's `StageTensorParallel.agree`: each value a rank offers."""
    from glmc.analysis.comm import LINKS
    from glmc.parallel.pipeline import _stage_tp
    stage_tp = _stage_tp(2, 1, 2, "", False, "time", LINKS["loopback"])
    return {"agreed": stage_tp.agree({f"unit of rank {rank}"})}


def _pp_tp_worker(rank: int, port: int, out: str, slow: bool, only: str = "") -> None:
    parts = [("glm", _pp_tp_part()), ("agree", _stage_agree_part)] + ([
        ("checkpoint", _pp_tp_checkpoint_part),
        ("gpipe", _pp_tp_part(schedule="gpipe")),
        ("sequence", _pp_tp_part(sequence=True)),
        ("hf_glm", _pp_tp_part("hf_glm")),
        ("llama", _pp_tp_part("llama", sgd=True)),
        ("qwen2_tied", _pp_tp_part("qwen2_tied", sgd=True)),
        ("qwen2_tied_adamw", _pp_tp_part("qwen2_tied")),
        ("pinned", _pp_tp_part(tp_plan="head.weight:replicate")),
        ("hf_glm_interleaved", _pp_tp_part("hf_glm", schedule="interleaved"))] if slow else [])
    run_parts(rank, port, 4, out, [p for p in parts if p[0] == only or not only])


@pytest.fixture(scope="module")
def pp_tp_runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
               ) -> Path:
    out = tmp_path_factory.mktemp("pp_tp")
    slow = slow_readers(request, "pp_tp_runs")
    spawn(_pp_tp_worker, str(out), slow, nprocs=4)
    return out


def test_tensor_parallel_pipeline_stages_train_like_one_process(pp_tp_runs: Path) -> None:
    """3-D parallelism's pp x tp: the GLM example in 2 stages under 1F1B, each stage on 2
    tensor-parallel ranks (the pass on each stage's joint graph: its attention heads, MLP
    and vocabulary sharded, whole values sent between peers of the same tp index). The
    losses of one process on the whole batch, every parameter after 3 AdamW steps (each
    rank's stage, gathered), each rank holding half of the sharded weights."""
    _pp_tp_like_one_process(pp_tp_runs, "glm")
    for rank in range(4):
        r = result(pp_tp_runs, "glm", rank)
        # stage 0: embedding (vocab-parallel), one block; stage 1: one block, norm, head
        assert r["collectives"] == {0: {"all_reduce": 5}, 1: {"all_reduce": 8}}
        assert r["whole_ops"] == {0: {}, 1: {}}
        block = "blocks.0" if rank < 2 else "blocks.1"
        assert r["local"][f"{block}.attn.wo.weight"] == (64, 32)
        assert r["local"][f"{block}.mlp.gate_up.weight"] == (172, 64)
        assert r["local"]["embed.weight" if rank < 2 else "head.weight"] == (128, 64)


def test_every_rank_takes_rank_0s_choice_for_each_stage(pp_tp_runs: Path) -> None:
    """`choose=time` in pipeline stages: every rank captures every stage, and each stage's
    choice is rank 0's on all of them (`PassContext.agree`), so a stage's tp ranks and its
    replicas shard it alike whatever each one's own calibration says."""
    for rank in range(4):
        assert result(pp_tp_runs, "agree", rank)["agreed"] == {"unit of rank 0"}


@pytest.mark.slow  # 4 processes; the default run keeps the default test time in bounds
def test_a_checkpoint_of_tensor_parallel_stages_resumes_the_run(pp_tp_runs: Path) -> None:
    """A DCP checkpoint of pp=2 x tp=2 holds each rank's blocks as DTensors (Shard over
    "tp"; the fused gate/up weight, stored in interleaved parts, whole) and loads into a
    trainer whose parameters differ: its next step's loss and parameters are the run's."""
    for rank in range(4):
        r = result(pp_tp_runs, "checkpoint", rank)
        assert r["layout"] == "pipeline 2 stages x 1 replicas x tp 2"
        assert "DTensor" in r["kinds"] and "Tensor" in r["kinds"]
        assert r["again"] == r["loss"]  # None on the first stage's ranks
        for name, value in r["params"].items():
            torch.testing.assert_close(r["params_again"][name], value, rtol=0, atol=0,
                                       msg=name)
    assert sum(result(pp_tp_runs, "checkpoint", k)["loss"] is not None for k in range(4)) == 2


def _pp_tp_like_one_process(runs: Path, part: str, noise: str = "", world: int = 4) -> None:
    for rank in range(world):
        r = result(runs, part, rank)
        if r["losses"] is not None:  # the last stage's ranks
            torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
        assert r["params"], "each rank trains its stage's parameters"
        assert all(not ops for ops in r["whole_ops"].values()), r["whole_ops"]  # no gathers
        for name, ref in r["ref_params"].items():
            if noise and name.endswith(noise):  # a rounding-noise gradient under Adam
                continue
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
    # the last stage's ranks: its tp pair in every replica
    assert sum(result(runs, part, rank)["losses"] is not None for rank in range(world)) == \
        world // 2


@pytest.mark.slow  # 4 processes, more models and plans
@pytest.mark.parametrize("part", ["gpipe", "sequence", "hf_glm", "llama", "qwen2_tied",
                                  "qwen2_tied_adamw", "pinned", "hf_glm_interleaved"])
def test_tensor_parallel_stages_of_more_models_and_schedules(pp_tp_runs: Path,
                                                             part: str) -> None:
    """pp=2 x tp=2 with GPipe, with sequence parallelism inside the stages, on transformers'
    GLM, Llama and Qwen2 with a tied embedding (one table read by the first and the last
    stage, vocab-parallel in both, its gradient summed over the two stages' ranks of the
    same tp index; with SGD, and with AdamW: each stage's optimizer its own moments of the
    table's block), with a pin naming a parameter of the last stage only (the LM head
    kept whole), and transformers' GLM interleaved (4 stages on 2 pipeline ranks): the
    losses and parameters of one process."""
    if part == "qwen2_tied_adamw":  # the tied table to rtol 1e-4; elsewhere AdamW turns a
        # rounding-noise gradient into a step of up to lr either way (2 of 4,096 elements of
        # a q_proj 4.4e-6 apart in a run here): every element within 3 steps of lr
        for rank in range(4):
            r = result(pp_tp_runs, part, rank)
            if r["losses"] is not None:
                torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-5, atol=0)
            for name, ref in r["ref_params"].items():
                if "embed_tokens" in name or "lm_head" in name:
                    torch.testing.assert_close(r["params"][name], ref, rtol=1e-4, atol=1e-6)
                assert (r["params"][name] - ref).abs().max() <= STEPS * r["lr"], name
        return
    _pp_tp_like_one_process(pp_tp_runs, part, noise="k_proj.bias")
    if part == "pinned":
        for rank in (2, 3):
            assert result(pp_tp_runs, part, rank)["local"]["head.weight"] == (256, 64)


def _dp_pp_tp_worker(rank: int, port: int, out: str) -> None:
    run_parts(rank, port, 8, out, [("dp_pp_tp", _pp_tp_part(dp=2)),
                                   ("dp_pp_tp_zero1", _pp_tp_part(dp=2, zero=1))])


@pytest.mark.slow  # 8 processes
def test_replicas_of_tensor_parallel_pipelines_train_like_one_process(
        tmp_path: Path) -> None:
    """The 3-D mesh dp=2 x pp=2 x tp=2 on 8 processes (global rank = (replica x 2 + stage)
    x 2 + tp index): each replica's 2 rows of the batch through its pipeline of
    tensor-parallel stages, each stage's gradient blocks averaged over the replicas of the
    same stage and tp index; and with ZeRO-1 (each stage's update on its blocks sharded over
    "dp": the blocks' AdamW state in rows per replica). The losses and parameters of one
    process on the whole batch."""
    spawn(_dp_pp_tp_worker, str(tmp_path), nprocs=8)
    for part in ("dp_pp_tp", "dp_pp_tp_zero1"):  # ZeRO-1: AdamW state rows over "dp"
        _pp_tp_like_one_process(tmp_path, part, world=8)
        for rank in range(8):
            r = result(tmp_path, part, rank)
            assert r["local"]["embed.weight" if rank % 4 < 2 else "head.weight"] == (128, 64)
            if rank % 4 < 2:  # a (64, 32) block of stage 0's output projection: its AdamW
                moment = r["local"]["exp_avg:blocks.0.attn.wo.weight"]  # moment's rows
                assert moment == (64 * 32 // 2 if part.endswith("zero1") else 64 * 32)


def test_a_tensor_parallel_stage_that_sends_a_view_is_captured() -> None:
    """A stage whose sent value is a view of one it computed (a reshape of the MLP's output;
    transformers' GLM cut between its layers does this): AOTAutograd's joint export takes no
    output that aliases another tensor, so the stage copies it and is captured, its MLP
    column/row parallel (on a fake process group of 2; no processes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from glmc.parallel.stage_tp import StageTensorParallel
    from glmc.trace.stages import capture_stage

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x + self.down(torch.nn.functional.gelu(self.up(x)))
            return h.view(-1, 16)  # a view of a value the stage made

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
        block = Block()
        opt = torch.optim.AdamW(block.parameters())
        tp = StageTensorParallel(2, 0, mesh)
        stage = capture_stage(0, block, opt, [(0, torch.randn(2, 8, 16))], send=["h"], tp=tp)
        assert tp.plans[0].tiles == {"up.weight": Tile("column", 0), "up.bias":
                                     Tile("column", 0), "down.weight": Tile("row", 1)}
        # down's output (the batch input x needs no gradient)
        assert tp.stats[0].collectives == {"all_reduce": 1}
        assert [s.target for s in stage.forward.outputs][:1] == ["h"]
    finally:
        dist.destroy_process_group()
