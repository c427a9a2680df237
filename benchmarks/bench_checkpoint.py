"""Incremental against full checkpoints: size, save time and restore time on transformers' GLM
(`examples/hf_glm.py` at the benchmark size: batch 4 x 128, hidden 256, 4 layers, vocab 8192),
trained by glmc with AdamW (lr 1e-3).

After `--warmup` steps a full checkpoint is the base. Then for each interval J in `--intervals`
(steps since the base), at that point both are written synchronously by `Checkpointer` (write,
fsync, SHA-256 manifest, rename): the full snapshot, and the incremental one (XOR byte planes
against the base, zstd; glmc.runtime.incremental). Restore = `load` of the checkpoint (the
incremental one reads and applies its base too) and is checked bit for bit against the
snapshot. Median of `--repeats` saves and loads each, full and incremental interleaved.

    python benchmarks/bench_checkpoint.py
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, cpu_name, run_meta, write_result  # noqa: E402

import glmc  # noqa: E402
from glmc.runtime import incremental  # noqa: E402
from glmc.runtime.checkpoint import Checkpointer, load, snapshot  # noqa: E402


def _workload():
    spec = importlib.util.spec_from_file_location("hf_glm", ROOT / "examples" / "hf_glm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workload(4, 128, 256, 4, 8192)


def _timed_save(root: Path, step: int, state: dict, base: tuple | None) -> tuple:
    """(seconds, bytes) of one synchronous save (into a fresh directory each time)."""
    ck = Checkpointer(root, keep=100, background=False)
    if base is not None:
        ck.rebase(*base)  # the same full checkpoint as the base
    t0 = time.perf_counter()
    ck.save(step, state, incremental=base is not None)
    return time.perf_counter() - t0, ck.saved[-1].bytes, ck.saved[-1].kind


def _same(a: dict, b: dict) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in
               zip(incremental._tensors(a), incremental._tensors(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--intervals", default="1,10,50")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    model, batch, _, opt = _workload()
    params = sum(p.numel() for p in model.parameters())
    trainer = glmc.optimize(model, batch, optimizer=opt, backend=a.backend)
    for _ in range(a.warmup):
        trainer.step(**batch)
    root = Path(tempfile.mkdtemp(prefix="glmc-ckpt-bench-"))
    first = snapshot(model, opt, trainer, {}, a.warmup)
    Checkpointer(root / "base", keep=1, background=False).save(a.warmup, first)
    base_dir = root / "base" / f"step-{a.warmup:08d}"
    done, rows = a.warmup, []
    for interval in (int(v) for v in a.intervals.split(",")):
        while done < a.warmup + interval:
            trainer.step(**batch)
            done += 1
        state = snapshot(model, opt, trainer, {}, done)
        times: dict[str, list[float]] = {"full": [], "incremental": []}
        loads: dict[str, list[float]] = {"full": [], "incremental": []}
        sizes: dict[str, int] = {}
        for r in range(a.repeats):
            for kind in ("full", "incremental"):
                where = root / f"{kind}-{interval}-{r}"
                seconds, size, got = _timed_save(where, done, state,
                                                 (base_dir, first) if kind == "incremental"
                                                 else None)
                assert got == kind
                if kind == "incremental":  # its base sits beside it, as in a real directory
                    shutil.copytree(base_dir, where / base_dir.name)
                times[kind].append(seconds)
                sizes[kind] = size
                t0 = time.perf_counter()
                back = load(where / f"step-{done:08d}")
                loads[kind].append(time.perf_counter() - t0)
                assert _same(state, back), f"{kind} checkpoint does not restore exactly"
        row = {"steps_since_full": interval}
        for kind in ("full", "incremental"):
            row[f"{kind}_mib"] = round(sizes[kind] / 2**20, 2)
            row[f"{kind}_save_s"] = round(statistics.median(times[kind]), 3)
            row[f"{kind}_restore_s"] = round(statistics.median(loads[kind]), 3)
        row["size_ratio"] = round(sizes["incremental"] / sizes["full"], 3)
        rows.append(row)
        print(row, flush=True)
    shutil.rmtree(root, ignore_errors=True)
    meta = run_meta("bench_checkpoint.py")
    md = [f"transformers GlmForCausalLM ({params / 1e6:.2f}M params, hidden 256, 4 layers, "
          f"vocab 8192), AdamW, glmc {a.backend} backend; full checkpoint after {a.warmup} "
          f"steps; median of {a.repeats} synchronous saves/loads; restore exact in every case; "
          f"{meta['date']}, {cpu_name()}, torch {meta['torch']}", "",
          "| steps since full | full MiB | full save s | full restore s | incremental MiB | "
          "incremental save s | incremental restore s | size ratio |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['steps_since_full']} | {r['full_mib']} | {r['full_save_s']} | "
           f"{r['full_restore_s']} | {r['incremental_mib']} | {r['incremental_save_s']} | "
           f"{r['incremental_restore_s']} | {r['size_ratio']:.2f} |" for r in rows]
    write_result(Path(a.out), "checkpoint", {**meta, "cpu": cpu_name(), "params": params,
                                             "rows": rows}, "\n".join(md))


if __name__ == "__main__":
    main()
