"""A step saved to disk and loaded in a fresh process trains like the captured one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import glmc
from glmc.errors import InputError
from tests.models import CASES, glmc_losses, twin

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
import glmc
from tests.models import CASES, glmc_losses, twin
(model, x, loss_fn, opt), _ = twin(CASES[{case!r}].make)
trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend={backend!r},
                        passes={passes!r}, graph_path={path!r}, measure=False, predict=False)
print(json.dumps({{"losses": glmc_losses(trainer, x, 3),
                   "pipeline": [p.spelling() for p in trainer._pipeline],
                   "created": sorted({{n.meta["glmc"].created_by
                                       for n in trainer.graph.compute_nodes()}})}}))
"""


def _train_in_fresh_process(case: str, path: Path, backend: str, passes: str) -> dict:
    code = _CHILD.format(root=str(ROOT), case=case, backend=backend, passes=passes,
                         path=str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case,backend", [pytest.param("glm", "eager", marks=pytest.mark.slow),
                                          pytest.param("mlp", "inductor",
                                                       marks=pytest.mark.slow),
                                          ("mlp", "eager")])  # GLM: 24 s, Inductor: 35 s
def test_saved_step_reloads_through_rederiving_passes(tmp_path, case, backend):
    """Capture, save, load in a fresh process, run fusion and precision (both re-derive the
    backward from the IR alone) and compile: the same losses as the same pipeline on the
    captured step in this process."""
    passes = "fusion,precision{policy=bf16},cleanup"
    (model, x, loss_fn, opt), (model2, x2, loss_fn2, opt2) = twin(CASES[case].make)
    glmc.save_graph(glmc.capture(model, x, loss_fn, opt), tmp_path / "step")
    doc = json.loads((tmp_path / "step" / "graph.json").read_text())
    assert doc["meta"]["optimizer"]["fields"]["kind"] == type(opt).__name__
    trainer = glmc.optimize(model2, x2, loss_fn=loss_fn2, optimizer=opt2, backend=backend,
                            passes=passes, measure=False, predict=False)
    here = glmc_losses(trainer, x2, 3)
    there = _train_in_fresh_process(case, tmp_path / "step", backend, passes)
    assert there["pipeline"] == ["fusion", "precision", "cleanup"]
    assert "precision" in there["created"]  # the passes really ran on the loaded step
    torch.testing.assert_close(torch.tensor(there["losses"]), torch.tensor(here),
                               rtol=1e-6, atol=0)


def test_loaded_graph_roundtrips_structure(tmp_path):
    (model, x, loss_fn, opt), _ = twin(CASES["glm"].make)
    graph = glmc.capture(model, x, loss_fn, opt)
    loaded = glmc.load_graph(glmc.save_graph(graph, tmp_path / "g"))
    assert loaded.signature() == graph.signature()
    assert loaded.code() == graph.code()
    a = [n.meta["glmc"] for n in graph.graph.nodes if "glmc" in n.meta]
    b = [n.meta["glmc"] for n in loaded.graph.nodes if "glmc" in n.meta]
    assert a == b
    assert loaded.meta["optimizer"] == graph.meta["optimizer"]


def test_saved_step_of_another_model_is_rejected(tmp_path):
    (model, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    glmc.save_graph(glmc.capture(model, x, loss_fn, opt), tmp_path / "mlp")
    (other, y, loss_fn2, opt2), _ = twin(CASES["cnn"].make)
    with pytest.raises(InputError, match="different model|saved step"):
        glmc.optimize(other, y, loss_fn=loss_fn2, optimizer=opt2, backend="eager",
                      graph_path=str(tmp_path / "mlp"), measure=False, predict=False)


def test_load_rejects_a_directory_without_a_graph(tmp_path):
    with pytest.raises(InputError, match="graph.json"):
        glmc.load_graph(tmp_path)


def test_spmd_program_with_collectives_and_placements_roundtrips(tmp_path):
    """A data-parallel step (gradients all-reduced by functional collectives over a mesh dim,
    placements on the specs) saves and loads with its communication intact and unbound."""
    from glmc.ir.graph import MeshSpec
    from glmc.ir.program import SpmdProgram, all_reduce_gradients, comm_nodes

    mesh = MeshSpec((2,), ("dp",), "cpu")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = glmc.capture(model, (torch.randn(5, 4), torch.randn(5, 3)),
                         torch.nn.functional.mse_loss, opt)
    all_reduce_gradients(graph, mesh, "dp")
    loaded = glmc.load_graph(glmc.save_graph(graph, tmp_path / "spmd"))
    SpmdProgram(loaded, mesh).verify()
    assert [n.name for n in comm_nodes(loaded)] == [n.name for n in comm_nodes(graph)]
    assert [n.meta["glmc"] for n in comm_nodes(loaded)] == \
        [n.meta["glmc"] for n in comm_nodes(graph)]
    assert loaded.code() == graph.code()
