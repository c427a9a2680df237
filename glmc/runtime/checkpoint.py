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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmc.errors import CheckpointError

STATE = "state.pt"
DELTA = "delta.pt"  #: an incremental checkpoint's file (glmc.runtime.incremental)
MANIFEST = "manifest.json"
FORMAT = 1


@dataclass
class Saved:
    """One completed save: its step, wall seconds, kind ("full" or "incremental") and bytes."""

    step: int
    seconds: float
    kind: str
    bytes: int


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
    rng = rng_states()
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
    if "fingerprint" not in state:
        raise CheckpointError(f"{where}: written by a data-parallel run; resume it with the "
                              "same --nproc / --zero")
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
    if "rng" not in state:
        raise CheckpointError(f"{where}: written by a data-parallel run; resume it with the "
                              "same --nproc / --zero")
    set_rng_states(state["rng"])


def name_of(step: int) -> str:
    return f"step-{step:08d}"


def load(path: Path) -> dict[str, Any]:
    """The snapshot in checkpoint directory `path`, verified against its manifest (an
    incremental one: applied to its full checkpoint, verified too)."""
    problem = check(path)  # an incremental checkpoint's full one is checked with it
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    base = _manifest(path).get("base")
    if base is None:
        return torch.load(path / STATE, map_location="cpu", weights_only=False)
    from glmc.runtime import incremental
    delta = torch.load(path / DELTA, map_location="cpu", weights_only=False)
    full = torch.load(path.parent / base / STATE, map_location="cpu", weights_only=False)
    return incremental.decode(delta, full)


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def check(path: Path) -> str | None:
    """Why checkpoint directory `path` is not complete and intact, or None."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST}: the save did not finish"
    try:
        written = json.loads(manifest.read_text())
        entries = written["files"]
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
    base = written.get("base")
    if base is not None:  # an incremental checkpoint is as complete as its full one
        problem = check(path.parent / base)  # its state.pt against its own manifest's hash
        if problem is None and _manifest(path.parent / base)["files"][STATE]["sha256"] != \
                written.get("base_sha256"):
            problem = f"{STATE} is not the one this delta was written against"
        if problem is not None:
            return f"its full checkpoint {base}: {problem}"
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
        #: (name, state, SHA-256 of its file) of the last full checkpoint this run wrote: what
        #: incremental ones are written against (none after a resume: the next save is full)
        self._base: tuple[str, dict[str, Any], str] | None = None
        self.errors: list[str] = []  #: failed saves, reported and kept for the run's summary
        self.saved: list[Saved] = []  #: each completed save

    def save(self, step: int, state: dict[str, Any], incremental: bool = False) -> None:
        """Write `state` (a `snapshot`) as the checkpoint of `step`; waits for the previous
        background write first. `incremental`: as its difference from the last full checkpoint
        of this run (glmc.runtime.incremental), full when there is none yet."""
        self.wait()
        base = self._base if incremental else None
        if self.background:
            self._thread = threading.Thread(target=self._write_reporting, args=(step, state, base),
                                            daemon=True, name="glmc-checkpoint")
            self._thread.start()
        else:
            self._write_reporting(step, state, base)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def rebase(self, path: Path, state: dict[str, Any]) -> None:
        """Write incremental checkpoints against full checkpoint `path` (whose loaded snapshot
        is `state`), e.g. the one a run resumed from; an incremental `path` is ignored."""
        from glmc.runtime import incremental
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        if "base" not in manifest:  # a copy: restoring lets the live optimizer state alias
            # the loaded tensors (load_state_dict keeps them), and training changes those
            self._base = (Path(path).name, incremental.clone_tensors(state),
                          manifest["files"][STATE]["sha256"])

    def _write_reporting(self, step: int, state: dict[str, Any], base: Any) -> None:
        import time
        start = time.perf_counter()
        try:
            size = self._write(step, state, base)
            _prune(self.root, self.keep)
            self.saved.append(Saved(step, time.perf_counter() - start,
                                    "incremental" if base else "full", size))
        except Exception as e:  # a full disk, a vanished directory, a tensor the delta
            # encoding cannot take: reported, the run goes on
            msg = (f"checkpoint of step {step} failed ({type(e).__name__}: {e}); training "
                   "goes on, the previous checkpoints are intact")
            self.errors.append(msg)
            warnings.warn(msg, stacklevel=1)

    def _write(self, step: int, state: dict[str, Any], base: Any = None) -> int:
        """Write `state`, whole or (`base`: (name, state, SHA-256) of a full checkpoint) as
        its difference from that checkpoint; returns the bytes written."""
        from glmc.runtime import incremental
        final = self.root / name_of(step)
        tmp = self.root / f".{name_of(step)}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        name, head = (DELTA, {"base": base[0], "base_sha256": base[2]}) if base else (STATE, {})
        try:
            with open(tmp / name, "wb") as f:
                torch.save(incremental.encode(state, base[1]) if base else state, f)
                f.flush()
                os.fsync(f.fileno())
            files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}}
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"format": FORMAT, "step": step, **head, "files": files}, f, indent=1)
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
        if not base:
            self._base = (final.name, state, files[STATE]["sha256"])
        return int(files[name]["bytes"])



class ShardedCheckpointer:
    """Checkpoints of a multi-process trainer (data parallel with ZeRO 0-3, or a pipeline),
    written by every rank together: the sharded model and optimizer state through
    torch.distributed.checkpoint (each rank its shards or stages, `dcp/`), the rest (`state.pt`: data position, every rank's RNG states, step, glmc
    state) by rank 0, all into a temporary directory that rank 0 renames into place after the
    manifest (every file's size and SHA-256) is written. Synchronous and collective: every
    rank calls `save` at the same step. Resharding to another world size is DCP's."""

    background = False

    def __init__(self, root: str | Path, keep: int = 3) -> None:
        import torch.distributed as dist
        if keep < 1:
            raise CheckpointError(f"checkpoint: --keep must be >= 1, got {keep}")
        self.root, self.keep, self.rank = Path(root), keep, dist.get_rank()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        self.errors: list[str] = []
        self.saved: list[Saved] = []

    def save(self, step: int, sharded: dict[str, Any], host: dict[str, Any]) -> None:
        """Every rank: write `sharded` (this rank's part of the distributed state, as DCP
        takes it; its "layout" entry, a string naming the plan, goes to the host state and is
        checked on load) and rank 0's `host` state as the checkpoint of `step`."""
        import time

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        start = time.perf_counter()
        final, tmp = self.root / name_of(step), self.root / f".{name_of(step)}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save({k: v for k, v in sharded.items() if k != "layout"},
                 checkpoint_id=str(tmp / "dcp"))
        host = {**host, "layout": sharded.get("layout")}
        rngs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_states())
        dist.barrier()
        if self.rank == 0:
            with open(tmp / STATE, "wb") as f:
                torch.save({**host, "format": FORMAT, "step": step, "rng_ranks": rngs}, f)
                f.flush()
                os.fsync(f.fileno())
            files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(tmp.rglob("*")) if p.is_file()}
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"format": FORMAT, "step": step, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            _prune(self.root, self.keep)
        dist.barrier()  # every rank records the save (the one that prints may not be rank 0)
        try:
            files = json.loads((final / MANIFEST).read_text())["files"]
        except OSError:  # pruned at once: a newer-named checkpoint of an earlier run is kept
            files = {}
        self.saved.append(Saved(step, time.perf_counter() - start, "full",
                                sum(f["bytes"] for f in files.values())))

    def wait(self) -> None:
        pass


