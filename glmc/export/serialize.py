"""Save and load a TrainGraph: `glmc.save_graph(graph, path)` / `glmc.load_graph(path)`.

A saved step is a directory with `graph.json` (every node: op, target, arguments, typed
metadata and the spec of its value; the signature; the optimizer, loss scaling and recorded
value statistics) and `constants.safetensors` (tensors the graph reads through `get_attr`).
Loading rebuilds the fx graph with fake tensors made from the recorded specs, so a loaded step
verifies, runs through every pass (re-derivation included) and compiles like a captured one.
No pickle: nothing in a saved step can run code when it is loaded.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import operator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from glmc.errors import InputError
from glmc.ir.graph import InputSpec, OutputSpec, TrainGraph
from glmc.ir import graph as ir
from glmc.trace.scaler import LossScaling
from glmc.trace.step import GroupSpec, OptimizerSpec
from glmc.trace.valuestats import stats_from_dict, stats_to_dict

FORMAT = "glmc-graph/1"
_DATACLASSES = {c.__name__: c for c in (GroupSpec, OptimizerSpec, LossScaling, InputSpec,
                                        OutputSpec)}


def save_graph(graph: TrainGraph, path: str | Path) -> Path:
    """Write `graph` to the directory `path` (created); returns it."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    constants: dict[str, torch.Tensor] = {}
    nodes = [_node_to_json(n, graph.gm, constants) for n in graph.graph.nodes]
    doc = {"format": FORMAT, "nodes": nodes,
           "inputs": [_enc(s) for s in graph.inputs], "outputs": [_enc(s) for s in graph.outputs],
           "meta": _meta_to_json(graph.meta)}
    (out / "graph.json").write_text(json.dumps(doc, indent=1))
    save_file({k: v.detach().contiguous().cpu() for k, v in constants.items()},
              str(out / "constants.safetensors"))
    return out


def load_graph(path: str | Path, device: str | None = None) -> TrainGraph:
    """The TrainGraph saved at `path`. `device` moves every tensor spec (e.g. "cpu")."""
    from safetensors.torch import load_file

    src = Path(path)
    if not (src / "graph.json").exists():
        raise InputError(f"load_graph: {src} has no graph.json; pass a directory written by "
                         "glmc.save_graph")
    doc = json.loads((src / "graph.json").read_text())
    if doc.get("format") != FORMAT:
        raise InputError(f"load_graph: {src} is format {doc.get('format')!r}; this glmc reads "
                         f"{FORMAT}")
    constants = load_file(str(src / "constants.safetensors"))
    root = torch.nn.Module()
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for d in doc["nodes"]:
        env[d["name"]] = _node_from_json(d, g, env, root, constants, mode, device)
    gm = fx.GraphModule(root, g)
    graph = TrainGraph(gm, [_dec(s) for s in doc["inputs"]], [_dec(s) for s in doc["outputs"]],
                       _meta_from_json(doc["meta"]))
    graph.verify()
    return graph


# ---- nodes -----------------------------------------------------------------------------------

def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"op:{target.namespace}::{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "operator.getitem"
    raise InputError(f"save_graph: cannot save call target {target!r}; only ATen/custom ops "
                     "and getitem are serializable")


def _target_of(name: str) -> Any:
    if name == "operator.getitem":
        return operator.getitem
    ns, _, rest = name[3:].partition("::")
    op, _, overload = rest.rpartition(".")
    if ns == "glmc":
        from glmc.ir import kernels  # noqa: F401  (registers glmc's ops)
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _node_to_json(n: fx.Node, gm: fx.GraphModule, constants: dict) -> dict[str, Any]:
    d: dict[str, Any] = {"name": n.name, "op": n.op}
    if n.op == "call_function":
        d["target"] = _target_name(n.target)
    elif n.op == "get_attr":
        d["target"] = n.target
        constants[n.target] = getattr(gm, n.target)
    d["args"], d["kwargs"] = _enc(n.args), _enc(n.kwargs)
    d["val"] = _val_to_json(n.meta.get("val"))
    if "glmc" in n.meta:
        d["glmc"] = _enc(n.meta["glmc"])
    if n.meta.get(ir.REMAT):
        d["remat"] = True
    if n.meta.get(ir.EARLY_UPDATE):
        d["early_update"] = True
    return d


