"""`glmc train FILE`: a training run over real data, with checkpoints that survive being killed,
exact resume, an LR schedule and live metrics. The step is compiled as `glmc compile` compiles
it (every backend, pass and parallel option).

    glmc train model.py --data train.bin --seq-len 256 --batch-size 8 --steps 300 \\
        --checkpoint-dir ckpt --checkpoint-every 50 --lr-schedule cosine --warmup 20
    glmc train model.py ... --resume        # continues from the newest complete checkpoint

Data: a token file (`glmc.runtime.data.TokenFile`: nanoGPT's flat uint16/uint32 ids) cut into
batches laid out like the FILE's example batch, or the FILE's own `data` (any iterable of
batches; on resume the batches already trained on are skipped by iterating past them, so it
must yield the same batches in the same order each run).

Resume is exact: the model, the optimizer, glmc's own state (loss scale), the data position,
the RNG states and the step come back, so the losses and parameters after a kill and a resume
equal an uninterrupted run's (tested). SIGTERM (a spot instance's notice) writes a checkpoint
and exits with status 143.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from glmc.errors import CheckpointError, ConfigError, GlmcError, InputError

SCHEDULES = ("constant", "cosine", "linear")


def add_arguments(t: Any) -> None:
    """`glmc train`'s own options (the compile options are added beside them)."""
    t.add_argument("--data", default=None, metavar="FILE",
                   help="a token file (flat uint16/uint32 ids, nanoGPT's format); without it "
                        "the FILE's `data` iterable is used")
    t.add_argument("--token-dtype", default="uint16", choices=("uint16", "uint32"),
                   help="with --data: the ids' dtype (default uint16)")
    t.add_argument("--seq-len", type=int, default=None, metavar="S",
                   help="with --data: tokens per sequence (default: the example batch's)")
    t.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="with --data: the global batch in sequences (default: the example's)")
    t.add_argument("--seed", type=int, default=0, help="data shuffling seed (default 0)")
    t.add_argument("--eos-id", type=int, default=None, metavar="ID",
                   help="with --data: train on documents (the runs of ids up to each "
                        "end-of-text ID, --seq-len the longest) padded to shape buckets, "
                        "instead of fixed windows")
    t.add_argument("--buckets", default="4", metavar="K|L1,L2,..",
                   help="with --eos-id: K bucket lengths placed to minimise padding "
                        "(default 4), or the lengths themselves; 1 pads all to --seq-len")
    t.add_argument("--token-budget", type=int, default=None, metavar="T",
                   help="with --eos-id: tokens per batch; a batch of bucket L holds T // L "
                        "sequences (default: --batch-size x --seq-len)")
    t.add_argument("--pad-id", type=int, default=0, metavar="ID",
                   help="with --eos-id: the input id of padding (labels get -100; default 0)")
    t.add_argument("--checkpoint-dir", default=None, metavar="D",
                   help="write checkpoints here (atomic, checked by a manifest)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="with --checkpoint-dir: a checkpoint every K steps (and at the end)")
    t.add_argument("--incremental-every", type=int, default=0, metavar="J",
                   help="with --checkpoint-dir: between full checkpoints, one every J steps "
                        "written as its exact difference from the last full one (one process)")
    t.add_argument("--keep", type=int, default=3, metavar="M",
                   help="with --checkpoint-dir: keep the newest M checkpoints (default 3)")
    t.add_argument("--sync-checkpoints", action="store_true",
                   help="write checkpoints in the training thread (default: in the background)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    t.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="with --nproc: torchrun restarts the job up to R times when a rank "
                        "fails; the restarted ranks resume from the newest checkpoint")
    t.add_argument("--lr-schedule", default="constant", choices=SCHEDULES,
                   help="the learning rate over the run: constant (default), cosine or linear "
                        "decay to --min-lr-ratio, after --warmup steps of linear warm-up")
    t.add_argument("--warmup", type=int, default=0, metavar="N", help="warm-up steps")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="R",
                   help="the final learning rate as a fraction of the optimizer's (default 0.1)")
    t.add_argument("--log-every", type=int, default=1, metavar="N",
                   help="print the progress line every N steps (default 1)")
    t.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the metrics as TensorBoard events into DIR (needs the "
                        "tensorboard package)")
    t.add_argument("--metrics", default=None, metavar="FILE",
                   help="metrics.jsonl path (default: in --report-dir, else --checkpoint-dir)")


