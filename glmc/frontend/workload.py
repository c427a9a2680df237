"""Loading a user's FILE for the CLI.

A FILE defines either `model` and `example_inputs` (optionally `loss_fn` and `optimizer`), or a
function `workload()` returning `(model, example_inputs, loss_fn, optimizer)`. As with
`python FILE`, the FILE's directory is on `sys.path`, so it can import the modules next to it.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from glmc.errors import ConfigError


@dataclass
class Workload:
    model: nn.Module
    example_inputs: Any
    loss_fn: Any = None
    optimizer: Any = None
    #: `glmc train`: the FILE's `data`, any iterable of batches (e.g. a DataLoader), if it
    #: defines one
    data: Any = None


def _importable_siblings(file: Path) -> None:
    """Put the FILE's directory first on sys.path, as `python FILE` does. It stays there: the
    model may import its siblings lazily (inside `forward`, `workload()`, or when unpickled)."""
    here = str(file.resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def load_workload(path: str) -> Workload:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no such file; pass a Python file that defines `model` and "
                          "`example_inputs`, or `workload()`")
    _importable_siblings(file)
    name = f"glmc_workload_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    if hasattr(module, "workload"):
        result = module.workload()
        if not isinstance(result, tuple) or len(result) != 4:
            raise ConfigError(f"{path}: workload() must return (model, example_inputs, loss_fn, "
                              "optimizer); use None for the defaults")
        work = Workload(*result)
    elif hasattr(module, "model") and hasattr(module, "example_inputs"):
        work = Workload(module.model, module.example_inputs, getattr(module, "loss_fn", None),
                        getattr(module, "optimizer", None))
    else:
        missing = [n for n in ("model", "example_inputs") if not hasattr(module, n)]
        raise ConfigError(f"{path}: defines neither `workload()` nor {' and '.join(missing)}; "
                          "add `model = ...` and `example_inputs = (...)` at module level")
    work.data = getattr(module, "data", None)
    if not isinstance(work.model, nn.Module):
        raise ConfigError(f"{path}: `model` must be a torch.nn.Module, got "
                          f"{type(work.model).__name__}")
    return work
