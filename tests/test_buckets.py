"""Variable sequence lengths (issue 39): documents in shape buckets with a token budget."""
from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from glmc.errors import InputError
from glmc.runtime.buckets import (IGNORE_INDEX, BucketBatches, TokenDocs, choose_buckets,
                                  pad_batch, parse_buckets, real_tokens,
                                  synthetic_corpus)
from glmc.runtime.data import BatchLayout

ROOT = Path(__file__).resolve().parent.parent


def _padding(lengths: np.ndarray, buckets: list[int]) -> int:
    return int(np.asarray(buckets)[np.searchsorted(buckets, lengths)].sum() - lengths.sum())


def test_documents_are_split_at_eos_and_cut_to_the_longest(tmp_path: Path) -> None:
    ids = np.array([5, 6, 0, 7, 8, 9, 10, 11, 12, 0, 3, 0, 4, 4], dtype=np.uint16)
    ids.tofile(tmp_path / "d.bin")
    docs = TokenDocs(tmp_path / "d.bin", max_len=4, eos=0)
    # [5 6 0] -> 2 positions; [7..12 0] (7 tokens) -> pieces of 4 and 2 positions (overlap one);
    # [3 0] -> 1; the unterminated tail [4 4] -> 1
    assert docs.lengths.tolist() == [2, 4, 2, 1, 1]
    assert docs.window(1).tolist() == [7, 8, 9, 10, 11]
    assert docs.window(2).tolist() == [11, 12, 0]
    assert TokenDocs(tmp_path / "d.bin", 4, 0, min_len=2).lengths.tolist() == [2, 4, 2]
    with pytest.raises(InputError, match="--eos-id"):
        TokenDocs(tmp_path / "d.bin", 4, eos=9, min_len=20)


def test_chosen_buckets_minimise_padding() -> None:
    """The dynamic programme's k lengths pad no more than any other choice of k lengths from
    the (aligned) lengths present, the longest always the maximum."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(3, 1, 400).astype(int), 1, 96)
    values = sorted(set(np.minimum(-(-lengths // 8) * 8, 96).tolist()) | {96})
    for k in (1, 2, 3):
        got = choose_buckets(lengths, k, 96)
        assert got[-1] == 96 and len(got) == k
        best = min(_padding(lengths, [*c, 96])
                   for c in itertools.combinations(values[:-1], k - 1))
        assert _padding(lengths, got) == best
    assert parse_buckets("16,96", lengths, 96) == [16, 96]
    with pytest.raises(InputError, match="shorter than the longest"):
        parse_buckets("16,32", lengths, 96)


def test_bucket_batches_hold_the_token_budget_and_resume(tmp_path: Path) -> None:
    synthetic_corpus(tmp_path / "c.bin", 600, 64, 20, 256, eos=0)
    docs = TokenDocs(tmp_path / "c.bin", 64, 0, min_len=2)
    layout = BatchLayout(keyword=False, shifted=True)
    make = lambda: BucketBatches(docs, [16, 32, 64], 256, layout, seed=2, multiple=2)  # noqa: E731
    a = make()
    assert a.rows == [16, 8, 4]
    first = [a.next_batch() for _ in range(a.per_epoch + 3)]  # into the second epoch
    shapes = {tuple(ids.shape) for ids, _ in first}
    assert shapes <= {(16, 16), (8, 32), (4, 64)} and len(shapes) == 3
    for ids, labels in first:  # labels are the next ids; padding is ignored by the loss
        real = labels != IGNORE_INDEX
        assert torch.equal(ids[:, 1:][real[:, :-1] & real[:, 1:]],
                           labels[:, :-1][real[:, :-1] & real[:, 1:]])
        assert (ids[~real] == 0).all() and real[:, 0].all()
    assert real_tokens(first[0]) == int((first[0][1] != IGNORE_INDEX).sum())
    b = make()
    b.load_state_dict(a.state_dict())
    c = make()
    for _ in range(len(first)):
        c.next_batch()
    assert all(torch.equal(x[0], y[0]) for x, y in
               zip((b.next_batch() for _ in range(4)), (c.next_batch() for _ in range(4))))
    with pytest.raises(InputError, match="same --seed and --buckets"):
        BucketBatches(docs, [32, 64], 256, layout, seed=2).load_state_dict(a.state_dict())


def test_each_rank_reads_its_own_rows(tmp_path: Path) -> None:
    """Data parallel: each rank's batch is its block of the global batch's rows (what the
    trainer would cut from it), padded to the global batch's bucket; windows likewise."""
    from glmc.runtime.data import TokenBatches, TokenFile
    synthetic_corpus(tmp_path / "c.bin", 600, 64, 20, 256, eos=0)
    docs = TokenDocs(tmp_path / "c.bin", 64, 0, min_len=2)
    layout = BatchLayout(keyword=False, shifted=True)
    make = lambda r, w: BucketBatches(docs, [16, 32, 64], 256, layout, seed=1,  # noqa: E731
                                      multiple=2, rank=r, world=w)
    whole, parts = make(0, 1), [make(0, 2), make(1, 2)]
    for _ in range(12):
        ids, labels = whole.next_batch()
        (a, la), (b, lb) = (p.next_batch() for p in parts)
        assert torch.equal(torch.cat([a, b]), ids) and torch.equal(torch.cat([la, lb]), labels)
    f = TokenFile(tmp_path / "c.bin", 16)
    whole, parts = TokenBatches(f, 4, layout, 3), [TokenBatches(f, 4, layout, 3, r, 2)
                                                   for r in (0, 1)]
    for _ in range(5):
        ids, _ = whole.next_batch()
        assert torch.equal(torch.cat([p.next_batch()[0] for p in parts]), ids)
    with pytest.raises(InputError, match="does not divide by 2"):
        TokenBatches(f, 3, layout, 0, 0, 2)


