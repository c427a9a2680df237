"""Session setup. The default run is spread over pytest-xdist workers (`-n`, pyproject's
addopts), one test file per worker at a time (`--dist loadfile`: a file's module fixtures,
such as the spawned multi-process runs, run once), files in `HEAVY_FIRST` order
(`--no-loadscope-reorder`: xdist would order them by test count); each worker takes its share
of the cores, so workers and the ranks they spawn do not spin against each other. `-n 0`
runs in one process (e.g. for `--pdb`)."""
from __future__ import annotations

import os

import torch


def workers() -> int:
    """How many pytest processes share this host (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def threads_per_process(processes: int = 1) -> int:
    return max(1, (os.cpu_count() or 1) // (processes * workers()))


def pytest_configure(config: object) -> None:
    if workers() > 1:
        torch.set_num_threads(threads_per_process())
    # `glmc train` keeps optimized steps in a step cache (warm start): the tests' own, empty
    # at each run, not the user's ~/.cache/glmc/steps (subprocesses inherit the variable)
    if "GLMC_STEP_CACHE" not in os.environ:
        import tempfile
        os.environ["GLMC_STEP_CACHE"] = tempfile.mkdtemp(prefix="glmc-test-steps-")
    # the links the tests' runs measure go to the tests' own cache, not the user's
    # ~/.cache/glmc: a link timed while the suite loads the host is far off (a 2-process
    # gloo link of 0.29 GB/s against 0.72 on the quiet host) and `glmc plan --cluster local`
    # would price with it; the user's compute calibration is copied in (no timing again)
    if "GLMC_CACHE_DIR" not in os.environ:
        import shutil
        import tempfile

        from glmc.analysis.calibration import cache_dir
        own = tempfile.mkdtemp(prefix="glmc-test-cache-")
        for path in cache_dir().glob("cpu-profile-*.json"):
            shutil.copy(path, own)
        os.environ["GLMC_CACHE_DIR"] = own


#: the files that take longest (a CI run's durations), handed to the workers first so that no
#: long file starts last and runs alone (longest-first keeps the workers busy to the end)
HEAVY_FIRST = ("test_zoo.py", "test_parallel.py", "test_cli.py", "test_pipeline.py",
               "test_ort.py", "test_tvm.py", "test_cost_memory.py",
               "test_compress_topology.py", "test_report_export.py", "test_recompute.py")


def pytest_collection_modifyitems(session: object, config: object, items: list) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
