"""report.json / report.html / glmc report, graph dumps, and the exported step (Python, ONNX)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import glmc
from tests.models import ATOL, CASES, RTOL, glmc_losses

ROOT = Path(__file__).resolve().parent.parent


def _trainer(case: str, backend: str = "eager", **options):
    model, x, loss_fn, opt = CASES[case].make()
    return glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                         **options), x


def test_report_files_are_complete_and_self_contained(tmp_path: Path) -> None:
    trainer, x = _trainer("glm", dump_dir=str(tmp_path / "graphs"))
    glmc_losses(trainer, x, 4)
    json_path, html_path = trainer.write_report(str(tmp_path))
    data = json.loads(Path(json_path).read_text())
    c = data["compiles"][0]
    cleanup = next(r for r in c["passes"] if r["name"] == "cleanup")
    assert cleanup["changed"]
    assert cleanup["predicted"]["peak_bytes"] <= c["passes"][0]["predicted"]["peak_bytes"]
    assert c["measured"]["peak_bytes"] > 0 and c["steps_run"] == 3
    assert c["predicted"]["memory"]["timeline"] and c["errors"]["peak_memory"] is not None
    assert c["errors"]["transient_memory"] is not None
    assert c["predicted"]["time"]["profile_provenance"]
    html = Path(html_path).read_text()
    assert html.count("<svg") >= 2 and "cleanup" in html and "measured peak" in html
    # offline: no scripts, stylesheets or images fetched from anywhere
    # (matplotlib's clip paths use in-document url(#id) references only)
    assert not re.search(r"<script|<link|<img|@import|url\((?!#)", html)
    # every pass section the stats wrote is in report.json and drawn
    for r in c["passes"]:
        if r.get("section"):
            assert f"<h3>{r['section']['title']}</h3>" in html
    dumps = sorted(p.name for p in (tmp_path / "graphs").iterdir())
    assert dumps[0] == "00_captured.py" and len(dumps) == len(c["passes"]) + 1
    assert any(d.endswith("_cleanup.py") for d in dumps)
    assert "torch.ops.aten.mm" in (tmp_path / "graphs" / dumps[-1]).read_text()


def test_report_sections_come_from_the_passes(tmp_path: Path) -> None:
    """report_html knows no pass: a section is data the pass's stats return, stored in
    report.json, and drawn from there (also by `glmc report` on a saved file). Rendering
    touches no global matplotlib state."""
    import matplotlib

    from glmc.compiler.report_parts import LinePlot, ReportSection, Table, Text
    from glmc.report.html import render_html
    source = (ROOT / "glmc" / "report" / "html.py").read_text()
    assert not re.search(r"recompute|precision|fusion|cleanup", source)
    section = ReportSection("My pass", (Text("did <things>", "note"),
                                        Table(("value", "size"), (("a", 1), ("b", 2))),
                                        LinePlot("curve", "x", "y", (1.0, 2.0), (3.0, 4.0),
                                                 ("p", "q"))), "summary line")
    assert ReportSection.from_dict(json.loads(json.dumps(section.to_dict()))) == section
    data = {"created": "now", "machine": "m", "torch": "t", "compiles": [{
        "batch": "(x)", "backend": "eager", "capture_seconds": 0, "passes_seconds": 0,
        "backend_seconds": 0, "nodes_captured": 1, "nodes_final": 1, "fallbacks": [],
        "passes": [{"name": "mine", "options": {}, "changed": True, "stats": {"n": 1},
                    "seconds": 0, "nodes_before": 1, "nodes_after": 1, "skipped": False,
                    "predicted": None, "section": section.to_dict()}],
        "predicted_captured": None, "predicted": None, "measured": None, "steps_run": 0,
        "measured_step_seconds": None, "errors": {}, "warnings": []}]}
    backend = matplotlib.rcParams._get_backend_or_none()
    pyplot = sys.modules.get("matplotlib.pyplot")
    figures = pyplot.get_fignums() if pyplot else []
    html = render_html(data)
    assert matplotlib.rcParams._get_backend_or_none() == backend  # no matplotlib.use()
    assert (pyplot.get_fignums() if pyplot else []) == figures  # no pyplot figures left
    assert "<h3>My pass</h3>" in html and "did &lt;things&gt;" in html and "<svg" in html
    del data["compiles"][0]["passes"][0]["section"]  # a report.json from before sections
    assert "<h3>My pass</h3>" not in render_html(data)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless chromium")
def test_report_renders_in_headless_browser(tmp_path: Path) -> None:
    trainer, x = _trainer("mlp")
    glmc_losses(trainer, x, 3)
    _, html = trainer.write_report(str(tmp_path))
    png = tmp_path / "report.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={png}", "--window-size=1200,1600", f"file://{html}"],
                   capture_output=True, timeout=120)
    assert png.exists() and png.stat().st_size > 20_000


def test_glmc_report_command(tmp_path: Path) -> None:
    trainer, x = _trainer("mlp")
    glmc_losses(trainer, x, 3)
    trainer.write_report(str(tmp_path))
    (tmp_path / "report.html").unlink()
    r = subprocess.run([sys.executable, "-m", "glmc", "report", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cleanup" in r.stdout and "predicted:" in r.stdout and "measured:" in r.stdout
    assert (tmp_path / "report.html").exists()
    bad = subprocess.run([sys.executable, "-m", "glmc", "report", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr


def _run_export(directory: Path, *args: str) -> list[float]:
    r = subprocess.run([sys.executable, str(directory / "step.py"), *args],
                       capture_output=True, text=True, timeout=600,
                       cwd=directory)  # not the repo: the export must not need glmc
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case,onnx", [("glm", False), ("cnn", False),  # ONNX GLM: -m slow
                                       pytest.param("glm", True, marks=pytest.mark.slow),
                                       ("mlp", True)])
def test_export_reproduces_the_next_steps(tmp_path: Path, case: str, onnx: bool) -> None:
    if onnx:
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    # ONNX: torch's exporter has no function for the fused attention's backward (capability
    # matrix), so the ONNX cases export the unfused step
    extra = {"fusion": False} if onnx else {}
    trainer, x = _trainer(case, predict=False, measure=False, **extra)
    glmc_losses(trainer, x, 2)
    files = trainer.export(str(tmp_path), onnx=onnx)
    assert {Path(f).name for f in files} >= {"step.py", "state.safetensors", "signature.json"}
    want = glmc_losses(trainer, x, 5, seed=100)  # the trainer goes on from the exported state
    got = _run_export(tmp_path, "--steps", "5", "--seed", "100", *(["--onnx"] if onnx else []))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("precision,onnx", [  # fp16 through ONNX (60 s): -m slow
    ("bf16", False), pytest.param("fp16", True, marks=pytest.mark.slow)])
def test_export_carries_precision(tmp_path: Path, precision: str, onnx: bool) -> None:
    """The casts, the fused loss (lowered to plain ATen) and fp16's loss-scaler state travel
    with the export; onnxruntime's CPU kernels take fp16 (not bf16)."""
    if onnx:
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    trainer, x = _trainer("glm", predict=False, measure=False, precision=precision)
    glmc_losses(trainer, x, 2)
    trainer.export(str(tmp_path), onnx=onnx)
    sig = json.loads((tmp_path / "signature.json").read_text())
    assert ("loss_scale" in {i["target"] for i in sig["inputs"]}) == (precision == "fp16")
    assert f"torch.{ {'bf16': 'bfloat16', 'fp16': 'float16'}[precision]}" in \
        (tmp_path / "step.py").read_text()
    want = glmc_losses(trainer, x, 4, seed=100)
    for mode in [[]] + ([["--onnx"]] if onnx else []):
        got = _run_export(tmp_path, "--steps", "4", "--seed", "100", *mode)
        # unchunked vs chunked fp32 loss: summation order differs at ~1e-7
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_report_has_precision_section(tmp_path: Path) -> None:
    trainer, x = _trainer("glm", precision="bf16")
    glmc_losses(trainer, x, 3)
    json_path, html_path = trainer.write_report(str(tmp_path))
    c = json.loads(Path(json_path).read_text())["compiles"][0]
    rec = next(r for r in c["passes"] if r["name"] == "precision")
    st = rec["stats"]
    assert st["casts_inserted"] == len(st["casts"]) > 0
    assert len(st["node_dtypes"]) == sum(sum(v.values()) for v in st["step_dtypes"].values()) \
        + sum(1 for row in st["node_dtypes"] if row[3] == "-")
    assert rec["predicted"]["peak_bytes"] < c["predicted_captured"]["memory"]["peak_bytes"]
    html = Path(html_path).read_text()
    assert "Precision: bf16" in html and "first reader" in html and "dtype of every node" in html


