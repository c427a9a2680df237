"""glmc: a compiler for PyTorch training steps."""
from glmc.api import optimize
from glmc.capture import capture
from glmc.errors import (BudgetError, CaptureError, ConfigError, GlmcError, InputError,
                         PassError, PipelineError, UnsupportedOpError)
from glmc.ir import NodeInfo, Phase, Role, TrainGraph
from glmc.passmanager import Pass, PassContext, PassManager, PassResult

__version__ = "0.1.0"

__all__ = ["optimize", "capture", "TrainGraph", "NodeInfo", "Phase", "Role", "Pass",
           "PassContext", "PassManager", "PassResult", "GlmcError", "CaptureError",
           "ConfigError", "InputError", "PassError", "PipelineError", "BudgetError",
           "UnsupportedOpError"]
