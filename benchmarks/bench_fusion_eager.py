"""Fusion on the eager backend, held-out transformers GLM-4 (issue 36 item 6): step time and
peak with and without the fusion pass, and each pattern alone, interleaved.

A report said glmc's eager step was 1.10x slower with fusion on transformers' Glm4ForCausalLM
(2 layers, hidden 256, one process, median of 3, not interleaved). Here every contender trains
its own copy of the same model from the same weights; after warm-up the contenders' steps are
interleaved, one per round, and the median step is reported with its ratio to plain eager.

    python benchmarks/bench_fusion_eager.py --steps 15   # writes results/fusion-eager-glm4.*
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_step import ROOT, MiB, _clone, cpu_name, run_meta, write_result

import glmc
from glmc.analysis.memory import measure_peak
from glmc.trace.capture import batch_leaves, split_batch

CONTENDERS = {"eager": "cleanup", "eager + fusion": "fusion,cleanup",
              "fusion: attention": "fusion{patterns=attention},cleanup",
              "fusion: norm": "fusion{patterns=norm},cleanup",
              "fusion: mlp": "fusion{patterns=mlp},cleanup",
              "fusion: loss": "fusion{patterns=loss},cleanup"}


def glm4(batch: int = 4, seq: int = 256, hidden: int = 256, layers: int = 2,
         vocab: int = 4096):
    from transformers import Glm4Config, Glm4ForCausalLM
    config = Glm4Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, max_position_embeddings=seq,
                        attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    model = Glm4ForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    model, batch = glm4()
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainers = {}
    for name, passes in CONTENDERS.items():
        m, o = _clone(model, base)
        trainers[name] = glmc.optimize(m, batch, optimizer=o, backend="eager", passes=passes,
                                       predict=False, measure=False)
    for _ in range(args.warmup):
        for t in trainers.values():
            t.step(**batch)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(args.steps):  # interleaved: one step of each contender per round
        for name, t in trainers.items():
            t0 = time.perf_counter()
            t.step(**batch)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    peaks = {}
    for name, t in trainers.items():
        entry = t.entry_for(**batch)
        leaves = [g(batch_leaves(split_batch(batch))) for g in entry.getters]
        _, m = measure_peak(lambda: entry.step(leaves), "cpu", state=leaves)
        peaks[name] = m.to_dict()["total_peak_bytes"]
    rows = [{"contender": k, "median_s": med[k], "ratio": med[k] / med["eager"],
             "min_s": min(times[k]), "max_s": max(times[k]), "peak_bytes": peaks[k]}
            for k in trainers]
    meta = {**run_meta("bench_fusion_eager.py"), "cpu": cpu_name(),
            "model": "transformers Glm4ForCausalLM, 2 layers, hidden 256, vocab 4096, "
                     "batch 4x256, AdamW", "steps": args.steps, "warmup": args.warmup}
    md = [f"Fusion on eager, held-out GLM-4 ({meta['date']}, {meta['cpu']}, "
          f"{meta['machine']}; {args.steps} interleaved steps after {args.warmup} warm-up)", "",
          "| contender | median step (ms) | vs eager | min-max (ms) | peak (MiB) |",
          "|---|---|---|---|---|"]
    md += [f"| {r['contender']} | {r['median_s'] * 1e3:.1f} | {r['ratio']:.3f}x | "
           f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} | {r['peak_bytes'] / MiB:.1f} |"
           for r in rows]
    write_result(Path(args.out), "fusion-eager-glm4", {"meta": meta, "rows": rows},
                 "\n".join(md))


if __name__ == "__main__":
    main()
