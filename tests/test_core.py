"""The core's contracts: pass declarations, pipeline validation, spellings, option precedence,
layering (no import cycles, no upward imports), no hidden global effects, function size."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import networkx as nx
import pytest
import torch

import glmc
from glmc.compiler.passmanager import Effect, Need, check_needs
from glmc.errors import ConfigError, PipelineError
from glmc.passes import parse_pipeline, registry
from tests.models import CASES, glmc_losses, twin

ROOT = Path(__file__).resolve().parent.parent

#: non-default options for every registered pass, to check that spellings parse back
_OPTIONS = {
    "cleanup": {"cse": False},
    "fusion": {"patterns": "norm+mlp", "attention": False},
    "precision": {"policy": "fp16", "ops": {"_softmax": "fp32", "mm": "low"},
                  "modules": {"head": "fp32"}, "init_scale": 1024.0, "growth_interval": 100,
                  "head": "low", "recast": False},
    "recompute": {"budget": "2GiB", "solver": "greedy", "time_limit": 2.5, "pareto": False},
    "shard": {"stage": 3, "bucket_mb": 8.0, "overlap": False, "accumulate": True},
    "partition": {"stages": 4, "microbatches": 8, "schedule": "interleaved", "virtual": 2,
                  "profiles": "h100;h100;kunpeng920;kunpeng920"},
    "compress": {"method": "topk", "ratio": 0.05, "rank": 2, "error_feedback": False,
                 "min_numel": 64},
    "accumulate": {},
    "clip": {"max_norm": 0.5},
    "tensor_parallel": {"size": 4, "plan": "blocks.*.mlp.down.weight:replicate"},
}


@pytest.mark.parametrize("name", sorted(registry()))
def test_every_spelling_parses_back_to_the_same_pass(name: str) -> None:
    cls = registry()[name]
    for p in (cls(), cls(**_OPTIONS[name])):
        (again,) = parse_pipeline(p.spelling())
        assert again.spelling() == p.spelling()
        assert {k: str(v) for k, v in again.options().items()} == \
            {k: str(v) for k, v in p.options().items()} or again.options() == p.options()


def test_every_registered_pass_is_covered_by_the_spelling_test() -> None:
    assert set(_OPTIONS) == set(registry())


def test_contracts_come_from_declarations() -> None:
    reg = registry()
    assert reg["fusion"]().effects() == {Effect.REDERIVES}
    assert Effect.EDITS_BACKWARD in reg["recompute"]().effects()
    assert Need.VALUE_STATS in reg["precision"](policy="auto").needs()
    assert Need.VALUE_STATS not in reg["precision"](policy="bf16").needs()
    assert Effect.ADDS_STATE in reg["precision"](policy="fp16").effects()
    assert reg["precision"](policy="bf16").changes_signature is False
    assert reg["cleanup"]().effects() == frozenset()
    assert reg["shard"]().effects() == {Effect.INSERTS_COMM}
    assert reg["shard"](accumulate=True).changes_signature  # running sums become inputs
    assert Need.STEP in reg["shard"]().needs()


@pytest.mark.parametrize("bad", ["cleanup,recompute,fusion", "precision,fusion",
                                 "recompute{budget=0.5},precision{policy=bf16}"])
def test_a_rederiving_pass_may_not_undo_an_earlier_backward_edit(bad: str) -> None:
    with pytest.raises(PipelineError, match="re-derives the backward and would undo"):
        parse_pipeline(bad)


def test_needs_are_checked_before_any_pass_runs() -> None:
    passes = parse_pipeline("fusion,precision{policy=auto},cleanup")
    with pytest.raises(PipelineError) as e:
        check_needs(passes, frozenset())
    assert "fusion" in str(e.value) and "recorded value ranges" in str(e.value)
    check_needs(passes, frozenset({Need.STEP, Need.VALUE_STATS}))


def test_memory_budget_next_to_a_pipeline_naming_recompute_is_an_error() -> None:
    with pytest.raises(PipelineError, match="give it in one place"):
        parse_pipeline("cleanup,recompute{budget=0.3}", memory_budget=0.9)
    with pytest.raises(PipelineError, match="give it in one place"):
        parse_pipeline("precision{policy=fp16},cleanup", precision="bf16")
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    with pytest.raises(PipelineError, match="recompute"):
        glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                      passes="cleanup,recompute{budget=0.3}", memory_budget=0.9)


def test_option_and_pipeline_spellings_give_the_same_pipeline() -> None:
    """`fusion=True, precision=...` is exactly the pipeline `fusion,precision{...},cleanup`:
    no pass reads another pass's option."""
    by_option = parse_pipeline(None, precision="bf16", fusion=True)
    by_string = parse_pipeline("fusion,precision{policy=bf16},cleanup")
    assert [p.spelling() for p in by_option] == [p.spelling() for p in by_string]


