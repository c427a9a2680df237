"""Top-k 1% and PowerSGD r4 with error feedback on GLM tiny: does a known remedy bring them
within 3% of uncompressed?

A one-process simulation of `bench_compression.py`'s 2-process run (same model, corpus,
global batch 8, AdamW lr 3e-3, 300 steps, final loss = mean of the last 20): each step takes
two ranks' gradients from the two halves of the global batch, compresses each with error
feedback, averages what was sent and applies AdamW as torch computes it (one flat vector).
It reproduces the 2-process figures (uncompressed 2.2559, top-k 2.7958, PowerSGD r4 2.5519
against the hook's 2.5458-2.5519) and tries, as MODE[@W] (W uncompressed warm-up steps):

    dense           uncompressed
    topk            top-k over the whole bucket
    freeze          Adam's second moment frozen after W uncompressed steps (1-bit Adam's rule)
    pertensor       top-k of each tensor instead of over the bucket
    ramp            DGC's sparsity warm-up: 25%, 6.25%, ... down to the ratio, every 15 steps
    update          each rank's own Adam update compressed (local moments, EF on the update)
    momentum        each rank's momentum compressed with EF, the average adopted by every rank,
                    the second moment frozen after W uncompressed steps (1-bit Adam)
    psgd, psgd-update, psgd-momentum, psgd-freeze: the same with PowerSGD rank 4 (per matrix
                    of at least 1,024 elements, Q warm-started) instead of top-k

`--schedule cos` decays the learning rate along a cosine to 0.1x over the run (every mode).

    python benchmarks/compression_remedies.py --modes dense,topk,freeze@50,update
    python benchmarks/compression_remedies.py --modes dense,psgd,psgd-momentum@50 --schedule cos
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import LR, TAIL, corpus_batch  # noqa: E402
from bench_step import WORKLOADS  # noqa: E402

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.01  # torch.optim.AdamW(lr=LR)'s defaults
RANKS = 2


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


class TopK:
    """Each rank sends its k largest |e| (over the bucket, or per tensor)."""

    def __init__(self, shapes: list[torch.Size], ratio: float, per_tensor: bool = False,
                 ramp: bool = False) -> None:
        self.sizes = [s.numel() for s in shapes]
        self.ratio, self.per_tensor, self.ramp = ratio, per_tensor, ramp

    @staticmethod
    def pick(e: torch.Tensor, ratio: float) -> torch.Tensor:
        sent = torch.zeros_like(e)
        idx = e.abs().topk(max(1, int(ratio * e.numel()))).indices
        sent[idx] = e[idx]
        return sent

    def __call__(self, es: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        ratio = max(self.ratio, 0.25 ** (1 + step // 15)) if self.ramp else self.ratio
        if self.per_tensor:
            return [torch.cat([self.pick(p, ratio) for p in e.split(self.sizes)]) for e in es]
        return [self.pick(e, ratio) for e in es]


class PowerSGD:
    """Rank-r P Q^T of each matrix (rows x rest, >= min_numel elements, both sides > r), P and
    Q averaged over the ranks, Q warm-started; smaller tensors averaged dense. Every rank
    'sends' the common approximation (its residual keeps what the average missed)."""

    def __init__(self, shapes: list[torch.Size], rank: int = 4, min_numel: int = 1024,
                 seed: int = 0) -> None:
        self.shapes, self.rank = shapes, rank
        self.sizes = [s.numel() for s in shapes]
        gen = torch.Generator().manual_seed(seed)
        self.q: dict[int, torch.Tensor] = {}
        for i, s in enumerate(shapes):
            rows = s[0] if len(s) else 1
            cols = s.numel() // rows
            if len(s) >= 2 and s.numel() >= min_numel and min(rows, cols) > rank:
                self.q[i] = torch.randn(cols, rank, generator=gen)

    def __call__(self, es: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        parts = [e.split(self.sizes) for e in es]
        out = []
        for i, s in enumerate(self.shapes):
            if i not in self.q:
                out.append(sum(p[i] for p in parts) / len(es))
                continue
            ms = [p[i].reshape(s[0], -1) for p in parts]
            p_avg, _ = torch.linalg.qr(sum(m @ self.q[i] for m in ms) / len(ms))
            self.q[i] = sum(m.t() @ p_avg for m in ms) / len(ms)
            out.append((p_avg @ self.q[i].t()).reshape(-1))
        approx = torch.cat(out)
        return [approx] * len(es)


def compressor(mode: str, shapes: list[torch.Size], ratio: float):
    if mode.startswith("psgd"):
        return PowerSGD(shapes)
    return TopK(shapes, ratio, per_tensor=mode == "pertensor", ramp=mode == "ramp")


def run(model0, seq: int, steps: int, mode: str, warm: int, ratio: float = 0.01,
        schedule: str = "constant") -> float:
    model = copy.deepcopy(model0)
    ps = list(model.parameters())
    sizes = [p.numel() for p in ps]
    n = sum(sizes)
    squeeze = compressor(mode, [p.shape for p in ps], ratio)
    base = mode.removeprefix("psgd").removeprefix("-") or "topk"  # psgd -> topk's rule
    ef = [torch.zeros(n) for _ in range(RANKS)]
    m, v = torch.zeros(n), torch.zeros(n)
    local = [(torch.zeros(n), torch.zeros(n)) for _ in range(RANKS)]  # per-rank moments
    losses = []
    for i in range(steps):
        ids, labels = corpus_batch(i, 8, seq, 256)
        grads, loss = [], 0.0
        half = 8 // RANKS
        for r in range(RANKS):
            model.zero_grad()
            out = model(ids[r * half:(r + 1) * half], labels[r * half:(r + 1) * half])
            out.backward()
            loss += out.item() / RANKS
            grads.append(flat([p.grad for p in ps]))
        losses.append(loss)
        t = i + 1
        for r, (mr, vr) in enumerate(local):  # every rank's own moments, for update/momentum
            mr.mul_(B1).add_(grads[r], alpha=1 - B1)
            vr.mul_(B2).addcmul_(grads[r], grads[r], value=1 - B2)
        compressed = mode != "dense" and i >= warm
        if compressed and base == "update":
            es = [(mr / (1 - B1 ** t)) / ((vr / (1 - B2 ** t)).sqrt() + EPS) + ef[r]
                  for r, (mr, vr) in enumerate(local)]
            sent = squeeze(es, i - warm)
            ef = [e - s for e, s in zip(es, sent)]
            upd = sum(sent) / RANKS
        elif compressed and base == "momentum":
            es = [mr + ef[r] for r, (mr, _) in enumerate(local)]
            sent = squeeze(es, i - warm)
            ef = [e - s for e, s in zip(es, sent)]
            m = sum(sent) / RANKS
            for mr, _ in local:
                mr.copy_(m)  # 1-bit Adam: every rank continues from the averaged momentum
            upd = (m / (1 - B1 ** t)) / ((v / (1 - B2 ** max(warm, 1))).sqrt() + EPS)
        else:
            if compressed:
                es = [g + e for g, e in zip(grads, ef)]
                sent = squeeze(es, i - warm)
                ef = [e - s for e, s in zip(es, sent)]
                g = sum(sent) / RANKS
            else:
                g = sum(grads) / RANKS
            m.mul_(B1).add_(g, alpha=1 - B1)
            if base == "momentum":
                for mr, _ in local:
                    mr.copy_(m)  # compression starts from the synchronised momentum
            frozen = base == "freeze" and compressed
            if not frozen:
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
            bc2 = 1 - B2 ** (min(t, warm) if frozen else t)
            upd = (m / (1 - B1 ** t)) / ((v / bc2).sqrt() + EPS)
        lr = LR
        if schedule == "cos":
            lr = LR * (0.1 + 0.45 * (1 + math.cos(math.pi * i / steps)))
        with torch.no_grad():
            new = flat(ps) * (1 - lr * WD) - lr * upd
            for p, part in zip(ps, new.split(sizes)):
                p.copy_(part.view_as(p))
    return sum(losses[-TAIL:]) / TAIL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--modes", default="dense,topk,topk@20,freeze@20,freeze@50,freeze@100,"
                                       "pertensor,ramp,update,momentum@50,psgd,psgd-update,"
                                       "psgd-freeze@50,psgd-momentum@50")
    ap.add_argument("--schedule", choices=("constant", "cos"), default="constant")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, batch, _, _ = WORKLOADS["glm-tiny"]()
    seq = batch[0].shape[1]
    for spec in a.modes.split(","):
        mode, _, warm = spec.partition("@")
        loss = run(model, seq, a.steps, mode, int(warm or 0), schedule=a.schedule)
        print(f"{spec:16s} final loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
