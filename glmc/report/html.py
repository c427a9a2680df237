"""report.html: one self-contained page (inline CSS and SVG plots, no scripts, no network).

Rendered from the report dict alone. Pass-specific parts are the sections the passes' stats
wrote (glmc.compiler.report_parts.ReportSection); this module draws any section and knows no pass by
name. Plots are drawn on a bare `matplotlib.figure.Figure` (no pyplot, no `matplotlib.use`):
rendering a report never changes the user's matplotlib backend or figure registry.
"""
from __future__ import annotations

import html
import io
from typing import Any

from glmc.analysis.memory import CATEGORIES
from glmc.compiler.report_parts import (LinePlot, MiB, ReportSection, Table, Text, brief_stats,
                                        measured_peak, mib, ms, pass_state, pct)

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px} h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:right} th{background:#f4f4f4} td.l,th.l{text-align:left}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;
padding:8px 14px;min-width:200px}.card b{font-size:18px;display:block}
.warn{color:#a40} .note{color:#555} code{background:#f6f6f6;padding:0 3px}
svg{max-width:100%;height:auto}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


# ---- plots ------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height))


def _svg(fig: Any) -> str:
    """The figure as inline SVG (Figure.savefig picks the SVG canvas; nothing global)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _timeline_plot(c: dict[str, Any]) -> str:
    fig = _figure(12, 3.8)
    ax1, ax2 = fig.subplots(1, 2)
    for label, pred, style in (("captured (before passes)", c.get("predicted_captured"), "--"),
                               ("compiled (after passes)", c.get("predicted"), "-")):
        if not pred:
            continue
        tl = pred["memory"]["timeline"]
        n = max(tl[-1][0], 1) if tl else 1
        ax1.plot([i / n for i, _ in tl], [sum(v.values()) / MiB for _, v in tl], style,
                 label=f"{label}: peak {pred['memory']['peak_bytes'] / MiB:,.1f} MiB")
    total, state_from = measured_peak(c)
    if total is not None:
        how = "" if state_from == "tensors" else " (state predicted)"
        ax1.axhline(total / MiB, color="k", lw=0.8, ls=":",
                    label=f"measured peak {total / MiB:,.1f} MiB{how}")
    ax1.set_xlabel("position in the step (fraction of nodes)")
    ax1.set_ylabel("live MiB")
    ax1.set_title("predicted memory timeline, before vs after the pipeline")
    if ax1.get_lines():
        ax1.legend(fontsize=8)
    pred = c.get("predicted")
    if pred:
        tl = pred["memory"]["timeline"]
        ys = [[v.get(cat, 0) / MiB for _, v in tl] for cat in CATEGORIES]
        ax2.stackplot([i for i, _ in tl], ys, labels=CATEGORIES)
        ax2.set_xlabel("node index (compiled step)")
        ax2.set_ylabel("live MiB")
        ax2.set_title("compiled step, by category")
        ax2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _svg(fig)


def _pass_plot(c: dict[str, Any]) -> str | None:
    captured = c.get("predicted_captured")
    points = [("captured", captured["time"]["seconds"], captured["memory"]["peak_bytes"])] \
        if captured else []
    points += [(r["name"], r["predicted"]["seconds"], r["predicted"]["peak_bytes"])
               for r in c["passes"] if r.get("predicted")]
    if len(points) < 2:
        return None
    fig = _figure(6, 3)
    ax = fig.subplots()
    names = [n for n, _, _ in points]
    ax.plot(names, [s * 1e3 for _, s, _ in points], "o-", label="step ms")
    ax.set_ylabel("predicted step (ms)")
    ax2 = ax.twinx()
    ax2.plot(names, [b / MiB for _, _, b in points], "s--", color="C1", label="peak MiB")
    ax2.set_ylabel("predicted peak (MiB)")
    ax.set_title("prediction after each pass")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
    fig.tight_layout()
    return _svg(fig)


def _line_plot(p: LinePlot) -> str:
    fig = _figure(6, 3.2)
    ax = fig.subplots()
    ax.plot(p.x, p.y, "o-")
    for label, x, y in zip(p.labels, p.x, p.y):
        ax.annotate(label, (x, y), fontsize=8, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    ax.set_title(p.title)
    fig.tight_layout()
    return _svg(fig)


def _training_section(rows: list[dict[str, Any]]) -> str:
    """The loss and throughput curves of a `glmc train` run."""
    steps = [r["step"] for r in rows]
    fig = _figure(9, 3.2)
    loss_ax, speed_ax = fig.subplots(1, 2)
    loss_ax.plot(steps, [r["loss"] for r in rows], lw=1)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("Training loss")
    if any("tokens_per_s" in r for r in rows):
        speed_ax.plot([r["step"] for r in rows if "tokens_per_s" in r],
                      [r["tokens_per_s"] for r in rows if "tokens_per_s" in r], lw=1)
        speed_ax.set_ylabel("tokens/s")
    else:
        speed_ax.plot(steps, [r["step_s"] * 1e3 for r in rows], lw=1)
        speed_ax.set_ylabel("step (ms)")
    speed_ax.set_xlabel("step")
    speed_ax.set_title("Throughput")
    fig.tight_layout()
    last = rows[-1]
    return (f"<h2>Training run</h2><p>{len(rows)} points, last step {last['step']}: loss "
            f"{last['loss']:.4f}. Every step is in metrics.jsonl.</p>" + _svg(fig))


# ---- pass sections ----------------------------------------------------------------------------


def _table(t: Table) -> str:
    def cls(i: int, value: Any) -> str:
        left = t.align[i] == "l" if i < len(t.align) else isinstance(value, str)
        return " class=l" if left else ""
    first = t.rows[0] if t.rows else t.columns
    head = "".join(f"<th{cls(i, first[i] if i < len(first) else '')}>{_esc(h)}</th>"
                   for i, h in enumerate(t.columns))
    body = "".join("<tr>" + "".join(f"<td{cls(i, v)}>{_esc(v)}</td>" for i, v in enumerate(row))
                   + "</tr>" for row in t.rows)
    out = f"<table><tr>{head}</tr>{body}</table>"
    if t.collapsed:
        return f"<details><summary>{_esc(t.collapsed)}</summary>{out}</details>"
    return out


def _block(b: Any) -> str:
    if isinstance(b, Text):
        return f"<p class={b.style}>{_esc(b.text)}</p>" if b.style else f"<p>{_esc(b.text)}</p>"
    if isinstance(b, Table):
        return _table(b)
    if isinstance(b, LinePlot):
        return _line_plot(b)
    return ""


def _pass_sections(c: dict[str, Any]) -> str:
    parts = []
    for r in c["passes"]:
        if r.get("section"):
            s = ReportSection.from_dict(r["section"])
            parts.append(f"<h3>{_esc(s.title)}</h3>" + "\n".join(_block(b) for b in s.blocks))
    return "\n".join(parts)


# ---- the page ---------------------------------------------------------------------------------


def _cards(c: dict[str, Any]) -> str:
    pred, meas, err = c.get("predicted"), c.get("measured"), c.get("errors") or {}
    cards = []
    if pred:
        mem = pred["memory"]
        cards.append(("predicted step", ms(pred["time"]["seconds"]),
                      f"{pred['time']['kernels']} kernels, {pred['time']['gflops']} GFLOP"))
        cards.append(("predicted peak", mib(mem["peak_bytes"]),
                      f"{mib(mem['persistent_bytes'])} state + {mib(mem['transient_bytes'])} "
                      "in-step"))
    if c.get("measured_step_seconds") is not None:
        cards.append(("measured step", ms(c["measured_step_seconds"]),
                      f"fastest of {max(c['steps_run'] - 1, 0)} steps; error "
                      f"{pct(err.get('step_time'))}"))
    if meas:
        total, state_from = measured_peak(c)
        state = mib(meas["persistent_bytes"]) + " state (the step's tensors)" \
            if meas.get("persistent_bytes") is not None else "state not measured"
        cards.append(("measured peak", mib(total),
                      f"{state} + {mib(meas['peak_bytes'])} in-step ({meas['source']}); error "
                      f"{pct(err.get('peak_memory'))}: in-step "
                      f"{pct(err.get('transient_memory'))}, state "
                      f"{pct(err.get('persistent_memory'))}"
                      + ("; state taken from the prediction" if state_from == "prediction"
                         else "")))
    return '<div class="cards">' + "".join(
        f'<div class="card">{_esc(t)}<b>{_esc(v)}</b><small>{_esc(d)}</small></div>'
        for t, v, d in cards) + "</div>"


def _pass_table(c: dict[str, Any]) -> str:
    rows = ["<tr><th class=l>pass</th><th class=l>options</th><th>state</th><th>ms</th>"
            "<th>nodes</th><th>pred. step</th><th>pred. peak</th><th class=l>stats</th></tr>"]
    if c.get("predicted_captured"):
        pc = c["predicted_captured"]
        rows.append(f"<tr><td class=l>(captured)</td><td></td><td></td><td></td>"
                    f"<td>{c['nodes_captured']}</td><td>{ms(pc['time']['seconds'])}</td>"
                    f"<td>{mib(pc['memory']['peak_bytes'])}</td><td></td></tr>")
    for r in c["passes"]:
        p = r.get("predicted") or {}
        rows.append(f"<tr><td class=l>{_esc(r['name'])}</td><td class=l>{_esc(r['options'])}</td>"
                    f"<td>{pass_state(r)}</td><td>{r['seconds'] * 1e3:.1f}</td>"
                    f"<td>{r['nodes_before']} &rarr; {r['nodes_after']}</td>"
                    f"<td>{ms(p.get('seconds'))}</td><td>{mib(p.get('peak_bytes'))}</td>"
                    f"<td class=l><code>{_esc(brief_stats(r['stats']))}</code></td></tr>")
    return "<h3>Passes</h3><table>" + "".join(rows) + "</table>"


def _peak_tables(pred: dict[str, Any]) -> str:
    mem, t = pred["memory"], pred["time"]
    out = [f"<h3>At the predicted peak</h3><p>node <code>{_esc(mem['peak_node'])}</code> "
           f"({_esc(mem['peak_source'] or 'no source')})</p>",
           _table(Table(CATEGORIES, ((*(mib(mem["at_peak"].get(k, 0)) for k in CATEGORIES),),),
                        "r" * len(CATEGORIES))),
           _table(Table(("tensor", "size", "category", "source"),
                        tuple((n, mib(b), k, s or "") for n, b, k, s in mem["largest_at_peak"]),
                        "lrll")),
           "<h3>Predicted time by op kind</h3>",
           _table(Table(tuple(t["by_kind"]), (tuple(ms(v) for v in t["by_kind"].values()),),
                        "r" * len(t["by_kind"])))]
    if t["unknown_ops"]:
        out.append(f"<p class=warn>Ops without a cost rule (costed by the generic bytes rule): "
                   f"{_esc(t['unknown_ops'])}</p>")
    return "\n".join(out)


def _compile_section(i: int, c: dict[str, Any]) -> str:
    pred = c.get("predicted")
    profile = ""
    if pred:
        t = pred["time"]
        profile = f" Cost profile: {_esc(t['profile'])}" + (
            f" ({_esc(t['profile_provenance'])})" if t.get("profile_provenance") else "") + "."
    parts = [f"<h2>Compile {i + 1}: batch {_esc(c['batch'])} &rarr; {_esc(c['backend'])}</h2>",
             _cards(c),
             f"<p>capture {c['capture_seconds']:.2f}s, passes {c['passes_seconds']:.2f}s, "
             f"backend compile {c['backend_seconds']:.2f}s; nodes {c['nodes_captured']} &rarr; "
             f"{c['nodes_final']}.{profile}</p>",
             _pass_table(c), "<h3>Memory timeline</h3>" + _timeline_plot(c), _comm_plot(c),
             _pass_sections(c),
             _pass_plot(c) or ""]
    if pred:
        parts.append(_peak_tables(pred))
    parts.append(_phase_table(c.get("phases")))
    if c["fallbacks"]:
        parts.append(f"<h3 class=warn>{len(c['fallbacks'])} op(s) fell back to eager</h3><ul>"
                     + "".join(f"<li><code>{_esc(f['op'])}</code> at {_esc(f['where'])}</li>"
                               for f in c["fallbacks"]) + "</ul>")
    if c.get("warnings"):
        parts.append("<h3 class=warn>Warnings</h3><ul>"
                     + "".join(f"<li>{_esc(w)}</li>" for w in c["warnings"]) + "</ul>")
    return "\n".join(parts)


def _phase_table(phases: dict[str, Any] | None) -> str:
    """The measured per-phase profile (glmc.analysis.phases) and its top kernels."""
    if not phases:
        return ""
    step = phases["step_seconds"] or 1.0
    ref = phases.get("reference") or {}

    def ref_cell(p: str) -> str:
        return f"<td>{ref[p] * 1e3:.2f}</td>" if p in ref else "<td></td>"
    rows = "".join(f"<tr><td>{p}</td><td>{phases['phases'].get(p, 0) * 1e3:.2f}</td>"
                   f"<td>{phases['phases'].get(p, 0) / step:.1%}</td>{ref_cell(p)}</tr>"
                   for p in ("forward", "backward", "optimizer", "other"))
    rows += f"<tr><td>step</td><td>{step * 1e3:.2f}</td><td></td>{ref_cell('step')}</tr>"
    kernels = "".join(
        f"<tr><td><code>{_esc(k['kernel'][:90])}</code></td><td>{k['seconds'] * 1e3:.2f}</td>"
        f"<td>{k['calls']}</td><td>{_esc(', '.join(f'{p} {w:.0%}' for p, w in k['phases'].items()))}"
        "</td></tr>" for k in phases.get("top_kernels", [])[:10])
    return (f"<h3>Per-phase profile (measured)</h3><p>{_esc(phases['backend'])}, median of "
            f"{phases['steps']} steps of {step * 1e3:.2f} ms. {_esc(phases['method'])}.</p>"
            "<table><tr><th>phase</th><th>glmc ms</th><th>share</th>"
            "<th>torch.compile ms</th></tr>" + rows + "</table>"
            "<table><tr><th>kernel</th><th>ms/step</th><th>calls</th><th>phases</th></tr>"
            + kernels + "</table>")


def _plan_section(plan: dict[str, Any], last: dict[str, Any]) -> str:
    """`--plan auto`'s choice and the runners-up, predicted; the chosen one also measured."""
    measured = last.get("median_step_seconds")
    rows = []
    for p in [plan["chosen"], *plan["runners_up"]]:
        meas = f"{measured * 1e3:.1f}" if p is plan["chosen"] and measured else ""
        rows.append((p["rank"], p["spelling"], f"{p['step_s'] * 1e3:.1f}", meas,
                     f"{p['peak_bytes'] / 2**20:.1f}"))
    table = Table(("rank", "plan", "predicted ms", "measured ms", "predicted MiB per process"),
                  tuple(rows), "rlrrr")
    return (f"<h2>Parallel plan (--plan auto, {plan['of']} plans priced)</h2>" + _table(table))


def _comm_plot(c: dict[str, Any]) -> str:
    """The predicted timeline of one rank: compute by phase, collectives on the link."""
    comm = (c.get("predicted") or {}).get("communication")
    if not comm:
        return ""
    fig = _figure(12, 2.2)
    ax = fig.subplots()
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    for s in comm["compute_spans"]:
        ax.broken_barh([(s["start_s"] * 1e3, (s["end_s"] - s["start_s"]) * 1e3)], (1, 0.8),
                       color=colors.get(s["phase"], "tab:gray"))
    for k in comm["timeline"]:
        ax.broken_barh([(k["start_s"] * 1e3, (k["end_s"] - k["start_s"]) * 1e3)], (0, 0.8),
                       color="tab:red")
    ax.set_yticks([0.4, 1.4], ["communication", "compute"])
    ax.set_xlabel("ms (predicted)")
    ax.set_title(f"one rank of {comm['ranks']}: {comm['collectives']} collectives, "
                 f"{comm['exposed_seconds'] * 1e3:.2f} ms of {comm['comm_seconds'] * 1e3:.2f} ms "
                 "exposed (blue forward, orange backward, green update, red collectives)",
                 fontsize=9)
    fig.tight_layout()
    meas = (c.get("measured") or {}).get("exposed_comm_seconds")
    note = (f"<p>Measured: {meas * 1e3:.2f} ms blocked in collective waits in one step. "
            "timeline-predicted.json (next to this report) opens in Perfetto.</p>"
            if meas is not None else "")
    return "<h3>Compute and communication</h3>" + _svg(fig) + note


def render_html(data: dict[str, Any]) -> str:
    body = [f"<h1>glmc compile report</h1><p>{_esc(data.get('created', ''))} &middot; "
            f"{_esc(data.get('machine', ''))} &middot; torch {_esc(data.get('torch', ''))}</p>"]
    if not data["compiles"]:
        body.append("<p>No compiles recorded.</p>")
    if data.get("training"):
        body.append(_training_section(data["training"]))
    body += [_compile_section(i, c) for i, c in enumerate(data["compiles"])]
    if data.get("plan"):
        body.append(_plan_section(data["plan"], data["compiles"][-1] if data["compiles"]
                                  else {}))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>glmc report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")


# ---- the pipeline report ----------------------------------------------------------------------

#: Gantt colours per action kind (torch.distributed.pipelining's vocabulary, plus UPDATE)
_KIND_COLOURS = {"F": "#4878d0", "B": "#6acc64", "I": "#6acc64", "W": "#ee854a",
                 "UPDATE": "#956cb4", "SEND_F": "#bbbbbb", "SEND_B": "#bbbbbb",
                 "RECV_F": "#dddddd", "RECV_B": "#dddddd"}


def _gantt(spans: list[dict[str, Any]], ranks: int, title: str, ax: Any) -> None:
    """One row per rank, one bar per action (labelled with its microbatch where wide)."""
    end = max((s["end_s"] for s in spans), default=0.0) or 1.0
    for s in spans:
        width = (s["end_s"] - s["start_s"]) * 1e3
        ax.broken_barh([(s["start_s"] * 1e3, width)], (s["rank"] - 0.4, 0.8),
                       facecolors=_KIND_COLOURS.get(s["kind"], "#999999"), edgecolors="white",
                       linewidth=0.5)
        if s["kind"] in ("F", "B", "I", "W") and width > end * 1e3 / 60:
            ax.text(s["start_s"] * 1e3 + width / 2, s["rank"], s["action"], ha="center",
                    va="center", fontsize=6)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title, fontsize=10)


