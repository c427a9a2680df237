"""`glmc train`: token data, checkpoints that survive kills, exact resume, metrics (issue 39)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from glmc.errors import CheckpointError, InputError
from glmc.runtime.checkpoint import Checkpointer, latest, load, restore, snapshot
from glmc.runtime.data import BatchLayout, Prefetch, TokenBatches, TokenFile
from glmc.runtime.metrics import lr_factor

ROOT = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"^step +(\d+) +loss ([\d.]+)", re.M)


def _tokens(path: Path, n: int = 20000, dtype=np.uint16, vocab: int = 256) -> Path:
    np.random.default_rng(0).integers(0, vocab, size=n).astype(dtype).tofile(path)
    return path


def test_token_file_batches_are_deterministic_and_resumable(tmp_path: Path) -> None:
    f = TokenFile(_tokens(tmp_path / "t.bin"), seq_len=32)
    assert len(f) == (20000 - 1) // 32
    layout = BatchLayout.of((torch.zeros(4, 32, dtype=torch.long),) * 2)  # labels = ids
    assert not layout.shifted
    a = TokenBatches(f, 4, layout, seed=3)
    first = [a.next_batch() for _ in range(5)]
    state = a.state_dict()
    after = [a.next_batch() for _ in range(3)]
    b = TokenBatches(f, 4, layout, seed=3)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, [b.next_batch() for _ in range(5)]))
    c = TokenBatches(f, 4, layout, seed=3)
    c.load_state_dict(state)  # a resumed reader reads exactly what the first one read next
    assert all(torch.equal(x[0], y[0]) for x, y in zip(after, [c.next_batch() for _ in range(3)]))
    shifted = BatchLayout.of({"input_ids": torch.zeros(2, 4, dtype=torch.long),
                              "labels": torch.ones(2, 4, dtype=torch.long)})
    ids_labels = shifted.make(f.window(0)[None])
    assert torch.equal(ids_labels["labels"][0, :-1], ids_labels["input_ids"][0, 1:])
    fetched = Prefetch(TokenBatches(f, 4, layout, seed=3))  # a background thread, same order
    got = [next(fetched) for _ in range(5)]
    assert fetched.consumed_state() == state
    fetched.close()
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, got))
    with pytest.raises(InputError, match="different .*seed|data seed"):
        TokenBatches(f, 4, layout, seed=4).load_state_dict(state)


def test_a_token_file_of_the_wrong_size_is_a_typed_error(tmp_path: Path) -> None:
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x00" * 7)
    with pytest.raises(InputError, match="not a multiple of 2"):
        TokenFile(bad, 4)
    with pytest.raises(InputError, match="fewer than one sequence"):
        TokenFile(_tokens(tmp_path / "short.bin", n=8), 32)


def _model_and_opt(width: int = 8):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoints_are_atomic_checked_and_fall_back(tmp_path: Path) -> None:
    """A complete checkpoint has a manifest (sizes, SHA-256) written last; `latest` skips, and
    names, a corrupt one, one without a manifest and a leftover temporary directory; a save
    that fails (a full disk) leaves the previous checkpoints intact and training goes on."""
    model, opt = _model_and_opt()
    ck = Checkpointer(tmp_path, keep=2)
    for step in (2, 4, 6):
        ck.save(step, snapshot(model, opt, None, {"epoch": 0, "index": step}, step))
    ck.wait()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000004", "step-00000006"]  # keep=2
    state = (tmp_path / "step-00000006" / "state.pt")
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    (tmp_path / "step-00000009").mkdir()  # killed before its manifest
    (tmp_path / ".step-00000010.tmp").mkdir()  # killed mid-write
    said: list[str] = []
    found = latest(tmp_path, report=said.append)
    assert found is not None and found.name == "step-00000004"
    assert any("step-00000006" in m and "checksum" in m for m in said)
    assert any("step-00000009" in m and "did not finish" in m for m in said)
    with pytest.raises(CheckpointError, match="checksum"):
        load(tmp_path / "step-00000006")
    other, other_opt = _model_and_opt(width=5)
    with pytest.raises(CheckpointError, match="another model"):
        restore(load(found), other, other_opt)

    import glmc.runtime.checkpoint as ckmod

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    real = ckmod.torch.save
    ckmod.torch.save = full
    try:
        with pytest.warns(UserWarning, match="No space left"):
            ck.save(8, snapshot(model, opt, None, {}, 8))
            ck.wait()
    finally:
        ckmod.torch.save = real
    assert ck.errors and "training goes on" in ck.errors[0]
    assert not list(tmp_path.glob(".step-00000008*"))  # no half-written directory left
    assert latest(tmp_path, report=said.append).name == "step-00000004"


def test_incremental_checkpoints_restore_exactly_and_keep_their_base(tmp_path: Path) -> None:
    """An incremental checkpoint is the exact XOR difference from the last full one: loading it
    gives the snapshot bit for bit (a tensor of another shape than the base's included), it is complete only while
    its full checkpoint is intact, and pruning keeps the full checkpoint kept deltas need."""
    from glmc.runtime import incremental
    model, opt = _model_and_opt(width=64)
    ck = Checkpointer(tmp_path, keep=2, background=False)
    ck.save(1, snapshot(model, opt, None, {"index": 1}, 1), incremental=True)  # no base: full
    assert ck.saved[-1].kind == "full"
    for step in (2, 3):
        model(torch.randn(3, 64)).sum().backward()
        opt.step()
        want = snapshot(model, opt, None, {"index": step}, step, {"t": torch.arange(step)})
        ck.save(step, want, incremental=True)
        assert ck.saved[-1].kind == "incremental"
    got = load(latest(tmp_path))
    assert got["step"] == 3 and got["data"] == {"index": 3}
    for (path, a), (_, b) in zip(incremental._tensors(want), incremental._tensors(got)):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # keep=2, and the base of both
        "step-00000001", "step-00000002", "step-00000003"]
    base = tmp_path / "step-00000001" / "state.pt"
    base.write_bytes(base.read_bytes()[:-10])
    said: list[str] = []
    assert latest(tmp_path, report=said.append) is None
    assert any("its full checkpoint step-00000001" in m for m in said)


_SAVER = r"""
import sys, time, torch
from glmc.runtime.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1], keep=3)
ck.save(1, {"step": 1, "w": torch.zeros(4)})
ck.wait()
ck.save(2, {"step": 2, "w": torch.randn(96, 1 << 20)})  # 384 MiB: killed while it is written
ck.wait()
time.sleep(60)
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL while a checkpoint is being written (its temporary directory exists): the
    previous checkpoint is the newest complete one and loads; the next save clears the rest."""
    import time
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not (tmp_path / ".step-00000002.tmp" / "state.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the save never started"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (tmp_path / "step-00000002").exists()  # killed before the rename
    found = latest(tmp_path)
    assert found is not None and found.name == "step-00000001"
    assert load(found)["step"] == 1
    ck = Checkpointer(tmp_path, keep=3, background=False)
    ck.save(2, {"step": 2})
    assert not list(tmp_path.glob(".step-*")) and load(latest(tmp_path))["step"] == 2


def test_lr_schedule_warms_up_and_decays() -> None:
    f = [lr_factor(i, 10, "cosine", 2, 0.1) for i in range(10)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == 1.0
    assert all(a >= b for a, b in zip(f[2:], f[3:])) and f[-1] > 0.1
    assert lr_factor(9, 10, "linear", 0, 0.0) == pytest.approx(0.1)


def _train(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "glmc", "train", "examples/glm.py",
                             "--backend", "eager", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _losses(text: str) -> dict[int, str]:
    return {int(i): v for i, v in LOSS.findall(text)}


def _until(proc: subprocess.Popen, pattern: str) -> str:
    """stdout lines up to and including the first that matches `pattern`."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.match(pattern, line):
            return "".join(seen)
    raise AssertionError("".join(seen) + proc.stderr.read())


