"""One typed family of errors. Messages read "<where>: what failed; how to fix it"."""
from __future__ import annotations

from dataclasses import dataclass


class GlmcError(Exception):
    """Base of every error glmc raises on purpose."""


@dataclass(frozen=True)
class Offense:
    """One reason a model could not be captured or lowered, with where it came from."""

    reason: str
    location: str = "<unknown location>"

    def __str__(self) -> str:
        return f"  {self.location}: {self.reason}"


class CaptureError(GlmcError):
    """The training step could not be captured into one graph. `offenses` lists every cause."""

    def __init__(self, summary: str, offenses: list[Offense] | None = None) -> None:
        self.offenses = list(offenses or [])
        lines = [summary] + [str(o) for o in self.offenses]
        super().__init__("\n".join(lines))


class GraphBreakError(CaptureError):
    """The model breaks into several graphs (Dynamo graph breaks); `offenses` lists each break
    with its reason in plain words and the user's line. Without `strict`, the Trainer falls
    back to compiling the pieces."""


class UnsupportedOpError(GlmcError):
    """A backend in strict mode met ops it cannot compile. `offenses` names them all."""

    def __init__(self, backend: str, offenses: list[Offense]) -> None:
        self.offenses = list(offenses)
        head = (f"backend '{backend}': {len(offenses)} op(s) not supported; "
                "drop strict=True to run them with eager fallback, or choose another backend")
        super().__init__("\n".join([head] + [str(o) for o in offenses]))


class ExportError(UnsupportedOpError):
    """An export (ONNX) cannot take the step. `offenses` names every op it has no function
    for, with source lines (empty when the exporter failed for another reason)."""

    def __init__(self, summary: str, offenses: list[Offense] | None = None) -> None:
        self.offenses = list(offenses or [])
        GlmcError.__init__(self, "\n".join([summary] + [str(o) for o in self.offenses]))


class BackendError(GlmcError):
    """A backend failed to compile a step glmc handed it (a compiler bug or limit)."""


class PassError(GlmcError):
    """A pass failed or left the graph malformed. The message starts with the pass name."""


class PipelineError(GlmcError):
    """A pipeline string or pass option could not be parsed or names an unknown pass."""


class BudgetError(GlmcError):
    """A memory budget cannot be met."""


class InputError(GlmcError):
    """A batch or argument does not match what the compiled step expects."""


class ConfigError(GlmcError):
    """An option of glmc.optimize / the CLI is invalid or unsupported."""


class CommError(GlmcError):
    """A collective of a multi-process step failed or timed out: another rank died, hung or
    diverged. Raised on every rank that notices, naming itself and the timeout."""


class CheckpointError(GlmcError):
    """A checkpoint cannot be written or used (incomplete, corrupt, another model's): names the
    file and what to do."""