def _gantt_plot(data: dict[str, Any]) -> str:
    ranks = len(data["ranks"])
    fig = _figure(12, 1.2 + 1.3 * ranks)
    ax1, ax2 = fig.subplots(2, 1)
    b = data["bubble"]
    _gantt(data["predicted_timeline"], ranks, f"predicted (bubble {b['predicted']:.1%})", ax1)
    _gantt(data["measured_timeline"], ranks, f"measured, one barrier-aligned step (bubble "
           f"{b['measured']:.1%})", ax2)
    from matplotlib.patches import Patch
    legend = {"F": "forward", "B": "backward", "W": "weight grad", "UPDATE": "update",
              "SEND_F": "send", "RECV_F": "receive (incl. waiting)"}
    ax1.legend(handles=[Patch(color=_KIND_COLOURS[k], label=v) for k, v in legend.items()],
               ncol=6, fontsize=7, loc="lower right")
    fig.tight_layout()
    return _svg(fig)


def _link(link: dict[str, Any] | None) -> str:
    if not link:
        return "none (free)"
    return (f"{link['name']}: latency {link['latency_us']:.1f} us, "
            f"{link['bandwidth_GBps']:.2f} GB/s ({link['source']})")


def _stage_budget(s: dict[str, Any]) -> str:
    rec = s.get("remat")
    if s.get("budget") is None or rec is None:
        return "none: all kept"
    return (f"{s['budget']}: {rec['rematerialized']} values "
            f"(+{rec['extra_seconds'] * 1e3:.2f} ms), joint-graph peak "
            f"{mib(rec['predicted_peak'])}")