def test_default_pipeline_is_fusion_and_cleanup() -> None:
    assert [p.spelling() for p in parse_pipeline(None)] == ["fusion", "cleanup"]
    assert [p.spelling() for p in parse_pipeline(None, fusion=False)] == ["cleanup"]
    low = [p.spelling() for p in parse_pipeline(None, precision="bf16", device="cpu")]
    assert low == ["fusion{attention=False}", "precision", "cleanup"]


def test_default_pipeline_trains_with_parity_and_reports_it() -> None:
    (m, x, loss_fn, opt), (m2, x2, loss_fn2, opt2) = twin(CASES["glm"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    assert [r.name for r in trainer.report.compiles[0].history] == ["fusion", "cleanup"]
    from tests.models import eager_losses
    torch.testing.assert_close(torch.tensor(glmc_losses(trainer, x, 3)),
                               torch.tensor(eager_losses(m2, x2, loss_fn2, opt2, 3)),
                               rtol=1e-5, atol=0)


def test_dropin_recompute_plans_the_joint_graph_on_eager_and_says_why_not_on_inductor() -> None:
    """Issue 36 item 4: drop-in `passes="cleanup,recompute{budget=...}"` was a typed error. On
    the eager target the recompute pass plans AOTAutograd's joint graph before the default
    partition, as on a pipeline stage (`PassManager.run_stage`): parity with eager PyTorch and
    fewer bytes saved for the backward. On Inductor its min-cut partitioner re-plans what the
    forward saves (the same bytes with and without glmc's plan): a typed error says so."""
    def run(passes: str, backend: str = "eager") -> tuple[list[float], int]:
        torch._dynamo.reset()
        model, x, _, opt = CASES["glm"].make()
        compiled = torch.compile(model, backend="glmc",
                                 options={"backend": backend, "passes": passes})
        losses, saved = [], {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        for i in range(3):
            torch.manual_seed(i)
            opt.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = compiled(*x)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, sum(saved.values())

    from tests.models import eager_losses
    model, x, loss_fn, opt = CASES["glm"].make()
    want = eager_losses(model, x, loss_fn, opt, 3)
    plain, plain_saved = run("cleanup")
    planned, planned_saved = run("cleanup,recompute{budget=min}")
    assert planned == pytest.approx(want, rel=1e-6) and plain == pytest.approx(want, rel=1e-6)
    assert planned_saved < 0.75 * plain_saved  # GLM example: 2.16 -> 1.15 MB (weights incl.)
    torch._dynamo.reset()
    model, x, _, _ = CASES["glm"].make()
    compiled = torch.compile(model, backend="glmc", options={
        "backend": "inductor", "passes": "cleanup,recompute{budget=0.5}"})
    with pytest.raises(Exception) as e:
        compiled(*x).backward()
    assert "glmc.optimize" in str(e.value) and "min-cut partitioner" in str(e.value)
    assert "KeyError" not in str(e.value)


def test_dropin_rejects_unknown_options_and_whole_step_passes() -> None:
    torch._dynamo.reset()
    model, x, loss_fn, _ = CASES["mlp"].make()
    with pytest.raises(Exception) as e:
        torch.compile(model, backend="glmc", options={"precision": "bf16"})(x[0])
    assert isinstance(e.value, ConfigError) or isinstance(e.value.__cause__, ConfigError) \
        or "unknown option" in str(e.value)
    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        compiled = torch.compile(model, backend="glmc",
                                 options={"backend": "eager", "passes": "fusion,cleanup"})
        loss_fn(compiled(x[0]), x[1]).backward()
    assert "whole training step" in str(e.value)


# ---- layering --------------------------------------------------------------------------------

#: the layers, lowest first: a module's layer is its subpackage's (passes/ and backends/ are
#: installed as glmc.passes and glmc.backends); a module imports only from its own layer or
#: below. `glmc` itself (the public names) and `glmc.__main__` sit on top.
LAYERS = (("glmc.errors", "glmc.version"), ("glmc.ir",), ("glmc.trace",), ("glmc.analysis",),
          ("glmc.compiler",), ("glmc.planning",), ("glmc.passes", "glmc.backends"),
          ("glmc.export", "glmc.report"), ("glmc.parallel",), ("glmc.runtime",),
          ("glmc.frontend",), ("glmc", "glmc.__main__"))


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or
                                                                 len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, f"{module}: in no layer; add its subpackage to LAYERS"
    return best[0]


def _modules() -> dict[str, Path]:
    """Every module of the installed package: glmc/ (subpackages included), passes/, backends/."""
    out = {}
    for folder, package in (("glmc", "glmc"), ("passes", "glmc.passes"),
                            ("backends", "glmc.backends")):
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every glmc module `path` imports, at module level and inside functions, under
    `if TYPE_CHECKING:` too (a typing-only import is still a dependency a reader follows)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in known}
    return found


def _import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for dep in _imports(path, set(mods)):
            if dep != name:
                g.add_edge(name, dep)
    return g


def test_every_module_is_in_a_layer_subpackage() -> None:
    """The tree is the architecture: no loose modules beside the layer subpackages."""
    loose = [m for m in _modules() if m.count(".") == 1 and m.split(".")[1] not in
             ("errors", "version", "__main__", "passes", "backends")
             and not (ROOT / "glmc" / m.split(".")[1]).is_dir()]
    assert not loose, loose
    for m in _modules():
        _layer(m)


def test_import_graph_has_no_cycles_and_no_upward_imports() -> None:
    g = _import_graph()
    cycles = [c for c in nx.simple_cycles(g)]
    assert not cycles, f"import cycles: {cycles[:5]}"
    upward = [(a, b) for a, b in g.edges if _layer(b) > _layer(a)]
    assert not upward, f"upward imports: {upward}"


def test_passes_and_backends_stay_in_their_lane() -> None:
    """No pass imports another pass, the runtime, a parallel strategy or a backend; no backend
    imports the runtime, a pass or another backend's package internals through the registry."""
    g = _import_graph()
    is_pass = lambda m: m.startswith("glmc.passes.")  # noqa: E731
    is_backend = lambda m: m.startswith("glmc.backends")  # noqa: E731
    above = ("glmc.runtime", "glmc.parallel", "glmc.frontend", "glmc.export", "glmc.report")
    bad = [(a, b) for a, b in g.edges if is_pass(a) and
           (is_pass(b) or b == "glmc.passes" or is_backend(b) or b.startswith(above))]
    assert not bad, f"passes importing passes, backends or the runtime: {bad}"
    bad = [(a, b) for a, b in g.edges if is_backend(a) and
           (b.startswith("glmc.passes") or b.startswith(above))]
    assert not bad, f"backends importing passes or the runtime: {bad}"
    core = [(a, b) for a, b in g.edges if _layer(a) < _layer("glmc.backends") and
            is_backend(b)]
    assert not core, f"core importing backends: {core}"


def test_architecture_names_every_module() -> None:
    """docs/architecture.md covers the whole package: every module's file name and folder."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for name, path in _modules().items():
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if f"`{folder}" not in page and f"{folder}`" not in page and folder not in page:
            missing.append(f"{name}: folder {folder}")
        if path.stem != "__init__" and f"{path.name}" not in page:
            missing.append(f"{name}: {path.name}")
    assert not missing, missing


def test_no_function_over_80_lines() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long


def test_only_the_inductor_backend_and_the_dropin_touch_inductor_internals() -> None:
    allowed = ("glmc.backends.inductor", "glmc.runtime.dropin")
    for name, path in _modules().items():
        if not name.startswith(allowed):
            assert "torch._inductor" not in path.read_text(), name


# ---- no hidden global effects ----------------------------------------------------------------

def test_running_glmc_leaves_global_state_alone(tmp_path, monkeypatch) -> None:
    import os

    import matplotlib
    before = matplotlib.get_backend()
    calls = []
    monkeypatch.setattr(os, "dup2", lambda *a: calls.append(("dup2", a)))
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append(("dynamo.reset",)))
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    attrs = set(vars(opt))
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    glmc_losses(trainer, x, 2)
    trainer.write_report(str(tmp_path / "r"))
    assert matplotlib.get_backend() == before
    assert calls == []
    assert set(vars(opt)) == attrs  # no private attributes set on the user's optimizer


def test_capture_failure_does_not_reset_dynamo(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append(1))

    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.sum().item() > 0:  # data-dependent control flow: a graph break
                return self.lin(x).sum()
            return self.lin(x).mean()

    with pytest.raises(glmc.CaptureError):
        glmc.capture(Breaks(), (torch.ones(2, 4),))
    assert calls == []


def test_lr_scheduler_sees_compiled_steps_without_warnings() -> None:
    import warnings
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            trainer.step(*x)
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.base_lrs[0] * 0.25)


def test_passes_get_only_target_facts_from_the_context() -> None:
    from glmc.compiler.passmanager import PassContext
    fields = {f.name for f in dataclasses.fields(PassContext)}
    assert fields == {"traits", "profile", "mesh", "agree"}


def test_runtime_reads_no_pass_stats_or_options() -> None:
    """Measurement feedback goes through `Pass.after_measure`: the runtime names no pass and
    touches no stats or option fields."""
    text = (ROOT / "glmc" / "runtime" / "trainer.py").read_text()
    for word in ("budget_bytes", "margin", '"recompute"', '"precision"', '"fusion"',
                 "dataclasses.replace"):
        assert word not in text, word


def test_recompute_asks_for_a_rerun_when_measured_over_budget() -> None:
    from glmc.passes.recompute import RecomputePass, RecomputeStats
    stats = RecomputeStats(budget="0.5", budget_bytes=1000, target_bytes=1000, baseline_peak=2000,
                           persistent_bytes=500, planned_peak=990, predicted_peak=990,
                           solver="greedy", solve_seconds=0.0, milp_gap=None,
                           greedy_seconds_extra=None, recomputed=1, kept=1, extra_flops=1.0,
                           extra_seconds=0.0, candidates=2)
    p = RecomputePass(budget="0.5")
    assert p.after_measure(stats, 1005, False).rerun is None  # within 1%
    verdict = p.after_measure(stats, 1100, False)
    assert verdict.rerun == RecomputePass(budget="0.5", margin=100) and "lowered" in verdict.note
    late = p.after_measure(stats, 1100, True)
    assert late.rerun is None and "after one retry" in late.note


def test_a_functional_backend_whose_state_outputs_are_adopted(monkeypatch) -> None:
    """A functional backend that hands over its state outputs (CompiledStep.adopt): the
    runtime points the user's tensors at them instead of copying — same objects, new memory,
    the same training as eager."""
    from glmc.backends.eager import EagerBackend

    from glmc.ir.target import BackendTraits
    from tests.models import assert_state_close, eager_losses

    compile_ = EagerBackend._compile

    def adopting(self, gm, graph):
        fn = compile_(self, gm, graph)
        step = lambda inputs: fn(inputs)  # noqa: E731
        step.adopt = True
        return step

    monkeypatch.setattr(EagerBackend, "traits", lambda self: BackendTraits("eager", inplace=False))
    monkeypatch.setattr(EagerBackend, "_compile", adopting)
    (m, x, loss_fn, opt), (m2, x2, loss_fn2, opt2) = twin(CASES["cnn"].make)
    params = list(m.parameters())
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    assert next(iter(trainer._cache.values())).step.adopt
    # hold the original storages: freed, their addresses could be handed out again (glmc
    # keeps freed host memory for reuse) and an adopted output could land on one of them
    originals = [p.data for p in params]
    before = [t.data_ptr() for t in originals]
    got = glmc_losses(trainer, x, 3)
    assert list(m.parameters()) == params and all(
        p.data_ptr() != b for p, b in zip(params, before))  # adopted, not copied into
    torch.testing.assert_close(torch.tensor(got), torch.tensor(eager_losses(m2, x2, loss_fn2,
                                                                            opt2, 3)),
                               rtol=1e-4, atol=1e-5)
    assert_state_close(m, m2, opt, opt2)  # parameters, BatchNorm buffers, Adam state


def test_a_functional_backend_trains_through_the_runtime_write_back(monkeypatch) -> None:
    """A backend that cannot update state in place gets the functional step (inputs ->
    outputs) and the runtime writes the new state back: the same training as in place."""
    from glmc.backends.eager import EagerBackend

    from glmc.ir.target import BackendTraits
    from tests.models import assert_state_close, eager_losses

    monkeypatch.setattr(EagerBackend, "traits", lambda self: BackendTraits("eager", inplace=False))
    (m, x, loss_fn, opt), (m2, x2, loss_fn2, opt2) = twin(CASES["cnn"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    assert not next(iter(trainer._cache.values())).step.inplace
    got = glmc_losses(trainer, x, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(eager_losses(m2, x2, loss_fn2,
                                                                            opt2, 3)),
                               rtol=1e-4, atol=1e-5)
    assert_state_close(m, m2, opt, opt2)  # parameters, BatchNorm buffers, Adam state


def test_graph_meta_holds_data_only() -> None:
    """Compiled objects (the write-back module, a backend's compiled step) are cached beside
    the graph, keyed on its module; `graph.meta` keeps data a saved step could hold."""
    from glmc.backends import get_backend
    from glmc.backends.base import CompiledStep
    from glmc.compiler.inplace import compile_inplace, compiled_step, inplace_module
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager")
    glmc_losses(trainer, x, 1)
    graph = trainer.graph
    inplace_module(graph)
    compile_inplace(graph, get_backend("eager"))
    assert isinstance(compiled_step(graph), CompiledStep)
    assert compiled_step(graph.copy()) is None  # a copy (a pass may rewrite it) carries none
    for key, value in graph.meta.items():
        assert not isinstance(value, (torch.nn.Module, CompiledStep)) and not callable(value), key
