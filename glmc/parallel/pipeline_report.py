"""The pipeline report: a pipelined run's plan and predictions next to its measurement, as
report.json (`pipeline_report`), a few printed lines (`summary`) and report.html with Chrome
traces of both timelines (`write_report`)."""
from __future__ import annotations

import time
from typing import Any

from glmc.planning.schedule import Action, ActionKind, Timeline, predicted_peaks, simulate


def _fused_spelling(fusion: Any) -> str:
    return fusion if isinstance(fusion, str) else "attention/norm/MLP"  # an older report


def _spans(timeline: Timeline | None) -> list[dict]:
    if timeline is None:
        return []
    return [{"rank": r, "action": str(a), "kind": a.kind.value, "start_s": s, "end_s": e}
            for a, (r, s, e) in sorted(timeline.spans.items(), key=lambda x: x[1][1:])]


def replay(schedule: Any, measured: Timeline) -> Timeline:
    """`schedule` simulated with each action's *measured* duration (a receive: only its part
    after its send finished, as the transfer; the rest was waiting, which the simulation
    derives again): what the schedule model predicts given perfect action times. Near the measured
    timeline, the schedule model holds and the remaining error is in the predicted action
    times."""
    K = ActionKind
    spans = measured.spans

    def seconds(a: Action) -> float:
        r, s, e = spans[a]
        if a.kind in (K.RECV_F, K.RECV_B):
            send = next((p for p in schedule.dag.predecessors(a)
                         if p.kind in (K.SEND_F, K.SEND_B)), None)
            return e - max(s, spans[send][2]) if send in spans else e - s
        return e - s
    return simulate(schedule, seconds)


def pipeline_report(plan: Any, measured: Any,
                    pipeline: Any = None) -> dict:
    """The plan's predictions next to the measurement, as plain data (report.json). With the
    captured `program`: each rank's peak predicted from its stages' graphs walked through the
    schedule (`glmc.planning.schedule.predicted_peaks`; else the plan's estimate), and the measured
    action times replayed through the schedule; with a memory budget, each stage's budget and
    what the recompute pass did on it."""
    program = pipeline.program if pipeline is not None else None
    sched_ranks = measured.timeline.num_ranks
    stages = []
    for i, s in enumerate(plan.stages):
        stages.append({"stage": i, "rank": i % sched_ranks, "blocks": list(s.blocks),
                       "profile": s.profile, "forward_s": s.forward_s,
                       "backward_s": s.backward_s, "update_s": s.update_s,
                       "seconds": s.seconds, "in_flight": s.in_flight,
                       **_stage_recompute(pipeline, i), "passes": _stage_passes(pipeline, i),
                       "planned_peak_bytes": s.peak_bytes, "send_bytes": s.send_bytes})
    peaks = predicted_peaks(program) if program is not None else None
    ranks = []
    for r in range(sched_ranks):
        own = [st for st in stages if st["rank"] == r]
        ranks.append({"rank": r, "stages": [st["stage"] for st in own],
                      "planned_peak_bytes": sum(st["planned_peak_bytes"] for st in own),
                      "predicted_peak_bytes": peaks[r] if peaks is not None else
                      sum(st["planned_peak_bytes"] for st in own),
                      "measured_peak_bytes": measured.peak_bytes[r],
                      "measured_state_bytes": measured.state_bytes[r],
                      "budget_bytes": pipeline.rank_budget_bytes if pipeline else None})
    pred = plan.timeline
    replayed = replay(program.schedule, measured.timeline) if program is not None else None
    return {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "schedule": plan.schedule,
            "microbatches": plan.microbatches, "cut": list(plan.cut), "link": plan.link,
            "imbalance": plan.imbalance, "equal_imbalance": plan.equal_imbalance,
            "measured_imbalance": measured.imbalance(),
            "stages": stages, "ranks": ranks,
            "bubble": {"predicted": plan.bubble, "measured": measured.timeline.bubble(),
                       "measured_steady": measured.steady_bubble(),
                       "replayed": replayed.bubble() if replayed is not None else None},
            "step_seconds": {"predicted": pred.makespan if pred is not None else None,
                             "measured": measured.timeline.makespan,
                             "measured_steady": measured.period_s},
            "memory_source": measured.source,
            "predicted_timeline": _spans(pred), "measured_timeline": _spans(measured.timeline)}


def _stage_passes(pipeline: Any, i: int) -> list[dict]:
    """What glmc's passes did to stage i, in order (report.json: name, graph, time, nodes)."""
    if pipeline is None:
        return []
    return [{"name": r.name, "form": r.form, "changed": r.changed, "skipped": r.skipped,
             "seconds": round(r.seconds, 6), "nodes_before": r.nodes_before,
             "nodes_after": r.nodes_after} for r in pipeline.passes if r.stage == i]


def _stage_recompute(pipeline: Any, i: int) -> dict:
    """Stage i's budget and the recompute pass's result on it (report.json fields)."""
    budget = pipeline.budgets[i] if pipeline is not None and pipeline.budgets else None
    stats = pipeline.recompute[i] if pipeline is not None and pipeline.recompute else None
    rec = None if stats is None else {
        "rematerialized": stats.recomputed, "kept": stats.kept, "solver": stats.solver,
        "extra_seconds": stats.extra_seconds, "budget_bytes": stats.budget_bytes,
        "baseline_peak": stats.baseline_peak, "predicted_peak": stats.predicted_peak,
        "rematerialized_values": [list(v) for v in stats.recomputed_values]}
    return {"budget": budget.describe() if budget is not None else None, "remat": rec}


