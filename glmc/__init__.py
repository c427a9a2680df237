"""glmc: a compiler for PyTorch training steps."""
from glmc.api import optimize
from glmc.capture import capture
from glmc.errors import (BudgetError, CaptureError, CommError, ConfigError, GlmcError,
                         GraphBreakError, InputError, PassError, PipelineError,
                         UnsupportedOpError)
from glmc.ir import NodeInfo, Phase, Role, TrainGraph
from glmc.passmanager import Pass, PassContext, PassManager, PassResult
from glmc.serialize import load_graph, save_graph

__version__ = "0.1.0"

_LAZY = {"Parallel": "glmc.parallel", "save_checkpoint": "glmc.parallel",
         "load_checkpoint": "glmc.parallel"}  #: data parallelism, imported on first use


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glmc' has no attribute {name!r}")


__all__ = ["optimize", "capture", "save_graph", "load_graph", "TrainGraph", "NodeInfo", "Phase", "Role", "Pass",
           "PassContext", "PassManager", "PassResult", "GlmcError", "CaptureError", "GraphBreakError",
           "ConfigError", "InputError", "PassError", "PipelineError", "BudgetError",
           "UnsupportedOpError", "CommError", "Parallel", "save_checkpoint", "load_checkpoint"]
