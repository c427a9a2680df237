from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def glmc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmc", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_compile_glm_eager_matches_eager_losses(tmp_path: Path) -> None:
    from glmc.workload import load_workload
    from tests.models import eager_losses

    r = glmc("compile", "examples/glm.py", "--backend", "eager", "--steps", "3",
             "--report-dir", str(tmp_path), "--export-dir", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    got = [float(v) for v in re.findall(r"step +\d+ +loss ([\d.]+)", r.stdout)]
    w = load_workload(str(ROOT / "examples/glm.py"))
    want = eager_losses(w.model, w.example_inputs, None, w.optimizer, 3)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert "cleanup" in r.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    # the default pipeline
    assert [p["name"] for p in report["compiles"][0]["passes"]] == ["fusion", "cleanup"]
    assert (tmp_path / "report.html").read_text().count("<svg") >= 2
    assert (tmp_path / "graphs" / "02_cleanup.py").exists()
    assert "measured:" in r.stdout and "predicted:" in r.stdout
    # fused ops are lowered to ATen in the export
    assert (tmp_path / "export" / "step.py").read_text().count("torch.ops.aten.") > 0


def test_missing_model_is_exit_1(tmp_path: Path) -> None:
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    r = glmc("compile", str(f))
    assert r.returncode == 1
    assert "defines neither `workload()` nor model and example_inputs" in r.stderr
    assert "Traceback" not in r.stderr


def test_export_onnx_needs_export_dir() -> None:
    r = glmc("compile", "examples/mlp.py", "--backend", "eager", "--steps", "1", "--export-onnx")
    assert r.returncode == 1 and "--export-onnx needs --export-dir" in r.stderr


def test_usage_error_is_exit_2() -> None:
    assert glmc("compile").returncode == 2
    assert glmc("frobnicate").returncode == 2
    assert glmc("compile", "--help").returncode == 0


def test_check_lists_nothing_for_supported_model() -> None:
    r = glmc("check", "examples/mlp.py", "--backend", "eager")
    assert r.returncode == 0 and "every op is supported" in r.stdout


def test_debug_prints_traceback(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text("raise RuntimeError('boom')\n")
    r = glmc("compile", str(f), "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "boom" in r.stderr


def test_compile_with_memory_budget(tmp_path: Path) -> None:
    r = glmc("compile", "examples/glm.py", "--backend", "eager", "--steps", "3",
             "--memory-budget", "0.6", "--no-fusion", "--report-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (rec,) = [p for p in report["compiles"][0]["passes"] if p["name"] == "recompute"]
    assert rec["changed"] and rec["stats"]["predicted_peak"] <= rec["stats"]["budget_bytes"]
    assert "Pareto" in (tmp_path / "report.html").read_text()
    bad = glmc("compile", "examples/glm.py", "--backend", "eager", "--steps", "1",
               "--memory-budget", "1KiB")
    assert bad.returncode == 1 and "smallest peak this step can reach" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_compile_with_precision_and_fusion(tmp_path: Path) -> None:
    r = glmc("compile", "examples/glm.py", "--backend", "eager", "--steps", "3",
             "--precision", "bf16", "--fusion", "--report-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "precision" in r.stdout and "casts_inserted=" in r.stdout
    data = json.loads((tmp_path / "report.json").read_text())
    assert [p["name"] for p in data["compiles"][0]["passes"]] == ["fusion", "precision",
                                                                  "cleanup"]
    assert "Fusion</h3>" in (tmp_path / "report.html").read_text()
    bad = glmc("compile", "examples/glm.py", "--precision", "int4")
    assert bad.returncode == 1 and "unknown policy" in bad.stderr