def usage_problems(args: Any) -> list[str]:
    out = []
    if args.resume and not args.checkpoint_dir:
        out.append("--resume needs --checkpoint-dir")
    if args.checkpoint_every and not args.checkpoint_dir:
        out.append("--checkpoint-every needs --checkpoint-dir")
    if args.incremental_every and not args.checkpoint_dir:
        out.append("--incremental-every needs --checkpoint-dir")
    if args.incremental_every and args.plan.strategy != "single":
        out.append("--incremental-every: multi-process checkpoints (DCP) are full only; "
                   "drop it with --nproc / --zero / --pp")
    if args.max_restarts and not (args.plan.nproc and args.checkpoint_dir):
        out.append("--max-restarts needs --nproc and --checkpoint-dir (restarted ranks "
                   "resume from the newest checkpoint)")
    if args.checkpoint_every < 0 or args.incremental_every < 0 or args.keep < 1 or args.warmup < 0 or args.log_every < 1:
        out.append("--checkpoint-every and --warmup must be >= 0, --keep and --log-every >= 1")
    if not args.data and (args.seq_len or args.batch_size or args.eos_id is not None):
        out.append("--seq-len / --batch-size / --eos-id need --data")
    if args.eos_id is None and args.token_budget:
        out.append("--token-budget needs --eos-id (documents in shape buckets)")
    if args.plan.strategy == "pipeline" and args.eos_id is not None:
        out.append("--eos-id with --pp: a pipeline is compiled for one micro-batch shape; "
                   "train it on fixed windows (drop --eos-id)")
    if args.plan.strategy == "pipeline" and args.checkpoint_dir and args.plan.zero:
        out.append("--checkpoint-dir with --pp and --zero 1: checkpoints of pipelines with "
                   "sharded optimizer state are not supported yet; use --zero 0")
    return out


def train(args: Any) -> int:
    from glmc.frontend.workload import load_workload
    from glmc.runtime.metrics import Meter, lr_factor

    work = load_workload(args.file)
    source, example, tokens = _data(args, work)
    run = _Run(args, _trainer(args, work, example, source), source)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts
    if restarted and args.checkpoint_dir:
        run.say(f"glmc: restart {restarted} of "
                f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} (a rank failed)")
    start, base_lr = run.resume() if args.resume or (restarted and args.checkpoint_dir) else \
        (0, run.learning_rates())
    if start >= args.steps:
        run.say(f"glmc: the checkpoint is at step {start}, not before --steps {args.steps}")
        return 0
    metrics = Path(args.metrics) if args.metrics else \
        Path(args.report_dir or args.checkpoint_dir or ".") / "metrics.jsonl"
    flops, peak = run.model_flops()
    meter = Meter(args.steps, tokens, flops, peak, metrics if run.lead else None,
                  args.log_every, None if run.lead else open(os.devnull, "w"),
                  args.tensorboard if run.lead else None)
    stop = _on_sigterm()
    batches = source.iterate()
    try:
        for i in range(start, args.steps):
            factor = lr_factor(i, args.steps, args.lr_schedule, args.warmup, args.min_lr_ratio)
            groups = run.param_groups()
            for g, lr in zip(groups, base_lr):
                g["lr"] = lr * factor
            batch = _next_batch(batches, run, i, base_lr)
            t0 = time.perf_counter()
            loss = run.step(batch)
            tokens = run.tokens(source.tokens(batch))
            if run.lead:
                meter.step(i, loss, groups[0]["lr"], time.perf_counter() - t0, tokens=tokens,
                           flops=_flops(run.trainer, batch) if source.buckets() else None)
            done, stopping = i + 1, run.agreed(stop.is_set())
            full = done == args.steps or stopping or (
                args.checkpoint_every and done % args.checkpoint_every == 0)
            delta = args.incremental_every and done % args.incremental_every == 0
            if run.ckpt is not None and (full or delta):
                run.save(done, base_lr, incremental=not full)
            if stopping:
                run.wait()
                print(f"glmc: SIGTERM: checkpoint of step {done} written; exiting",
                      file=sys.stderr)
                return 143
    except BaseException:
        run.wait()  # a checkpoint in flight completes before the error propagates
        raise
    finally:
        source.close()
        meter.close()
    if run.lead:
        _finish(args, run, meter, source)
    run.close()
    return 0


