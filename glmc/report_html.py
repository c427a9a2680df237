"""report.html: one self-contained page (inline CSS and SVG plots, no scripts, no network)."""
from __future__ import annotations

import html
import io
from typing import Any

from glmc.memory import CATEGORIES
from glmc.report import MiB, _brief, mib, ms, pass_state, pct

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px} h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:right} th{background:#f4f4f4} td.l,th.l{text-align:left}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;
padding:8px 14px;min-width:200px}.card b{font-size:18px;display:block}
.warn{color:#a40} code{background:#f6f6f6;padding:0 3px} svg{max-width:100%;height:auto}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _timeline_plot(c: dict[str, Any]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    for label, pred, style in (("captured (before passes)", c.get("predicted_captured"), "--"),
                               ("compiled (after passes)", c.get("predicted"), "-")):
        if not pred:
            continue
        tl = pred["memory"]["timeline"]
        n = max(tl[-1][0], 1) if tl else 1
        ax1.plot([i / n for i, _ in tl], [sum(v.values()) / MiB for _, v in tl], style,
                 label=f"{label}: peak {pred['memory']['peak_bytes'] / MiB:,.1f} MiB")
    meas = c.get("measured")
    if meas and c.get("predicted"):
        total = c["predicted"]["memory"]["persistent_bytes"] + meas["peak_bytes"]
        ax1.axhline(total / MiB, color="k", lw=0.8, ls=":",
                    label=f"measured peak {total / MiB:,.1f} MiB")
    ax1.set_xlabel("position in the step (fraction of nodes)")
    ax1.set_ylabel("live MiB")
    ax1.set_title("predicted memory timeline, before vs after the pipeline")
    ax1.legend(fontsize=8)
    pred = c.get("predicted")
    if pred:
        tl = pred["memory"]["timeline"]
        xs = [i for i, _ in tl]
        ys = [[v.get(cat, 0) / MiB for _, v in tl] for cat in CATEGORIES]
        ax2.stackplot(xs, ys, labels=CATEGORIES)
        ax2.set_xlabel("node index (compiled step)")
        ax2.set_ylabel("live MiB")
        ax2.set_title("compiled step, by category")
        ax2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _svg(fig)


def _pass_plot(c: dict[str, Any]) -> str | None:
    points = [("captured", c.get("predicted_captured"))]
    points += [(r["name"], {"time": {"seconds": r["predicted"]["seconds"]},
                            "memory": {"peak_bytes": r["predicted"]["peak_bytes"]}})
               for r in c["passes"] if r.get("predicted")]
    points = [(n, p) for n, p in points if p]
    if len(points) < 2:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [n for n, _ in points]
    ax.plot(names, [p["time"]["seconds"] * 1e3 for _, p in points], "o-", label="step ms")
    ax.set_ylabel("predicted step (ms)")
    ax2 = ax.twinx()
    ax2.plot(names, [p["memory"]["peak_bytes"] / MiB for _, p in points], "s--", color="C1",
             label="peak MiB")
    ax2.set_ylabel("predicted peak (MiB)")
    ax.set_title("prediction after each pass")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8)
    fig.tight_layout()
    return _svg(fig)


