"""One self-contained HTML report of a run folder, with its plots also written as PNG files
(tools/report.py writes it).

Contents: loss (and validation loss) and learning rate, throughput, MFU/HFU and memory over steps; the steady-state
measurement (mindscale/perf/mfu.py's `of_run`, the numbers tools/mfu.py prints) next to the planner's prediction
for the same config (mindscale/perf/planner/); the MFU/HFU
formula with the FLOPs per token and the peak used, so the numbers can be redone by hand; the data mix
(tokens per source) and the time the loop waited for data; the profiler summary (mindscale/perf/profile.py)
when the run has a profile; the resolved config. The
PNGs are embedded as base64 and written next to the HTML as <stem>_<plot>.png.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
from pathlib import Path

from mindscale.perf import flops, planner
from mindscale.perf.metrics_io import (
    load_run,
    per_step_mean,
    profile_window,
    segments,
    steady_records,
    warn_if_truncated,
)
from mindscale.perf.mfu import of_run
from mindscale.perf.profile import ProfileError, analyse, text as profile_text

# (key, label, unit, format) of the measured-vs-predicted table; keys follow metrics.jsonl.
COMPARED = [
    ("step_time_s", "step time", "s", "{:.4f}"),
    ("tokens_per_s", "throughput", "tokens/s", "{:.1f}"),
    ("tokens_per_s_per_device", "throughput per device", "tokens/s/device", "{:.1f}"),
    ("samples_per_s_per_device", "samples per device", "samples/s/device", "{:.3f}"),
    ("tflops_per_device", "model TFLOP/s per device", "TFLOP/s", "{:.4f}"),
    ("mfu", "MFU", "", "{:.2%}"),
    ("hfu", "HFU", "", "{:.2%}"),
    ("memory_gib", "peak memory per device", "GiB", "{:.2f}"),
]


def planner_prediction(cfg, peak_tflops: float | None) -> tuple[dict, list[str]]:
    """What mindscale/perf/planner/ predicts for `cfg` at the run's peak, keyed like metrics.jsonl, and
    the lines that say where it comes from (its assumptions)."""
    try:
        plan = planner.plan(cfg, peak_tflops=peak_tflops)
    except planner.PlanError as exc:
        return {}, [f"the planner cannot plan this config: {exc}"]
    predicted = {k: v for k, v in plan["predicted"].items() if isinstance(v, (int, float))}
    predicted["memory_gib"] = plan["memory_gib"]["total"]
    source = [
        f"mindscale/perf/planner/ at {plan['predicted']['peak_tflops']:g} TFLOP/s per device "
        f"(the run's peak); memory {'fits' if plan['fits'] else 'does NOT fit'} the "
        f"{plan['memory_budget_gib']:.1f} GiB budget",
        *plan["predicted"].get("assumptions", []),
    ]
    return predicted, source


def figure_png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def validation_records(records: list[dict]) -> list[dict]:
    """The records of steps followed by a validation pass (train.eval_interval)."""
    return [r for r in records if r.get("val_loss") is not None]


def validation_section(run) -> str | None:
    """HTML table of the validation passes (step, val_loss, each held-out source's loss for a blend of several,
    val_ppl, seconds) after a sentence naming the held-out set, or None without any pass."""
    validated = validation_records([r for segment in segments(run.metrics.records) for r in segment])
    if not validated:
        return None
    data, eval_steps, batch = run.config.data, run.config.train.eval_steps, run.config.samples_per_step
    sources = [e.path for e in data.valid_blend or ()] or [data.valid_path]
    if len(sources) == 1:
        held_out = (
            f"The token-weighted mean loss over the first {eval_steps} x {batch} sequences of "
            f"{html.escape(str(sources[0]))} (train.eval_steps x global batch), after the step."
        )
    else:
        weights = ", ".join(f"{html.escape(e.path)} (weight {e.weight:g})" for e in data.valid_blend)
        held_out = (
            f"The token-weighted mean loss over the held-out blend data.valid_blend, after the step, and "
            f"each source's own: {weights}. Each source gives the first sequences of its folder, its "
            f"weight's share of train.eval_steps={eval_steps} steps of {batch} sequences in whole steps "
            "(at least one; docs/data.md)."
        )
    per_source = sources if len(sources) > 1 else []
    head = "".join(f"<th>{html.escape(path)}</th>" for path in per_source)
    rows = "".join(
        f"<tr><td>{r['step']}</td><td>{r['val_loss']:.4f}</td>"
        + "".join(f"<td>{r.get('val_loss_by_source', {}).get(path, float('nan')):.4f}</td>" for path in per_source)
        + f"<td>{r['val_ppl']:.2f}</td><td>{r.get('val_time_s', float('nan')):.2f}</td></tr>"
        for r in validated
    )
    return (
        f"<p>{held_out}</p><table><tr><th>step</th><th>val_loss</th>{head}<th>val_ppl</th><th>seconds</th>"
        f"</tr>{rows}</table>"
    )


def data_mix(records: list[dict]) -> str | None:
    """'data mix at step N: SOURCE 75.0% (T tokens), ...' from the last record with data_tokens."""
    last = next((r for r in reversed(records) if r.get("data_tokens")), None)
    if last is None:
        return None
    tokens = last["data_tokens"]
    total = sum(tokens.values())
    parts = [f"{path} {n / total:.1%} ({n} tokens)" for path, n in tokens.items()]
    return f"data mix at step {last['step']}: " + ", ".join(parts)


def data_section(run, kept: list[dict]) -> str | None:
    """HTML: the tokens each data source gave by the last logged step next to its configured share (runs on
    MindRecord data), and how long the loop waited for its batches (data_wait_s); None when neither is logged."""
    parts = []
    last = next((r for r in reversed(run.metrics.records) if r.get("data_tokens")), None)
    if last is not None:
        weights = {e.path: e.weight for e in run.config.data.blend or ()} or {run.config.data.path: 1.0}
        total, weight_sum = sum(last["data_tokens"].values()), sum(weights.values())
        rows = "".join(
            f"<tr><td>{html.escape(path)}</td><td>{weights.get(path, 0) / weight_sum:.1%}</td>"
            f"<td>{n:,}</td><td>{n / total:.1%}</td></tr>"
            for path, n in last["data_tokens"].items()
        )
        parts.append(
            f"<p>Tokens drawn from each source in steps 1 to {last['step']} (metrics.jsonl's data_tokens; "
            "the blend keeps every source within one sample of its share after each step, docs/data.md)."
            f"</p><table><tr><th>source</th><th>configured share</th><th>tokens</th><th>share drawn</th></tr>"
            f"{rows}</table>"
        )
    waits = [r for r in kept if "data_wait_s" in r]
    if waits:
        wait, step = per_step_mean(waits, "data_wait_s"), per_step_mean(waits, "step_time_s")
        parts.append(
            f"<p>Waiting for data: the loop waited {wait * 1e3:.2f} ms per step for its next batch "
            f"(data_wait_s over the steps after warm-up), {wait / step:.2%} of their step time "
            f"({step * 1e3:.1f} ms).</p>"
        )
    return "".join(parts) or None


def plots(run, kept_steps: set[int], measured: dict, predicted: dict) -> dict[str, bytes]:
    """PNG bytes by name: loss_lr, throughput, mfu_hfu, memory; `measured` is the run's `of_run`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for segment in segments(run.metrics.records) for r in segment]
    steps = [r["step"] for r in records]
    restarts = [segment[0]["step"] for segment in segments(run.metrics.records)[1:]]
    devices = run.config.devices
    warm = [r for r in records if r["step"] not in kept_steps]

    def series(ax, key, scale=1.0, label=None, steady=True, warm_label=True, style=".-"):
        """`key` over steps; warm-up records greyed; the steady-state measurement as a dashed line."""
        (line,) = ax.plot(steps, [r[key] * scale for r in records], style, label=label or key, markersize=4)
        if warm and steady:
            ax.plot(
                [r["step"] for r in warm],
                [r[key] * scale for r in warm],
                "o",
                color="lightgray",
                markersize=7,
                zorder=0,
                label="warm-up / profiled (not measured)" if warm_label else None,
            )
        if steady:
            value = measured[key] * scale
            ax.axhline(value, color=line.get_color(), linestyle="--", linewidth=0.8, label=f"measured {value:.4g}")

    def predicted_line(ax, key, scale=1.0):
        if key in predicted:
            ax.axhline(
                predicted[key] * scale, color="purple", linestyle=":", label=f"planner {predicted[key] * scale:.4g}"
            )

    def finish(fig, ax, title, ylabel, extra_handles=()):
        for i, step in enumerate(restarts):
            ax.axvline(step, color="black", linewidth=0.6, alpha=0.5, label=None if i else "restart (resume)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(
            handles + [h for h in extra_handles],
            labels + [h.get_label() for h in extra_handles],
            fontsize=8,
            loc="best",
        )
        fig.tight_layout()
        png = figure_png(fig)
        plt.close(fig)
        return png

    out = {}
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.plot(steps, [r["loss"] for r in records], ".-", color="tab:blue", markersize=4, label="loss")
    validated = validation_records(records)
    if validated:  # train.eval_interval: the held-out loss of the weights after those steps
        ax.plot(
            [r["step"] for r in validated],
            [r["val_loss"] for r in validated],
            "s-",
            color="tab:green",
            markersize=5,
            label="validation loss",
        )
    lr_ax = ax.twinx()
    (lr_line,) = lr_ax.plot(steps, [r["lr"] for r in records], "-", color="tab:orange", label="learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:orange")
    out["loss_lr"] = finish(
        fig, ax, "Loss, validation loss and learning rate" if validated else "Loss and learning rate", "loss", [lr_line]
    )

    fig, ax = plt.subplots(figsize=(8, 3.4))
    series(ax, "tokens_per_s", label="tokens/s")
    predicted_line(ax, "tokens_per_s")
    ax.set_ylim(bottom=0)
    per_device = ax.secondary_yaxis("right", functions=(lambda x: x / devices, lambda x: x * devices))
    per_device.set_ylabel(f"tokens/s per device ({devices} devices)")
    out["throughput"] = finish(fig, ax, "Throughput", "tokens/s")

    fig, ax = plt.subplots(figsize=(8, 3.4))
    series(ax, "mfu", 100, label="MFU")
    series(
        ax,
        "hfu",
        100,
        label="HFU" if run.config.recompute.mode != "none" else "HFU (= MFU: no recompute)",
        warm_label=False,
        style="x--",
    )
    predicted_line(ax, "mfu", 100)
    ax.set_ylim(bottom=0)
    peak = run.metrics.records[-1].get("peak_tflops")
    out["mfu_hfu"] = finish(
        fig, ax, f"MFU / HFU (peak {peak:.4g} TFLOP/s per device)" if peak else "MFU / HFU", "% of peak"
    )

    fig, ax = plt.subplots(figsize=(8, 3.4))
    series(ax, "memory_gib", label="memory", steady=False)
    predicted_line(ax, "memory_gib")
    ax.set_ylim(bottom=0)
    what = "host RSS per worker" if run.config.hardware.device_target == "CPU" else "peak device memory"
    out["memory"] = finish(fig, ax, f"Memory ({what})", "GiB")
    return out


