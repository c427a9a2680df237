"""Gradient compression on 2 processes (gloo): convergence, bytes on the wire, step time.

Every contender trains its own copy of the GLM example (tiny) from the same weights on the same
fixed synthetic corpus — text from a random Markov chain (4 successors per token), so the loss
falls from ln(256) = 5.5 towards the chain's entropy, 1.28 — for `--steps` steps, interleaved (one step of each
contender per round). glmc's compress pass with each method, with and without error feedback,
against uncompressed glmc and against torch's own PowerSGD DDP communication hook at the same
rank, and each lossy method again with a 20-step uncompressed warm-up (`warmup_steps`). Reported:
final loss (mean of the last 20 steps) and its ratio to uncompressed; bytes each rank hands to
the gradient collectives per step, predicted (the compiled step's collectives) and measured
(counted at the collectives during the last step, the loss's 4-byte all-reduce included); the
pass's predicted communication time on this host's measured gloo link and predicted compute of
its added ops; median step time; and the loss-vs-step curves (SVG plot and CSV).

    python benchmarks/bench_compression.py                # 300 steps
    python benchmarks/bench_compression.py --steps 50
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_step import WORKLOADS, cpu_name, run_distributed, run_meta, write_result  # noqa: E402

import glmc  # noqa: E402
from glmc.trace.capture import LossModule  # noqa: E402

CONTENDERS = {  # name -> compress option (None: uncompressed); {"hook": seed}: torch's hook
    "glmc": None,
    "glmc bf16": {"method": "bf16"},
    "glmc sign": {"method": "sign"},
    "glmc sign, no EF": {"method": "sign", "error_feedback": False},
    "glmc sign, block 256": {"method": "sign", "block": 256},
    "glmc sign, block 64": {"method": "sign", "block": 64},
    "glmc topk 1%": {"method": "topk", "ratio": 0.01},
    "glmc topk 1%, no EF": {"method": "topk", "ratio": 0.01, "error_feedback": False},
    "glmc topk 5%": {"method": "topk", "ratio": 0.05},
    "glmc topk 10%": {"method": "topk", "ratio": 0.1},
    "glmc powersgd r4": {"method": "powersgd", "rank": 4, "min_numel": 1024},
    "glmc powersgd r8": {"method": "powersgd", "rank": 8, "min_numel": 1024},
    "glmc powersgd r16": {"method": "powersgd", "rank": 16, "min_numel": 1024},
    "ddp-powersgd r4": {"hook": 0},
    "glmc sign, warm-up 20": {"method": "sign", "warmup_steps": 20},
    "glmc topk 1%, warm-up 20": {"method": "topk", "ratio": 0.01, "warmup_steps": 20},
    "glmc powersgd r4, warm-up 20": {"method": "powersgd", "rank": 4, "min_numel": 1024,
                                     "warmup_steps": 20},
    # like for like with torch's hook (its start_powerSGD_iter=2), over the initial Q's seed
    **{f"glmc powersgd r4, warm-up 2, seed {s}": {"method": "powersgd", "rank": 4,
                                                  "min_numel": 1024, "warmup_steps": 2,
                                                  "seed": s} for s in range(3)},
    **{f"ddp-powersgd r4, seed {s}": {"hook": s} for s in (1, 2)},
}
SEEDED = ("glmc powersgd r4, warm-up 2, seed ", ("ddp-powersgd r4", "ddp-powersgd r4, seed "))
LR = 3e-3
TAIL = 20  #: final loss = mean of the last TAIL steps


def corpus(vocab: int, length: int = 8192) -> torch.Tensor:
    """A fixed text from a random Markov chain: each token has 4 possible successors with
    probabilities 0.4/0.3/0.2/0.1, so the best achievable loss is their entropy (1.28 nats),
    well below the start (ln vocab) and well above zero."""
    g = torch.Generator().manual_seed(1234)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    picks = torch.multinomial(probs, length, replacement=True, generator=g)
    text = [0]
    for k in picks.tolist()[1:]:
        text.append(int(succ[text[-1], k]))
    return torch.tensor(text)


CORPUS: dict[int, torch.Tensor] = {}


def corpus_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """`batch` windows of the corpus at positions drawn from the step's own seed."""
    text = CORPUS.setdefault(vocab, corpus(vocab))
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
    ids = torch.stack([text[s:s + seq] for s in starts.tolist()])
    labels = torch.stack([text[s + 1:s + seq + 1] for s in starts.tolist()])
    return ids, labels


