"""Training data: a memory-mapped token file (nanoGPT's format) cut into language-model batches,
with deterministic shuffling, a resumable position and a background prefetch thread.

    data = TokenBatches(TokenFile("train.bin", seq_len=256), batch_size=8, seed=0)
    for batch in Prefetch(data):              # (ids, labels) or {"input_ids", "labels"}
        trainer.step(*batch)
    state = data.state_dict()                 # {"seed", "epoch", "index"}: part of a checkpoint

The file is a flat array of token ids (uint16 for vocabularies up to 65,536, else uint32),
nothing else — what nanoGPT's `prepare.py` writes. It is cut into non-overlapping windows of
`seq_len + 1` tokens; each epoch visits every window once in an order drawn from
(`seed`, epoch) with torch's generator, so a run resumed at (epoch, index) reads exactly the
batches the uninterrupted run would have read.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from glmc.errors import InputError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenFile:
    """A flat file of token ids as windows of `seq_len + 1` tokens (`len(self)` of them)."""

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16") -> None:
        self.path = Path(path)
        if dtype not in DTYPES:
            raise InputError(f"data: token dtype {dtype!r}; use one of {sorted(DTYPES)}")
        if not self.path.is_file():
            raise InputError(f"data: {self.path}: no such token file")
        if seq_len < 1:
            raise InputError(f"data: --seq-len must be >= 1, got {seq_len}")
        size = self.path.stat().st_size
        width = np.dtype(DTYPES[dtype]).itemsize
        if size % width:
            raise InputError(f"data: {self.path} has {size:,} bytes, not a multiple of {width} "
                             f"({dtype} token ids); is it a token file of another dtype, or "
                             "truncated?")
        self.dtype, self.seq_len = dtype, seq_len
        self.tokens = np.memmap(self.path, dtype=DTYPES[dtype], mode="r")
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise InputError(f"data: {self.path} holds {len(self.tokens)} tokens, fewer than one "
                             f"sequence of {seq_len} + 1")

    def __len__(self) -> int:
        return self.windows

    def window(self, i: int) -> torch.Tensor:
        """Window i: `seq_len + 1` token ids as int64."""
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


@dataclass
class BatchLayout:
    """How a batch is laid out for the model, read off the FILE's example batch: a tuple
    `(ids, labels)` or a dict with `input_ids` and `labels`; labels either the same ids (the
    model shifts them, transformers' convention) or the next tokens."""

    keyword: bool
    shifted: bool  #: labels are the next token (else the ids themselves)

    @staticmethod
    def of(example: Any) -> "BatchLayout":
        if isinstance(example, dict) and "input_ids" in example and "labels" in example:
            ids, labels, keyword = example["input_ids"], example["labels"], True
        elif isinstance(example, (tuple, list)) and len(example) == 2 and \
                all(isinstance(t, torch.Tensor) for t in example):
            (ids, labels), keyword = example, False
        else:
            raise InputError("data: a token file feeds models whose example batch is (ids, "
                             "labels) or {'input_ids': ..., 'labels': ...}; define `data` in "
                             "the FILE (an iterable of batches) for other layouts")
        if ids.shape != labels.shape or ids.dim() != 2:
            raise InputError(f"data: the example's ids {tuple(ids.shape)} and labels "
                             f"{tuple(labels.shape)} must both be (batch, seq)")
        return BatchLayout(keyword, not torch.equal(ids, labels))

    def make(self, windows: torch.Tensor) -> Any:
        ids = windows[:, :-1]
        labels = windows[:, 1:] if self.shifted else ids
        ids, labels = ids.contiguous(), labels.clone()
        return {"input_ids": ids, "labels": labels} if self.keyword else (ids, labels)


def local_rows(picks: Any, rank: int, world: int) -> Any:
    """Rank `rank`'s block of a global batch's rows: what the data-parallel trainer would cut
    from the whole batch, read without reading the rest."""
    n = len(picks) // world
    return picks[rank * n:(rank + 1) * n]


class TokenBatches:
    """Batches of `batch_size` windows of a TokenFile, forever, epoch after epoch, each
    epoch in the order drawn from (seed, epoch). The position is (epoch, index): index is the
    next batch of the epoch; an epoch's remainder (fewer windows than a batch) is skipped.
    With `world` > 1 each batch is only rank `rank`'s rows of the global batch."""

    def __init__(self, source: TokenFile, batch_size: int, layout: BatchLayout | None = None,
                 seed: int = 0, rank: int = 0, world: int = 1) -> None:
        if batch_size < 1 or batch_size > len(source):
            raise InputError(f"data: --batch-size {batch_size} must be between 1 and the "
                             f"{len(source)} sequences of {source.path}")
        if batch_size % world:
            raise InputError(f"data: --batch-size {batch_size} does not divide by {world} "
                             "data-parallel ranks")
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.rank, self.world = rank, world  #: this rank reads rows [r B/W, (r+1) B/W)
        self.layout = layout or BatchLayout(False, True)
        self.epoch, self.index = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def per_epoch(self) -> int:
        return len(self.source) // self.batch_size

    def order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.source), generator=g))
        return self._order[1]

    def next_batch(self) -> Any:
        if self.index >= self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        picks = self.order(self.epoch)[self.index * self.batch_size:
                                       (self.index + 1) * self.batch_size]
        picks = local_rows(picks, self.rank, self.world)
        self.index += 1
        return self.layout.make(torch.stack([self.source.window(int(i)) for i in picks]))

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next_batch()

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.source.seq_len

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise InputError(f"data: the checkpoint's data seed {state['seed']} differs from "
                             f"this run's {self.seed}; resume with the same --seed")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class Prefetch:
    """Batches of `source` made `depth` ahead on a background thread (pinned, for a non-blocking
    copy, when the step runs on CUDA). Iterating yields them in order; an error raised by the
    source is raised here, at the batch it belongs to. The position to checkpoint is the
    source's as of the last batch *consumed*: `consumed_state()`."""

    def __init__(self, source: TokenBatches, depth: int = 2, pin: bool = False) -> None:
        self.source, self.pin = source, pin
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._consumed = source.state_dict()  # before the thread moves the source on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True, name="glmc-prefetch")
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self.source.next_batch()
                if self.pin:
                    batch = _map(batch, lambda t: t.pin_memory())
                item = (batch, self.source.state_dict(), None)
            except BaseException as e:  # delivered to the consumer, in order
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self) -> Any:
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._consumed = state
        return batch

    def consumed_state(self) -> dict[str, int]:
        """The source's position after the last batch handed out."""
        return dict(self._consumed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _map(batch: Any, fn: Any) -> Any:
    if isinstance(batch, dict):
        return {k: fn(v) for k, v in batch.items()}
    return tuple(fn(t) for t in batch)


__all__ = ["TokenFile", "TokenBatches", "BatchLayout", "Prefetch", "DTYPES", "local_rows"]
