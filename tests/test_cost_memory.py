"""Cost model (FLOPs, bytes, profiles) and memory model (liveness; predicted vs measured)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import glmc
from glmc.analysis import predict
from glmc.capture import split_batch
from glmc.cost import (BUILTIN, DeviceProfile, _interp, estimate_time, get_profile,
                       host_profile, kind_of, op_cost)
from glmc.errors import ConfigError
from glmc.memory import measure_peak, simulate
from tests.models import CASES

aten = torch.ops.aten
MiB = 1 << 20


def _trace(fn, *args) -> fx.Graph:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return gm.graph


def _node(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "call_function" and
                n.target._schema.name.split("::")[-1] == name)


FLAT = DeviceProfile("flat", "cpu", {"float32": ((1.0, 1e9),)}, 1e9, ((1.0, 1e9),), 0.0, 0.0,
                     "test")


def test_matmul_flops_and_bytes() -> None:
    g = _trace(lambda a, b: torch.mm(a, b), torch.randn(8, 16), torch.randn(16, 4))
    c = op_cost(_node(g, "mm"))
    assert c.kind == "matmul"
    assert c.flops == 2 * 8 * 16 * 4
    assert c.bytes_read == (8 * 16 + 16 * 4) * 4 and c.bytes_written == 8 * 4 * 4


def test_views_cost_nothing_and_pointwise_weights() -> None:
    g = _trace(lambda a: a.t().exp(), torch.randn(8, 16))
    assert kind_of(_node(g, "t")) == "view" and op_cost(_node(g, "t")).bytes == 0
    exp = op_cost(_node(g, "exp"))
    assert exp.kind == "pointwise" and exp.flops == 8 * 128 and exp.bytes == 2 * 128 * 4


def test_unknown_ops_are_counted_not_free() -> None:
    g = _trace(lambda a: torch.linalg.cholesky(a @ a.t() + torch.eye(4)), torch.randn(4, 4))
    est = estimate_time(g, FLAT, fused=False)
    assert "linalg_cholesky_ex" in est.unknown
    node = _node(g, "linalg_cholesky_ex")
    assert est.node_seconds[node.name] > 0


def test_conv_flops_from_torch_formula() -> None:
    g = _trace(lambda x, w: torch.conv2d(x, w), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    c = op_cost(_node(g, "convolution"))
    assert c.kind == "matmul" and c.flops == 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)


def test_roofline_takes_the_slower_of_compute_and_memory() -> None:
    g = _trace(lambda a, b: torch.mm(a, b), torch.randn(64, 64), torch.randn(64, 64))
    est = estimate_time(g, FLAT, fused=False)
    flops, nbytes = 2 * 64 ** 3, 3 * 64 * 64 * 4
    assert est.seconds == pytest.approx(max(flops, nbytes) / 1e9)


def test_curve_interpolates_in_log_size() -> None:
    curve = ((10.0, 1.0), (1000.0, 3.0))
    assert _interp(curve, 1.0) == 1.0 and _interp(curve, 1e6) == 3.0
    assert _interp(curve, 100.0) == pytest.approx(2.0)


def test_builtin_profiles_and_errors() -> None:
    for name in ("h100", "h200", "a100", "kunpeng920"):
        p = get_profile(name)
        assert p.matmul_rate("float32", 1e9) > 0 and p.bandwidth_at(1e6) > 0
    assert "bfloat16" not in BUILTIN["kunpeng920"].matmul  # no BF16 instructions
    assert BUILTIN["h200"].bandwidth_at(1) > BUILTIN["h100"].bandwidth_at(1)
    with pytest.raises(ConfigError, match="unknown device profile"):
        get_profile("tpu")


def test_host_profile_is_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLMC_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr("glmc.cost.calibrate", lambda: calls.append(1) or FLAT)
    assert host_profile() == FLAT and host_profile() == FLAT
    assert len(calls) == 1
    (cached,) = tmp_path.glob("cpu-profile-*.json")
    assert json.loads(cached.read_text())["name"] == "flat"


# ---- memory model --------------------------------------------------------------------------


def test_liveness_frees_after_last_use_and_views_keep_bases_alive() -> None:
    def f(x):
        a = x * 2  # 4 KiB
        v = a.view(-1)  # alias of a
        b = x + 1  # 4 KiB, a still alive through v
        c = v.sum() + b.sum()
        return (c,)
    g = _trace(f, torch.randn(32, 32))
    mem = simulate(g)
    assert mem.persistent_bytes == 4096
    # x, a (kept alive by its view v until v.sum()) and b, plus the 4-byte v.sum() result
    assert mem.peak_bytes == 3 * 4096 + 4
    assert [t[0] for t in mem.largest_at_peak[:2]] == ["mul", "add"]
    # after v.sum() the base `a` is freed: the last timeline point holds x and scalars only
    assert sum(mem.timeline[-1][1].values()) < 2 * 4096


def test_measure_peak_sees_allocations() -> None:
    def f():
        a = torch.empty(MiB // 4)  # 1 MiB
        b = torch.empty(MiB // 2)  # 2 MiB, a still alive
        del a, b
        return torch.zeros(())
    _, m = measure_peak(f)
    assert m.peak_bytes >= 3 * MiB - 64 and m.peak_bytes < 3 * MiB + 4096
    assert "c10" in m.source


@pytest.mark.parametrize("case,backend,tol", [
    ("mlp", "eager", 0.01), ("glm", "eager", 0.01), ("cnn", "eager", 0.01),
    ("cnn", "inductor", 0.15),
])
def test_predicted_peak_matches_measured(case: str, backend: str, tol: float) -> None:
    model, x, loss_fn, opt = CASES[case].make()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend=backend)
    args, kwargs = split_batch(x)
    for _ in range(2):  # the second step runs under the memory profiler
        trainer.step(*args, **kwargs)
    rec = trainer.report.compiles[-1].to_dict()
    assert rec["measured"]["peak_bytes"] > 0
    assert abs(rec["errors"]["peak_memory"]) <= tol, rec["errors"]
    assert rec["predicted"]["memory"]["at_peak"]["parameters"] > 0


def test_early_writeback_lowers_eager_peak() -> None:
    model, x, loss_fn, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False)
    from glmc.backends.base import lower_writeback
    early = simulate(lower_writeback(trainer.graph, early=True).graph)
    late = simulate(lower_writeback(trainer.graph, early=False).graph)
    assert early.peak_bytes <= late.peak_bytes

    def optimizer_phase_peak(m):  # the last 30% of the step is the optimizer update
        tail = m.timeline[int(len(m.timeline) * 0.7):]
        return max(sum(v.values()) for _, v in tail)
    # copied-late, every new parameter and state tensor is alive until the end of the step
    assert optimizer_phase_peak(late) > 1.3 * optimizer_phase_peak(early)


def test_prediction_categories_sum_to_peak() -> None:
    model, x, loss_fn, opt = CASES["glm"].make()
    trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False)
    p = predict(trainer.graph, "eager", FLAT)
    assert sum(p.memory.at_peak.values()) == p.memory.peak_bytes
    assert p.memory.at_peak["activations"] > 0
    assert p.time.seconds > 0 and p.time.kernels > 100