class Contender:
    def __init__(self, name: str, spec, model, batch, loss_fn, link: str) -> None:
        self.name = name
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.wire = self.dense = self.price = None
        self.counted: int | None = None  #: bytes counted at the collectives in the last step
        if spec is not None and "hook" in spec:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            from torch.nn.parallel import DistributedDataParallel
            ddp = DistributedDataParallel(self.model)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                       start_powerSGD_iter=2, min_compression_rate=2,
                                       random_seed=spec["hook"])
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
            self.loss_module = LossModule(ddp, loss_fn)
            self.trainer = None
            return
        parallel = {"zero": 0, "compress": {**spec, "link": link} if spec else None}
        self.trainer = glmc.optimize(self.model, batch, loss_fn=loss_fn, optimizer=self.opt,
                                     backend="eager", parallel=parallel, predict=False,
                                     measure=False)
        rec = self.trainer.report.compiles[-1]
        stats = next((r.stats for r in rec.history if r.name == "compress"), None)
        if stats is not None:
            self.wire, self.dense, self.price = stats.wire_bytes, stats.dense_bytes, stats.price

    def step(self, batch, count: bool = False) -> float:
        if self.trainer is not None:
            if count:
                from glmc.analysis.comm import count_wire_bytes
                loss, counted = count_wire_bytes(lambda: self.trainer.step(*batch))
                self.counted = sum(counted.values())
                return loss.item()
            return self.trainer.step(*batch).item()
        rank, world = dist.get_rank(), dist.get_world_size()
        n = batch[0].shape[0] // world
        local = [t[rank * n:(rank + 1) * n] for t in batch]
        self.opt.zero_grad(set_to_none=True)
        (loss,) = self.loss_module(*local)
        loss.backward()
        self.opt.step()
        out = loss.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
        return out.item()


def rank_main(a: argparse.Namespace) -> None:
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))  # rank 0 may calibrate
    from glmc.analysis.calibration import calibrate
    from glmc.analysis.comm import measure_link
    if dist.get_rank() == 0:
        calibrate()  # the host profile the pass prices compute on: cached after the first run
    dist.barrier()
    model, batch, loss_fn, _ = WORKLOADS["glm-tiny"]()
    seq = batch[0].shape[1]
    make = lambda i: corpus_batch(i, a.batch, seq, 256)  # noqa: E731 (GLM tiny: vocab 256)
    measured = measure_link()  # the compress pass prices the traffic on this host's gloo link
    link = f"{measured.latency_s * 1e6:.3f}us:{measured.bandwidth / 1e9:.4f}GBps"
    names = ["glmc", *(n for n in a.only.split(";") if n != "glmc")] if a.only else CONTENDERS
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--only: unknown contenders {unknown}; known: {list(CONTENDERS)}")
    subjects = {n: Contender(n, CONTENDERS[n], model, make(0), loss_fn, link) for n in names}
    losses = {n: [] for n in subjects}
    times = {n: [] for n in subjects}
    for i in range(a.steps):
        b = make(i)
        last = i == a.steps - 1  # counted at the collectives: slower, kept out of the times
        for n, c in subjects.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[n].append(c.step(b, count=last))
            if not last:
                times[n].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        report(a, subjects, losses, times, link)
    dist.destroy_process_group()


