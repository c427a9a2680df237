"""Regenerate docs/benchmarks.md from benchmarks/results/.

    python benchmarks/render_docs.py            # writes docs/benchmarks.md
    python benchmarks/render_docs.py --check    # exit 1 if docs/benchmarks.md is out of date

Every result in benchmarks/results/ gets a section: the date, machine, torch version and the
command that produced it (from the JSON, where it records them), then the table the benchmark
script wrote next to it (`NAME.md`), or, for scripts that write JSON only, a table made from the
JSON's rows. A `NAME-curves.svg` is linked under its result. Results with only a hand-kept `.md`
(pipeline.md, zoo.md) are included as they are. Standard library only; the output depends on
the files alone (no timestamps), so `--check` can run in CI.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks.md"

#: (group title, [(result stem, section title, the docs page that discusses it)]), in order;
#: a stem not listed here goes to "Other results" at the end.
GROUPS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("One-process training step", [
        ("glm-small", "Step time and memory, GLM small (`bench_step.py`)", "backends/inductor.md"),
        ("cnn", "Step time and memory, CNN (`bench_step.py`)", "backends/inductor.md"),
        ("step-set-transformers", ("Step time against torch.compile, transformers set "
         "(`bench_step.py --set transformers`)"), "backends/inductor.md"),
        ("compile", "Compile time, cold cache (`bench_compile.py`)", "backends/inductor.md"),
        ("model_accuracy", "Cost and memory model accuracy (`model_accuracy.py`)",
         "cost-model.md"),
    ]),
    ("Passes", [
        ("fusion", "Fusion (`bench_fusion.py`)", "passes/fusion.md"),
        ("fusion-each", "Fusion, each pattern alone (`bench_fusion.py --each`)",
         "passes/fusion.md"),
        ("fusion-eager-glm4", ("Fusion on eager, held-out transformers GLM-4, interleaved "
         "(`bench_fusion_eager.py`)"), "passes/fusion.md"),
        ("precision-numerics", ("Precision: numerics against fp64 "
         "(`bench_precision.py --part numerics`)"), "passes/precision.md"),
        ("precision-memory", "Precision: memory and time (`bench_precision.py --part memory`)",
         "passes/precision.md"),
        ("recompute", "Recompute: GLM small, CNN, held-out transformers GLM "
         "(`bench_recompute.py`; each model's table has its own date)", "passes/recompute.md"),
    ]),
    ("Backends", [
        ("backends", "ONNX Runtime vs eager vs Inductor (`bench_backends.py`)",
         "backends/ort.md"),
        ("tvm", "TVM against eager and Inductor (`bench_tvm.py`)", "backends/tvm.md"),
        ("tvm_ops", "TVM kernel by kernel, with and without glmc's schedules "
         "(`profile_tvm.py`)", "backends/tvm.md"),
    ]),
    ("Parallelism", [
        ("comm", ("The communication model per collective kind, size and process count "
         "(`bench_comm.py`)"), "data-parallel.md"),
        ("parallel-glm-small", "Data parallel against DDP and FSDP2 (`bench_parallel.py`)",
         "data-parallel.md"),
        ("zoo-parallel", "Data parallel on the model zoo (`zoo_parallel.py`)",
         "data-parallel.md"),
        ("compression", "Gradient compression (`bench_compression.py`)", "compression.md"),
        ("compression-sign-blocks", ("Gradient compression: sign with a scale per block "
         "(`bench_compression.py --only ...`)"), "compression.md"),
        ("compression-psgd-seeds", ("Gradient compression: PowerSGD against torch's hook, "
         "three seeds (`bench_compression.py --only ...`)"), "compression.md"),
        ("pipeline", ("Pipeline parallelism against torch.distributed.pipelining "
         "(`bench_pipeline.py`, tables collected by hand)"), "pipeline-parallel.md"),
        ("tensor-parallel-llama-2x384-4x256", ("Tensor parallelism against torch's "
         "parallelize_module plan (`bench_tensor_parallel.py`)"), "passes/tensor_parallel.md"),
        ("planner", ("The planner's predictions against measured runs "
         "(`bench_planner.py`)"), "planner.md"),
        ("megatron-picks", ("glmc's own plans for Megatron-LM's published runs, predicted "
         "(`megatron_picks.py`)"), "planner.md"),
        ("megatron-table2", ("Megatron-LM's Table 2, ZeRO-3 against PTD-P, predicted "
         "(`megatron_table2.py`)"), "planner.md"),
    ]),
    ("Model zoo", [
        ("zoo", "Model zoo, one process (`zoo_table.py`)", "capabilities.md"),
    ]),
]


def meta_of(data: object) -> dict:
    """The run's metadata: a `meta` dict where the script writes one, else the top-level keys."""
    if not isinstance(data, dict):
        return {}
    meta = data.get("meta")
    return dict(meta) if isinstance(meta, dict) else dict(data)


