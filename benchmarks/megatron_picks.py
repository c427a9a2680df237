"""glmc's own plans for Megatron-LM's published runs (Narayanan et al., SC'21, Table 1).

For each row's GPT model (on the meta device), cluster of DGX A100s and global batch, three
predictions: the published configuration (`--fix` its TP/PP, full recompute, interleaved
1F1B where pipelined), glmc's top plan (only fp16 fixed, as published), and glmc's top plan
keeping full recompute. The gradient all-reduce is priced after the backward, as Megatron-LM
ran it in 2021. Predictions only: nothing here ran on a GPU.

    python benchmarks/megatron_picks.py [--rows 0 4]   # -> results/megatron-picks.{json,md}
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from tests.test_planner import MEGATRON, megatron_picks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(range(len(MEGATRON))))
    ap.add_argument("--render", action="store_true",
                    help="only write the .md again from results/megatron-picks.json")
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results"
    if args.render:
        render(json.loads((out / "megatron-picks.json").read_text()), out)
        return
    rows = []
    for i in args.rows:
        t0 = time.perf_counter()
        picks = megatron_picks(MEGATRON[i])
        rows.append({"row": i, "params_b": MEGATRON[i][0], "gpus": MEGATRON[i][6],
                     "global_batch": MEGATRON[i][7], "published_tflops": MEGATRON[i][8],
                     **picks, "seconds": time.perf_counter() - t0})
        r = rows[-1]
        print(f"{r['params_b']}B on {r['gpus']}: published {r['published']['step_s']:.2f} s, "
              f"pick {r['pick']['step_s']:.2f} s ({r['pick']['spelling']}), with full "
              f"recompute {r['pick_full']['step_s']:.2f} s ({r['pick_full']['spelling']})",
              flush=True)
    data = {"date": datetime.date.today().isoformat(), "rows": rows}
    (out / "megatron-picks.json").write_text(json.dumps(data, indent=1) + "\n")
    render(data, out)


def render(data: dict, out: Path) -> None:
    lines = [f"# glmc's picks vs Megatron-LM's published plans ({data['date']}, predicted)", "",
             "Step seconds predicted for A100-80GB DGX nodes; ratios to the published plan's "
             "prediction. TFLOP/s: the paper's count (recompute included) for the published "
             "plan. Peak: predicted GiB per GPU.", "",
             "| params | GPUs | batch | published plan | glmc's pick | step, peak "
             "| pick keeping full recompute | step, peak |", "|---|---|---|---|---|---|---|---|"]
    keep = ("dp", "tp", "pp", "zero", "microbatch", "schedule", "virtual")
    for r in data["rows"]:
        pub = r["published"]

        def short(k: str) -> str:
            parts = dict(p.split("=") for p in r[k]["spelling"].split(","))
            return ",".join(f"{x}={parts[x]}" for x in keep) + \
                ("" if k == "pick_full" else f",recompute={parts['recompute']}")

        def cell(k: str) -> str:
            return (f"{r[k]['step_s']:.2f} s ({r[k]['step_s'] / pub['step_s']:.2f}x), "
                    f"{r[k]['peak_gib']:.0f} GiB")
        lines.append(f"| {r['params_b']}B | {r['gpus']} | {r['global_batch']} | "
                     f"{pub['step_s']:.2f} s, {pub['tflops']:.0f} TFLOP/s, "
                     f"{pub['peak_gib']:.0f} GiB | `{short('pick')}` | {cell('pick')} | "
                     f"`{short('pick_full')}` | {cell('pick_full')} |")
    (out / "megatron-picks.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
