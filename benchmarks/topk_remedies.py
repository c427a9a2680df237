"""Top-k 1% with error feedback on GLM tiny: does a known remedy bring it within 3%?

A one-process simulation of `bench_compression.py`'s 2-process run (same model, corpus,
global batch 8, AdamW lr 3e-3, 300 steps, final loss = mean of the last 20): each step takes
two ranks' gradients from the two halves of the global batch, compresses each with error
feedback, averages what was sent and applies AdamW as torch computes it (one flat vector).
It reproduces the 2-process figures (uncompressed 2.2559, top-k 2.7958) and tries:

    dense           uncompressed
    topk[@W]        top-k over the whole bucket, W uncompressed warm-up steps
    freeze@W        Adam's second moment frozen after W uncompressed steps (1-bit Adam's rule)
    pertensor       top-k 1% of each tensor instead of over the bucket
    ramp            DGC's sparsity warm-up: 25%, 6.25%, ... down to 1% kept, every 15 steps
    update          top-k of each rank's own Adam update (local moments, EF on the update)

    python benchmarks/topk_remedies.py --modes dense,topk,freeze@50,update
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import LR, TAIL, corpus_batch  # noqa: E402
from bench_step import WORKLOADS  # noqa: E402

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.01  # torch.optim.AdamW(lr=LR)'s defaults


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def topk(e: torch.Tensor, k: int) -> torch.Tensor:
    sent = torch.zeros_like(e)
    idx = e.abs().topk(k).indices
    sent[idx] = e[idx]
    return sent


def sparsify(mode: str, e: torch.Tensor, step: int, warm: int, sizes: list[int],
             ratio: float) -> torch.Tensor:
    if mode == "pertensor":
        return torch.cat([topk(part, max(1, int(ratio * part.numel())))
                          for part in e.split(sizes)])
    if mode == "ramp":
        ratio = max(ratio, 0.25 ** (1 + (step - warm) // 15))
    return topk(e, max(1, int(ratio * e.numel())))


def run(model0, seq: int, steps: int, mode: str, warm: int, ratio: float = 0.01) -> float:
    model = copy.deepcopy(model0)
    ps = list(model.parameters())
    sizes = [p.numel() for p in ps]
    n = sum(sizes)
    ef = [torch.zeros(n), torch.zeros(n)]
    m, v = torch.zeros(n), torch.zeros(n)
    local = [(torch.zeros(n), torch.zeros(n)) for _ in range(2)]  # "update": per-rank moments
    losses = []
    for i in range(steps):
        ids, labels = corpus_batch(i, 8, seq, 256)
        grads, loss = [], 0.0
        for r in range(2):
            model.zero_grad()
            out = model(ids[r * 4:(r + 1) * 4], labels[r * 4:(r + 1) * 4])
            out.backward()
            loss += out.item() / 2
            grads.append(flat([p.grad for p in ps]))
        losses.append(loss)
        t = i + 1
        if mode == "update":
            upd = torch.zeros(n)
            for r, (mr, vr) in enumerate(local):
                mr.mul_(B1).add_(grads[r], alpha=1 - B1)
                vr.mul_(B2).addcmul_(grads[r], grads[r], value=1 - B2)
                e = (mr / (1 - B1 ** t)) / ((vr / (1 - B2 ** t)).sqrt() + EPS) + ef[r]
                sent = topk(e, max(1, int(ratio * n)))
                ef[r] = e - sent
                upd += sent / 2
        else:
            if mode == "dense" or i < warm:
                g = (grads[0] + grads[1]) / 2
            else:
                g = torch.zeros(n)
                for r in range(2):
                    e = grads[r] + ef[r]
                    sent = sparsify(mode, e, i, warm, sizes, ratio)
                    ef[r] = e - sent
                    g += sent / 2
            m.mul_(B1).add_(g, alpha=1 - B1)
            frozen = mode == "freeze" and i >= warm
            if not frozen:
                v.mul_(B2).addcmul_(g, g, value=1 - B2)
            bc2 = 1 - B2 ** (min(t, warm) if frozen else t)
            upd = (m / (1 - B1 ** t)) / ((v / bc2).sqrt() + EPS)
        with torch.no_grad():
            new = flat(ps) * (1 - LR * WD) - LR * upd
            for p, part in zip(ps, new.split(sizes)):
                p.copy_(part.view_as(p))
    return sum(losses[-TAIL:]) / TAIL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--modes", default="dense,topk,topk@20,freeze@20,freeze@50,freeze@100,"
                                       "pertensor,ramp,update")
    a = ap.parse_args()
    model, batch, _, _ = WORKLOADS["glm-tiny"]()
    seq = batch[0].shape[1]
    for spec in a.modes.split(","):
        mode, _, warm = spec.partition("@")
        print(f"{spec:12s} final loss {run(model, seq, a.steps, mode, int(warm or 0)):.4f}",
              flush=True)


if __name__ == "__main__":
    main()
