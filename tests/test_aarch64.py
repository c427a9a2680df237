"""glmc itself on aarch64: the GLM example trained 3 steps under qemu-aarch64 with torch's
aarch64 wheel, eager and Inductor (C++ for aarch64 from the cross g++), equal to this x86 host's
eager losses within rtol 1e-4 (fp32; the two CPUs' BLAS kernels sum in different orders).

Needs `tools/aarch64_sysroot.sh --torch` (qemu-user, g++-aarch64-linux-gnu, Debian's arm64
python3.11, torch 2.13.0 for aarch64). Slow: an emulated CPU, tens of minutes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-4
STEPS = 3


def _sysroot() -> Path:
    root = Path(os.environ.get("GLMC_AARCH64_SYSROOT", Path.home() / ".cache/glmc/aarch64"))
    missing = [t for t in ("aarch64-linux-gnu-g++", "qemu-aarch64") if shutil.which(t) is None]
    if missing or not (root / "rootfs/usr/bin/python3.11").exists() or \
            not (root / "torch/torch").exists() or not (root / "python3.11").exists():
        pytest.skip(f"needs {', '.join(missing) or 'an aarch64 sysroot with torch'}: "
                    "tools/aarch64_sysroot.sh --torch")
    return root


def _layout(site: Path) -> Path:
    """This checkout as `pip install` lays it out (pyproject's package-dir: passes/ and
    backends/ inside glmc/), by symlinks: the aarch64 Python imports the working tree."""
    (site / "glmc").mkdir(parents=True)
    for entry in (ROOT / "glmc").iterdir():
        (site / "glmc" / entry.name).symlink_to(entry)
    for sub in ("passes", "backends"):
        (site / "glmc" / sub).symlink_to(ROOT / sub)
    return site


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ +loss +(\S+)", text, re.M)]


@pytest.mark.slow
def test_glm_example_on_aarch64_eager_and_inductor_match_x86(tmp_path) -> None:
    root = _sysroot()
    x86 = subprocess.run([sys.executable, "-m", "glmc", "compile", "examples/glm.py",
                          "--backend", "eager", "--steps", str(STEPS), "--profile",
                          "generic-cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=True)
    want = _losses(x86.stdout)
    assert len(want) == STEPS
    site = _layout(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": f"{site}:{root / 'torch'}",
           "PYTHON": str(root / "python3.11"), "CXX": "aarch64-linux-gnu-g++",
           "CPLUS_INCLUDE_PATH": str(root / "rootfs/usr/include"),
           "TORCHINDUCTOR_CPP_MARCH": "armv8.2-a+fp16+dotprod",
           "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    r = subprocess.run(["sh", "tools/aarch64_check.sh", str(STEPS)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = {line.split()[0]: [float(x) for x in line.split("[")[1].split("]")[0].split(",")]
           for line in r.stdout.splitlines() if "[" in line}
    assert set(got) == {"eager", "inductor"}
    for backend, losses in got.items():
        assert losses == pytest.approx(want, rel=RTOL), (backend, losses, want)