def formula_lines(run, summary: dict) -> list[str]:
    """The MFU/HFU definitions with this run's numbers (`of_run`'s), and its MFU redone by hand."""
    cfg, fpt, peak = run.config, summary["flops_per_token"], summary["peak_tflops"]
    redo = summary["tokens_per_s"] * fpt / (summary["devices"] * peak * 1e12)
    return [
        flops.formula_text(),
        f"N = {summary['matmul_params']:,} matmul weights (of {summary['params']:,} parameters); model FLOPs "
        f"per token = {fpt:.4g}; hardware FLOPs per token = {summary['hflops_per_token']:.4g} "
        f"(recompute.mode={cfg.recompute.mode}, {summary['recomputed_layers']} of {cfg.model.num_layers} layers)",
        f"peak = {peak:g} TFLOP/s per device ({summary['peak_source']}); by hand: {summary['tokens_per_s']:.1f} "
        f"tokens/s x {fpt:.4g} / ({summary['devices']} x {peak:g}e12) = {redo:.3%} (the MFU above: "
        f"{summary['mfu']:.3%})",
    ]


def profile_section(run) -> str | None:
    """The profile report of the run's profile/ folder, None without one."""
    profile_dir = run.path / "profile"
    if not profile_dir.is_dir():
        return None
    try:
        return profile_text(analyse(profile_dir, cfg=run.config, config_source=str(run.path / "config.yaml")))
    except ProfileError as exc:
        return f"profile/ could not be read: {exc}"


