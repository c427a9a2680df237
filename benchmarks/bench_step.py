"""Side-by-side training step: eager PyTorch, plain torch.compile, and glmc on each backend.

For every workload, in one process on one machine:
  * every contender trains its own copy of the same model from the same weights;
  * after warm-up, each round runs one step of every contender in turn (interleaved), and
    we report the median step time over rounds, the first-step (compile) time and the ratio
    to torch.compile;
  * one extra step per contender runs under the memory profiler (c10 allocator events): the
    measured peak = bytes live before the step (weights, optimizer state, grads, batch) + the
    peak allocated during it. That step is not timed;
  * for glmc contenders, the cost/memory model's predicted step time and peak, and their
    errors against the measurement.

    python benchmarks/bench_step.py                       # glm-small and cnn, all contenders
    python benchmarks/bench_step.py --models hf-glm --steps 5
    python benchmarks/bench_step.py --set transformers    # the step-time set (issue 18)

`--set transformers`: decoder LMs from transformers (GLM, Llama, Qwen2 style, random init,
AdamW) from ~1.5M to ~100M parameters, sequences 256-1024, plus the CNN; contenders
torch.compile with eager `torch.optim` (foreach), torch.compile with a compiled
`optimizer.step()`, and glmc's default pipeline on Inductor. Every contender also gets a
per-phase row: forward, backward and optimizer time (torch.compile: its compiled forward,
`loss.backward()` and `optimizer.step()` timed apart; glmc: `trainer.profile_phases`, every
kernel call of the compiled step timed and attributed to its phase).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import glmc
from glmc.analysis.memory import measure_peak
from glmc.analysis.phases import TorchLoop
from glmc.trace.capture import split_batch

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _load(file: str, *args):
    spec = importlib.util.spec_from_file_location(Path(file).stem, ROOT / "examples" / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod.workload(*args)


def _hf(kind: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
        batch: int, seq: int, tied: bool = False):
    """A transformers decoder LM from a small config (random init, no download)."""
    def make():
        import transformers
        cls, cfg_cls = {"glm": ("GlmForCausalLM", "GlmConfig"),
                        "llama": ("LlamaForCausalLM", "LlamaConfig"),
                        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config")}[kind]
        cfg = getattr(transformers, cfg_cls)(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=hidden // heads, max_position_embeddings=seq, attention_dropout=0.0,
            tie_word_embeddings=tied, pad_token_id=0, attn_implementation="eager")
        torch.manual_seed(0)
        model = getattr(transformers, cls)(cfg)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        return (model, {"input_ids": ids, "labels": ids.clone()}, None,
                torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1))
    return make


WORKLOADS = {
    "glm-small": lambda: _load("glm.py", "small"),
    "glm-tiny": lambda: _load("glm.py", "tiny"),
    "cnn": lambda: _load("cnn.py", 32, 32, 32),
    "hf-glm": lambda: _load("hf_glm.py", 4, 128, 256, 4, 8192),
    # the step-time set (--set transformers): name says style, layers x width, batch x seq
    "glm-2x128-4x256": _hf("glm", 2, 128, 4, 2, 256, 4096, 4, 256),
    # issue 36's held-out recompute model (3.6M parameters)
    "glm-2x256-4x256": _hf("glm", 2, 256, 4, 4, 640, 4096, 4, 256),
    "qwen2-tied-4x256-4x512": _hf("qwen2", 4, 256, 4, 2, 704, 16384, 4, 512, tied=True),
    "glm-4x512-4x256": _hf("glm", 4, 512, 8, 4, 1024, 8192, 4, 256),
    "llama-2x384-4x256": _hf("llama", 2, 384, 6, 6, 1024, 32000, 4, 256),
    "qwen2-6x640-2x512": _hf("qwen2", 6, 640, 10, 2, 1728, 32000, 2, 512),
    "llama-8x768-1x1024": _hf("llama", 8, 768, 12, 4, 2048, 32000, 1, 1024),
}
SETS = {"transformers": ["glm-2x128-4x256", "qwen2-tied-4x256-4x512", "glm-4x512-4x256",
                         "llama-2x384-4x256", "qwen2-6x640-2x512", "llama-8x768-1x1024", "cnn"]}
SET_CONTENDERS = {"transformers": ("torch.compile", "torch.compile+opt", "glmc-inductor",
                                   "glmc-inductor-nofusion")}
CONTENDERS = ("eager", "torch.compile", "glmc-eager", "glmc-inductor")
#: glmc's host memory policy (glmc.runtime.hostalloc) is process-wide: with it (the default) every
#: contender of the run gets it once glmc compiles; `--default-malloc` runs all without it
RETAIN_MEMORY = True


def _clone(model, optimizer):
    m = copy.deepcopy(model)
    o = type(optimizer)(m.parameters(), **{k: v for k, v in optimizer.defaults.items()
                                          if k != "decoupled_weight_decay"})
    return m, o


class _Contender:
    def __init__(self, name: str, model, optimizer, x, loss_fn) -> None:
        self.name, self.model, self.optimizer = name, model, optimizer
        self.trainer = None
        if name.startswith("glmc-"):
            # glmc's own measurement is switched off: the harness measures every contender alike
            # `glmc-BACKEND` is the default pipeline; `glmc-BACKEND-nofusion` without fusion
            backend, _, variant = name.removeprefix("glmc-").partition("-")
            self.trainer = glmc.optimize(model, x, loss_fn=loss_fn, optimizer=optimizer,
                                         backend=backend, measure=False,
                                         fusion=False if variant == "nofusion" else None,
                                         retain_memory=RETAIN_MEMORY)
            self.fn = lambda a, k: self.trainer.step(*a, **k)
        else:
            self.loop = TorchLoop(model, optimizer, loss_fn,
                                  compile_forward=name.startswith("torch.compile"),
                                  compile_update=name == "torch.compile+opt")
            self.fn = self.loop.step

    def phases(self, args: tuple, kwargs: dict, steps: int) -> dict[str, float]:
        """Forward, backward and optimizer seconds (medians) of `steps` more steps."""
        if self.trainer is not None:
            prof = self.trainer.profile_phases(*args, steps=steps, **kwargs)
            self.top_kernels = [{"kernel": k["kernel"][:80], "ms": round(k["seconds"] * 1e3, 2),
                                 "calls": k["calls"], "phases": k["phases"]}
                                for k in prof.kernels[:8]]
            return dict(prof.phases)
        self.loop.times.clear()
        for _ in range(steps):
            self.fn(args, kwargs)
        return {p: t for p, t in self.loop.phases().items() if p != "step"}

    def state_bytes(self, batch: list[torch.Tensor]) -> int:
        """Bytes of distinct storages live between steps: weights, buffers, grads, optimizer
        state and the batch."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *batch]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        seen = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def run(name: str, steps: int, warmup: int, contenders: list[str], phase_steps: int = 0,
        min_seconds: float = 0.0) -> dict:
    """At least `steps` interleaved rounds (one step of each contender per round), and more
    while the timed rounds have taken less than `min_seconds` (as timeit's autorange: a 20-ms
    step moves by several % between rounds on a shared host), up to 200 rounds."""
    model, x, loss_fn, opt = WORKLOADS[name]()
    args, kwargs = split_batch(x)
    leaves = [*args, *kwargs.values()]
    subjects, compile_s, losses = {}, {}, {}
    for c in contenders:
        m, o = _clone(model, opt)
        t0 = time.perf_counter()
        subjects[c] = _Contender(c, m, o, x, loss_fn)
        torch.manual_seed(0)
        losses[c] = [subjects[c].fn(args, kwargs).item()]  # the first step compiles
        compile_s[c] = time.perf_counter() - t0
    for i in range(1, warmup):
        for c in contenders:
            torch.manual_seed(i)
            losses[c].append(subjects[c].fn(args, kwargs).item())
    peaks = {}
    for c in contenders:  # one profiled (untimed) step each, same seed for all
        before = subjects[c].state_bytes(leaves)
        torch.manual_seed(warmup)
        loss, m = measure_peak(lambda: subjects[c].fn(args, kwargs))
        losses[c].append(loss.item())
        peaks[c] = (before, m)
    times = {c: [] for c in contenders}
    start, i = time.perf_counter(), 0
    while i < steps or (i < 200 and time.perf_counter() - start < min_seconds):
        for c in contenders:  # interleaved: one step of each per round
            torch.manual_seed(warmup + 1 + i)
            t0 = time.perf_counter()
            losses[c].append(subjects[c].fn(args, kwargs).item())
            times[c].append(time.perf_counter() - t0)
        i += 1
    steps = i  # the rounds that ran
    med = {c: statistics.median(t) for c, t in times.items()}
    phases = {c: subjects[c].phases(args, kwargs, phase_steps) for c in contenders} \
        if phase_steps else {}
    ref = med.get("torch.compile")
    rows = []
    for c in contenders:
        before, m = peaks[c]
        row = {"contender": c, "median_step_ms": round(med[c] * 1e3, 2),
               "ratio_to_torch_compile": round(med[c] / ref, 3) if ref else None,
               "first_step_s": round(compile_s[c], 1),
               "measured_peak_mib": round((before + m.peak_bytes) / MiB, 1),
               "measured_in_step_mib": round(m.peak_bytes / MiB, 1),
               "final_loss": round(losses[c][-1], 6)}
        if c in phases:
            row["phases_ms"] = {p: round(t * 1e3, 2) for p, t in phases[c].items()}
        if getattr(subjects[c], "top_kernels", None):
            row["top_kernels"] = subjects[c].top_kernels
        tr = subjects[c].trainer
        if tr is not None:  # what the fusion pass chose (attention kept unfused, and why)
            stats = [h.stats for h in tr.report.compiles[0].history if h.name == "fusion"]
            if stats and stats[0] is not None:
                row["fusion"] = {"counts": stats[0].counts,
                                 "kept_unfused": [r["op"] for r in stats[0].regions
                                                  if r.get("kept")]}
        tr = subjects[c].trainer
        if tr is not None and tr.report.compiles[-1].predicted:
            pred = tr.report.compiles[-1].predicted
            row["predicted_step_ms"] = round(pred["time"]["seconds"] * 1e3, 2)
            row["predicted_peak_mib"] = round(pred["memory"]["peak_bytes"] / MiB, 1)
            row["step_time_error"] = round(pred["time"]["seconds"] / med[c] - 1, 3)
            row["peak_error"] = round(pred["memory"]["peak_bytes"] / (before + m.peak_bytes)
                                      - 1, 3)
        rows.append(row)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params, "steps": steps, "warmup": warmup, "rows": rows}


