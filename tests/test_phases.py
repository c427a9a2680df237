"""Per-phase profile (glmc.analysis.phases) and the fused in-place optimizer update on Inductor."""
from __future__ import annotations

import json

import pytest
import torch

import glmc
from glmc.errors import ConfigError
from tests.models import CASES, RTOL, assert_state_close, eager_losses, glmc_losses, twin


def _mlp_adamw():
    model, x, loss_fn, _ = CASES["mlp"].make()
    return model, x, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _check_profile(prof) -> None:
    assert prof.steps == 2
    for phase in ("forward", "backward", "optimizer"):
        assert prof.phases[phase] > 0, (phase, prof.phases)
    # the phases and the time outside kernels add up to the step (medians of the same steps)
    assert sum(prof.phases.values()) == pytest.approx(prof.step_seconds, rel=0.25)
    assert prof.kernels and all(0 < sum(k["phases"].values()) <= 1.001 for k in prof.kernels)
    assert prof.top("optimizer"), "the update's kernels are named"


def test_eager_profile_has_every_phase(tmp_path) -> None:
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False)
    before = [p.detach().clone() for p in m.parameters()]
    prof = trainer.profile_phases(*x, steps=2)
    _check_profile(prof)
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters())), \
        "profiled steps train"
    trace = json.loads(prof.write_trace(tmp_path / "trace.json").read_text())
    assert {e["cat"] for e in trace["traceEvents"]} >= {"forward", "backward", "optimizer"}
    # the profile lands in the report
    data = trainer.report.to_dict()
    assert data["compiles"][-1]["phases"]["phases"]["backward"] > 0
    assert "backward" in trainer.report.summary()


def test_profile_rejects_zero_steps() -> None:
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False, predict=False)
    with pytest.raises(ConfigError, match="steps"):
        trainer.profile_phases(*x, steps=0)


def test_inductor_fused_update_in_place_and_profiled() -> None:
    """On Inductor the default pipeline runs AdamW as ATen's fused kernel, in place on the
    user's tensors (one `glmc::fused_adam_` call in the compiled wrapper, no functional copy),
    with parity; the per-phase profile attributes every kernel call of the wrapper."""
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(_mlp_adamw)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="inductor",
                            measure=False, predict=False)
    regions = [r for r in trainer.report.compiles[0].history[0].stats.regions
               if r["pattern"] == "optimizer"]
    assert regions and "_fused_adamw" in regions[0]["op"], regions
    got = glmc_losses(trainer, x, 3)
    want = eager_losses(m2, x, loss_fn, opt2, 3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=1e-5)
    assert_state_close(m, m2, opt, opt2)
    sites = trainer.entry_for(*x).step.instrument.sites()
    names = [s.name for s in sites]
    assert names.count("glmc.fused_adam_.default") == 1, names
    assert not any("_fused_adamw" in n for n in names), "the functional form would copy"
    prof = trainer.profile_phases(*x, steps=2)
    _check_profile(prof)
    unattributed = [k for k in prof.kernels if k["kernel"] == "(not attributed)"]
    assert not unattributed, unattributed


def test_profile_with_torch_compile_reference_leaves_the_model_alone() -> None:
    """`reference=True` times torch.compile (model + loss) with the same optimizer on a copy of
    the model, in the same loop; the user's model trains only through glmc's steps."""
    (m, x, loss_fn, opt), (m2, _, _, opt2) = twin(_mlp_adamw)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False, predict=False)
    glmc_losses(trainer, x, 1)
    prof = trainer.profile_phases(*x, steps=2, reference=True)
    ref = prof.reference
    assert set(ref) == {"forward", "backward", "optimizer", "step"}
    assert all(v > 0 for v in ref.values()) and ref["step"] >= ref["backward"]
    assert "torch.compile" in trainer.report.summary()
    # three glmc steps in all (one + two profiled) = three eager steps: the copy did not leak
    eager_losses(m2, x, loss_fn, opt2, 3)
    assert_state_close(m, m2, opt, opt2)


def test_cpu_steps_keep_freed_memory_without_page_faults() -> None:
    """glmc.runtime.hostalloc on a CPU trainer: the report says the policy is in force, and a large
    block freed and allocated again is not faulted in again (glibc only)."""
    import platform
    import resource
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the policy needs glibc")
    (m, x, loss_fn, opt), _ = twin(CASES["mlp"].make)
    trainer = glmc.optimize(m, x, loss_fn=loss_fn, optimizer=opt, backend="eager",
                            measure=False, predict=False)
    assert "keeps freed memory" in trainer.report.compiles[0].host_memory
    assert "host memory" in trainer.report.summary()
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.ones(16 << 20)  # 64 MiB, every page written
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del t
    assert faults[-1] < 1000, faults  # 16384 pages when each block is a fresh mmap
