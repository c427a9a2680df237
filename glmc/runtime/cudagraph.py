"""Whole-step CUDA graphs: the compiled training step recorded once and replayed every step.

glmc's step is one program over tensors that stay put from step to step — parameters,
buffers, optimizer state, the loss scaler — plus the batch and a few CPU scalars (each
group's learning rate). That is the case CUDA graphs were made for: replaying the recorded
step launches the whole forward, backward and update with one call, no Python and no per-kernel
launch cost. `glmc.optimize(..., cuda_graphs=True)` / `--cuda-graphs`.

    call 1:   the step runs as compiled (warm-up: workspaces, autotuning, lazy init), then is
              recorded on a side stream (recording runs nothing)
    call n:   the batch is copied into the recorded batch tensors, the graph replays — new
              state is copied into the state tensors inside the graph — and the loss is
              cloned out (the recorded output is overwritten by the next replay)
    recorded again when a CPU scalar input changes value (a learning-rate schedule: kernel
              arguments are baked into the graph) or a state tensor moved (load_state_dict
              with assign=True, a user's `p.data = ...`)

Dropout stays random: recording registers torch's CUDA generator, each replay draws new
offsets. Status: partial — written for CUDA and tested on the CPU through a stand-in recorder
(`Recorder`); no GPU has run it yet.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from glmc.errors import BackendError, ConfigError
from glmc.ir.graph import Role, TrainGraph
from glmc.ir.writeback import copy_back, writeback_pairs

#: a compiled step, as glmc.backends.base.StepFn (the core does not import backends)
StepFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]

#: inputs that live at fixed addresses between steps (checked before every replay)
_STATE = (Role.PARAMETER, Role.BUFFER, Role.OPTIMIZER_STATE, Role.SCALER)


class Recorder:
    """torch.cuda's graph API, behind the three calls GraphedStep makes (a stand-in replays
    on the CPU in tests)."""

    def record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, what `fn` returned while recorded)."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


class GraphedStep:
    """`step` (inputs -> outputs, outputs[0] the loss) of `graph` recorded as one graph, the
    state write-back (`writeback_pairs`) inside it; a step that updates its state in place
    (`step.inplace`, returns [loss]) needs none."""

    def __init__(self, step: StepFn, graph: TrainGraph, recorder: Recorder | None = None
                 ) -> None:
        self.step = step
        self.pairs = [] if getattr(step, "inplace", False) else writeback_pairs(graph)
        self.recorder = recorder or Recorder()
        self.batch = [i for i, s in enumerate(graph.inputs) if s.role is Role.INPUT]
        self.state = [i for i, s in enumerate(graph.inputs) if s.role in _STATE]
        self.graph: Any = None
        self.key: tuple = ()
        self.static: list[torch.Tensor] = []
        self.loss: torch.Tensor | None = None
        self.recordings = 0

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        key = self._key(inputs)
        if self.graph is not None and key == self.key:
            for i in self.batch:
                self.static[i].copy_(inputs[i], non_blocking=True)
            self.recorder.replay(self.graph)
            return [self.loss.clone()]
        loss = self._recorded(inputs)  # runs the step: also the warm-up
        self._record(inputs, key)
        return [loss]

    def _key(self, inputs: list[torch.Tensor]) -> tuple:
        scalars = tuple(float(t) for t in inputs if t.device.type == "cpu" and t.dim() == 0)
        return scalars + tuple(inputs[i].data_ptr() for i in self.state)

    def _recorded(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The step with its write-back: what is recorded (and the warm-up run)."""
        outs = self.step(inputs)
        copy_back(self.pairs, inputs, outs)
        return outs[0]

    def _record(self, inputs: list[torch.Tensor], key: tuple) -> None:
        # the batch gets recorded tensors of its own (the caller's change every step); the
        # state tensors are recorded where they are
        self.static = [t.clone() if i in self.batch else t for i, t in enumerate(inputs)]
        try:
            self.graph, self.loss = self.recorder.record(lambda: self._recorded(self.static))
        except RuntimeError as e:
            self.graph = None
            first = (str(e).strip().splitlines() or [""])[0]
            raise BackendError(f"cuda_graphs: the step cannot be recorded as a CUDA graph "
                               f"({first}); it synchronizes with the CPU or allocates "
                               "outside the graph. Run without cuda_graphs") from e
        self.key = key
        self.recordings += 1


def check_cuda_graphs(device: str, parallel: Any) -> None:
    """cuda_graphs needs a CUDA step in one process (collectives inside a recorded graph need
    NCCL's graph support, not wired here)."""
    if device != "cuda":
        raise ConfigError(f"cuda_graphs: the step runs on {device}; CUDA graphs need the model "
                          "and batch on a CUDA device. Drop cuda_graphs=True / --cuda-graphs")
    if parallel is not None:
        raise ConfigError("cuda_graphs: not supported with data parallelism yet (collectives "
                          "in a recorded graph); drop cuda_graphs or parallel")