def test_export_save_continues_training(tmp_path: Path) -> None:
    trainer, x = _trainer("mlp", predict=False, measure=False)
    trainer.export(str(tmp_path))
    first = _run_export(tmp_path, "--steps", "2", "--save")
    second = _run_export(tmp_path, "--steps", "2")
    assert second[0] < first[0] and second[0] != first[1]


def test_onnx_export_of_an_unsupported_step_fails_typed_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op the exporter cannot take is found on fake tensors before anything is written.
    The export lowers the step as the ORT backend does (the fused attention's backward
    decomposed: no offense since issue 36); a glmc op without an ATen decomposition is one."""
    pytest.importorskip("onnxscript")
    import glmc.ir.kernels
    from glmc.export.artifacts import OnnxExportError, onnx_export_offenses

    trainer, _ = _trainer("glm", predict=False, measure=False)
    assert onnx_export_offenses(trainer) == []  # SDPA's backward lowers as on ONNX Runtime
    full = glmc.ir.kernels.decompositions
    monkeypatch.setattr(glmc.ir.kernels, "decompositions",
                        lambda: {k: v for k, v in full().items() if "rms_norm" not in str(k)})
    with pytest.raises(OnnxExportError) as e:
        trainer.export(str(tmp_path / "new" / "export"), onnx=True)
    assert isinstance(e.value, glmc.UnsupportedOpError)
    reasons = [o.reason for o in e.value.offenses]
    assert {r.split(":")[0] for r in reasons} == {"glmc.rms_norm.default",
                                                  "glmc.rms_norm_backward.default"}
    assert all("file a glmc issue" in r for r in reasons)
    assert all(re.search(r"examples/glm\.py:\d+ in forward", o.location)
               for o in e.value.offenses)
    assert "--disable fusion" in str(e.value) and "\x1b" not in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no directory, not even the parent


class _CachedAttention(torch.nn.Module):
    """SDPA attention whose keys and values are concatenated to an empty cache tensor held as
    a plain attribute, as transformers' DynamicCache starts: a real constant in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
        self.empty = torch.tensor([])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([self.empty, k], dim=-2), torch.cat([self.empty, v], dim=-2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, 16))


