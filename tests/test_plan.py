"""The parallel plan: one frozen object, validated in one place, spelled and parsed back, with
the command line's flags generated from its fields."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from glmc.errors import ConfigError
from glmc.parallel.data import Parallel
from glmc.parallel.plan import ParallelPlan, StepOptions

PLANS = [ParallelPlan(), ParallelPlan(nproc=4, zero=1),
         ParallelPlan(nproc=8, pp=2, microbatches=8, schedule="interleaved", zero=1),
         ParallelPlan(zero=0, compress="powersgd", compress_rank=4, compress_warmup=10,
                      bucket_mb=12.5, overlap=False, timeout_s=60.0),
         ParallelPlan(nproc=8, zero=0, nodes=2, hierarchical="on", intra_link="nvlink4",
                      inter_link="10us:12.5GBps", accumulate=4)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.spelling() or "single")
def test_spelling_parses_back_to_an_equal_plan(plan: ParallelPlan) -> None:
    assert ParallelPlan.parse(plan.spelling()) == plan
    assert plan.problems() == []


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.spelling() or "single")
def test_flags_are_generated_from_the_fields_and_give_the_plan_back(plan: ParallelPlan) -> None:
    parser = argparse.ArgumentParser()
    ParallelPlan.add_arguments(parser)
    assert ParallelPlan.from_args(parser.parse_args(plan.flags())) == plan
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(ParallelPlan)}  # one flag per field


def test_strategy_and_degrees() -> None:
    assert ParallelPlan().strategy == "single"
    assert ParallelPlan(nproc=2).strategy == "data" == ParallelPlan(zero=3).strategy
    assert ParallelPlan(nproc=4, pp=2).strategy == "pipeline"
    assert ParallelPlan(pp=2).degrees(8) == {"pp": 2, "dp": 4}
    with pytest.raises(ConfigError, match="do not divide into 3 pipeline stages"):
        ParallelPlan(pp=3).degrees(8)
    # what each launched process runs: no nproc, ZeRO 0 unless asked (or pipelined)
    assert ParallelPlan(nproc=4).for_rank() == ParallelPlan(zero=0)
    assert ParallelPlan(nproc=4, pp=2).for_rank() == ParallelPlan(pp=2)


@pytest.mark.parametrize("plan,step,message", [
    (ParallelPlan(zero=5), None, "--zero: 5 is not a ZeRO stage"),
    (ParallelPlan(nproc=0), None, "--nproc: must be positive"),
    (ParallelPlan(schedule="wave"), None, "--schedule: unknown schedule 'wave'"),
    (ParallelPlan(bucket_mb=4.0), None, "--bucket-mb needs --nproc or --zero"),
    (ParallelPlan(compress="topk"), None, "--compress needs --nproc or --zero"),
    (ParallelPlan(zero=0, compress="zip"), None, "--compress: unknown method 'zip'"),
    (ParallelPlan(zero=0, compress_rank=2), None, "--compress-rank needs --compress METHOD"),
    (ParallelPlan(zero=0, compress="topk", compress_block=64), None,
     "--compress-block needs --compress sign"),
    (ParallelPlan(nodes=2), None, "--nodes / --hierarchical / --intra-link / --inter-link"),
    (ParallelPlan(nproc=6, nodes=4), None, "--nodes 4 does not divide --nproc 6"),
    (ParallelPlan(zero=2, hierarchical="on"), None, "--hierarchical on needs --zero 0 or 1"),
    (ParallelPlan(zero=2, compress="sign"), None, "--compress sign needs --zero 0 or 1"),
    (ParallelPlan(zero=0, intra_link="carrier-pigeon"), None, "--intra-link: "),
    (ParallelPlan(microbatches=4), None, "--microbatches / --schedule / --cut need --pp"),
    (ParallelPlan(cut="2"), None, "--microbatches / --schedule / --cut need --pp"),
    (ParallelPlan(nproc=4, pp=2, zero=2), None, "--pp 2 --zero 2: a pipeline stage sums"),
    (ParallelPlan(nproc=3, pp=2), None, "--nproc must be a multiple of 2"),
    (ParallelPlan(pp=2), StepOptions(precision="auto"), "--pp: --precision auto"),
    (ParallelPlan(pp=2), StepOptions(passes="cleanup"), "--pp: --passes cannot apply"),
    (ParallelPlan(pp=2), StepOptions(backend="ort"), "--pp: --backend ort runs functional"),
    (ParallelPlan(zero=1), StepOptions(export=True), "exporting a data-parallel or pipelined"),
])
def test_every_rule_is_the_plans(plan: ParallelPlan, step: StepOptions | None,
                                 message: str) -> None:
    problems = plan.problems(step)
    assert any(message in p for p in problems), problems
    with pytest.raises(ConfigError, match="plan: "):
        plan.validate(step)


def test_parse_errors_are_typed() -> None:
    with pytest.raises(ConfigError, match="cannot read 'tp'"):
        ParallelPlan.parse("tp")
    with pytest.raises(ConfigError, match="zero='one' is not a valid int"):
        ParallelPlan.parse("zero=one")
    with pytest.raises(ConfigError, match="overlap='maybe'"):
        ParallelPlan.parse("overlap=maybe")


def test_the_api_takes_a_plan_for_data_parallelism() -> None:
    p = Parallel.of(ParallelPlan(nproc=2, zero=1, bucket_mb=5.0, compress="topk",
                                 compress_ratio=0.05))
    assert (p.zero, p.bucket_mb, p.compress) == (1, 5.0, {"method": "topk", "ratio": 0.05})
    assert Parallel.of("zero=2,accumulate=2") == Parallel(zero=2, accumulate=2)
    assert Parallel.of(ParallelPlan()) is None
    with pytest.raises(ConfigError, match="pipeline plan"):
        Parallel.of(ParallelPlan(pp=2))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow),
                                     pytest.param("ort", marks=pytest.mark.slow)])
def test_one_process_accumulates_like_the_whole_batch(backend: str) -> None:
    """`--accumulate 2` on one process (issue 36 item 5): the batch in 2 micro-batches, the
    first through the micro program (running sums, no update), one update — the losses,
    parameters and optimizer state of eager PyTorch on the whole batch; the reported loss is
    the mean over the micro-batches. k may change between steps (1/k is a step input)."""
    import glmc
    from glmc.runtime.strategy import Accumulating
    from glmc.trace.capture import split_batch
    from tests.models import ATOL, CASES, RTOL, assert_state_close, eager_losses, glmc_losses, twin
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(CASES["glm"].make)
    want = eager_losses(m2, x, loss_fn, opt2, 3)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend=backend,
                            parallel=ParallelPlan(accumulate=2))
    assert isinstance(trainer.strategy, Accumulating)
    got = glmc_losses(trainer, x, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_state_close(m, m2, opt, opt2)
    names = [p.name for p in trainer.report.compiles[-1].history]
    assert "accumulate" in names
    trainer.strategy.accumulate = 4  # 4 one-row micro-batches: a new shape, still one update
    loss = trainer.step(*split_batch(x)[0])
    assert torch.isfinite(loss)
    with pytest.raises(glmc.InputError, match="do not split into accumulate=3"):
        trainer.strategy.accumulate = 3
        trainer.step(*split_batch(x)[0])
