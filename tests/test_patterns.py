"""Declared graph patterns (glmc.compiler.patterns): what a pattern matches and what it does not."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from glmc.compiler.patterns import Alt, Capture, Op, Pattern, find, is_float
from glmc.ir.graph import op_name

X, EPS = Capture("x"), Capture("eps", is_float)
#: x * rsqrt(x + eps), either order of the product
SCALED = Pattern(Op("mul", (X, Op("rsqrt", (Op("add", (X, EPS)),))), commutative=True,
                    bind="end"))


def _graph(fn, *args) -> fx.Graph:
    return make_fx(fn)(*args).graph


def test_a_pattern_matches_either_order_and_binds_its_captures() -> None:
    x = torch.rand(3) + 1
    for fn in (lambda x: x * torch.rsqrt(x + 1e-5), lambda x: torch.rsqrt(x + 1e-5) * x):
        (m,) = find(SCALED, _graph(fn, x))
        assert m["eps"] == 1e-5 and m["x"].op == "placeholder" and m.root is m["end"]
        assert [op_name(n) for n in m.nodes] == ["add", "rsqrt", "mul"]  # children first


def test_a_capture_binds_one_node_and_literals_must_be_equal() -> None:
    x, y = torch.rand(3) + 1, torch.rand(3) + 1
    assert not list(find(SCALED, _graph(lambda x, y: x * torch.rsqrt(y + 1e-5), x, y)))
    assert not list(find(SCALED, _graph(lambda x: x * torch.rsqrt(x + 1), x)))  # eps not float
    two = Pattern(Op("pow", (X, 2)))
    assert len(list(find(two, _graph(lambda x: x ** 2, x)))) == 1
    assert not list(find(two, _graph(lambda x: x ** 3, x)))


def test_an_intermediate_read_outside_the_match_is_no_match() -> None:
    x = torch.rand(3) + 1

    def shared(x):
        r = torch.rsqrt(x + 1e-5)
        return x * r, r  # r is read again: rewriting the product would keep it alive
    assert not list(find(SCALED, _graph(shared, x)))


def test_alternatives_and_checks() -> None:
    x = torch.rand(3) + 1
    root = Alt((Op("sqrt", (X,)), Op("rsqrt", (X,))))
    pattern = Pattern(Op("mul", (root, Capture("w")), bind="end"),
                      check=lambda b: b["w"].meta["val"].shape == (3,))
    assert len(list(find(pattern, _graph(lambda x, w: torch.rsqrt(x) * w, x, x)))) == 1
    assert len(list(find(pattern, _graph(lambda x, w: torch.sqrt(x) * w, x, x)))) == 1
    assert not list(find(pattern, _graph(lambda x, w: torch.sqrt(x) * w, x, torch.rand(1))))


def test_nodes_an_earlier_match_took_are_not_matched_again() -> None:
    x = torch.rand(3) + 1
    g = _graph(lambda x: x * torch.rsqrt(x + 1e-5), x)
    consumed: set = set()
    assert len(list(find(SCALED, g, consumed))) == 1
    assert not list(find(SCALED, g, consumed))  # the same chain, already taken