def render_pipeline_html(data: dict[str, Any]) -> str:
    """report.html of a pipelined run (glmc.parallel.pipeline_report.pipeline_report's dict)."""
    b, t = data["bubble"], data["step_seconds"]
    stages = Table(("stage", "rank", "blocks", "profile", "F", "B", "update", "total",
                    "in flight", "budget: rematerialized", "planned peak", "sends per microbatch"),
                   tuple((str(s["stage"]), str(s["rank"]), ", ".join(s["blocks"]), s["profile"],
                          ms(s["forward_s"]), ms(s["backward_s"]), ms(s["update_s"]),
                          ms(s["seconds"]), str(s["in_flight"]),
                          _stage_budget(s),
                          mib(s["planned_peak_bytes"]),
                          mib(s["send_bytes"])) for s in data["stages"]))
    passes = Table(("stage", "pass", "graph", "changed", "time", "nodes"),
                   tuple((str(s["stage"]), r["name"], r["form"] or "",
                          "skipped" if r["skipped"] else ("yes" if r["changed"] else "no"),
                          ms(r["seconds"]), f"{r['nodes_before']} → {r['nodes_after']}")
                         for s in data["stages"] for r in s.get("passes", [])))
    ranks = Table(("rank", "stages", "planned peak (cut)", "predicted peak (stage graphs)",
                   "measured peak", "measured state"),
                  tuple((str(r["rank"]), ", ".join(map(str, r["stages"])),
                         mib(r["planned_peak_bytes"]), mib(r["predicted_peak_bytes"]),
                         mib(r["measured_peak_bytes"]),
                         mib(r["measured_state_bytes"])) for r in data["ranks"]))
    pred_t = ms(t["predicted"])
    body = [
        f"<h1>glmc pipeline report</h1><p>{_esc(data['created'])} &middot; schedule "
        f"{_esc(data['schedule'])}, {data['microbatches']} microbatches, "
        f"{len(data['stages'])} stages on {len(data['ranks'])} ranks</p>",
        f"<h2>Plan</h2><p>Cut before blocks {_esc(data['cut'])}; imbalance (max/mean) "
        f"{data['imbalance']:.3f} (an equal split of blocks: {data['equal_imbalance']:.3f}); "
        f"measured {data.get('measured_imbalance') or 0:.3f} (busiest rank's compute over the "
        "mean, steps back to back). "
        f"Boundary transfers priced on link {_esc(_link(data['link']))}.</p>",
        _table(stages),
        "<h2>Passes per stage</h2>", _table(passes),
        "<p class=note>glmc's passes on each stage, through the pass manager: on its forward "
        "program before it is differentiated, on its joint graph before the partition, and on "
        "its update.</p>",
        "<h2>Schedule</h2>",
        f"<p>Bubble predicted {b['predicted']:.1%}, measured {b['measured']:.1%} in one "
        f"barrier-aligned step and {b['measured_steady']:.1%} with steps back to back"
        + (f"; the measured action times replayed through the schedule give "
           f"{b['replayed']:.1%} (the schedule model's own error; the rest is in the predicted "
           f"action times)" if b.get("replayed") is not None else "") + ". Step "
        f"predicted {pred_t}, measured {ms(t['measured'])} "
        f"({ms(t['measured_steady'])} back to back).</p>",
        _gantt_plot(data),
        "<p class=note>pipeline-predicted.json and pipeline-trace.json (next to this report) "
        "open in Perfetto.</p>",
        "<h2>Memory per rank</h2>", _table(ranks),
        f"<p class=note>Planned: the partition plan's estimate (state + in-flight microbatches "
        "x saved bytes, from the whole step's graph), what the cut was chosen on. Predicted: "
        "the captured stage graphs' liveness walked through the schedule (in-flight saved "
        "activations, accumulated gradients, each action's transient bytes). Measured: "
        f"{_esc(data['memory_source'])}, one step: the allocator's peak above the live state, "
        "plus that state (parameters, optimizer state).</p>"]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>glmc pipeline report"
            f"</title><style>{_CSS}</style></head><body>{''.join(body)}</body></html>")
