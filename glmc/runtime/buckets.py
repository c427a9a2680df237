"""Variable sequence lengths without a recompile storm: documents of a token file batched into a
few shape buckets, each batch holding about the same number of tokens.

    docs = TokenDocs("train.bin", max_len=512, eos=50256)        # documents split at end-of-text
    lengths = choose_buckets(docs.lengths, 4)                     # e.g. [64, 128, 256, 512]
    data = BucketBatches(docs, lengths, token_budget=8 * 512, layout=layout, seed=0)
    for batch in data: trainer.step(*batch)                      # 4 shapes: 4 compiles at most

A document is the run of ids up to and including an end-of-text id; one longer than `max_len`
tokens is cut into pieces (windows of `max_len + 1` tokens overlapping by one, as `TokenFile`
cuts the whole file). Every sequence is padded on the right to the smallest bucket that holds
it: input ids with `pad_id`, labels with -100 (the ignore index of PyTorch's and transformers'
cross-entropy, so padding adds nothing to the loss or the gradients), and `attention_mask`
zeros when the model takes one. Right padding with a causal model changes nothing the real
tokens see; a bidirectional model needs the mask.

Token budget: a batch of bucket L holds `token_budget // L` sequences (rounded down to a
multiple of `multiple`, the data-parallel ranks times the accumulation count), so short
sequences come many to a batch and every step carries about the same number of tokens — the
per-step effect of the usual `accum = max(1, base * avg_len // cur_len)` rule, with one
compiled step per bucket instead of one per accumulation count. Batches are drawn per epoch in
an order fixed by (seed, epoch); the position is (epoch, index), part of a checkpoint.

`choose_buckets` places k bucket lengths to minimise the padded tokens of the corpus (dynamic
programming over the distinct lengths, rounded up to `align`), the longest always `max_len`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from glmc.errors import InputError
from glmc.runtime.data import BatchLayout, local_rows

IGNORE_INDEX = -100


class TokenDocs:
    """The documents of a flat token file (nanoGPT's format), split at `eos`, as sequences of
    at most `max_len` positions (`max_len + 1` tokens: inputs and next-token labels)."""

    def __init__(self, path: str | Path, max_len: int, eos: int, dtype: str = "uint16",
                 min_len: int = 1) -> None:
        from glmc.runtime.data import TokenFile
        whole = TokenFile(path, max_len, dtype)  # checks the file, its size and dtype
        self.path, self.max_len, self.eos = whole.path, max_len, eos
        self.tokens = whole.tokens
        ends = np.flatnonzero(self.tokens == eos) + 1  # a document ends after its eos
        if not len(ends) or ends[-1] != len(self.tokens):
            ends = np.append(ends, len(self.tokens))
        starts = np.concatenate(([0], ends[:-1]))
        sizes = ends - starts  # tokens per document, eos included
        # a document of n tokens holds n - 1 positions; cut into pieces of <= max_len positions
        pieces = np.maximum(1, -(-(sizes - 1) // max_len))
        first = np.repeat(starts, pieces)
        k = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        begin = first + k * max_len
        end = np.minimum(begin + max_len + 1, np.repeat(ends, pieces))
        keep = (end - begin - 1) >= max(1, min_len)
        self.begin, self.lengths = begin[keep], (end - begin - 1)[keep]
        if not len(self.begin):
            raise InputError(f"data: {self.path} has no document of >= {max(1, min_len)} "
                             f"tokens between end-of-text ids {eos}; is --eos-id right?")

    def __len__(self) -> int:
        return len(self.begin)

    def window(self, i: int) -> torch.Tensor:
        """Sequence i: its `length + 1` token ids as int64."""
        b = int(self.begin[i])
        return torch.from_numpy(self.tokens[b:b + int(self.lengths[i]) + 1].astype(np.int64))

    def summary(self) -> dict[str, float]:
        return {"sequences": len(self), "mean_len": float(self.lengths.mean()),
                "max_len": int(self.lengths.max()), "tokens": int(self.lengths.sum())}


def choose_buckets(lengths: np.ndarray, k: int, max_len: int | None = None,
                   align: int = 8) -> list[int]:
    """k bucket lengths (ascending, the last `max_len`) that minimise the padded tokens of
    sequences of these `lengths`, each bucket a multiple of `align` (or `max_len`)."""
    if k < 1:
        raise InputError(f"data: --buckets must be >= 1, got {k}")
    top = int(max_len or lengths.max())
    rounded = np.minimum(-(-np.asarray(lengths) // align) * align, top)
    values, counts = np.unique(rounded, return_counts=True)
    if values[-1] != top:
        values, counts = np.append(values, top), np.append(counts, 0)
    n = len(values)
    k = min(k, n)
    # cost[i][j]: sequences with values[i..j] padded to values[j]
    csum = np.concatenate(([0], np.cumsum(counts)))
    wsum = np.concatenate(([0], np.cumsum(counts * values)))

    def cost(i: int, j: int) -> int:
        return int((csum[j + 1] - csum[i]) * values[j] - (wsum[j + 1] - wsum[i]))

    inf = float("inf")
    best = [[inf] * n for _ in range(k + 1)]  # best[b][j]: b buckets cover values[..j], ending at j
    back = [[-1] * n for _ in range(k + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(n):
            for i in range(b - 2, j):
                c = best[b - 1][i] + cost(i + 1, j)
                if c < best[b][j]:
                    best[b][j], back[b][j] = c, i
    b = min(range(1, k + 1), key=lambda b: best[b][n - 1])
    out, j = [], n - 1
    while b >= 1 and j >= 0:
        out.append(int(values[j]))
        j, b = back[b][j], b - 1
    return sorted(out)


def parse_buckets(spec: str, lengths: np.ndarray, max_len: int) -> list[int]:
    """`--buckets`: a count k (lengths chosen by `choose_buckets`) or ascending lengths
    `64,128,512` (the last must be >= the longest sequence)."""
    try:
        values = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"data: --buckets {spec!r}: give a count (4) or lengths (64,128,512)") \
            from None
    if len(values) == 1:
        return choose_buckets(lengths, values[0], max_len)
    if values != sorted(set(values)) or values[0] < 1:
        raise InputError(f"data: --buckets {spec!r}: lengths must be ascending and >= 1")
    if values[-1] < int(lengths.max()):
        raise InputError(f"data: --buckets {spec!r}: the longest bucket {values[-1]} is shorter "
                         f"than the longest sequence ({int(lengths.max())}); add {max_len}")
    return values


class BucketBatches:
    """Batches of `TokenDocs` sequences padded to bucket lengths, `token_budget // length` rows
    each (a multiple of `multiple`), forever, epoch after epoch; resumable like TokenBatches."""

    def __init__(self, docs: TokenDocs, buckets: list[int], token_budget: int,
                 layout: BatchLayout, seed: int = 0, multiple: int = 1, pad_id: int = 0,
                 mask: bool = False, rank: int = 0, world: int = 1) -> None:
        self.docs, self.buckets, self.layout = docs, list(buckets), layout
        self.seed, self.pad_id, self.mask = seed, pad_id, mask
        self.rank, self.world = rank, world  #: each batch: this rank's rows (multiple of world)
        self.bucket_of = np.searchsorted(np.asarray(self.buckets), docs.lengths)
        self.rows = [max(1, token_budget // length) // multiple * multiple
                     for length in self.buckets]
        if min(self.rows) < 1:
            raise InputError(f"data: --token-budget {token_budget} holds no batch of "
                             f"{multiple} sequence(s) of {self.buckets[-1]} tokens; raise it to "
                             f">= {multiple * self.buckets[-1]}")
        self.epoch, self.index = 0, 0
        self._plan: tuple[int, list[np.ndarray]] | None = None
        if not self.per_epoch:
            raise InputError(f"data: {docs.path} fills no batch of any bucket ({self.rows} "
                             f"rows of {self.buckets}); lower --token-budget")

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches (arrays of sequence indices), in the order trained."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.docs), generator=g).numpy()
        batches: list[np.ndarray] = []
        for b, rows in enumerate(self.rows):
            mine = order[self.bucket_of[order] == b]
            batches += [mine[i:i + rows] for i in range(0, len(mine) - rows + 1, rows)]
        shuffle = torch.randperm(len(batches), generator=g).tolist()
        self._plan = (epoch, [batches[i] for i in shuffle])
        return self._plan[1]

    @property
    def per_epoch(self) -> int:
        return len(self.plan(self.epoch))

    def next_batch(self) -> Any:
        plan = self.plan(self.epoch)
        if self.index >= len(plan):
            self.epoch, self.index = self.epoch + 1, 0
            plan = self.plan(self.epoch)
        picks = plan[self.index]
        self.index += 1
        return self.batch(picks)

    def batch(self, picks: np.ndarray) -> Any:
        """The batch of these sequences (this rank's rows of it), padded to its bucket."""
        # the bucket is the whole batch's (every rank compiles the same shapes)
        length = self.buckets[int(self.bucket_of[picks].max())]
        return pad_batch([self.docs.window(int(i)) for i in
                          local_rows(picks, self.rank, self.world)], [length], self.layout,
                         self.pad_id, self.mask)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def tokens_per_batch(self) -> None:
        return None  # varies: counted per batch (`real_tokens`)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index,
                "buckets": list(self.buckets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed or list(state.get("buckets", [])) != self.buckets:
            raise InputError(f"data: the checkpoint read seed {state['seed']} with buckets "
                             f"{state.get('buckets')}, this run {self.seed} with {self.buckets}; "
                             "resume with the same --seed and --buckets")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def pad_batch(windows: list[torch.Tensor], buckets: list[int], layout: BatchLayout,
              pad_id: int = 0, mask: bool = False) -> Any:
    """Windows (each `n + 1` tokens) as one batch padded on the right to the smallest bucket
    that holds the longest: ids `pad_id`, labels -100, `attention_mask` 0 (with `mask`)."""
    longest = max(len(w) - 1 for w in windows)
    length = buckets[int(np.searchsorted(np.asarray(buckets), longest))]
    ids = torch.full((len(windows), length), pad_id, dtype=torch.int64)
    labels = torch.full((len(windows), length), IGNORE_INDEX, dtype=torch.int64)
    attention = torch.zeros((len(windows), length), dtype=torch.int64)
    for r, w in enumerate(windows):
        n = len(w) - 1
        ids[r, :n] = w[:-1]
        labels[r, :n] = w[1:] if layout.shifted else w[:-1]
        attention[r, :n] = 1
    if not layout.keyword:
        return ids, labels
    out = {"input_ids": ids, "labels": labels}
    if mask:
        out["attention_mask"] = attention
    return out


def synthetic_corpus(path: str | Path, docs: int, max_len: int, mean_len: float, vocab: int,
                     eos: int, seed: int = 0, sigma: float = 1.0) -> np.ndarray:
    """Write a token file of `docs` random documents whose lengths follow a long-tailed
    (log-normal, `sigma`) distribution with about `mean_len` positions, clipped to
    [2, max_len], each ended by `eos`; returns the lengths (for tests and benchmarks)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean_len) - sigma ** 2 / 2
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, docs)), 2, max_len).astype(np.int64)
    ids = rng.integers(0, vocab - 1, int(lengths.sum()) + docs)
    ids[ids >= eos] += 1  # eos only at the ends
    ids[np.cumsum(lengths + 1) - 1] = eos
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    ids.astype(dtype).tofile(path)
    return lengths


def real_tokens(batch: Any) -> int:
    """Positions of a batch that carry a label (not padding)."""
    labels = batch["labels"] if isinstance(batch, dict) else batch[1]
    return int((labels != IGNORE_INDEX).sum())


__all__ = ["TokenDocs", "BucketBatches", "choose_buckets", "parse_buckets", "real_tokens",
           "synthetic_corpus", "pad_batch", "IGNORE_INDEX"]
