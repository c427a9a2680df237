"""Declared graph patterns: an op tree over named captures, matched at a root node.

Inductor's `register_replacement` is the model (a pattern plus an `extra_check`), without
tracing search functions: a pattern is written as the ATen expression it matches, e.g.
RMSNorm's `w * (x * rsqrt(mean(x ** 2, [-1], True) + eps))`:

    X, W, EPS = Capture("x"), Capture("w"), Capture("eps", is_float)
    RMS = Op("mul", (Op("mul", (X, Op("rsqrt", (Op("add", (Op("mean", (Op("pow", (X, 2)),
             [-1], True)), EPS)),))), commutative=True, bind="norm"), W), commutative=True)

A `Capture` binds whatever sits there (the same name must bind the same node); an `Op` matches
a call of that ATen op (its overload packet's name) with exactly these positional arguments
(`commutative`: either order of two), its `kwargs`, and binds the node under `bind`; `Alt`
tries its options in order; anything else is a literal compared with `==` (a list matches a
list or tuple). A match also requires that every matched node but the root is read only inside
the match: the intermediates die with the rewrite. `Pattern.check` sees the bindings (shapes,
say); `find` yields the matches at every node of a graph, in graph order, lazily, so a rewrite
of one match is seen by the next.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch.fx as fx

from glmc.ir.graph import op_name


@dataclass(frozen=True)
class Capture:
    name: str
    test: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Op:
    name: str | tuple[str, ...]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    commutative: bool = False
    bind: str | None = None

    def names(self) -> tuple[str, ...]:
        return (self.name,) if isinstance(self.name, str) else self.name


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Match:
    binds: dict[str, Any]
    nodes: list[fx.Node]  #: the matched op nodes, children before parents (the root last)

    def __getitem__(self, name: str) -> Any:
        return self.binds[name]

    @property
    def root(self) -> fx.Node:
        return self.nodes[-1]


@dataclass(frozen=True)
class Pattern:
    expr: Op
    check: Callable[[dict[str, Any]], bool] | None = None

    def match(self, node: Any) -> Match | None:
        binds: dict[str, Any] = {}
        nodes: list[fx.Node] = []
        if not _match(self.expr, node, binds, nodes):
            return None
        inside = set(nodes)
        if any(u not in inside for n in nodes if n is not node for u in n.users):
            return None  # an intermediate is read outside the match
        if self.check is not None and not self.check(binds):
            return None
        return Match(binds, nodes)


def find(pattern: Pattern, graph: fx.Graph, consumed: set | None = None) -> Iterator[Match]:
    """Every match of `pattern` rooted at a node of `graph` (graph order, checked lazily).
    `consumed`: nodes earlier matches took (a rewrite leaves them dead until DCE); a match
    that shares one is skipped, and each match's nodes are added."""
    roots = set(pattern.expr.names())
    consumed = set() if consumed is None else consumed
    for node in [n for n in graph.nodes if n.op == "call_function" and op_name(n) in roots]:
        m = pattern.match(node)
        if m is not None and not consumed.intersection(m.nodes):
            consumed.update(m.nodes)
            yield m


def is_float(v: Any) -> bool:
    return isinstance(v, float)


def is_node(v: Any) -> bool:
    return isinstance(v, fx.Node)


def _match(p: Any, v: Any, binds: dict[str, Any], nodes: list[fx.Node]) -> bool:
    if isinstance(p, Capture):
        if p.name in binds:
            return binds[p.name] is v if isinstance(v, fx.Node) else binds[p.name] == v
        if p.test is not None and not p.test(v):
            return False
        binds[p.name] = v
        return True
    if isinstance(p, Alt):
        return any(_attempt(lambda q=q: _match(q, v, binds, nodes), binds, nodes)
                   for q in p.options)
    if isinstance(p, Op):
        if not isinstance(v, fx.Node) or v.op != "call_function" or op_name(v) not in p.names():
            return False
        orders = [p.args] + ([p.args[::-1]] if p.commutative and len(p.args) == 2 else [])
        for args in orders:
            if _attempt(lambda args=args: _op_args(p, args, v, binds, nodes), binds, nodes):
                nodes.append(v)
                if p.bind is not None:
                    binds[p.bind] = v
                return True
        return False
    if isinstance(p, list):
        return isinstance(v, (list, tuple)) and list(v) == p
    return not isinstance(v, fx.Node) and v == p


def _op_args(p: Op, args: tuple, v: fx.Node, binds: dict, nodes: list) -> bool:
    if len(v.args) != len(args):
        return False
    return all(_match(q, a, binds, nodes) for q, a in zip(args, v.args)) and \
        all(k in v.kwargs and _match(q, v.kwargs[k], binds, nodes) for k, q in p.kwargs.items())


def _attempt(run: Callable[[], bool], binds: dict, nodes: list) -> bool:
    """`run()`, with the bindings and matched nodes restored when it fails."""
    saved, count = dict(binds), len(nodes)
    if run():
        return True
    binds.clear()
    binds.update(saved)
    del nodes[count:]
    return False
