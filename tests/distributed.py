"""Launching a test's workers in several processes (gloo on CPU), with a bound on every run:
a failure is the child's traceback, a hang a test failure, never a stuck test session."""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

#: generous: 2 loaded cores run both processes and their compiles
JOIN_TIMEOUT_S = int(os.environ.get("GLMC_TEST_JOIN_TIMEOUT", 600))
PG_TIMEOUT_S = 300  #: every collective of a test fails after this (a rank may still be compiling)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable, *args: object, nprocs: int = 2) -> None:
    """Runs worker(rank, port, *args) in `nprocs` processes; a failure or a hang fails the
    test with each rank's own output (a crash in C++ — gloo aborting, a segfault — leaves no
    Python traceback, so every rank writes its stdout, stderr and faulthandler's stacks to a
    log whose tail the failure shows).

    A run killed by a signal or hung (not a Python error, not a wrong result), or whose port
    another process took between `free_port` and the store's bind, is run once more, on a
    fresh port, and the first attempt's logs are reported as a warning: gloo
    aborted a rank once in a CI run, and a rank spun for 10 minutes once locally, neither
    reproduced since; one that recurs fails the test with its logs."""
    for attempt in (1, 2):
        crash = _spawn_once(worker, args, nprocs)
        if crash is None:
            return
        if attempt == 1:
            warnings.warn("distributed workers crashed or hung; running them once more:\n"
                          + crash)
    pytest.fail(crash)


def _spawn_once(worker: Callable, args: tuple, nprocs: int) -> str | None:
    """None on success; the crash or hang with each rank's log tail."""
    logs = Path(tempfile.mkdtemp(prefix="glmc-ranks-"))
    ctx = mp.start_processes(_logged, args=(worker, str(logs), nprocs, free_port(), *args),
                             nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=2):  # raises with the child's traceback or exit signal
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                return (f"distributed workers did not finish within {JOIN_TIMEOUT_S} s "
                        f"(every thread's stack is in the logs)\n{_tails(logs, nprocs)}")
    except ProcessExitedException as e:
        if e.signal_name is None:
            pytest.fail(f"{e}\n{_tails(logs, nprocs)}")
        return f"{e}\n{_tails(logs, nprocs)}"
    except ProcessException as e:
        text = f"{e}\n{_tails(logs, nprocs)}"
        if "EADDRINUSE" in text or "ddress already in use" in text:
            return text  # another pytest worker's process group took the port first
        pytest.fail(text)
    return None


def _logged(rank: int, worker: Callable, logs: str, nprocs: int, port: int,
            *args: object) -> None:
    # the ranks (and other pytest workers) share this host's cores: more threads than cores
    # spin against each other
    from tests.conftest import threads_per_process
    torch.set_num_threads(threads_per_process(nprocs))
    log = open(Path(logs) / f"rank{rank}.log", "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(log, all_threads=True)  # SIGABRT/SIGSEGV: every thread's Python stack
    # a hang: every thread's stack in the log before the parent gives up on this rank
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 60, file=log)
    worker(rank, port, *args)


def _tails(logs: Path, nprocs: int, lines: int = 80) -> str:
    out = []
    for rank in range(nprocs):
        path = logs / f"rank{rank}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log)"]
        out.append(f"---- rank {rank}: last {lines} lines of {path} ----")
        out.extend(text[-lines:])
    return "\n".join(out)


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


def slow_readers(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a selected slow test reads `fixture` (a module fixture's slow parts run only
    then: `-m slow`)."""
    return any(item.get_closest_marker("slow") and fixture in item.fixturenames
               for item in request.session.items)


def result(out: Path, part: str, rank: int) -> dict:
    found = torch.load(out / f"{part}{rank}.pt", weights_only=False)
    if "error" in found:
        pytest.fail(f"rank {rank} failed:\n{found['error']}")
    return found