def test_onnx_export_of_an_sdpa_step_with_a_real_constant(tmp_path: Path) -> None:
    """Issue 36 item 3: the pre-check traced on fake tensors met the model's real empty cache
    tensor (`aten.cat([tensor([]), FakeTensor])`) and gave up; the export then failed on
    SDPA's CPU backward, which the ORT backend lowers itself. Both now use one lowering: the
    step checks clean and step.onnx trains as the trainer does."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import warnings

    from glmc.export.artifacts import onnx_export_offenses
    torch.manual_seed(0)
    model, x, y = _CachedAttention(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    trainer = glmc.optimize(model, (x, y), loss_fn=torch.nn.functional.mse_loss,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                            backend="eager", predict=False, measure=False)
    glmc_losses(trainer, (x, y), 1)
    assert any("scaled_dot_product" in str(n.target) for n in trainer.graph.graph.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not check the step" is a failure here
        assert onnx_export_offenses(trainer) == []
    files = trainer.export(str(tmp_path), onnx=True)
    assert "step.onnx" in {Path(f).name for f in files}
    want = glmc_losses(trainer, (x, y), 3, seed=100)
    got = _run_export(tmp_path, "--steps", "3", "--seed", "100", "--onnx")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_failed_onnx_export_leaves_the_directory_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exporter failure: a typed error without the exporter's terminal colours, and the
    earlier export in the directory untouched (files are staged, then moved in)."""
    pytest.importorskip("onnxscript")
    from glmc.export.artifacts import OnnxExportError

    trainer, _ = _trainer("mlp", predict=False, measure=False)
    trainer.export(str(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def fail(*args, **kwargs):
        raise RuntimeError("Failed to convert. \x1b[96mThis is step 3/3\x1b[0m of exporting.\n"
                           "## Exception summary\n\nDispatchError: \x1b[1mno function\x1b[0m")
    monkeypatch.setattr(torch.onnx, "export", fail)
    with pytest.raises(OnnxExportError, match="DispatchError: no function") as e:
        trainer.export(str(tmp_path), onnx=True)
    assert "\x1b" not in str(e.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_onnx_export_with_dropout_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import glmc.export.artifacts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1),
                                torch.nn.Linear(8, 1))
    trainer = glmc.optimize(model, (torch.randn(4, 8), torch.randn(4, 1)),
                            loss_fn=torch.nn.functional.mse_loss, backend="eager",
                            predict=False, measure=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.export(str(tmp_path / "py"))  # step.py reproduces torch's masks: no warning
    pytest.importorskip("onnxscript")
    monkeypatch.setattr(glmc.export.artifacts, "export_onnx", lambda g, i, path, **kw: path.write_bytes(b""))
    with pytest.warns(UserWarning, match="native_dropout.*ONNX Runtime's generator"):
        trainer.export(str(tmp_path / "onnx"), onnx=True)


def test_measured_step_is_the_fastest_and_a_spread_says_the_machine_is_loaded() -> None:
    """The report's measured step time is the fastest timed step (the least disturbed); when
    the median is well above it the report warns that the machine looks loaded."""
    from glmc.report.summary import CompileRecord

    def record(seconds: list[float]) -> dict:
        return CompileRecord("b", "eager", 0.0, 0.0, 0.0, 1, 1, [], [],
                             step_seconds=seconds).to_dict()

    calm = record([5.0, 0.100, 0.102, 0.101, 0.103])  # the first step warms up: not timed
    assert calm["measured_step_seconds"] == 0.100 and calm["median_step_seconds"] == 0.1015
    assert not calm["warnings"]
    loaded = record([5.0, 0.100, 0.210, 0.190, 0.400])
    assert loaded["measured_step_seconds"] == 0.100
    (warning,) = loaded["warnings"]
    assert "2.00x the fastest" in warning and "loaded" in warning
