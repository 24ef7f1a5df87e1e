"""Write a study's scaling report: PNG plots, table.json and one self-contained HTML page."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import jinja2

from vitpod.analysis import goodput, plots
from vitpod.analysis.scaling import (
    DEFINITIONS,
    OFF_BY,
    STUDY_FILE,
    Row,
    Study,
    baseline,
    off_points,
    rows_as_json,
    scaling_table,
)
from vitpod.analysis.stragglers import stragglers
from vitpod.registry import io, runfiles

# Published figures shown beside ours; efficiency computed with the same arithmetic as our table.
REFERENCES: list[dict[str, Any]] = [
    {
        "name": "VOLO-D5 pretraining, DGX A100 POD, parameter server (NVIDIA)",
        "short": "VOLO-D5 (NVIDIA)",
        "base_gpus": 8,
        "base_images_per_s": 500.0,
        "gpus": 40,
        "images_per_s": 2100.0,
    },
    {
        "name": "DeepSpeed ViT-B/16 on CIFAR-10 (7.41x on 8 GPUs)",
        "short": "DeepSpeed ViT-B/16",
        "base_gpus": 1,
        "base_images_per_s": 1.0,
        "gpus": 8,
        "images_per_s": 7.41,
    },
]

# Layout: the page must fit a 1300-px-wide browser window with no horizontal scrollbar (checked
# in a real headless Chromium by tests/test_report_browser.py). One 18-column table did not
# (about 1500 px), so the numbers are split into two tables of at most 10 columns, headers wrap,
# long paths in a failed row break anywhere, and images shrink with the page. No external
# assets: styles are inline and the plots are data: URIs, so the file works offline.
TEMPLATE = """<!doctype html>
<html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>vitpod scaling report: {{ title }}</title>
<style>
body { font-family: sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 72em; }
table { border-collapse: collapse; margin: 1em 0; max-width: 100%; }
td, th { border: 1px solid #bbb; padding: 0.25em 0.5em; text-align: right; }
th { background: #f3f3f3; font-weight: 600; }
td.text, th.text { text-align: left; }
td.path { text-align: left; overflow-wrap: anywhere; word-break: break-word; }
tr.failed td { background: #fde2e2; color: #900; }
.plots { display: flex; flex-wrap: wrap; gap: 0.5em; }
.plots img { width: calc(50% - 0.5em); min-width: 20em; max-width: 100%; height: auto;
  border: 1px solid #ddd; box-sizing: border-box; }
</style></head><body>
<h1>Scaling report: {{ title }}</h1>
<p>Mode: <b>{{ mode }}</b>. Model: {{ model or "n/a" }}. Baseline: {{ base }}.
{% if failed %}<b style="color:#900">{{ failed }} point(s) failed and are excluded from
speedup and efficiency.</b>{% endif %}</p>
<h2>Definitions</h2>
<p><b>This study.</b> {{ definition }}</p>
<p><b>For comparison.</b> {{ other_definition }}</p>
<p>Images/s is the trainer's global throughput with warmup steps excluded. MFU is model FLOPs
(torch's flop counter, forward and backward) per second over the GPUs' datasheet peak (the
PaLM paper's definition); n/a where the device is not in the trainer's peak table. The breakdown is
the mean seconds per optimizer step over all ranks and timed steps; communication overhead is
comm / step time. Predicted communication is what the planner recorded for the run (the
alpha-beta cost model of analysis/commcost.py, priced with the {{ fabric_source }}; runs it did
not price have none); ratio = measured / predicted. A rank's comm clock starts when its
gradients are ready, so it also counts waiting for slower ranks; "exchange" is the median over
steps of the least comm time over ranks (the last rank ready waits for nobody): the exchange
itself, which is what the model predicts.</p>
<h2>Throughput and efficiency</h2>
<table id="throughput"><tr><th>GPUs</th><th>nodes</th><th class="text">state</th>
<th>global batch</th><th>images/s</th><th>images/s per GPU</th><th>speedup</th><th>ideal</th>
<th>efficiency</th><th>MFU</th></tr>
{% for r in rows %}{% if r.state == "ok" %}<tr><td>{{ r.gpus }}</td><td>{{ r.nodes }}</td>
<td class="text">ok</td><td>{{ r.global_batch }}</td>
<td>{{ "%.1f"|format(r.images_per_s) }}</td>
<td>{{ "%.1f"|format(r.images_per_s_per_gpu) }}</td><td>{{ "%.2f"|format(r.speedup) }}</td>
<td>{{ "%.2f"|format(r.ideal_speedup) }}</td><td>{{ "%.1f%%"|format(100 * r.efficiency) }}</td>
<td>{{ "%.1f%%"|format(100 * r.mfu) if r.mfu is not none else "n/a" }}</td></tr>
{% else %}<tr class="failed"><td>{{ r.gpus }}</td><td>{{ r.nodes }}</td>
<td class="text">FAILED</td><td colspan="7" class="path">{{ r.error }} ({{ r.run_dir }})</td>
</tr>{% endif %}{% endfor %}</table>
<h2>Step-time breakdown and communication</h2>
<table id="breakdown"><tr><th>GPUs</th><th>data ms</th><th>compute ms</th><th>comm ms</th>
<th>optimizer ms</th><th>step ms</th><th>comm %</th><th class="text">engine</th>
<th>predicted comm ms</th><th>measured / predicted</th><th>exchange ms</th>
<th>exchange / predicted</th></tr>
{% for r in rows %}{% if r.state == "ok" %}<tr><td>{{ r.gpus }}</td>
{% for part in ("data", "compute", "comm", "optimizer", "step") %}
<td>{{ "%.2f"|format(1000 * r.time[part]) }}</td>{% endfor %}
<td>{{ "%.1f"|format(r.comm_pct) if r.comm_pct is not none else "n/a" }}</td>
<td class="text">{{ r.engine or "n/a" }}</td>
<td>{{ "%.3f"|format(1000 * r.predicted_comm_s) if r.predicted_comm_s is not none else "n/a" }}</td>
<td>{{ "%.2f"|format(r.comm_ratio) if r.comm_ratio is not none else "n/a" }}</td>
<td>{{ "%.3f"|format(1000 * r.exchange_s) if r.exchange_s is not none else "n/a" }}</td>
<td>{{ "%.2f"|format(r.exchange_ratio) if r.exchange_ratio is not none else "n/a" }}</td></tr>
{% else %}<tr class="failed"><td>{{ r.gpus }}</td>
<td colspan="11" class="text">FAILED (see above)</td></tr>
{% endif %}{% endfor %}</table>
<h2>Step time predicted against measured, and {{ kind }}-hours</h2>
<p>The step-time model <code>make place</code> uses: the baseline's measured compute (step time
minus communication) scaled by the images a rank computes per step at this point, plus this
point's predicted communication; error = (predicted - measured) / measured.
{% if off %}<b>The model is off by more than {{ "%.0f%%"|format(100 * off_by) }} at
{{ off }} GPU(s).</b>{% else %}It is within {{ "%.0f%%"|format(100 * off_by) }} at every
point.{% endif %} {{ kind }}-hours are Slurm's: the allocated {{ kind }}s x the time each point's
job held them (sacct), and the useful part, its {{ kind }}s x the time of the training steps
kept; n/a where the accounting was not read. In all: {{ total }}.</p>
<table id="prediction"><tr><th>GPUs</th><th class="text">state</th><th>measured step ms</th>
<th>predicted step ms</th><th>error</th><th>{{ kind }}-hours</th>
<th>useful {{ kind }}-hours</th></tr>
{% for r in rows %}<tr{% if r.state != "ok" %} class="failed"{% endif %}><td>{{ r.gpus }}</td>
<td class="text">{{ r.state }}</td>
<td>{{ "%.2f"|format(1000 * r.time["step"]) if r.time else "n/a" }}</td>
<td>{{ "%.2f"|format(1000 * r.predicted_step_s) if r.predicted_step_s is not none else "n/a" }}</td>
<td>{% if r.step_error is not none %}{{ "%+.0f%%"|format(100 * r.step_error) }}
{%- if r.step_error|abs > off_by %} (off){% endif %}{% else %}n/a{% endif %}</td>
<td>{{ "%.3g"|format(r.device_hours) if r.device_hours is not none else "n/a" }}</td>
<td>{{ "%.3g"|format(r.useful_device_hours) if r.useful_device_hours is not none else "n/a" }}</td>
</tr>{% endfor %}</table>
<h2>Goodput</h2>
<p>Where each point's wall time went, from the trainer's own records (queue wait is Slurm's:
<code>make status</code> shows it): start-up to the first step, training steps, checkpoint
stalls, evaluation, steps lost to a restart, and what none of these explains.</p>
<table id="goodput"><tr><th>GPUs</th><th>wall s</th><th>start-up s</th><th>training s</th>
<th>checkpoint s</th><th>eval s</th><th>lost s</th><th>other s</th><th>goodput</th></tr>
{% for r, g in ledgers %}<tr><td>{{ r.gpus }}</td><td>{{ "%.1f"|format(g.wall) }}</td>
{% for part in ("startup", "training", "checkpoint", "eval", "lost") %}
<td>{{ "%.1f"|format(g.parts[part]) }}</td>{% endfor %}<td>{{ "%.1f"|format(g.other) }}</td>
<td>{{ "%.0f%%"|format(100 * g.parts["training"] / g.wall) if g.wall > 0 else "n/a" }}</td>
</tr>{% endfor %}</table>
<h2>Stragglers</h2>
<p>Ranks whose own step time (step minus the wait in the gradient exchange) stayed above the
profile's <code>hang.straggler_ratio</code> x the ranks' median over the last steps.</p>
<table id="stragglers"><tr><th>GPUs</th><th>rank</th><th class="text">node</th><th>ratio</th>
</tr>{% for r, s in stragglers %}<tr><td>{{ r.gpus }}</td><td>{{ s.rank }}</td>
<td class="text">{{ s.node }}</td><td>{{ "%.2f"|format(s.ratio) }}</td></tr>
{% else %}<tr><td colspan="4">none</td></tr>{% endfor %}</table>
<h2>Plots</h2>
<div class="plots">
{% for name, data in images %}<img alt="{{ name }}" src="data:image/png;base64,{{ data }}">
{% endfor %}</div>
<h2>Reference figures</h2>
<table id="references"><tr><th class="text">reference</th><th>baseline GPUs</th><th>GPUs</th>
<th>speedup</th><th>efficiency</th></tr>
{% for ref in references %}<tr><td class="text">{{ ref.name }}</td>
<td>{{ ref.base_gpus }}</td><td>{{ ref.gpus }}</td><td>{{ "%.2f"|format(ref.speedup) }}</td>
<td>{{ "%.1f%%"|format(100 * ref.efficiency) }}</td></tr>{% endfor %}</table>
<p>VOLO-D5: about 500 images/s on one DGX A100 (8 GPUs) and about 2100 on five.</p>
</body></html>
"""


def references() -> list[dict[str, Any]]:
    """REFERENCES with speedup and efficiency filled in."""
    out = []
    for ref in REFERENCES:
        speedup = ref["images_per_s"] / ref["base_images_per_s"]
        out.append(
            {**ref, "speedup": speedup, "efficiency": speedup / (ref["gpus"] / ref["base_gpus"])}
        )
    return out


def render_html(study: Study, rows: list[Row], images: dict[str, bytes]) -> str:
    base = baseline(rows)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        title=study.model or study.root.name,
        mode=study.mode,
        model=study.model,
        fabric_source=study.fabric_source,
        base=f"{base.gpus} GPU(s)" if base else "none (every point failed)",
        failed=sum(r.state != "ok" for r in rows),
        definition=DEFINITIONS[study.mode],
        other_definition=next(text for mode, text in DEFINITIONS.items() if mode != study.mode),
        rows=rows,
        images=[(name, base64.b64encode(png).decode("ascii")) for name, png in images.items()],
        references=references(),
        ledgers=[(r, goodput.from_trainer(Path(r.run_dir))) for r in rows if r.state == "ok"],
        stragglers=[(r, s) for r in rows for s in stragglers(Path(r.run_dir))],
        off=", ".join(str(r.gpus) for r in off_points(rows)),
        off_by=OFF_BY,
        kind=device_kind(rows),
        total=_total_line(rows),
    )


def device_kind(rows: list[Row]) -> str:
    """'GPU', or 'CPU' where the points ran on CPU profiles (what sacct allocated)."""
    return next((r.device_kind for r in rows if r.device_kind), "GPU")


def _total_line(rows: list[Row]) -> str:
    summary = study_summary(rows)
    if summary["device_hours"] is None:
        return "n/a"
    kind = summary["device_kind"]
    return (f"{summary['device_hours']:.3g} {kind}-hours allocated, "
            f"{summary['useful_device_hours']:.3g} useful")  # fmt: skip


def study_summary(rows: list[Row]) -> dict[str, Any]:
    """The study's totals for report.json: device-hours (None when no point was accounted) and
    the points where the step-time model is off by more than OFF_BY."""
    known = [r for r in rows if r.device_hours is not None]
    return {
        "device_kind": device_kind(rows),
        "device_hours": sum(r.device_hours or 0.0 for r in known) if known else None,
        "useful_device_hours": sum(r.useful_device_hours or 0.0 for r in known) if known
        else None,
        "off_by": OFF_BY,
        "off_points": [r.gpus for r in off_points(rows)],
        "stragglers": [{"gpus": r.gpus, "rank": s.rank, "node": s.node, "ratio": s.ratio}
                       for r in rows for s in stragglers(Path(r.run_dir))],
    }  # fmt: skip


def make_images(study: Study, rows: list[Row]) -> dict[str, bytes]:
    return {
        "speedup.png": plots.speedup_plot(rows, study.mode),
        "efficiency.png": plots.efficiency_plot(rows, study.mode, references()),
        "breakdown.png": plots.breakdown_plot(rows),
        "comm.png": plots.comm_plot(rows),
    }


def write_report(study: Study, out_dir: Path | None = None) -> Path:
    """Compute the table, write PNGs, table.json and report.html under out_dir; return the HTML."""
    rows = scaling_table(study)
    out = Path(out_dir) if out_dir else study.root / runfiles.REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    images = make_images(study, rows)
    for name, png in images.items():
        io.write_bytes_atomic(out / name, png)
    table = {"mode": study.mode, "model": study.model, "rows": rows_as_json(rows)}
    io.write_text_atomic(out / runfiles.TABLE, json.dumps(table, indent=2))
    if (study.root / STUDY_FILE).is_file():  # a study's own directory (not loose run dirs)
        record = {"study": str(study.root), "mode": study.mode, "model": study.model,
                  **study_summary(rows), "points": rows_as_json(rows)}  # fmt: skip
        io.write_text_atomic(study.root / runfiles.REPORT, json.dumps(record, indent=2))
    html = out / runfiles.REPORT_HTML
    io.write_text_atomic(html, render_html(study, rows, images))
    return html