def _next_batch(batches: Any, run: "_Run", step: int, base_lr: list[float]) -> Any:
    """The next batch; when the data source raises, the steps trained so far are
    checkpointed first (the error then propagates, with the checkpoint named)."""
    try:
        return next(batches)
    except StopIteration:
        error: BaseException = ConfigError(
            f"data: the FILE's `data` ran out after {step} batches; give it more (or "
            "cycle it) or lower --steps")
    except GlmcError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - any error of the user's iterator
        error = InputError(f"data: the data source raised {type(e).__name__}: {e}")
        error.__cause__ = e
    if run.ckpt is not None and step > 0 and not run.saved(step):
        run.save(step, base_lr)
        run.wait()
        run.say(f"glmc: the data source failed at step {step}; checkpoint of step {step} "
                "written, resume with --resume once the data is fixed")
    raise error


def _trainer(args: Any, work: Any, example: Any, source: Any) -> Any:
    """The compiled step, as `glmc compile` compiles it: a Trainer (one process, data
    parallel, accumulation) or a PipelineTrainer (--pp)."""
    plan = args.plan
    if plan.strategy == "pipeline":
        from glmc.parallel.pipeline import plan_trainer
        return plan_trainer(plan, work.model, work.optimizer, work.loss_fn, example,
                            memory_budget=args.memory_budget, backend=args.backend,
                            precision=args.precision, fusion=bool(args.fusion))
    from glmc.frontend.api import optimize
    data = plan.strategy == "data"
    return optimize(work.model, example, loss_fn=work.loss_fn, optimizer=work.optimizer,
                    backend=args.backend, passes=args.passes,
                    memory_budget=args.memory_budget, precision=args.precision,
                    fusion=args.fusion, strict=args.strict, disable=tuple(args.disable),
                    profile=args.profile, progress=_rank() == 0,
                    step_cache=None if args.step_cache in ("off", "none", "") else
                    args.step_cache, clip_grad_norm=args.clip_grad_norm,
                    parallel=plan.data_parallel() if data else
                    (plan if plan.accumulate > 1 else None),
                    max_cache=max(8, len(source.buckets()) + 1),
                    local_batches=data and bool(args.data))


