"""Warm start: the optimized step graph of a model kept on disk, so a second run of the same
model, batch shapes, optimizer and options skips capture and passes; the backend's own cache
(Inductor's FX graph cache) then makes its compile fast too.

The key hashes what the step depends on: every source file that defines a class among the
model's modules (and the loss function's), the model's parameter and buffer names, shapes,
dtypes and `requires_grad`, its training flag, every loaded source file of the user's
(outside the Python installation and its packages), the batch's structure, shapes and dtypes, the
optimizer's class and hyperparameters (not the learning rate: a step input), the pass
pipeline's spelling, the backend, the device, and the versions of glmc, torch, Python and
transformers (when imported). A miss captures as usual and stores the result (written to a
temporary directory, then renamed); an entry that fails to load is ignored and replaced.
Only one-process steps are cached (a data-parallel step's plan lives outside the graph).
"""
from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from glmc.errors import GlmcError


def default_dir() -> Path:
    return Path(os.environ.get("GLMC_STEP_CACHE", Path.home() / ".cache" / "glmc" / "steps"))


def step_key(model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer,
             options: str) -> str:
    """The hash a cached step is stored under (see the module docstring); `options` spells
    the pipeline, backend and device."""
    from glmc.trace.capture import describe
    from glmc.version import __version__
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for p in parts:
            h.update(repr(p).encode())
            h.update(b"\0")

    put(__version__, torch.__version__, sys.version_info[:3], options, describe(batch))
    if "transformers" in sys.modules:
        put(getattr(sys.modules["transformers"], "__version__", ""))
    for m in model.modules():
        put(type(m).__module__, type(m).__qualname__, m.training)
    sources: list[Any] = list({type(m) for m in model.modules()})
    if loss_fn is not None:
        put(getattr(loss_fn, "__module__", ""), getattr(loss_fn, "__qualname__", repr(loss_fn)))
        sources.append(loss_fn)
    files = {os.path.realpath(f) for f in map(_source_file, sources) if f}
    own = _glmc_files()
    files |= _user_files()
    for f in sorted(files - set(own)):
        put(f, _file_hash(f))
    put(_tree_hash(own))  # glmc's whole source (a checkout's edits change the key)
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        put(name, tuple(t.shape), t.dtype, t.requires_grad, str(t.device))
    put(type(optimizer).__qualname__)
    for g in optimizer.param_groups:
        put(sorted((k, repr(v)) for k, v in g.items()
                   if k not in ("params", "lr", "initial_lr")), len(g["params"]))
    return h.hexdigest()[:32]


def load(root: Path, key: str, device: str) -> Any:
    """The cached TrainGraph under `key`, or None (absent, or written by a glmc that cannot
    read it: then removed)."""
    from glmc.export.serialize import load_graph
    path = root / key
    if not (path / "graph.json").is_file():
        return None
    try:
        return load_graph(path, device=device)
    except (GlmcError, ValueError, KeyError, OSError):
        shutil.rmtree(path, ignore_errors=True)
        return None


def store(root: Path, key: str, graph: Any) -> str | None:
    """Save `graph` under `key`; returns why it could not be cached, or None."""
    from glmc.export.serialize import save_graph
    tmp = root / f".{key}.{os.getpid()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        save_graph(graph, tmp)
        final = root / key
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return None
    except (GlmcError, OSError, TypeError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"{type(e).__name__}: {e}"


EXTRA = "predictions.json"


def store_extra(root: Path, key: str, data: dict[str, Any]) -> None:
    """The cost model's predictions for a cached step, written beside it (best effort)."""
    import json
    path = root / key
    if not path.is_dir():
        return
    tmp = path / f".{EXTRA}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(data))
        os.rename(tmp, path / EXTRA)
    except (OSError, TypeError, ValueError):
        tmp.unlink(missing_ok=True)


def load_extra(root: Path, key: str) -> dict[str, Any] | None:
    import json
    try:
        return json.loads((root / key / EXTRA).read_text())
    except (OSError, ValueError):
        return None


def _user_files() -> set[str]:
    """The source files of every loaded module outside the Python installation and its
    site-packages (the user's own code: a helper the forward calls counts too)."""
    import sysconfig
    roots = {os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sysconfig.get_paths()[
        "stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}}
    roots |= _generated_code_dirs()
    out = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f or not f.endswith(".py"):
            continue
        real = os.path.realpath(f)
        if "site-packages" in real or any(real.startswith(r + os.sep) for r in roots):
            continue
        if os.path.isfile(real):
            out.add(real)
    return out


def _generated_code_dirs() -> set[str]:
    """Where compilers write the Python they generate and import (Inductor's cache): not the
    user's code, and loaded only after a first compile (it would change the key in-process)."""
    import getpass
    import tempfile
    out = {os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
           os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")}
    return {os.path.realpath(p) for p in out if p}


def _glmc_files() -> list[str]:
    """Every source file of glmc (`glmc`, `glmc.passes`, `glmc.backends`), loaded or not."""
    roots = {str(Path(__file__).resolve().parents[1])}  # glmc/ (no upward import)
    for name in ("glmc.passes", "glmc.backends"):  # installed from passes/ and backends/
        roots |= set(getattr(sys.modules.get(name), "__path__", None) or ())
    out: set[str] = set()
    for root in roots:
        out |= {os.path.realpath(p) for p in Path(root).rglob("*.py")}
    return sorted(out)


def _tree_hash(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        h.update(_file_hash(f).encode())
    return h.hexdigest()


def _source_file(obj: Any) -> str:
    try:
        return inspect.getsourcefile(obj) or ""
    except TypeError:  # builtins, C extensions
        return ""


_HASHES: dict[tuple[str, float, int], str] = {}


def _file_hash(path: str) -> str:
    st = os.stat(path)
    key = (path, st.st_mtime, st.st_size)
    if key not in _HASHES:
        _HASHES[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return _HASHES[key]


__all__ = ["step_key", "load", "store", "store_extra", "load_extra", "default_dir"]
