"""Backends by name. A new backend adds a module and one line here."""
from __future__ import annotations

from glmc.backends.base import Backend, CompiledStep, lower_writeback

from glmc.errors import ConfigError


def _eager() -> Backend:
    from glmc.backends.eager import EagerBackend
    return EagerBackend()


def _inductor() -> Backend:
    from glmc.backends.inductor.backend import InductorBackend
    return InductorBackend()


def _ort() -> Backend:
    from glmc.backends.ort.backend import OrtBackend
    return OrtBackend()


def _tvm() -> Backend:
    from glmc.backends.tvm.backend import TvmBackend
    return TvmBackend()


BACKENDS = {
    "eager": _eager,
    "inductor": _inductor,
    "ort": _ort,
    "tvm": _tvm,
}


def get_backend(name: str | Backend) -> Backend:
    """The backend registered as `name`; a Backend instance (a backend with non-default
    options, e.g. `TvmBackend(target="kunpeng920")`) is used as given."""
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ConfigError(f"backend '{name}' is unknown; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["Backend", "CompiledStep", "lower_writeback", "get_backend", "BACKENDS"]
