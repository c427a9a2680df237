"""glmc: a compiler for PyTorch training steps."""
from glmc.compiler.passmanager import Pass, PassContext, PassManager, PassResult
from glmc.errors import (BudgetError, CaptureError, CheckpointError, CommError, ConfigError,
                         GlmcError, GraphBreakError, InputError, PassError, PipelineError,
                         UnsupportedOpError)
from glmc.export.serialize import load_graph, save_graph
from glmc.frontend.api import optimize
from glmc.frontend.planning import plan
from glmc.ir.graph import NodeInfo, Phase, Role, TrainGraph
from glmc.trace.capture import capture

from glmc.version import __version__  # noqa: F401  (glmc.__version__)

_LAZY = {"Parallel": "glmc.parallel.data", "save_checkpoint": "glmc.parallel.data",
         "load_checkpoint": "glmc.parallel.data"}  #: data parallelism, imported on first use


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glmc' has no attribute {name!r}")


__all__ = ["optimize", "plan", "capture", "save_graph", "load_graph", "TrainGraph", "NodeInfo", "Phase", "Role", "Pass",
           "PassContext", "PassManager", "PassResult", "GlmcError", "CaptureError", "GraphBreakError",
           "ConfigError", "InputError", "PassError", "PipelineError", "BudgetError",
           "UnsupportedOpError", "CommError", "CheckpointError", "Parallel", "save_checkpoint", "load_checkpoint"]
