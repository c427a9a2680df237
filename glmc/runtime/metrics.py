"""Live training metrics: one line per step (or every n) and a `metrics.jsonl`.

    meter = Meter(total_steps=300, tokens_per_step=8 * 256, flops_per_step=f, peak_flops=p,
                  jsonl=Path("run/metrics.jsonl"))
    meter.step(i, loss, lr, seconds)          # -> the line `glmc train` prints

Throughput is tokens over the step's wall time; MFU is the step's model FLOPs (the matmul FLOPs
of the compiled step graph, forward and backward, counted by glmc's cost rules) over the
device's *achievable* matmul rate (the calibrated profile's best measured rate, not a
datasheet peak) — say which when quoting it. Memory is the process's peak resident set (the
whole process, allocator caches included).
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def step_flops(graph: Any) -> float:
    """Matmul FLOPs of one step of `graph` (a TrainGraph), as glmc's cost rules count them."""
    from glmc.analysis.opcost import op_cost
    total = 0.0
    for n in graph.compute_nodes():
        try:
            c = op_cost(n)
        except Exception:  # an op the rules cannot price adds nothing to the model FLOPs
            continue
        if c.kind == "matmul":
            total += c.flops
        else:  # a fused op's matmuls (the chunked LM head)
            total += sum(p.flops * k for p, k in c.parts if p.kind == "matmul")
    return total


def achievable_flops(device: str, dtype: str = "float32") -> float | None:
    """The best matmul rate of this device's cost profile (measured on a CPU host), or None."""
    try:
        from glmc.analysis.cost import get_profile
        profile = get_profile(None, device)
        curve = profile.matmul.get(dtype) or profile.matmul["float32"]
        return max(rate for _, rate in curve) if curve else None
    except Exception:  # no profile: MFU is left out
        return None


class Meter:
    """Per-step metrics: prints a line every `every` steps, appends every step to `jsonl` and
    (with `tensorboard`, a directory) to a TensorBoard event file; keeps the curve (`curve()`)
    for the report."""

    def __init__(self, total_steps: int, tokens_per_step: int | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None,
                 jsonl: Path | None = None, every: int = 1, out: TextIO | None = None,
                 tensorboard: str | None = None) -> None:
        self.total, self.tokens, self.every = total_steps, tokens_per_step, max(1, every)
        self.flops, self.peak = flops_per_step, peak_flops
        self.out = out or sys.stdout
        self.file = None
        if jsonl is not None:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(jsonl, "a")
        self.times: list[float] = []
        self.rows: list[dict[str, Any]] = []
        self.start = time.perf_counter()
        self.board = _board(tensorboard) if tensorboard else None

    def step(self, i: int, loss: float, lr: float | None, seconds: float,
             extra: dict[str, Any] | None = None, tokens: int | None = None,
             flops: float | None = None) -> dict[str, Any]:
        """Record step i; `tokens` and `flops`: this step's (unpadded tokens; its compiled
        graph's FLOPs) when batches vary."""
        self.times.append(seconds)
        recent = sorted(self.times[-20:])[len(self.times[-20:]) // 2]  # median of the last 20
        row: dict[str, Any] = {"step": i, "loss": loss, "lr": lr, "step_s": round(seconds, 6),
                               "peak_rss_mib": round(peak_rss_bytes() / (1 << 20), 1),
                               "time": round(time.time(), 3)}
        tokens = tokens or self.tokens
        if tokens:
            row["tokens"] = tokens
            row["tokens_per_s"] = round(tokens / seconds, 1)
        flops = flops or self.flops
        if flops and self.peak:
            row["mfu"] = round(flops / seconds / self.peak, 5)
        row["eta_s"] = round(recent * max(0, self.total - i - 1), 1)
        row.update(extra or {})
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        self.rows.append({k: row[k] for k in ("step", "loss", "lr", "step_s", "tokens_per_s",
                                               "mfu") if k in row})
        if self.board is not None:
            for k in ("loss", "lr", "tokens_per_s", "mfu", "step_s", "peak_rss_mib"):
                if row.get(k) is not None:
                    self.board.add_scalar(f"train/{k}", row[k], i)
        if (i + 1) % self.every == 0 or i + 1 == self.total:
            print(self.line(row), file=self.out, flush=True)
        return row

    @staticmethod
    def line(row: dict[str, Any]) -> str:
        """`step    3  loss 5.623456` (as `glmc compile` prints it), then the rest."""
        parts = [f"step {row['step']:4d}  loss {row['loss']:.6f}"]
        if row.get("lr") is not None:
            parts.append(f"lr {row['lr']:.3e}")
        if "tokens_per_s" in row:
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        if "mfu" in row:
            parts.append(f"MFU {row['mfu'] * 100:.1f}%")
        parts.append(f"{row['step_s'] * 1e3:.1f} ms")
        parts.append(f"RSS {row['peak_rss_mib']:,.0f} MiB")
        eta = row.get("eta_s", 0.0)
        parts.append(f"ETA {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}")
        return "  ".join(parts)

    def curve(self, points: int = 2000) -> list[dict[str, Any]]:
        """The run's rows, every k-th so that at most `points` remain (for the report)."""
        k = max(1, -(-len(self.rows) // points))
        return self.rows[::k]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.board is not None:
            self.board.close()
            self.board = None


def _board(directory: str) -> Any:
    """A TensorBoard SummaryWriter into `directory` (needs the `tensorboard` package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from glmc.errors import ConfigError
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard "
                          "(or drop --tensorboard; metrics.jsonl has every step)") from None
    return SummaryWriter(directory)


def lr_factor(step: int, total: int, schedule: str, warmup: int, min_ratio: float) -> float:
    """The learning rate of `step` (0-based) as a fraction of the base rate: linear warm-up
    over `warmup` steps, then constant, linear or cosine decay to `min_ratio` at `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown LR schedule {schedule!r}")


__all__ = ["Meter", "lr_factor", "peak_rss_bytes", "step_flops", "achievable_flops"]
