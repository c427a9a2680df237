"""Checkpoints that survive being killed: written atomically, checked by a manifest, optionally
in the background while training goes on.

    ckpt = Checkpointer("ckpt/", keep=3)
    ckpt.save(step, snapshot(model, optimizer, trainer, data_state, step))   # returns at once
    found = latest(Path("ckpt/"))          # the newest *complete* checkpoint, or None
    restore(load(found), model, optimizer, trainer)

Layout: `D/step-00000050/` holds `state.pt` (model, optimizer, glmc state, data position, RNG
states, step, fingerprint) and `manifest.json` (each file's size and SHA-256, written last).
A save writes into `D/.step-00000050.tmp/`, fsyncs every file and the directory, then renames
it into place: a crash at any moment leaves either the old set of checkpoints or the new one,
never a half-written directory under a checkpoint's name. `latest` verifies manifests, newest
first, and skips (naming them) any that are incomplete or corrupt. The snapshot is taken in
the caller's thread (tensors copied), so the step that follows may change the live tensors
while a background thread writes; an error there (a full disk) is reported at the next save
or `wait()`, and the previous checkpoints stay intact.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from glmc.errors import CheckpointError

STATE = "state.pt"
MANIFEST = "manifest.json"
FORMAT = 1


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: Any,
             data: dict[str, Any] | None, step: int, extra: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """Everything a run needs to continue exactly, copied now (CPU tensors, cloned)."""
    def cpu(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cpu(v) for v in x)
        return copy.deepcopy(x)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a torch dependency here
        pass
    return {"format": FORMAT, "step": step, "fingerprint": fingerprint(model),
            "model": cpu(model.state_dict()), "optimizer": cpu(optimizer.state_dict()),
            "glmc": cpu(trainer.state_dict()) if trainer is not None else {},
            "data": dict(data or {}), "rng": rng, "extra": dict(extra or {})}


def fingerprint(model: torch.nn.Module) -> list[list[Any]]:
    """Names, shapes and dtypes of the model's parameters and buffers."""
    return [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()]


def restore(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            trainer: Any = None, where: str = "checkpoint") -> None:
    """Load a snapshot into live objects (the RNG states too); a snapshot of another model is a
    CheckpointError naming the first difference."""
    mine, theirs = fingerprint(model), state["fingerprint"]
    if mine != theirs:
        diff = next((f"{a} vs {b}" for a, b in zip(theirs, mine) if a != b),
                    f"{len(theirs)} vs {len(mine)} tensors")
        raise CheckpointError(f"{where}: saved from another model ({diff}); resume with the "
                              "model that wrote it, or start without --resume")
    with torch.no_grad():
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if trainer is not None and state.get("glmc"):
        trainer.load_state_dict(state["glmc"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])


def name_of(step: int) -> str:
    return f"step-{step:08d}"


def load(path: Path) -> dict[str, Any]:
    """The snapshot in checkpoint directory `path`, verified against its manifest."""
    problem = check(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return torch.load(path / STATE, map_location="cpu", weights_only=False)


def check(path: Path) -> str | None:
    """Why checkpoint directory `path` is not complete and intact, or None."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST}: the save did not finish"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, want in entries.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size:,} bytes, the manifest says {want['bytes']:,}"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum (corrupt)"
    return None


def latest(root: Path, report: Any = None) -> Path | None:
    """The newest complete checkpoint under `root`; each newer one that is not complete is
    named through `report` (default: a warning) and skipped."""
    if not root.is_dir():
        return None
    for path in sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")),
                       key=lambda p: p.name, reverse=True):
        problem = check(path)
        if problem is None:
            return path
        (report or (lambda m: warnings.warn(m, stacklevel=2)))(
            f"checkpoint {path} skipped: {problem}; using an older one")
    return None


class Checkpointer:
    """Writes snapshots under `root` atomically, keeping the newest `keep`; with `background`
    one write at a time runs on a thread while training goes on."""

    def __init__(self, root: str | Path, keep: int = 3, background: bool = True) -> None:
        if keep < 1:
            raise CheckpointError(f"checkpoint: --keep must be >= 1, got {keep}")
        self.root, self.keep, self.background = Path(root), keep, background
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []  #: failed saves, reported and kept for the run's summary
        self.saved: list[tuple[int, float]] = []  #: (step, seconds) of each completed save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write `state` (a `snapshot`) as the checkpoint of `step`; waits for the previous
        background write first."""
        self.wait()
        if self.background:
            self._thread = threading.Thread(target=self._write_reporting, args=(step, state),
                                            daemon=True, name="glmc-checkpoint")
            self._thread.start()
        else:
            self._write_reporting(step, state)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write_reporting(self, step: int, state: dict[str, Any]) -> None:
        import time
        start = time.perf_counter()
        try:
            self._write(step, state)
            self._prune()
            self.saved.append((step, time.perf_counter() - start))
        except OSError as e:  # a full disk, a vanished directory: the run goes on
            msg = (f"checkpoint of step {step} failed ({e}); training goes on, the previous "
                   "checkpoints are intact")
            self.errors.append(msg)
            warnings.warn(msg, stacklevel=1)

    def _write(self, step: int, state: dict[str, Any]) -> None:
        final = self.root / name_of(step)
        tmp = self.root / f".{name_of(step)}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            with open(tmp / STATE, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            files = {STATE: {"bytes": (tmp / STATE).stat().st_size,
                             "sha256": _sha256(tmp / STATE)}}
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"format": FORMAT, "step": step, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # a checkpoint of the same step from an earlier run
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _prune(self) -> None:
        done = sorted((p for p in self.root.iterdir()  # complete: the manifest is written last
                       if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file()),
                      key=lambda p: p.name)
        for old in done[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["Checkpointer", "CheckpointError", "snapshot", "restore", "load", "latest", "check",
           "name_of"]