def _recompute_section(c: dict[str, Any]) -> str:
    rec = next((r for r in c["passes"] if r["name"] == "recompute" and r["stats"]), None)
    if rec is None:
        return ""
    st = rec["stats"]
    meas = c.get("measured")
    measured = mib(st["persistent_bytes"] + meas["peak_bytes"]) if meas else "-"
    budget = mib(st["budget_bytes"]) if st["budget_bytes"] is not None else "min"
    gap = f", MILP gap {st['milp_gap']:.2g}" if st.get("milp_gap") is not None else ""
    parts = [f"<h3>Recompute</h3><p>budget <b>{_esc(st['budget'])}</b> ({budget}); peak without "
             f"recompute {mib(st['baseline_peak'])}; planned {mib(st['planned_peak'])}, "
             f"predicted (full simulation) {mib(st['predicted_peak'])}, measured {measured}. "
             f"{st['recomputed']} of {st['candidates']} values recomputed, {st['kept']} kept "
             f"for the backward; +{st['extra_flops'] / 1e9:.3f} GFLOP, "
             f"+{ms(st['extra_seconds'])} predicted. Solver: {_esc(st['solver'])} in "
             f"{st['solve_seconds']:.2f} s{gap}; heuristic's plan: "
             f"+{ms(st['greedy_seconds_extra'])}.</p>"]
    if st.get("notes"):
        parts.append("<p>" + "; ".join(_esc(n) for n in st["notes"]) + "</p>")
    for title, key in (("recomputed value", "recomputed_values"),
                       ("kept for the backward", "kept_values")):
        parts.append(f"<table><tr><th class=l>{title} (largest)</th><th>size</th>"
                     "<th class=l>source</th></tr>" + "".join(
                         f"<tr><td class=l>{_esc(n)}</td><td>{mib(b)}</td>"
                         f"<td class=l>{_esc(src or '')}</td></tr>"
                         for n, b, src in st.get(key, [])) + "</table>")
    if st.get("pareto"):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.2))
        xs = [p[1] / MiB for p in st["pareto"]]
        ys = [p[2] * 1e3 for p in st["pareto"]]
        ax.plot(xs, ys, "o-")
        for p, x, y in zip(st["pareto"], xs, ys):
            ax.annotate(str(p[0]), (x, y), fontsize=8, textcoords="offset points",
                        xytext=(4, 4))
        ax.set_xlabel("predicted peak (MiB)")
        ax.set_ylabel("predicted recompute (ms)")
        ax.set_title("runtime-memory Pareto curve (budget sweep, greedy)")
        fig.tight_layout()
        parts.append(_svg(fig))
    return "\n".join(parts)


def _before_after(c: dict[str, Any], i: int) -> tuple[dict, dict]:
    """The observer's prediction before and after pass `i` of a compile."""
    before = c["passes"][i - 1].get("predicted") if i else None
    captured = c.get("predicted_captured")
    if before is None and captured:
        before = {"peak_bytes": captured["memory"]["peak_bytes"],
                  "seconds": captured["time"]["seconds"]}
    return before or {}, c["passes"][i].get("predicted") or {}


def _fusion_section(c: dict[str, Any]) -> str:
    i, rec = next(((i, r) for i, r in enumerate(c["passes"]) if r["name"] == "fusion"
                   and r["stats"]), (None, None))
    if rec is None:
        return ""
    st = rec["stats"]
    before, after = _before_after(c, i)
    meas, pred = c.get("measured"), c.get("predicted")
    measured = mib(pred["memory"]["persistent_bytes"] + meas["peak_bytes"]) \
        if meas and pred else "-"
    counts = ", ".join(f"{k}: {v}" for k, v in st["counts"].items())
    return "\n".join([
        f"<h3>Fusion</h3><p>Regions fused per pattern: {_esc(counts)}. Predicted step "
        f"{ms(before.get('seconds'))} &rarr; {ms(after.get('seconds'))}, predicted peak "
        f"{mib(before.get('peak_bytes'))} &rarr; {mib(after.get('peak_bytes'))}; measured peak "
        f"of the compiled step {measured} (the benchmark <code>bench_fusion.py</code> measures "
        "with and without).</p>",
        "<table><tr><th class=l>pattern</th><th class=l>fused op</th><th class=l>source</th>"
        "<th>nodes replaced</th></tr>" + "".join(
            f"<tr><td class=l>{_esc(r['pattern'])}</td><td class=l>{_esc(r['op'])}</td>"
            f"<td class=l>{_esc(r['source'] or r['module'] or '')}</td>"
            f"<td>{len(r['nodes'])}</td></tr>" for r in st["regions"]) + "</table>"])