def _checkpointed(proc: subprocess.Popen, root: Path, timeout: float = 300) -> None:
    """Wait until `root` holds a complete checkpoint (the first is written in the background,
    so a step's line can come before it is on disk); a kill after this must resume from one."""
    import time
    deadline = time.monotonic() + timeout
    while latest(root) is None:
        assert proc.poll() is None, "the run ended before its first checkpoint was complete"
        assert time.monotonic() < deadline, f"no complete checkpoint in {root} after {timeout} s"
        time.sleep(0.05)


def test_a_killed_run_resumes_exactly(tmp_path: Path) -> None:
    """12 steps over a token file with a checkpoint every 3 (cosine LR, warm-up): a run killed
    with SIGKILL after step 4 and resumed with --resume ends with the losses and parameters of
    an uninterrupted run, bit for bit; a run sent SIGTERM writes a checkpoint and exits 143."""
    data = _tokens(tmp_path / "t.bin")
    common = ["--data", str(data), "--steps", "12", "--checkpoint-every", "3",
              "--lr-schedule", "cosine", "--warmup", "2", "--seed", "5"]
    whole = _train(*common, "--checkpoint-dir", str(tmp_path / "a"), "--report-dir",
                   str(tmp_path / "rep"), "--metrics", str(tmp_path / "a" / "metrics.jsonl"))
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    want = _losses(out)
    assert sorted(want) == list(range(12))
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(12))
    assert all(r["tokens_per_s"] > 0 and "mfu" in r for r in rows)
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [r["step"] for r in report["training"]] == list(range(12))  # the report's curves
    assert "Training run" in (tmp_path / "rep" / "report.html").read_text()

    killed = _train(*common, "--checkpoint-dir", str(tmp_path / "b"))
    seen = _until(killed, r"step +4 ")  # 7 steps still to go: the kill lands first
    _checkpointed(killed, tmp_path / "b")
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    seen += killed.stdout.read()
    resumed = _train(*common, "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    start = int(re.search(r"resumed from .* at step (\d+)", out).group(1))
    assert start in (3, 6, 9), out
    got = {**_losses(seen), **_losses(out)}
    assert got == want  # the printed losses, digit for digit
    a, b = (load(tmp_path / d / "step-00000012") for d in ("a", "b"))
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for k, v in a["optimizer"]["state"].items():
        for key, t in v.items():
            assert torch.equal(t, b["optimizer"]["state"][k][key]), (k, key)

    term = _train(*common, "--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "0")
    _until(term, r"step +1 ")
    term.send_signal(signal.SIGTERM)
    out, err = term.communicate(timeout=120)
    assert term.returncode == 143, err
    saved = latest(tmp_path / "c")
    assert saved is not None and int(load(saved)["step"]) >= 2


def test_a_run_resumes_exactly_from_an_incremental_checkpoint(tmp_path: Path) -> None:
    """`--incremental-every`: with the final full checkpoint gone, --resume continues from the
    newest incremental one (applied to its full checkpoint) to the same losses and parameters."""
    data = _tokens(tmp_path / "t.bin")
    common = ["--data", str(data), "--steps", "8", "--checkpoint-every", "4",
              "--incremental-every", "3", "--sync-checkpoints",
              "--checkpoint-dir", str(tmp_path / "a")]
    whole = _train(*common)
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    assert re.search(r"checkpoints: 1 incremental", out), out
    want, final = _losses(out), load(tmp_path / "a" / "step-00000008")
    assert json.loads((tmp_path / "a" / "step-00000006" / "manifest.json").read_text())[
        "base"] == "step-00000004"
    import shutil
    shutil.rmtree(tmp_path / "a" / "step-00000008")
    again = _train(*common, "--resume")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0 and "at step 6" in out, err
    assert _losses(out) == {6: want[6], 7: want[7]}
    got = load(tmp_path / "a" / "step-00000008")
    for k, v in final["model"].items():
        assert torch.equal(v, got["model"][k]), k
    # resumed from a full checkpoint: the next delta is written against it, and decodes to
    # the state an uninterrupted run saved (the base must not alias the live optimizer state)
    from glmc.runtime import incremental
    shutil.copytree(tmp_path / "a" / "step-00000004", tmp_path / "b" / "step-00000004")
    again = _train(*common[:-1], str(tmp_path / "b"), "--resume")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0 and "at step 4" in out, err
    assert _losses(out) == {i: want[i] for i in range(4, 8)}
    a6, b6 = load(tmp_path / "a" / "step-00000006"), load(tmp_path / "b" / "step-00000006")
    assert json.loads((tmp_path / "b" / "step-00000006" / "manifest.json").read_text())[
        "base"] == "step-00000004"
    for (path, x), (_, y) in zip(incremental._tensors(a6), incremental._tensors(b6)):
        assert torch.equal(x, y), path


def test_tensorboard_events_are_written(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from glmc.runtime.metrics import Meter
    meter = Meter(3, tokens_per_step=64, tensorboard=str(tmp_path), out=open(os.devnull, "w"))
    for i in range(3):
        meter.step(i, 2.0 - i * 0.5, 1e-3, 0.01)
    meter.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [2.0, 1.5, 1.0]
    assert len(events.Scalars("train/tokens_per_s")) == 3


_FAILING_DATA = """
import sys
sys.path.insert(0, {examples!r})
import torch
import glm

model, example_inputs, _, optimizer = glm.workload("tiny")


def _data():
    g = torch.Generator().manual_seed(0)
    for i in range(100):
        if i == 5:
            raise ValueError("corrupt shard 3")
        ids = torch.randint(0, 256, (4, 32), generator=g)
        yield ids, ids.clone()


data = _data()
"""


def test_a_failing_data_source_is_checkpointed_first(tmp_path: Path) -> None:
    """The FILE's `data` (a generator: its first batch is the example and is trained on) raises
    at its sixth batch: the five steps trained are checkpointed, then a typed error names the
    source's exception."""
    (tmp_path / "model.py").write_text(_FAILING_DATA.format(examples=str(ROOT / "examples")))
    r = subprocess.run([sys.executable, "-m", "glmc", "train", str(tmp_path / "model.py"),
                        "--backend", "eager", "--steps", "8", "--checkpoint-dir",
                        str(tmp_path / "ck")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1
    assert sorted(_losses(r.stdout)) == list(range(5))
    assert "glmc: error: data: the data source raised ValueError: corrupt shard 3" in r.stderr
    assert load(latest(tmp_path / "ck"))["step"] == 5


def test_train_usage_errors() -> None:
    r = subprocess.run([sys.executable, "-m", "glmc", "train", "examples/glm.py", "--resume",
                        "--seq-len", "8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "--resume needs --checkpoint-dir" in r.stderr
    assert "--seq-len / --batch-size / --eos-id need --data" in r.stderr


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torchrun starts its workers in sessions of
    their own: a process-group kill would leave them running)."""
    import os
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dcp_tensors(path: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(path / "dcp"), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("plan", [  # by default the pipeline (data parallel resumes in the
    # torchrun restart below, ZeRO's DCP state in test_parallel's checkpoint tests)
    pytest.param(("--zero", "1"), marks=pytest.mark.slow), ("--pp", "2"),
                                  pytest.param(("--tp", "2"), marks=pytest.mark.slow),
                                  pytest.param(("--pp", "2", "--tp", "2", "--nproc", "4"),
                                               marks=pytest.mark.slow)],
                         ids=["zero1", "pipeline", "tensor", "pipeline_tensor"])
def test_a_killed_two_process_run_resumes_exactly(tmp_path: Path, plan: tuple) -> None:
    """The same on 2 processes, data parallel with ZeRO-1 (sharded optimizer state through DCP),
    a 2-stage pipeline (each rank its stage's state through DCP), tensor parallelism (each
    rank's blocks gathered into whole tensors) and, on 4 processes, a pipeline of 2
    tensor-parallel stages (each rank's blocks as DTensors), every rank's RNG states
    and the data position: the whole torchrun job killed with SIGKILL after step 9 and resumed
    prints the losses of an uninterrupted run and ends with the same saved state."""
    data = _tokens(tmp_path / "t.bin")
    common = ["--data", str(data), "--steps", "40", "--checkpoint-every", "4", "--nproc", "2",
              *plan, "--seed", "1"]
    whole = _train(*common, "--checkpoint-dir", str(tmp_path / "a"))
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    want = _losses(out)
    assert sorted(want) == list(range(40))
    assert "checkpoints: 10 full" in out
    killed = _train(*common, "--checkpoint-dir", str(tmp_path / "b"))
    seen = _until(killed, r"step +9 ")  # 30 steps (~0.5 s) still to go: the kill lands first
    _checkpointed(killed, tmp_path / "b")
    _kill_tree(killed.pid)  # the launcher, torchrun and both ranks
    killed.wait(timeout=60)
    seen += killed.stdout.read()
    resumed = _train(*common, "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    found = re.search(r"resumed from .* at step (\d+)\n", out)
    assert found and int(found.group(1)) in range(4, 40, 4), out
    assert {**_losses(seen), **_losses(out)} == want
    a = _dcp_tensors(tmp_path / "a" / "step-00000040", tmp_path / "a.pt")
    b = _dcp_tensors(tmp_path / "b" / "step-00000040", tmp_path / "b.pt")
    assert a.keys() == b.keys() and a["optim"]
    for part in ("model", "optim"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of the process below `root` that torchrun started as `rank`."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    for pid in parents:
        p, chain = pid, set()
        while p in parents and p not in chain:
            chain.add(p)
            p = parents[p]
        if root not in chain or pid == root:
            continue
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=%d" % rank in env:
            return pid
    return None


def test_a_killed_rank_is_restarted_by_torchrun_and_resumes(tmp_path: Path) -> None:
    """`--max-restarts 1`: one rank of a 2-process run killed with SIGKILL after step 9;
    torchrun restarts both, they resume from the newest checkpoint by themselves, and the
    losses (the last printed for each step) equal an uninterrupted run's."""
    import time
    data = _tokens(tmp_path / "t.bin")
    common = ["--data", str(data), "--steps", "30", "--checkpoint-every", "4", "--nproc", "2",
              "--seed", "2"]
    whole = _train(*common, "--checkpoint-dir", str(tmp_path / "a"))
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    want = _losses(out)
    job = _train(*common, "--checkpoint-dir", str(tmp_path / "b"), "--max-restarts", "1")
    seen = _until(job, r"step +9 ")
    _checkpointed(job, tmp_path / "b")
    pid = None
    for _ in range(100):
        pid = pid or _rank_pid(job.pid, 1)
        if pid:
            break
        time.sleep(0.05)
    assert pid is not None, "rank 1's process not found"
    import os
    os.kill(pid, signal.SIGKILL)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err
    assert "restart 1 of 1" in out and re.search(r"resumed from .* at step \d+", out), out
    assert {**_losses(seen), **_losses(out)} == want


def test_the_step_cache_skips_capture_and_passes_and_keys_what_matters(tmp_path: Path) -> None:
    """Warm start (issue 39): the second trainer of the same model, batch shapes, optimizer and
    options loads the optimized step (no capture, no passes) and trains to the same losses; a
    changed hyperparameter or batch shape is another key; an unreadable entry is replaced."""
    import glmc
    from tests.models import CASES, glmc_losses

    def trainer(**change):
        model, x, loss_fn, opt = CASES["glm"].make()
        for g in opt.param_groups:
            g.update(change)
        return glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                             step_cache=str(tmp_path)), x

    cold, x = trainer()
    warm, _ = trainer()
    assert cold.report.compiles[-1].step_cache.startswith("stored ")
    record = warm.report.compiles[-1]
    assert record.step_cache == "hit " + cold.report.compiles[-1].step_cache.split()[1]
    assert record.history == []  # no pass ran
    assert glmc_losses(cold, x, 3) == glmc_losses(warm, x, 3)
    other, _ = trainer(weight_decay=0.5)
    assert other.report.compiles[-1].step_cache.startswith("stored ")
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2
    for entry in tmp_path.iterdir():
        (entry / "graph.json").write_text("{not json")
    again, _ = trainer()
    assert again.report.compiles[-1].step_cache.startswith("stored ")


def test_a_warm_inductor_step_loads_the_compiled_artifact(tmp_path: Path) -> None:
    """Warm start with Inductor: the first trainer keeps Inductor's compiled step (and which
    vector ISAs it found usable) in the step cache entry; the second loads it instead of
    compiling and trains to the same losses, bit for bit (the same kernels)."""
    import glmc
    from tests.models import CASES, glmc_losses

    def trainer():
        model, x, loss_fn, opt = CASES["mlp"].make()
        return glmc.optimize(model, x, loss_fn=loss_fn, optimizer=opt, backend="inductor",
                             step_cache=str(tmp_path)), x

    cold, x = trainer()
    key = cold.report.compiles[-1].step_cache.split()[1]
    artifacts = list((tmp_path / key).glob("inductor-*.bin"))
    assert len(artifacts) == 1
    assert (tmp_path / key / artifacts[0].name.replace(".bin", ".isa.json")).is_file()
    want = glmc_losses(cold, x, 3)
    warm, _ = trainer()
    assert warm.report.compiles[-1].step_cache == f"hit {key}"
    assert glmc_losses(warm, x, 3) == want
    artifacts[0].write_bytes(b"not an artifact")  # unreadable: compiled again, same losses
    again, _ = trainer()
    assert glmc_losses(again, x, 3) == want


def test_gradient_clipping_inside_the_step_matches_torch() -> None:
    """`clip_grad_norm=` (the clip pass): the losses, parameters and optimizer state of eager
    PyTorch with `torch.nn.utils.clip_grad_norm_` before every `optimizer.step()`, with the
    clip active (the first step's gradient norm is well above max_norm); composed with
    accumulation, the norm is the whole step's."""
    import glmc
    from glmc.parallel.plan import ParallelPlan
    from glmc.trace.capture import LossModule, split_batch
    from tests.models import ATOL, CASES, RTOL, assert_state_close, glmc_losses, twin

    for accumulate in (1, 2):
        (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["glm"].make)
        trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                                clip_grad_norm=0.05,
                                parallel=ParallelPlan(accumulate=accumulate))
        assert "clip" in [p.name for p in trainer.report.compiles[-1].history]
        got = glmc_losses(trainer, x, 3)
        wrapper = LossModule(m2, loss_fn)
        args, kwargs = split_batch(x)
        want, norms = [], []
        for i in range(3):
            torch.manual_seed(i)
            opt2.zero_grad(set_to_none=True)
            loss = wrapper(*args, **kwargs)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)))
            opt2.step()
            want.append(loss.item())
        assert norms[0] > 0.1  # clipping changed the step
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
        assert_state_close(m, m2, opt, opt2)