def load_sharded(path: Path, sharded: dict[str, Any]) -> dict[str, Any]:
    """Every rank: load a `ShardedCheckpointer` checkpoint into `sharded` (this rank's state
    dict, shaped as it was saved; DCP loads in place and reshards) and this rank's RNG states;
    returns the host state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    problem = check(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    host = torch.load(path / STATE, map_location="cpu", weights_only=False)
    if "rng_ranks" not in host:
        raise CheckpointError(f"{path}: written by one process; resume it without --nproc / "
                              "--zero / --pp (or start this run without --resume)")
    if len(host["rng_ranks"]) != dist.get_world_size():
        raise CheckpointError(f"{path}: written by {len(host['rng_ranks'])} ranks, resumed on "
                              f"{dist.get_world_size()}: resume on the same number of ranks")
    if host.get("layout") != sharded.get("layout"):
        raise CheckpointError(f"{path}: written by a {host.get('layout')} run, resumed as "
                              f"{sharded.get('layout')}: resume with the plan that wrote it")
    dcp.load({k: v for k, v in sharded.items() if k != "layout"}, checkpoint_id=str(path / "dcp"))
    set_rng_states(host["rng_ranks"][dist.get_rank()])
    return host


def rng_states() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a torch dependency here
        pass
    return rng


def set_rng_states(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np
        np.random.set_state(rng["numpy"])


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (the manifest is written last)."""
    done = sorted((p for p in root.iterdir()
                   if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file()),
                  key=lambda p: p.name)
    needed = set()
    for p in done[-keep:]:  # the full checkpoints that kept incremental ones are written against
        try:
            needed.add(json.loads((p / MANIFEST).read_text()).get("base"))
        except (OSError, ValueError):
            pass
    for old in done[:-keep]:
        if old.name not in needed:
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


__all__ = ["Saved", "Checkpointer", "ShardedCheckpointer", "CheckpointError", "snapshot", "restore",
           "load", "load_sharded", "latest", "check", "name_of", "rng_states", "set_rng_states"]