class _Run:
    """What differs between one process, data parallelism and a pipeline: the checkpointer
    (one file written in the background, or DCP shards written by every rank together),
    resume, the optimizers an LR schedule sets, who speaks (rank 0; a pipeline's first
    replica's last stage, which has the loss), and agreeing on a SIGTERM."""

    def __init__(self, args: Any, trainer: Any, source: Any) -> None:
        from glmc.runtime.checkpoint import Checkpointer, ShardedCheckpointer
        self.args, self.trainer, self.source = args, trainer, source
        self.kind = args.plan.strategy  # "single", "data" or "pipeline"
        self.lead = (trainer.last and trainer.replica == 0 and trainer.tp_rank == 0) \
            if self.kind == "pipeline" else _rank() == 0
        self.ckpt: Any = None
        if args.checkpoint_dir:
            self.ckpt = Checkpointer(args.checkpoint_dir, args.keep, not args.sync_checkpoints) \
                if self.kind == "single" else ShardedCheckpointer(args.checkpoint_dir, args.keep)

    def say(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)

    def param_groups(self) -> list[dict[str, Any]]:
        opts = self.trainer.optimizers if self.kind == "pipeline" else [self.trainer.optimizer]
        return [g for o in opts for g in o.param_groups]

    def tokens(self, mine: int | None) -> int | None:
        """This step's tokens over every rank when each counts its own (data parallel with
        buckets: each rank reads its rows), else `mine`."""
        if mine is None or self.kind != "data":
            return mine
        import torch
        import torch.distributed as dist
        t = torch.tensor([mine])
        dist.all_reduce(t)
        return int(t.item()) // (self.args.plan.tp or 1)  # a tp group counts its rows once

    def learning_rates(self) -> list[float]:
        return [g["lr"] for g in self.param_groups()]

    def step(self, batch: Any) -> float | None:
        if isinstance(batch, dict):
            loss = self.trainer.step(**batch)
        else:
            loss = self.trainer.step(*batch)
        return None if loss is None else loss.item()

    def model_flops(self) -> tuple[float | None, float | None]:
        """(model FLOPs per step, the device's achievable rate): MFU's parts; a pipeline's
        stages hold no whole-step graph, so its MFU is left out."""
        if self.kind == "pipeline":
            return None, None
        from glmc.analysis.predict import graph_device
        from glmc.runtime.metrics import achievable_flops, step_flops
        graph = self.trainer.graph
        return step_flops(graph), achievable_flops(graph_device(graph))

    def agreed(self, flag: bool) -> bool:
        """Whether any rank was told to stop (every rank then checkpoints the same step)."""
        if self.kind == "single":
            return flag
        import torch
        import torch.distributed as dist
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _sharded(self) -> dict[str, Any]:
        if self.kind == "pipeline":
            return self.trainer.sharded_state_dict()
        dp = self.trainer.parallel
        return {**dp.sharded_state_dict(self.trainer.model, self.trainer.optimizer),
                "layout": "data parallel"}

    def save(self, step: int, base_lr: list[float], incremental: bool = False) -> None:
        from glmc.runtime.checkpoint import snapshot
        extra = {"base_lr": base_lr}
        if self.kind == "single":
            self.ckpt.save(step, snapshot(self.trainer.model, self.trainer.optimizer,
                                          self.trainer, self.source.position(), step, extra),
                           incremental)
        else:
            self.ckpt.save(step, self._sharded(), {"data": self.source.position(),
                                                   "extra": extra,
                                                   "glmc": self.trainer.state_dict()})

    def wait(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()

    def saved(self, step: int) -> bool:
        """Whether this run already checkpointed `step`."""
        self.wait()
        return any(s.step == step for s in self.ckpt.saved)

    def resume(self) -> tuple[int, list[float]]:
        """(the step to continue at, the base learning rates) from the newest complete
        checkpoint in --checkpoint-dir, restored into the model, optimizer, trainer, RNGs and
        data source."""
        from glmc.runtime.checkpoint import latest, load, load_sharded, restore
        base_lr = self.learning_rates()
        found = latest(Path(self.args.checkpoint_dir), report=lambda m: self.say(f"glmc: {m}"))
        if found is None:
            self.say(f"glmc: no complete checkpoint in {self.args.checkpoint_dir}; starting "
                     "at step 0")
            return 0, base_lr
        if self.kind == "single":
            state = load(found)
            restore(state, self.trainer.model, self.trainer.optimizer, self.trainer,
                    where=str(found))
            if self.ckpt is not None:  # incremental checkpoints go on against it
                self.ckpt.rebase(found, state)
        else:
            sharded = self._sharded()
            state = load_sharded(found, sharded)
            if self.kind == "data":
                self.trainer.parallel.load_sharded(sharded, self.trainer.model,
                                                   self.trainer.optimizer)
            else:  # a pipeline: tensor-parallel stages' interleaved blocks
                self.trainer.load_sharded(sharded)
            if state.get("glmc"):
                self.trainer.load_state_dict(state["glmc"])
        self.source.load_state_dict(state["data"])
        start = int(state["step"])
        self.say(f"glmc: resumed from {found} at step {start}")
        # a pipeline rank's groups are its stages': the FILE's rates, not the saved list
        return start, base_lr if self.kind == "pipeline" else \
            state["extra"].get("base_lr", base_lr)

    def close(self) -> None:
        if self.kind == "pipeline":
            import torch.distributed as dist
            dist.destroy_process_group()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _finish(args: Any, run: _Run, meter: Any, source: Any) -> None:
    ckpt = run.ckpt
    if ckpt is not None:
        ckpt.wait()
        for e in ckpt.errors:
            print(f"glmc: {e}", file=sys.stderr)
        for kind in ("full", "incremental"):
            done = [s for s in ckpt.saved if s.kind == kind]
            if done:
                print(f"checkpoints: {len(done)} {kind} written to {args.checkpoint_dir} "
                      f"({sum(s.bytes for s in done) / len(done) / 2**20:.1f} MiB, "
                      f"{sum(s.seconds for s in done) / len(done):.2f} s each, in the "
                      f"{'background' if ckpt.background else 'step'})")
    if run.kind == "pipeline":
        return  # `glmc compile --pp --report-dir` reports a pipeline's plan and timeline
    trainer = run.trainer
    trainer.report.training = meter.curve()
    if source.buckets():
        print(f"compiled steps: {len(trainer.report.compiles)} for buckets {source.buckets()}")
    print(trainer.report.summary())
    if args.report_dir:
        for path in trainer.write_report(args.report_dir):
            print(f"report: {path}")


def _flops(trainer: Any, batch: Any) -> float | None:
    """The model FLOPs of the step compiled for this batch's shapes (counted once per shape,
    kept on the trainer's compiled entry)."""
    from glmc.runtime.metrics import step_flops
    entry = trainer.entry_for(**batch) if isinstance(batch, dict) else trainer.entry_for(*batch)
    if entry is None or entry.graph is None:
        return None
    if entry.model_flops is None:
        entry.model_flops = step_flops(entry.graph)
    return entry.model_flops


class _TokenSource:
    """Batches cut from a token file: fixed windows (TokenBatches) or documents in shape
    buckets (glmc.runtime.buckets.BucketBatches)."""

    def __init__(self, batches: Any) -> None:
        self.batches, self.prefetch = batches, None

    def tokens(self, batch: Any) -> int | None:
        from glmc.runtime.buckets import real_tokens
        return real_tokens(batch) if self.buckets() else None

    def buckets(self) -> list[int]:
        return list(getattr(self.batches, "buckets", []))

    def iterate(self) -> Any:
        from glmc.runtime.data import Prefetch
        self.prefetch = Prefetch(self.batches)
        return iter(self.prefetch)

    def position(self) -> dict[str, Any]:
        return self.prefetch.consumed_state() if self.prefetch else self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()


class _IterableSource:
    """The FILE's `data`: its position is the count of batches handed out; resuming skips
    that many (the iterable must repeat itself run to run)."""

    def __init__(self, data: Any) -> None:
        self.data, self.count, self.skip = data, 0, 0

    def iterate(self) -> Any:
        it = iter(self.data)
        for _ in range(self.skip):
            next(it)
        self.count = self.skip
        for batch in it:
            self.count += 1
            yield batch

    def position(self) -> dict[str, Any]:
        return {"batches": self.count}

    def tokens(self, batch: Any) -> None:
        return None  # the first batch's count (Meter's default) stands for every batch

    def buckets(self) -> list[int]:
        return []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches" not in state:
            raise CheckpointError("resume: the checkpoint was written reading a token file; "
                                  "resume with the same --data")
        self.skip = int(state["batches"])

    def close(self) -> None:
        pass


def _data(args: Any, work: Any) -> tuple[Any, Any, int | None]:
    """(source, example batch to compile with, tokens per step or None)."""
    from glmc.runtime.data import BatchLayout, TokenBatches, TokenFile
    from glmc.trace.capture import batch_leaves, split_batch
    if args.data:
        layout = BatchLayout.of(work.example_inputs)
        ids = work.example_inputs["input_ids"] if layout.keyword else work.example_inputs[0]
        seq_len = args.seq_len or int(ids.shape[1])
        batch_size = args.batch_size or int(ids.shape[0])
        if args.eos_id is not None:
            return _bucket_source(args, work, layout, seq_len, batch_size)
        rank, world = _data_rank(args)
        batches = TokenBatches(TokenFile(args.data, seq_len, args.token_dtype), batch_size,
                               layout, args.seed, rank, world)
        import torch

        from glmc.runtime.data import local_rows
        example = layout.make(torch.stack([batches.source.window(i) for i in
                                           local_rows(range(batch_size), rank, world)]))
        return _TokenSource(batches), example, batches.tokens_per_batch()
    if work.data is None:
        raise ConfigError(f"{args.file}: glmc train needs data: pass --data TOKENS.bin, or "
                          "define `data` (an iterable of batches) in the FILE")
    data = work.data
    first = next(iter(data))
    if iter(data) is data:  # a one-shot iterator (a generator): the first batch goes back in
        import itertools
        data = itertools.chain([first], data)
    leaves = batch_leaves(split_batch(first))
    # token ids: the first integer leaf's elements (no count for float inputs: images)
    tokens = next((int(t.numel()) for t in leaves if not t.dtype.is_floating_point), None)
    return _IterableSource(data), first, tokens


def _bucket_source(args: Any, work: Any, layout: Any, seq_len: int, batch_size: int
                   ) -> tuple[Any, Any, None]:
    """Documents of --data in shape buckets: (source, the first batch as the example, None)."""
    from glmc.runtime.buckets import BucketBatches, TokenDocs, parse_buckets
    docs = TokenDocs(args.data, seq_len, args.eos_id, args.token_dtype, min_len=2)
    buckets = parse_buckets(args.buckets, docs.lengths, seq_len)
    multiple = int(os.environ.get("WORLD_SIZE", "1")) * max(1, args.plan.accumulate)
    mask = isinstance(work.example_inputs, dict) and "attention_mask" in work.example_inputs
    batches = BucketBatches(docs, buckets, args.token_budget or batch_size * seq_len, layout,
                            args.seed, multiple, args.pad_id, mask, *_data_rank(args))
    if _rank() == 0:
        s = docs.summary()
        print(f"glmc: {s['sequences']:,} sequences (mean {s['mean_len']:.0f}, longest "
              f"{s['max_len']} tokens) in buckets {buckets} of {batches.rows} rows", flush=True)
    example = batches.batch(batches.plan(0)[0])
    return _TokenSource(batches), example, None


def _data_rank(args: Any) -> tuple[int, int]:
    """(rank, ranks) whose rows this process reads: its own with data parallelism (the
    trainer is told: `local_batches`), the whole batch otherwise (a pipeline's replicas and
    stages cut what they need from it)."""
    if args.plan.strategy != "data":
        return 0, 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.plan.tp or 1  # a tensor-parallel group reads its replica's rows together
    return _rank() // tp, world // tp


def _on_sigterm() -> Any:
    """An event set by SIGTERM (the loop checkpoints and exits at the step's end)."""
    import threading
    event = threading.Event()
    try:
        signal.signal(signal.SIGTERM, lambda *_: event.set())
    except ValueError:  # not the main thread (a test calling main() from a thread)
        pass
    return event


__all__ = ["train", "add_arguments", "usage_problems", "SCHEDULES"]
