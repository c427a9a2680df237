"""Reproducer: MetaSchedule crashes in apache-tvm 0.27.0.post1 (x86_64 wheel) on a 64x64 matmul.

Why glmc's TVM backend has no `tune_trials` option yet. Run: python tools/tvm_metaschedule_repro.py CASE
  space     design space with the target's rules, no postprocessors, no mutators: works (3 spaces)
  mutator   the same with MutateComputeLocation (or MutateParallel) in the space: segfault
  tune      tune_tir, replay-trace search (no mutators), random cost model: segfault at
            "Initializing Task #0"
Needs psutil and cloudpickle (MetaSchedule's own dependencies) for `tune`.
"""
import sys

import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

A = te.placeholder((64, 64), name="A")
B = te.placeholder((64, 64), name="B")
k = te.reduce_axis((0, 64), name="k")
C = te.compute((64, 64), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
mod = tvm.IRModule({"main": te.create_prim_func([A, B, C])})
target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
rules = list(ms.schedule_rule.ScheduleRule.create("llvm"))[1:]  # without ApplyCustomRule
case = sys.argv[1] if len(sys.argv) > 1 else "space"
if case in ("space", "mutator"):
    mutators = {}
    if case == "mutator":
        compute_location = list(ms.mutator.Mutator.create("llvm"))[1]
        mutators = {compute_location: 1.0}
    space = ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=[],
                                              mutator_probs=mutators)
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=space, task_name="mm",
                         num_threads=1)
    print("design spaces:", len(ctx.generate_design_space()))
else:
    space = ms.space_generator.PostOrderApply(sch_rules="from-target",
                                              postprocs="from-target", mutator_probs={})
    db = ms.tir_integration.tune_tir(mod, target, "/tmp/glmc-ms-repro", max_trials_global=8,
                                     num_trials_per_iter=4, cost_model="random", space=space,
                                     strategy="replay-trace")
    print("records:", len(db.get_all_tuning_records()))
