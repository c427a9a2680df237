"""Variable sequence lengths: tokens/s and compiled steps on a long-tailed corpus, shape buckets
with a token budget against padding every batch to the longest sequence, interleaved.

The corpus: `--docs` documents with log-normal lengths (sigma 1) clipped to `--max-len`, mean
about a third of it (`glmc.runtime.buckets.synthetic_corpus`). The model: the GLM example's
architecture at `--dim`/`--layers`/`--vocab`. Contenders, each its own model copy and data
stream over the same corpus, same token budget (`--rows` x `--max-len` tokens per batch):

* `pad to max`: one bucket, every batch `rows x max_len`;
* `glmc buckets=k`: `--buckets` lengths chosen to minimise padding, `budget // L` rows each;
* `torch.compile buckets=k` (`--torch`): eager model + loss + AdamW under torch.compile (its
  default dynamic-shape handling) on the same bucketed stream, for the recompile count.

After every contender has compiled every shape (`--warmup` steps each), `--rounds` rounds of
`--block` steps each, contenders interleaved; tokens/s = unpadded tokens over step time summed
over the measured steps. Recompiles: compiled steps (glmc) / graphs compiled (torch).

    python benchmarks/bench_buckets.py --torch
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import ROOT, cpu_name, run_meta, write_result  # noqa: E402

from glmc.runtime.buckets import (BucketBatches, TokenDocs, choose_buckets,  # noqa: E402
                                  real_tokens, synthetic_corpus)
from glmc.runtime.data import BatchLayout  # noqa: E402


def _glm():
    spec = importlib.util.spec_from_file_location("glm_example", ROOT / "examples" / "glm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["glm_example"] = mod
    spec.loader.exec_module(mod)
    return mod


class _Glmc:
    def __init__(self, model, example, backend):
        import glmc
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.trainer = glmc.optimize(model, example, optimizer=self.opt, backend=backend,
                                     max_cache=16)

    def step(self, batch):
        return self.trainer.step(*batch)

    def compiles(self):
        return len(self.trainer.report.compiles)


class _Torch:
    def __init__(self, model, example, backend):
        self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=3e-4,
                                                        weight_decay=0.1)
        self.fn = torch.compile(lambda a, b: self.model(a, b))
        torch._dynamo.utils.counters.clear()

    def step(self, batch):
        loss = self.fn(*batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def compiles(self):
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8, help="pad-to-max batch rows (sets the budget)")
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per batch shape")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--torch", action="store_true", help="add torch.compile on the buckets")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    glm = _glm()
    heads = max(1, a.dim // 64)
    cfg = glm.GLMConfig(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=heads,
                        kv_heads=max(1, heads // 2), ffn=a.dim * 8 // 3 // 8 * 8,
                        seq=a.max_len, batch=a.rows)
    corpus = Path(tempfile.mkdtemp()) / "corpus.bin"
    synthetic_corpus(corpus, a.docs, a.max_len, a.max_len / 3 * 1.15, a.vocab, eos=0)
    docs = TokenDocs(corpus, a.max_len, eos=0, min_len=2)
    layout = BatchLayout(keyword=False, shifted=False)  # the example model shifts its labels
    budget = a.rows * a.max_len
    chosen = choose_buckets(docs.lengths, a.buckets, a.max_len)
    torch.manual_seed(0)
    base = glm.GLM(cfg)
    contenders = [("pad to max", [a.max_len], _Glmc), (f"glmc buckets={a.buckets}", chosen, _Glmc)]
    if a.torch:
        contenders.append((f"torch.compile buckets={a.buckets}", chosen, _Torch))
    runs = []
    for name, buckets, kind in contenders:
        data = BucketBatches(docs, buckets, budget, layout, seed=0)
        first = data.next_batch()
        t0 = time.perf_counter()
        runner = kind(copy.deepcopy(base), first, a.backend)
        runner.step(first)
        seen: dict[tuple, int] = {}
        for _ in range(a.warmup * len(buckets) * 4):  # every shape compiled, run warmup times
            batch = data.next_batch()
            runner.step(batch)
            seen[tuple(batch[0].shape)] = seen.get(tuple(batch[0].shape), 0) + 1
            if len(seen) == len(buckets) and min(seen.values()) >= a.warmup:
                break
        runs.append({"name": name, "buckets": buckets, "rows": data.rows, "data": data,
                     "runner": runner, "warmup_s": time.perf_counter() - t0, "tokens": 0,
                     "padded": 0, "seconds": 0.0, "steps": 0})
        print(f"{name}: buckets {buckets} rows {data.rows}, warm-up {runs[-1]['warmup_s']:.1f} s",
              flush=True)
    for _ in range(a.rounds):
        for r in runs:
            for _ in range(a.block):
                batch = r["data"].next_batch()
                t0 = time.perf_counter()
                r["runner"].step(batch).item()
                r["seconds"] += time.perf_counter() - t0
                r["tokens"] += real_tokens(batch)
                r["padded"] += batch[0].numel()
                r["steps"] += 1
    rows = [{"contender": r["name"], "buckets": r["buckets"], "rows": r["rows"],
             "compiled_steps": r["runner"].compiles(), "steps": r["steps"],
             "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
             "padding_fraction": round(1 - r["tokens"] / r["padded"], 3),
             "warmup_s": round(r["warmup_s"], 1)} for r in runs]
    ref = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_pad_to_max"] = round(row["tokens_per_s"] / ref, 3)
    meta = run_meta("bench_buckets.py")
    s = docs.summary()
    md = [f"GLM example architecture (dim {a.dim}, {a.layers} layers, vocab {a.vocab}), "
          f"{a.backend}; corpus {s['sequences']:,} documents, mean {s['mean_len']:.1f} / max "
          f"{s['max_len']} tokens (log-normal); token budget {budget} per batch; "
          f"{a.rounds}x{a.block} interleaved steps after {a.warmup} warm-up per shape; {meta['date']}, "
          f"{cpu_name()}, torch {meta['torch']}", "",
          "| contender | buckets | rows | compiled steps | padding | tokens/s | vs pad to max |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['contender']} | {r['buckets']} | {r['rows']} | {r['compiled_steps']} | "
           f"{r['padding_fraction'] * 100:.0f}% | {r['tokens_per_s']:,.0f} | "
           f"{r['vs_pad_to_max']:.2f}x |" for r in rows]
    write_result(Path(a.out), "buckets", {**meta, "cpu": cpu_name(), "corpus": s,
                                          "budget": budget, "rows": rows}, "\n".join(md))


if __name__ == "__main__":
    main()