def run_meta(script: str) -> dict:
    """Date, machine, torch version and the command line of a benchmark run."""
    return {"date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, "
                       f"{platform.processor() or platform.platform()}",
            "torch": torch.__version__,
            "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (benchmarks say which CPU they ran on)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), platform.processor() or "unknown CPU")


def run_distributed(script: str, nproc: int, rank_main, args) -> None:
    """Under torchrun (RANK set): `rank_main(args)`; otherwise start `nproc` local processes
    of `script` with the same command line through torchrun and exit with its status."""
    import os
    import subprocess
    if "RANK" in os.environ:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", script, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


def write_result(out: Path, stem: str, data: dict, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text(md + "\n")
    print(md + "\n", flush=True)


def markdown(result: dict, meta: dict) -> str:
    lines = [f"**{result['model']}** ({result['params'] / 1e6:.2f}M params), median of "
             f"{result['steps']} interleaved steps after {result['warmup']} warm-up; {meta['date']}, "
             f"{meta['machine']}, torch {meta['torch']}",
             "", "| contender | median step (ms) | ratio to torch.compile | first step incl. "
             "compile (s) | measured peak (MiB) | predicted step (ms) / error | predicted peak "
             "(MiB) / error | loss after all steps |", "|---|---|---|---|---|---|---|---|"]

    def err(r: dict, key: str, val: str) -> str:
        return f"{r[val]} / {r[key] * 100:+.1f}%" if key in r else "-"
    for r in result["rows"]:
        lines.append(f"| {r['contender']} | {r['median_step_ms']} | {r['ratio_to_torch_compile']}"
                     f" | {r['first_step_s']} | {r['measured_peak_mib']} | "
                     f"{err(r, 'step_time_error', 'predicted_step_ms')} | "
                     f"{err(r, 'peak_error', 'predicted_peak_mib')} | {r['final_loss']} |")
    rows = [r for r in result["rows"] if "phases_ms" in r]
    if rows:
        lines += ["", "| contender | forward (ms) | backward (ms) | optimizer (ms) | other (ms) |",
                  "|---|---|---|---|---|"]
        for r in rows:
            p = r["phases_ms"]
            lines.append(f"| {r['contender']} | {p['forward']} | {p['backward']} | "
                         f"{p['optimizer']} | {p.get('other', '-')} |")
    return "\n".join(lines)


def summary(results: list[dict], meta: dict) -> str:
    """The set's ratio table: glmc against both torch.compile references, and glmc without
    fusion against torch.compile; geometric means."""
    import math
    cols = (("glmc-inductor", "torch.compile"), ("glmc-inductor", "torch.compile+opt"),
            ("glmc-inductor-nofusion", "torch.compile"))
    lines = [f"step time of glmc-inductor / reference (median of interleaved steps); "
             f"{meta['date']}, {meta['cpu']}, {meta['machine']}, torch {meta['torch']}; "
             f"malloc: {meta.get('malloc', '')}", "",
             "| model | params | glmc (ms) | / torch.compile | / torch.compile + compiled opt |"
             " glmc without fusion / torch.compile | glmc compile (s) | torch.compile compile "
             "(s) |", "|---|---|---|---|---|---|---|---|"]
    ratios: list[list[float]] = [[] for _ in cols]
    for res in results:
        rows = {r["contender"]: r for r in res["rows"]}
        g = rows.get("glmc-inductor")
        if g is None:
            continue
        cells = []
        for (mine, ref), found in zip(cols, ratios):
            if mine in rows and ref in rows:
                q = rows[mine]["median_step_ms"] / rows[ref]["median_step_ms"]
                found.append(q)
                cells.append(f"{q:.3f}")
            else:
                cells.append("-")
        lines.append(f"| {res['model']} | {res['params'] / 1e6:.1f}M | {g['median_step_ms']} | "
                     f"{' | '.join(cells)} | {g['first_step_s']} | "
                     f"{rows.get('torch.compile', {}).get('first_step_s', '-')} |")
    geo = [f"{math.exp(sum(map(math.log, v)) / len(v)):.3f}" if v else "-" for v in ratios]
    lines.append(f"| geometric mean | | | {' | '.join(geo)} | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm-small,cnn",
                    help=f"comma-separated, from {sorted(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--min-seconds", type=float, default=None, metavar="S",
                    help="more rounds for short steps: at least S seconds of timed rounds per "
                         "model, at most 200 (default 10 with --set, else 0)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--contenders", default=None,
                    help=f"comma-separated (default {','.join(CONTENDERS)}; with --set: "
                         "torch.compile, torch.compile+opt, glmc-inductor)")
    ap.add_argument("--set", default=None, choices=sorted(SETS),
                    help="a benchmark set (overrides --models)")
    ap.add_argument("--phases", type=int, default=None, metavar="N",
                    help="per-phase profile: N more steps per contender (default 3 with --set, "
                         "else 0)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="glmc leaves glibc malloc alone (retain_memory=False) for every "
                         "contender; by default its policy applies to the whole process")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    global RETAIN_MEMORY
    RETAIN_MEMORY = not a.default_malloc
    models = SETS[a.set] if a.set else a.models.split(",")
    contenders = (a.contenders or ",".join(SET_CONTENDERS.get(a.set, CONTENDERS))).split(",")
    phase_steps = a.phases if a.phases is not None else (3 if a.set else 0)
    bad = [m for m in models if m not in WORKLOADS]
    if bad:
        ap.error(f"unknown model(s) {bad}; choose from {sorted(WORKLOADS)}")
    meta = {**run_meta("bench_step.py"), "cpu": cpu_name(),
            "malloc": "glibc default" if a.default_malloc else "glmc.runtime.hostalloc policy "
            "(freed memory kept) for every contender, from glmc's first compile on"}
    results = []
    for name in models:
        min_s = a.min_seconds if a.min_seconds is not None else (10.0 if a.set else 0.0)
        result = run(name, a.steps, a.warmup, contenders, phase_steps, min_s)
        results.append(result)
        stem = (f"step-{name}" + ("-default-malloc" if a.default_malloc else "")) if a.set else name
        write_result(Path(a.out), stem, {**meta, **result}, markdown(result, meta))
        if a.set:  # the set's table so far (a long run leaves a usable partial result)
            tag = "-default-malloc" if a.default_malloc else ""
            write_result(Path(a.out), f"step-set-{a.set}{tag}", {**meta, "results": results},
                         summary(results, meta))


if __name__ == "__main__":
    main()