def _node_from_json(d: dict, g: fx.Graph, env: dict, root: torch.nn.Module,
                    constants: dict, mode: FakeTensorMode, device: str | None) -> fx.Node:
    args, kwargs = _dec(d["args"], env), _dec(d["kwargs"], env)
    if d["op"] == "placeholder":
        node = g.placeholder(d["name"])
    elif d["op"] == "get_attr":
        root.register_buffer(d["target"], constants[d["target"]].to(device or "cpu"))
        node = g.get_attr(d["target"])
    elif d["op"] == "output":
        node = g.output(args[0])
    else:
        node = g.call_function(_target_of(d["target"]), tuple(args), kwargs)
    node.name = d["name"]
    val = _val_from_json(d.get("val"), mode, device)
    if val is not None:
        node.meta["val"] = val
    if "glmc" in d:
        info = _dec(d["glmc"])
        if device is not None and info.spec is not None:
            info = info.replace(spec=dataclasses.replace(info.spec, device=device))
        node.meta["glmc"] = info
    if d.get("remat"):
        node.meta[ir.REMAT] = True
    if d.get("early_update"):
        node.meta[ir.EARLY_UPDATE] = True
    return node


def _val_to_json(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype)[6:],
                "device": v.device.type}
    if isinstance(v, (tuple, list)):
        return {"seq": [_val_to_json(x) for x in v]}
    if isinstance(v, (int, float, bool)):
        return {"scalar": v}
    return None


def _val_from_json(d: Any, mode: FakeTensorMode, device: str | None) -> Any:
    if d is None:
        return None
    if "seq" in d:
        return tuple(_val_from_json(x, mode, device) for x in d["seq"])
    if "scalar" in d:
        return d["scalar"]
    with mode:
        return torch.empty_strided(d["shape"], d["stride"], dtype=getattr(torch, d["dtype"]),
                                   device=device or d["device"])


# ---- values ----------------------------------------------------------------------------------

def _enc(v: Any) -> Any:
    """JSON of an argument or metadata value, with type tags where JSON has no type."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return {"float": repr(v)}
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, (list, tuple)):
        return {"list" if isinstance(v, list) else "tuple": [_enc(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v)[6:]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, (torch.memory_format, torch.layout)):
        return {"torch": str(v)[6:]}
    if isinstance(v, enum.Enum):
        return {"enum": type(v).__name__, "value": v.value}
    if isinstance(v, _placement_types()):
        fields = {"dim": v.dim} if hasattr(v, "dim") else {}
        if hasattr(v, "reduce_op"):
            fields["reduce_op"] = v.reduce_op
        return {"placement": type(v).__name__, "fields": fields}
    if dataclasses.is_dataclass(v):
        return {"dc": type(v).__name__,
                "fields": {f.name: _enc(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    raise InputError(f"save_graph: cannot save a value of type {type(v).__name__}: {v!r}")


def _dec(v: Any, env: dict | None = None) -> Any:
    if not isinstance(v, dict):
        return v
    if "node" in v:
        return env[v["node"]]  # type: ignore[index]
    if "float" in v:
        return float(v["float"])
    if "list" in v or "tuple" in v:
        items = [_dec(x, env) for x in v.get("list", v.get("tuple"))]
        return items if "list" in v else tuple(items)
    if "dict" in v:
        return {_dec(k, env): _dec(x, env) for k, x in v["dict"]}
    if "dtype" in v:
        return getattr(torch, v["dtype"])
    if "device" in v:
        return torch.device(v["device"])
    if "torch" in v:
        return getattr(torch, v["torch"])
    if "enum" in v:
        return getattr(ir, v["enum"])(v["value"])
    if "placement" in v:
        from torch.distributed.tensor import Partial, Replicate, Shard
        cls = {"Replicate": Replicate, "Shard": Shard, "Partial": Partial}[v["placement"]]
        return cls(**v["fields"])
    if "dc" in v:
        cls = _DATACLASSES.get(v["dc"]) or _ir_dataclass(v["dc"])
        return cls(**{k: _dec(x, env) for k, x in v["fields"].items()})
    raise InputError(f"load_graph: unknown value {v!r}")


def _placement_types() -> tuple[type, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    return (Replicate, Shard, Partial)


def _ir_dataclass(name: str) -> type:
    cls = getattr(ir, name, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise InputError(f"load_graph: unknown record type {name!r}")
    return cls


def _meta_to_json(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("optimizer", "loss_scaling"):
        if meta.get(key) is not None:
            out[key] = _enc(meta[key])
    out["foreach_update"] = bool(meta.get("foreach_update"))
    out["fused_update"] = bool(meta.get("fused_update"))
    if meta.get("value_stats") is not None:
        out["value_stats"] = stats_to_dict(meta["value_stats"])
    return out


def _meta_from_json(d: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {k: _dec(d[k]) for k in ("optimizer", "loss_scaling") if k in d}
    for key in ("foreach_update", "fused_update"):
        if d.get(key):
            meta[key] = True
    if "value_stats" in d:
        meta["value_stats"] = stats_from_dict(d["value_stats"])
    return meta
