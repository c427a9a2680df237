"""glmc's predictions for Megatron-LM's Table 2 (Narayanan et al., SC'21): GPT-3 175B and
530B trained with ZeRO-3 and no model parallelism (DeepSpeed) against PTD-P (tensor x
pipeline x data parallelism), on 384 to 2,240 A100-80GB GPUs at a fixed global batch.

Each row's degrees, micro-batch and ZeRO stage are fixed (`--fix`); glmc chooses the bucket
size. Also priced: the 530B ZeRO-3 run on 560 GPUs with micro-batches of 4, which the paper
reports did not fit. Predictions only: nothing here ran on a GPU.

    python benchmarks/megatron_table2.py   # -> results/megatron-table2.{json,md}
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from tests.test_planner import MEGATRON_ZERO3, zero3_row  # noqa: E402


def main() -> None:
    rows = []
    extra = (529.6, 20480, 105, 128, 1, 1, 560, 2240, 4, 3, None)  # did not fit (paper)
    for r in [*MEGATRON_ZERO3, extra]:
        predicted, plan = zero3_row(r)
        rows.append({"params_b": r[0], "scheme": "ZeRO-3" if r[9] == 3 else "PTD-P",
                     "tp": r[4], "pp": r[5], "gpus": r[6], "global_batch": r[7],
                     "microbatch": r[8], "published_tflops": r[-1],
                     "predicted_tflops": predicted, "spelling": plan.point.spelling(),
                     "step_s": plan.step_s, "peak_gib": plan.peak_bytes / 2**30,
                     "fits": plan.fits, "breakdown_s": plan.breakdown})
        print(f"{r[0]}B {rows[-1]['scheme']} on {r[6]}: {predicted:.0f} TFLOP/s per GPU "
              f"(published {r[-1]}), {rows[-1]['peak_gib']:.0f} GiB, fits {plan.fits}",
              flush=True)
    data = {"date": datetime.date.today().isoformat(), "rows": rows}
    out = ROOT / "benchmarks" / "results"
    (out / "megatron-table2.json").write_text(json.dumps(data, indent=1) + "\n")
    render(data, out)


def render(data: dict, out: Path) -> None:
    lines = [f"# Megatron-LM Table 2: ZeRO-3 vs PTD-P, predicted ({data['date']})", "",
             "TFLOP/s per GPU as the paper counts them (recomputation included); A100-80GB "
             "DGX nodes; fp16, full recompute. Exposed: the predicted seconds per step not "
             "hidden behind compute, by collective.", "",
             "| params | scheme | GPUs | batch | micro-batch | published | predicted | error "
             "| step | exposed communication | peak | bucket |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    errors = {"ZeRO-3": [], "PTD-P": []}
    for r in data["rows"]:
        pub = r["published_tflops"]
        err = f"{r['predicted_tflops'] / pub - 1:+.0%}" if pub else "-"
        if pub:
            errors[r["scheme"]].append(abs(r["predicted_tflops"] / pub - 1))
        comm = ", ".join(f"{k} {v:.1f} s" for k, v in r["breakdown_s"].items()
                         if v >= 0.05 and (k.startswith("dp_") or k in ("tp_comm", "p2p")))
        bucket = dict(p.split("=") for p in r["spelling"].split(",")).get("bucket", "-")
        lines.append(f"| {r['params_b']}B | {r['scheme']} | {r['gpus']} | {r['global_batch']} "
                     f"| {r['microbatch']} | {pub or 'did not fit'} | "
                     f"{r['predicted_tflops']:.0f} | {err} | {r['step_s']:.1f} s | {comm} | "
                     f"{r['peak_gib']:.0f} GiB{'' if r['fits'] else ' (does not fit)'} | "
                     f"{bucket} |")
    lines += ["", "Median / largest absolute error: " + "; ".join(
        f"{k} {statistics.median(v):.0%} / {max(v):.0%}" for k, v in errors.items() if v)]
    (out / "megatron-table2.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
