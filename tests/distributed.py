"""Launching a test's workers in several processes (gloo on CPU), with a bound on every run:
a failure is the child's traceback, a hang a test failure, never a stuck test session."""
from __future__ import annotations

import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOIN_TIMEOUT_S = 600  #: generous: 2 loaded cores run both processes and their compiles
PG_TIMEOUT_S = 300  #: every collective of a test fails after this (a rank may still be compiling)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable, *args: object, nprocs: int = 2) -> None:
    """Runs worker(rank, port, *args) in `nprocs` processes; a failure or a hang fails the
    test."""
    ctx = mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not ctx.join(timeout=2):  # raises ProcessRaisedException with the child's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"distributed workers did not finish within {JOIN_TIMEOUT_S} s")


def run_parts(rank: int, port: int, world: int, out: str,
              parts: list[tuple[str, Callable[[int, Path], dict]]]) -> None:
    """In one process group (process start-up dominates test time), run each part and save
    its result — or its error — for its own test to read (`result`)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        for name, part in parts:
            try:
                result = part(rank, Path(out))
            except Exception:
                result = {"error": traceback.format_exc()}
            torch.save(result, Path(out) / f"{name}{rank}.pt")
    finally:
        dist.destroy_process_group()


def result(out: Path, part: str, rank: int) -> dict:
    found = torch.load(out / f"{part}{rank}.pt", weights_only=False)
    if "error" in found:
        pytest.fail(f"rank {rank} failed:\n{found['error']}")
    return found