def meta_lines(meta: dict) -> list[str]:
    """Date, machine, software and command, as far as the JSON records them."""
    machine, cpu = str(meta.get("machine") or ""), str(meta.get("cpu") or "")
    if cpu and cpu not in machine:
        machine = f"{cpu}, {machine}" if machine else cpu
    if meta.get("threads") is not None and "thread" not in machine:
        threads = f"{meta['threads']} threads"
        machine = f"{machine}, {threads}" if machine else threads
    software = ", ".join(f"{name} {meta[name]}" for name in ("torch", "onnxruntime", "tvm")
                         if meta.get(name))
    out = []
    for label, value in (("date", meta.get("date")), ("machine", machine),
                         ("software", software), ("command", meta.get("command"))):
        if value:
            out.append(f"- {label}: `{value}`" if label == "command" else f"- {label}: {value}")
    return out


def cell(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return " / ".join(cell(v) for v in value)
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_from_rows(rows: list[dict]) -> list[str]:
    """A markdown table of a JSON result's rows (for scripts that write no .md)."""
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return []
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return lines


def demote(md: str) -> list[str]:
    """A result's own markdown under this page's section headings: its headings go 3 deeper."""
    out = []
    for line in md.rstrip("\n").split("\n"):
        if line.startswith("#"):
            line = "###" + line if line.lstrip("#").startswith(" ") else line
        out.append(line)
    return out


def section(stem: str, title: str, page: str | None) -> list[str]:
    js, md, svg = (RESULTS / f"{stem}.json", RESULTS / f"{stem}.md",
                   RESULTS / f"{stem}-curves.svg")
    data = json.loads(js.read_text()) if js.exists() else None
    files = [f"[`{p.name}`](../benchmarks/results/{p.name})" for p in (js, md) if p.exists()]
    lines = [f'<a id="{stem}"></a>', "", f"### {title}", ""]
    lines += meta_lines(meta_of(data))
    lines.append("- files: " + ", ".join(files))
    if page:
        lines.append(f"- discussed in: [{page}]({page})")
    lines.append("")
    if md.exists():
        lines += demote(md.read_text())
    elif isinstance(data, dict) and isinstance(data.get("rows"), list):
        lines += table_from_rows(data["rows"])
    if svg.exists():
        csv = RESULTS / f"{stem}-curves.csv"
        lines += ["", f"![{stem} curves](../benchmarks/results/{svg.name})"
                  + (f" (data: [`{csv.name}`](../benchmarks/results/{csv.name}))"
                     if csv.exists() else "")]
    return lines + [""]


def render() -> str:
    stems = sorted({p.stem for p in RESULTS.glob("*.json")}
                   | {p.stem for p in RESULTS.glob("*.md")})
    listed = {stem for _, entries in GROUPS for stem, _, _ in entries}
    groups = [(g, [e for e in entries if e[0] in stems]) for g, entries in GROUPS]
    other = [(s, s, None) for s in stems if s not in listed]
    if other:
        groups.append(("Other results", other))
    lines = ["# Benchmark results", "",
             ("<!-- Generated by `python benchmarks/render_docs.py` from benchmarks/results/; "
             "edit the results or the script, not this page. -->"), "",
             ("One current result per benchmark, as the scripts in `benchmarks/` wrote it. All "
             "runs are on shared CPU hosts (2 cores, no GPU): compare ratios within a table, "
             "not absolute times across tables. What each figure means, and its caveats, is on "
             "the page linked under each result; older runs are summarised in "
             "[CHANGELOG.md](../CHANGELOG.md)."), ""]
    for g, entries in groups:
        if entries:
            lines.append(f"- {g}: " + ", ".join(
                f"[{stem}](#{stem})" for stem, _, _ in entries))
    lines.append("")
    for g, entries in groups:
        if not entries:
            continue
        lines += [f"## {g}", ""]
        for stem, title, page in entries:
            lines += section(stem, title, page)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if the page differs from what would be written")
    a = ap.parse_args()
    text, out = render(), Path(a.out)
    if a.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date: run python benchmarks/render_docs.py", file=sys.stderr)
            sys.exit(1)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