def _against(rank: dict) -> str:
    """How the measured peak stands against a per-rank size budget ("" without one)."""
    budget = rank.get("budget_bytes")
    if not budget:
        return ""
    over = rank["measured_peak_bytes"] / budget - 1
    return (f" (budget {budget / 2**20:.2f} MiB: "
            + (f"{over:.1%} over)" if over > 0 else f"met, {-over:.1%} below)"))


def pass_times(passes: list[dict]) -> str:
    """"fusion (forward) 12.1 ms, cleanup (joint) 0.8 ms, ..." for a stage's pass records."""
    return ", ".join(f"{r['name']} ({r['form']}) "
                     + ("skipped" if r["skipped"] else f"{r['seconds'] * 1e3:.1f} ms")
                     for r in passes)


def summary(data: dict) -> str:
    """The report in a few lines (what `glmc compile --pp` prints)."""
    lines = []
    for st in data["stages"]:
        rec = st["remat"]
        budget = "" if st["budget"] is None else \
            f", budget {st['budget']}: {rec['rematerialized']} values recomputed, " \
            f"+{rec['extra_seconds'] * 1e3:.2f} ms, joint-graph peak " \
            f"{rec['predicted_peak'] / 2**20:.2f} MiB"
        lines.append(f"stage {st['stage']}: {', '.join(st['blocks'])}  predicted "
                     f"{st['seconds'] * 1e3:.2f} ms/step, planned peak "
                     f"{st['planned_peak_bytes'] / 2**20:.2f} MiB ({st['in_flight']} "
                     f"microbatches in flight{budget})")
        if st.get("passes"):
            lines.append(f"  passes: {pass_times(st['passes'])}")
    for r in data["ranks"]:
        lines.append(f"rank {r['rank']}: peak predicted {r['predicted_peak_bytes'] / 2**20:.2f} "
                     f"MiB (stage graphs through the schedule; the cut's plan "
                     f"{r['planned_peak_bytes'] / 2**20:.2f}), measured "
                     f"{r['measured_peak_bytes'] / 2**20:.2f} MiB{_against(r)}")
    if data.get("backend"):
        be = data["backend"]
        lines.append(f"stages run on {be['name']} in {be.get('precision', 'fp32')}"
                     + (f", {_fused_spelling(be['fusion'])} fused" if be.get("fusion")
                        else "") + (
            f" (each graph compiled once: {be['compile_seconds']:.1f} s on this rank)"
            if be["name"] != "eager" else " (the captured fx graphs)"))
        if be.get("loss_scale"):
            ls = be["loss_scale"]
            lines.append(f"fp16 loss scale {ls['scale']:g} after {ls['steps']} steps; "
                         f"{ls['skipped']} skipped because a gradient overflowed on some rank")
    b, t = data["bubble"], data["step_seconds"]
    pred_t = f"{t['predicted'] * 1e3:.1f}" if t["predicted"] is not None else "-"
    if data["link"]:
        lk = data["link"]
        lines.append(f"link between stages: {lk['name']}, latency {lk['latency_us']:.1f} us, "
                     f"{lk['bandwidth_GBps']:.2f} GB/s (prices the predicted transfers)")
    if b.get("replayed") is not None:
        lines.append(f"schedule model: the measured action times replayed through the "
                     f"schedule give a bubble of {b['replayed']:.1%} (measured "
                     f"{b['measured']:.1%}); the rest of the gap is in predicted action times")
    lines.append(f"pipeline: {data['schedule']}, {data['microbatches']} microbatches; imbalance "
                 f"{data['imbalance']:.3f} (equal split {data['equal_imbalance']:.3f}; measured "
                 f"{data['measured_imbalance'] or 0:.3f}: busiest rank / mean); bubble "
                 f"predicted {b['predicted']:.1%}, measured {b['measured']:.1%} (one aligned "
                 f"step), {b['measured_steady']:.1%} back to back; step predicted {pred_t} ms, "
                 f"measured {t['measured'] * 1e3:.1f} ms ({t['measured_steady'] * 1e3:.1f} ms "
                 "back to back)")
    return "\n".join(lines)


def write_report(data: dict, report_dir: str) -> str:
    """report.json, report.html and the two timelines as Chrome/Perfetto traces in
    `report_dir`; returns the html's path."""
    import json
    from pathlib import Path

    from glmc.report.html import render_pipeline_html

    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=1))
    for key, name in (("measured_timeline", "pipeline-trace.json"),
                      ("predicted_timeline", "pipeline-predicted.json")):
        events = [{"name": e["action"], "ph": "X", "pid": 0, "tid": e["rank"],
                   "ts": e["start_s"] * 1e6, "dur": (e["end_s"] - e["start_s"]) * 1e6,
                   "cat": e["kind"]} for e in data[key]]
        (out / name).write_text(json.dumps({"traceEvents": events}))
    (out / "report.html").write_text(render_pipeline_html(data))
    return str(out / "report.html")