def report(a, subjects, losses, times, link: str) -> None:
    meta = run_meta("bench_compression.py")
    cpu = cpu_name()
    base = statistics.mean(losses["glmc"][-TAIL:])
    base_t = statistics.median(times["glmc"][5:] or times["glmc"])
    rows = []
    priced = next((c.price for c in subjects.values() if c.price is not None), None)
    dense_bytes = next((c.dense for c in subjects.values() if c.dense), None)
    for n, c in subjects.items():
        final = statistics.mean(losses[n][-TAIL:])
        step = statistics.median(times[n][5:] or times[n])
        p = c.price
        comm = p.comm_seconds if p else (priced.dense_comm_seconds if priced and
                                          c.trainer is not None else None)
        rows.append({"contender": n, "first_loss": round(losses[n][0], 4),
                     "final_loss": round(final, 4), "vs_uncompressed": round(final / base, 3),
                     "wire_bytes": c.wire, "dense_bytes": c.dense, "measured_bytes": c.counted,
                     "predicted_bytes": c.wire or (dense_bytes if c.trainer is not None else None),
                     "ratio": round(c.dense / c.wire, 1) if c.wire else None,
                     "predicted_comm_ms": round(comm * 1e3, 3) if comm is not None else None,
                     "predicted_compute_ms": round(p.compute_seconds * 1e3, 3) if p else
                     (0.0 if c.trainer is not None else None),
                     "step_ms": round(step * 1e3, 2), "step_ratio": round(step / base_t, 3)})
    hook = next((r for r in rows if r["contender"].startswith("ddp")), None)
    ours = next((r for r in rows if r["contender"] == "glmc powersgd r4"), None)
    data = {"meta": meta, "cpu": cpu, "steps": a.steps, "batch": a.batch, "lr": LR,
            "link": link, "profile": priced.profile if priced else None,
            "rows": rows, "curves": losses,
            "powersgd_vs_torch_hook": None if hook is None or ours is None else {
                "final_loss_ratio": round(ours["final_loss"] / hook["final_loss"], 3),
                "step_time_ratio": round(ours["step_ms"] / hook["step_ms"], 3)}}
    lines = [f"**GLM tiny** on a synthetic Markov-chain text (best loss 1.28), global batch {a.batch}, "
             f"AdamW lr {LR}, 2 processes on gloo, {a.steps} interleaved steps; final loss = "
             f"mean of the last {TAIL}; {meta['date']}, {cpu}, torch {meta['torch']}; "
             f"`{meta['command']}`; predicted on the measured gloo link `{link}` and the "
             f"{data['profile']} profile", "",
             "| contender | first loss | final loss | vs uncompressed | bytes per rank per step:"
             " predicted / measured | compression | predicted comm (ms) | predicted compress "
             "compute (ms) | median step (ms) | vs uncompressed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    dash = lambda v, f="{:,}": "-" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        ratio = f"{r['ratio']}:1" if r["ratio"] else "-"
        lines.append(f"| {r['contender']} | {r['first_loss']} | {r['final_loss']} | "
                     f"{r['vs_uncompressed']} | {dash(r['predicted_bytes'])} / "
                     f"{dash(r['measured_bytes'])} | {ratio} | {dash(r['predicted_comm_ms'], '{}')}"
                     f" | {dash(r['predicted_compute_ms'], '{}')} | {r['step_ms']} | "
                     f"{r['step_ratio']} |")
    p = data["powersgd_vs_torch_hook"]
    if p is not None:
        lines += ["", f"glmc PowerSGD r4 vs torch's PowerSGD DDP hook r4: final loss ratio "
                  f"{p['final_loss_ratio']}, step time ratio {p['step_time_ratio']}."]
    data["powersgd_over_seeds"] = seeds = _over_seeds(rows)
    if seeds is not None:
        g, h = seeds["glmc"], seeds["hook"]
        lines += ["", f"PowerSGD r4 over the initial Q's seed, both warmed up 2 steps: glmc "
                  f"final loss {g['mean']} (seeds {g['seeds']}: {g['min']}-{g['max']}), "
                  f"torch's hook {h['mean']} ({h['seeds']}: {h['min']}-{h['max']}); ratio of "
                  f"the means {seeds['final_loss_ratio']}, of the median steps "
                  f"{seeds['step_time_ratio']}."]
    out = Path(a.out)
    _plot(losses, out / f"{a.name}-curves.svg")
    _csv(losses, out / f"{a.name}-curves.csv")
    write_result(out, a.name, data, "\n".join(lines))


def _over_seeds(rows: list[dict]) -> dict | None:
    """glmc's PowerSGD (warm-up 2) against torch's hook, each over the seeds that ran: the mean,
    the range and the ratios of the means (None unless both ran)."""
    def group(match) -> dict | None:
        got = [r for r in rows if match(r["contender"])]
        if not got:
            return None
        finals = [r["final_loss"] for r in got]
        return {"seeds": len(got), "mean": round(statistics.mean(finals), 4),
                "min": min(finals), "max": max(finals),
                "step_ms": statistics.mean(r["step_ms"] for r in got)}
    mine = group(lambda n: n.startswith(SEEDED[0]))
    hook = group(lambda n: n == SEEDED[1][0] or n.startswith(SEEDED[1][1]))
    if mine is None or hook is None:
        return None
    return {"glmc": mine, "hook": hook,
            "final_loss_ratio": round(mine["mean"] / hook["mean"], 3),
            "step_time_ratio": round(mine["step_ms"] / hook["step_ms"], 3)}


def _plot(losses: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for n, ys in losses.items():
        ax.plot(ys, label=n, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _csv(losses: dict, path: Path) -> None:
    """One row per step, one column per contender."""
    names = list(losses)
    lines = ["step," + ",".join(f'"{n}"' for n in names)]
    for i in range(len(losses[names[0]])):
        lines.append(f"{i + 1}," + ",".join(f"{losses[n][i]:.5f}" for n in names))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", default="", help="contenders separated by ; (uncompressed glmc "
                    "always runs, as the reference); default: all")
    ap.add_argument("--name", default="compression",
                    help="result files' stem: OUT/NAME.md, .json, -curves.svg, -curves.csv")
    a = ap.parse_args()
    run_distributed(__file__, 2, rank_main, a)


if __name__ == "__main__":
    main()
