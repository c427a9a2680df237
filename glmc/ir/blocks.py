"""The blocks of a captured step: the layer-granular units pipelining cuts between, the
recompute pass keeps checkpoints at, and the planner prices (`block_names`, `owner`,
`step_blocks`; `passes.partition` builds on them)."""
from __future__ import annotations

from typing import Iterable, Sequence

from glmc.ir.graph import Phase, Role, TrainGraph

__all__ = ["block_names", "owner", "step_blocks"]


def block_names(params: Iterable[str]) -> dict[str, str]:
    """Each parameter's layer-granular block: an item of the model's list of layers
    (`blocks.3.attn.wq.weight` -> `blocks.3`; nested, as in transformers:
    `model.layers.3.mlp.up_proj.weight` -> `model.layers.3`), else its module at the depth
    of that list (`head.weight` -> `head`; `model.embed_tokens.weight` ->
    `model.embed_tokens`, `lm_head.weight` -> `lm_head`); a parameter of the root itself is
    its own block."""
    def list_index(parts: list[str]) -> int | None:
        return next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)

    split = {n: n.split(".") for n in params}
    depth = min((i for i in map(list_index, split.values()) if i is not None), default=1)
    out = {}
    for name, parts in split.items():
        i = list_index(parts)
        keep = i + 1 if i is not None else max(1, min(depth, len(parts) - 1))
        out[name] = ".".join(parts[:keep])
    return out


def owner(path: str | None, blocks: Sequence[str]) -> str | None:
    """The block holding module `path`: the longest block name that is `path` or a prefix of
    it (a block `model` never takes the nodes of `model.layers.0`)."""
    if not path:
        return None
    found = [b for b in blocks if path == b or path.startswith(b + ".")]
    return max(found, key=len) if found else None


def step_blocks(graph: TrainGraph) -> list[str]:
    """The step's blocks in the order its forward first uses them."""
    params = (s.target for s in graph.inputs if s.role is Role.PARAMETER)
    names = set(block_names(params).values())
    order: list[str] = []
    for n in graph.compute_nodes():
        info = graph.info(n)
        b = owner(info.module, sorted(names)) if info.phase is Phase.FORWARD else None
        if b is not None and b not in order:
            order.append(b)
    return order + sorted(names - set(order))