def build(run_dir: str, output: Path | None, warmup: int) -> tuple[Path, list[Path]]:
    """Write the report (default RUN_DIR/report.html) and its PNGs; returns their paths."""
    run = load_run(run_dir)
    warn_if_truncated(run)
    summary = of_run(run, warmup)
    kept, _ = steady_records(run.metrics.records, warmup, profile_window(run.config))
    predicted, source = planner_prediction(run.config, summary["peak_tflops"])
    images = plots(run, {r["step"] for r in kept}, summary, predicted)

    output = output or run.path / "report.html"
    output.parent.mkdir(parents=True, exist_ok=True)
    png_paths = []
    for name, data in images.items():
        path = output.with_name(f"{output.stem}_{name}.png")
        path.write_bytes(data)
        png_paths.append(path)

    esc = html.escape
    rows = []
    for key, label, unit, fmt in COMPARED:
        measured = fmt.format(summary[key])
        pred = fmt.format(predicted[key]) if key in predicted else "–"
        ratio = f"{summary[key] / predicted[key]:.2f}" if predicted.get(key) else "–"
        rows.append(
            f"<tr><td>{esc(label)}</td><td>{esc(unit)}</td><td>{measured}</td><td>{pred}</td><td>{ratio}</td></tr>"
        )
    cfg = run.config
    facts = (
        f"{cfg.model.arch}, {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, seq "
        f"{cfg.model.seq_length}; {cfg.devices} device(s) (dp {cfg.parallel.data_parallel}, mp "
        f"{cfg.parallel.model_parallel}, pp {cfg.parallel.pipeline_stage}); global batch "
        f"{cfg.samples_per_step}; recompute {cfg.recompute.mode}; "
        f"{sum(len(s) for s in segments(run.metrics.records))} records, "
        f"{summary['records_used']} after warm-up ({summary['steps_used']} steps)"
    )
    figures = "\n".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{base64.b64encode(data).decode()}"></figure>'
        for name, data in images.items()
    )
    profile = profile_section(run)
    validation = validation_section(run)
    data = data_section(run, kept)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>MindScale run {esc(run.name)}</title>