def test_padding_to_a_bucket_leaves_loss_and_gradients_unchanged() -> None:
    """Right padding with ignored labels: the GLM example's loss and gradients on a padded
    batch equal those on the same sequences unpadded (causal attention never looks right)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import glm
    model = glm.GLM(glm.CONFIGS["tiny"])
    windows = [torch.randint(1, 256, (n + 1,), generator=torch.Generator().manual_seed(n))
               for n in (9, 9)]
    layout = BatchLayout(keyword=False, shifted=False)  # the model shifts its labels
    padded = pad_batch(windows, [16, 32], layout)
    assert padded[0].shape == (2, 16)
    plain = torch.stack([w[:-1] for w in windows])
    losses, grads = [], []
    for ids, labels in (padded, (plain, plain)):
        model.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_glmc_train_compiles_once_per_bucket_and_resumes(tmp_path: Path) -> None:
    """`glmc train --eos-id`: a long-tailed corpus in 3 buckets compiles at most 3 steps, prints
    per-step tokens/s, and a run stopped at a checkpoint and resumed prints the losses of an
    uninterrupted run."""
    synthetic_corpus(tmp_path / "c.bin", 1500, 32, 11, 256, eos=0)
    common = [sys.executable, "-m", "glmc", "train", "examples/glm.py", "--backend", "eager",
              "--data", str(tmp_path / "c.bin"), "--eos-id", "0", "--buckets", "3",
              "--checkpoint-every", "5", "--seed", "3"]
    run = lambda *a: subprocess.run([*common, *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    whole = run("--steps", "12", "--checkpoint-dir", str(tmp_path / "a"))
    assert whole.returncode == 0, whole.stderr
    compiled = int(re.search(r"compiled steps: (\d+) for buckets \[(.*)\]", whole.stdout)[1])
    assert 1 <= compiled <= 3
    loss = re.compile(r"^step +(\d+) +loss ([\d.]+) .* tok/s", re.M)
    want = dict(loss.findall(whole.stdout))
    assert len(want) == 12
    first = run("--steps", "5", "--checkpoint-dir", str(tmp_path / "b"))
    rest = run("--steps", "12", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    assert rest.returncode == 0 and "at step 5" in rest.stdout, rest.stderr
    assert {**dict(loss.findall(first.stdout)), **dict(loss.findall(rest.stdout))} == want
