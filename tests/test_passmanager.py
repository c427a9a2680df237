from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import glmc
from glmc.compiler.passmanager import Pass, PassContext, PassManager, PassResult, split_pipeline
from glmc.errors import PassError, PipelineError
from glmc.passes import parse_pipeline
from glmc.passes.cleanup import CleanupPass
from glmc.trace.capture import capture
from tests.models import CASES


def test_split_pipeline() -> None:
    assert split_pipeline("cleanup,fusion,recompute{budget=0.5}") == [
        ("cleanup", {}), ("fusion", {}), ("recompute", {"budget": "0.5"})]
    assert split_pipeline(" a{x=1, y=true} , b ") == [("a", {"x": "1", "y": "true"}), ("b", {})]


@pytest.mark.parametrize("bad", ["cleanup{", "clean up", "cleanup{cse}", "cleanup,,x"])
def test_split_pipeline_rejects(bad: str) -> None:
    with pytest.raises(PipelineError):
        split_pipeline(bad)


def test_parse_typed_options() -> None:
    (p,) = parse_pipeline("cleanup{cse=false}")
    assert p.cse is False and p.spelling() == "cleanup{cse=False}"
    with pytest.raises(PipelineError, match="unknown option"):
        parse_pipeline("cleanup{budget=1}")
    with pytest.raises(PipelineError, match="not a valid bool"):
        parse_pipeline("cleanup{cse=maybe}")
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        parse_pipeline("nope")


@dataclass(frozen=True)
class BreakSignature(Pass):
    name = "break_signature"

    def run(self, graph, ctx) -> PassResult:
        graph.outputs.pop()
        return PassResult(True)


@dataclass(frozen=True)
class AddNode(Pass):
    name = "add_node"

    def run(self, graph, ctx) -> PassResult:
        out = graph.output_node()
        loss = out.args[0][0]
        with graph.graph.inserting_before(out):
            new = graph.graph.call_function(torch.ops.aten.mul.Tensor, (loss, 1.0))
        new.meta["glmc"] = graph.info(loss)
        out.args = ((new, *out.args[0][1:]),)
        return PassResult(True)


def _graph():
    model, x, loss_fn, opt = CASES["mlp"].make()
    return capture(model, x, loss_fn, opt)


def test_verification_catches_changed_signature() -> None:
    with pytest.raises(PassError, match="^break_signature: left an invalid graph"):
        PassManager([BreakSignature()]).run(_graph(), PassContext())


def test_provenance_timing_and_disable() -> None:
    graph = _graph()
    manager = PassManager([AddNode(), CleanupPass()],
                          disabled=frozenset({"cleanup"}))
    manager.run(graph, PassContext())
    added, skipped = manager.history
    assert added.changed and added.nodes_after == added.nodes_before + 1 and added.seconds >= 0
    assert skipped.skipped and not skipped.changed
    created = [n for n in graph.compute_nodes() if graph.info(n).created_by == "add_node"]
    assert len(created) == 1


def test_ir_metadata_is_typed() -> None:
    graph = _graph()
    phases = {graph.info(n).phase for n in graph.compute_nodes()}
    assert phases == {glmc.Phase.FORWARD, glmc.Phase.BACKWARD, glmc.Phase.OPTIMIZER}
    roles = [graph.info(n).role for n in graph.placeholders()]
    assert roles.count(glmc.Role.PARAMETER) == 6 and roles.count(glmc.Role.INPUT) == 2
    fwd = [graph.info(n) for n in graph.compute_nodes() if graph.info(n).phase is glmc.Phase.FORWARD]
    assert any(i.source and "examples/mlp.py" in i.source for i in fwd)
    assert any(i.module == "fc1" for i in fwd)
    bwd = [graph.info(n) for n in graph.compute_nodes() if graph.info(n).phase is glmc.Phase.BACKWARD]
    assert any(i.source and "examples/mlp.py" in i.source for i in bwd)
    nx_graph = graph.to_networkx()
    import networkx as nx
    assert nx.is_directed_acyclic_graph(nx_graph) and nx_graph.number_of_nodes() == len(graph.graph.nodes)