def _precision_section(c: dict[str, Any]) -> str:
    i, rec = next(((i, r) for i, r in enumerate(c["passes"]) if r["name"] == "precision"
                   and r["stats"] and r["changed"]), (None, None))
    if rec is None:
        return ""
    st = rec["stats"]
    before, after = _before_after(c, i)
    meas = c.get("measured")
    pred = c.get("predicted")
    measured = mib(pred["memory"]["persistent_bytes"] + meas["peak_bytes"]) \
        if meas and pred else "-"
    parts = [f"<h3>Precision: {_esc(st['policy'])}</h3><p>{st['casts_inserted']} casts "
             f"inserted in the forward; {st['fused_losses']} loss(es) computed in fp32 straight "
             f"from low-precision logits, {st.get('fused_heads', 0)} of them together with "
             f"their LM head (chunked); {st.get('recast_in_backward', 0)} parameter casts made "
             f"again in the backward instead of kept. Predicted peak {mib(before.get('peak_bytes'))} "
             f"before &rarr; {mib(after.get('peak_bytes'))} after the pass (step "
             f"{ms(before.get('seconds'))} &rarr; {ms(after.get('seconds'))}); measured "
             f"peak of the compiled step {measured}.</p>"]
    if st.get("loss_scaling"):
        ls = st["loss_scaling"]
        parts.append(f"<p>Dynamic loss scaling in the step: initial scale {ls['init_scale']:g}, "
                     f"growth {ls['growth_factor']:g} every {ls['growth_interval']} clean steps, "
                     f"backoff {ls['backoff_factor']:g}.</p>")
    if st.get("device_note"):
        parts.append(f"<p>{_esc(st['device_note'])}</p>")
    phases = st.get("step_dtypes", {})
    dtypes = sorted({d for v in phases.values() for d in v})
    parts.append("<table><tr><th class=l>phase</th>" + "".join(f"<th>{_esc(d)}</th>"
                                                              for d in dtypes) + "</tr>"
                 + "".join(f"<tr><td class=l>{_esc(ph)}</td>" + "".join(
                     f"<td>{v.get(d, 0)}</td>" for d in dtypes) + "</tr>"
                           for ph, v in phases.items()) + "</table>")
    if st.get("layers"):
        parts.append("<table><tr><th class=l>module</th><th>dtype</th><th>|act| max</th>"
                     "<th>act underflow</th><th>|grad x scale| max</th><th>grad underflow</th>"
                     "<th class=l>reason</th></tr>" + "".join(
                         f"<tr><td class=l>{_esc(x['module'])}</td><td>{x['dtype']}</td>"
                         f"<td>{x['act_absmax']:.3g}</td><td>{x['act_underflow']:.1%}</td>"
                         f"<td>{x['grad_absmax']:.3g}</td><td>{x['grad_underflow']:.1%}</td>"
                         f"<td class=l>{_esc(x['reason'])}</td></tr>" for x in st["layers"])
                     + "</table>")
    parts.append("<table><tr><th class=l>cast value</th><th>from</th><th>to</th>"
                 "<th class=l>first reader</th><th class=l>source</th></tr>" + "".join(
                     f"<tr><td class=l>{_esc(x['value'])}</td><td>{x['src']}</td>"
                     f"<td>{x['dst']}</td><td class=l>{_esc(x['reader'])}</td>"
                     f"<td class=l>{_esc(x['where'] or '')}</td></tr>" for x in st["casts"])
                 + "</table>")
    parts.append(f"<details><summary>dtype of every node ({len(st.get('node_dtypes', []))})"
                 "</summary><table><tr><th class=l>node</th><th class=l>op</th>"
                 "<th class=l>phase</th><th>dtype</th></tr>" + "".join(
                     f"<tr><td class=l>{_esc(n)}</td><td class=l>{_esc(o)}</td>"
                     f"<td class=l>{_esc(p)}</td><td>{_esc(d)}</td></tr>"
                     for n, o, p, d in st.get("node_dtypes", [])) + "</table></details>")
    return "\n".join(parts)