<style>
body {{ font-family: sans-serif; max-width: 980px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 12px; }}
img {{ max-width: 100%; }} .note {{ color: #666; font-size: 90%; }}
</style></head><body>
<h1>Run {esc(run.name)}</h1>
<p>{esc(str(run.path))}<br>{esc(facts)}</p>
<p class="note">Generated {datetime.datetime.now().isoformat(timespec="seconds")} by tools/report.py.
{"metrics.jsonl ends in a truncated line; the complete lines are used." if run.metrics.truncated else ""}</p>
<h2>Measured (the steps after warm-up: their tokens over their time) vs predicted</h2>
<table><tr><th>metric</th><th>unit</th><th>measured</th><th>predicted</th><th>measured / predicted</th></tr>
{"".join(rows)}</table>
<p class="note">Memory is the maximum over all records{
        "; on CPU it is the worker's host RSS (framework and Python included), while the planner counts weights, "
        "gradients, optimizer states and activations only"
        if cfg.hardware.device_target == "CPU"
        else ""
    }.
Prediction: {"; ".join(esc(line) for line in source)}.</p>
<h2>Definitions</h2>
<ul>{"".join(f"<li>{esc(line)}</li>" for line in formula_lines(run, summary))}</ul>
<h2>Over steps</h2>
{figures}
{f"<h2>Validation</h2>{validation}" if validation else ""}
{f"<h2>Data</h2>{data}" if data else ""}
{f"<h2>Profile</h2><pre>{esc(profile)}</pre>" if profile else ""}
<h2>Resolved config</h2>
<pre>{esc(cfg.to_yaml())}</pre>
</body></html>
"""
    output.write_text(page)
    return output, png_paths