def _compile_section(i: int, c: dict[str, Any]) -> str:
    pred, meas, err = c.get("predicted"), c.get("measured"), c.get("errors") or {}
    parts = [f"<h2>Compile {i + 1}: batch {_esc(c['batch'])} &rarr; {_esc(c['backend'])}</h2>"]
    cards = []
    if pred:
        cards.append(("predicted step", ms(pred["time"]["seconds"]),
                      f"{pred['time']['kernels']} kernels, {pred['time']['gflops']} GFLOP"))
        cards.append(("predicted peak", mib(pred["memory"]["peak_bytes"]),
                      f"{mib(pred['memory']['persistent_bytes'])} state + "
                      f"{mib(pred['memory']['transient_bytes'])} in-step"))
    if c.get("measured_step_seconds") is not None:
        cards.append(("measured step", ms(c["measured_step_seconds"]),
                      f"median of {max(c['steps_run'] - 1, 0)} steps; error "
                      f"{pct(err.get('step_time'))}"))
    if meas and pred:
        total = pred["memory"]["persistent_bytes"] + meas["peak_bytes"]
        rss = f"; peak RSS growth {mib(meas['rss_peak_bytes'])}" if meas.get("rss_peak_bytes") \
            is not None else ""
        cards.append(("measured peak", mib(total),
                      f"{_esc(meas['source'])}{rss}; error {pct(err.get('peak_memory'))}"))
    parts.append('<div class="cards">' + "".join(
        f'<div class="card">{_esc(t)}<b>{_esc(v)}</b><small>{_esc(d)}</small></div>'
        for t, v, d in cards) + "</div>")
    parts.append(f"<p>capture {c['capture_seconds']:.2f}s, passes {c['passes_seconds']:.2f}s, "
                 f"backend compile {c['backend_seconds']:.2f}s; nodes {c['nodes_captured']} "
                 f"&rarr; {c['nodes_final']}."
                 + (f" Cost profile: {_esc(pred['time']['profile'])}." if pred else "") + "</p>")
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
                    f"<td class=l><code>{_esc(_brief(r['stats']))}</code></td></tr>")
    parts.append("<h3>Passes</h3><table>" + "".join(rows) + "</table>")
    parts.append("<h3>Memory timeline</h3>" + _timeline_plot(c))
    parts.append(_fusion_section(c))
    parts.append(_precision_section(c))
    parts.append(_recompute_section(c))
    plot = _pass_plot(c)
    if plot:
        parts.append(plot)
    if pred:
        mem = pred["memory"]
        parts.append(f"<h3>At the predicted peak</h3><p>node <code>{_esc(mem['peak_node'])}"
                     f"</code> ({_esc(mem['peak_source'] or 'no source')})</p><table><tr>"
                     + "".join(f"<th>{k}</th>" for k in CATEGORIES) + "</tr><tr>"
                     + "".join(f"<td>{mib(mem['at_peak'].get(k, 0))}</td>" for k in CATEGORIES)
                     + "</tr></table><table><tr><th class=l>tensor</th><th>size</th>"
                     "<th class=l>category</th><th class=l>source</th></tr>"
                     + "".join(f"<tr><td class=l>{_esc(n)}</td><td>{mib(b)}</td>"
                               f"<td class=l>{_esc(k)}</td><td class=l>{_esc(s or '')}</td></tr>"
                               for n, b, k, s in mem["largest_at_peak"]) + "</table>")
        t = pred["time"]
        parts.append("<h3>Predicted time by op kind</h3><table><tr>"
                     + "".join(f"<th>{_esc(k)}</th>" for k in t["by_kind"]) + "</tr><tr>"
                     + "".join(f"<td>{ms(v)}</td>" for v in t["by_kind"].values())
                     + "</tr></table>")
        if t["unknown_ops"]:
            parts.append(f"<p class=warn>Ops without a cost rule (costed by the generic bytes "
                         f"rule): {_esc(t['unknown_ops'])}</p>")
    if c["fallbacks"]:
        parts.append(f"<h3 class=warn>{len(c['fallbacks'])} op(s) fell back to eager</h3><ul>"
                     + "".join(f"<li><code>{_esc(f['op'])}</code> at {_esc(f['where'])}</li>"
                               for f in c["fallbacks"]) + "</ul>")
    if c.get("warnings"):
        parts.append("<h3 class=warn>Warnings</h3><ul>"
                     + "".join(f"<li>{_esc(w)}</li>" for w in c["warnings"]) + "</ul>")
    return "\n".join(parts)


def render_html(data: dict[str, Any]) -> str:
    body = [f"<h1>glmc compile report</h1><p>{_esc(data.get('created', ''))} &middot; "
            f"{_esc(data.get('machine', ''))} &middot; torch {_esc(data.get('torch', ''))}</p>"]
    if not data["compiles"]:
        body.append("<p>No compiles recorded.</p>")
    body += [_compile_section(i, c) for i, c in enumerate(data["compiles"])]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>glmc report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")
