"""A plan as text: the per-config report, the ranked layouts of a search as `--set` lines, and the
Markdown table of the shipped scale configs that README.md includes (tools/plan.py prints them; the
plan itself is full_plan.plan, its formulas docs/planner.md).
"""

from __future__ import annotations

from pathlib import Path

from mindscale.config import REPO_ROOT, load_config
from mindscale.perf import flops
from mindscale.perf.planner import compiled_memory
from mindscale.perf.planner.full_plan import plan
from mindscale.perf.planner.schedule import ONE_GRAPH_CALLS
from models.archs import ARCHS

SCALE_DIRS = tuple(d for spec in ARCHS.values() for d in spec.config_dirs)


def shipped_configs() -> list[Path]:
    """Every scale config (not the shared base.yaml files): by family, smallest model first."""
    out = []
    for d in SCALE_DIRS:
        paths = [(load_config(p), p) for p in (REPO_ROOT / "configs" / d).glob("*.yaml") if p.name != "base.yaml"]
        out += [p for _, p in sorted(paths, key=lambda cp: (flops.param_count(cp[0].model), cp[1].name))]
    return out


def _gib(x: float) -> str:
    return f"{x:6.1f} GiB"


def _bytes(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _context(lay: dict, label: str) -> str:
    """`label c x ` (header) or `label c ` (search) for a layout with context parallel, else nothing."""
    c = lay["context_parallel"]
    return "" if c == 1 else f"{label}{c} x " if label == "context " else f"{label}{c} "


def text(result: dict) -> str:
    """The plan of one config: layout, parameters, FLOPs, memory per device, communication, prediction."""
    lay, mem, comm, pred = result["layout"], result["memory_gib"], result["comm_bytes_per_step"], result["predicted"]
    stages = lay["pipeline_stage"]
    lines = [
        f"{result['config']} on {result['devices']} x {result['hardware']}: data {lay['data_parallel']} x model "
        f"{lay['model_parallel']}{_tensor_split(lay)} x {_context(lay, 'context ')}pipeline {stages}"
        + (f" (experts over {lay['expert_parallel']} of the data-parallel ranks)" if lay["expert_parallel"] > 1 else "")
        + f"; {lay['micro_batch_num']} micro batch(es) of "
        f"{lay['micro_batch_size']} x {lay['gradient_accumulation_steps']} accumulation = global batch "
        f"{lay['global_batch_size']}; recompute {lay['recompute']} {lay['recompute_layers']}{_comm(lay)}; "
        f"{_offload_layers(lay, after='; ')}"
        f"attention {lay['attention']}; sequence parallel {lay['sequence_parallel']}; "
        f"optimizer shard {lay['optimizer_shard']}"
        + (" (accumulation buffers sharded too)" if lay["gradient_accumulation_shard"] else ""),
        f"parameters      {result['params']:,} (matmul N = {result['matmul_params']:,}"
        + (f", active: the router, top_k of {lay['experts']} experts" if lay["experts"] else "")
        + ")",
        f"FLOPs per token model {result['flops_per_token']:.4g} (6N + 12·L·H·Q·T), "
        f"hardware {result['hflops_per_token']:.4g} (with recompute)",
        f"memory per device, worst stage {result['memory_stage']} of {stages} (layers per stage "
        f"{lay['layers_per_stage']}):",
    ]
    for key in ("weights", "grads", "optimizer", "transient", "activations", "reserve", "total"):
        lines.append(f"  {key:<12}{_gib(mem[key])}")
    lines.append(
        "  (weights, grads, optimizer: this rank's slices as MindSpore's compiler cuts them, exact; "
        "tools/dryrun.py compares them)"
    )
    if (calls := result["layer_graph_calls"]) > ONE_GRAPH_CALLS:
        lines.append(
            f"  (the step calls the layer graph {calls} times, over the {ONE_GRAPH_CALLS} MindSpore 2.9 compiles as one "
            "kernel graph: it runs as many, and the activations include the views they keep; docs/planner.md)"
        )
    verdict = "FITS" if result["fits"] else "DOES NOT FIT"
    lines.append(
        f"  budget      {_gib(result['memory_budget_gib'])} of {result['device_memory_gib']:g} GiB "
        f"(memory_margin of what the reserve leaves): {verdict}" + _near_budget(result, "; ")
    )
    lines.append(pipeline_line(result))
    if any(lay["offload_layers"]):
        lines.append(offload_line(result))
    lines.append(
        f"communication per device per step: data-parallel gradients {_bytes(comm['dp_grad_reduce'])}, "
        f"tensor-parallel {_bytes(comm['tp'])} ({_bytes(comm['tp_per_layer'])} per layer and micro "
        f"batch; {_bytes(comm['tp_vocab'])} at the vocabulary lookup and head), "
        + (
            f"context-parallel {_bytes(comm['cp'])} ({_bytes(comm['cp_per_layer'])} per layer and micro batch, "
            f"{lay['context_parallel_algo']}), "
            if lay["context_parallel"] > 1
            else ""
        )
        + (
            f"expert-parallel AlltoAll {_bytes(comm['ep'])} ({_bytes(comm['ep_per_layer'])} per layer and "
            "micro batch), "
            if lay["expert_parallel"] > 1
            else ""
        )
        + f"pipeline send/recv {_bytes(comm['pp_send_recv'])}"
    )
    lines.append(
        f"predicted (not measured): {pred['tokens_per_s']:,.0f} tokens/s "
        f"({pred['tokens_per_s_per_device']:,.1f}/device), MFU {pred['mfu']:.1%}, HFU {pred['hfu']:.1%} "
        f"(peak {pred['peak_tflops']:g} TFLOP/s per device){_model_error(pred)}"
    )
    lines.append(breakdown_line(pred))
    lines += goodput_lines(result["goodput"])
    lines += published_lines(result.get("published", []))
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in pred["assumptions"]]
    return "\n".join(lines)


STEP_PARTS = {
    "compute": "compute",
    "tensor_parallel": "tensor-parallel",
    "expert_parallel": "expert-parallel",
    "context_parallel": "context-parallel",
    "pipeline_sends": "pipeline sends",
    "bubble": "bubble",
    "data_parallel_exposed": "exposed data-parallel",
    "offload": "offload",
}
NEAR_BUDGET_GIB = 1.0  # a plan this close to its budget is flagged: the activation estimate is not exact


def goodput_lines(g: dict) -> list[str]:
    """The predicted goodput and the save interval that maximises it (goodput.py), per restart path."""
    configured = g["configured_save_interval"]
    lines = [
        f"goodput (predicted, not measured): a failure every {g['mtbf_s'] / 3600:.3g} h "
        f"({g['failures_per_device_hour']:.3g} per device-hour); a checkpoint of {_bytes(g['checkpoint_bytes_per_rank'])} "
        f"a rank blocks training {g['save_blocked_s']:.3g} s (writes {g['write_s']:.3g} s, loads {g['load_s']:.3g} s); "
        f"best save interval {g['save_interval']:,} steps ({g['optimal_interval_s'] / 60:.3g} min; "
        f"checkpoint.save_interval is {configured:,}{'' if configured else ': only at the end'})"
    ]
    for path, r in g["restarts"].items():
        at = (
            f", {r['goodput_configured']:.1%} at the configured interval" if r["goodput_configured"] is not None else ""
        )
        lines.append(
            f"  {path}: back to training in {r['restart_s']:.0f} s (compile {g['compile_s']:.0f} s assumed); goodput "
            f"{r['goodput_at_optimum']:.1%} at the best interval{at}"
        )
    return lines


def breakdown_line(pred: dict) -> str:
    """Where the predicted step goes: `step S s = compute ... + offload ... s`."""
    parts = " + ".join(f"{label} {pred['step_breakdown_s'][key]:.3g}" for key, label in STEP_PARTS.items())
    return f"  step {pred['step_time_s']:.3g} s = {parts} s"


def _model_error(pred: dict) -> str:
    """`; the speed model's median error ...` when the profile's speed model is calibrated, else nothing."""
    error = pred["speed_model"]["error"]
    return (
        f"; the speed model's median error on published 910B figures is {error:.0%} (docs/planner.md)" if error else ""
    )


def _near_budget(result: dict, before: str = "") -> str:
    """A flag for a plan that fits within NEAR_BUDGET_GIB of its memory budget, else nothing."""
    if not result["fits"] or result["memory_headroom_gib"] >= NEAR_BUDGET_GIB:
        return ""
    return f"{before}within {NEAR_BUDGET_GIB:g} GiB of the budget: the activation estimate may not hold there"


def published_lines(entries: list[dict]) -> list[str]:
    """The published figures that cover the config's model and card count (the anchors' claims, cited), each with
    the prediction for the anchor's own layout."""
    out = []
    for e in entries:
        out.append(
            f"published by {e['anchor']} (its claim, not a MindScale measurement; {e['source']}): "
            f"{e['tokens_per_s_per_card']:,} tokens/s per card, {e['model']}, {e['hardware']}, {e['layout']}, "
            f"global batch {e['global_batch']}, recompute {e['recompute']}; "
            f"predicted for that layout: {e['predicted_tokens_per_s_per_card']:,.0f} ({e['error']:+.1%})"
        )
    return out


def pipeline_line(result: dict) -> str:
    """The schedule's terms: bubble, chunk forwards in flight and their activations, stage-boundary sends."""
    lay, pred, comm = result["layout"], result["predicted"], result["comm_bytes_per_step"]
    p, v, m = lay["pipeline_stage"], lay["pipeline_interleave"], lay["micro_batch_num"]
    if p == 1:
        return "pipeline: none (one stage)"
    worst = result["memory_stage"]
    forwards = result["in_flight_forwards_per_stage"]
    schedule = "1F1B" if v == 1 else f"interleaved 1F1B, {v} chunks per stage ({lay['pipeline_scheduler']})"
    held = (
        f"{forwards[worst]} micro batches"
        if v == 1
        else f"{forwards[worst]} chunk forwards ({forwards[worst] / v:.3g} micro batches of its layers)"
    )
    ratio = f"(p-1)/m = {p - 1}/{m}" if v == 1 else f"(p-1)/(v·m) = {p - 1}/({v}·{m})"
    return (
        f"pipeline: {schedule}; bubble {pred['bubble_fraction']:.1%} = {ratio}; worst stage {worst} holds {held} in flight: activations "
        f"{result['memory_gib']['activations']:.1f} GiB (stage 0: {forwards[0]}); "
        f"{comm['pp_sends_per_micro_batch']} stage-boundary sends per micro batch on stage {worst}"
    )


def _tensor_split(lay: dict) -> str:
    """The 2D or 3D split after the tensor degree, e.g. " (2D: 2 x 4)"; nothing in 1D."""
    x, y, z = lay["tensor_split"]
    if x * y == 1:
        return ""
    return f" (3D: {x} x {y} x {z})" if z > 1 else f" (2D: {x} x {y})"


def _comm(lay: dict) -> str:
    """` + comm` where recompute.comm repeats tensor-parallel communication in the backward, else nothing."""
    return " + comm" if lay["recompute_comm"] else ""


def _offload_layers(lay: dict, before: str = "", after: str = "") -> str:
    """`offload [n per stage]` (`offload n a stage` when every stage offloads n) between `before` and `after` for a
    layout that offloads activations, else nothing."""
    counts = lay["offload_layers"]
    if not any(counts):
        return ""
    uniform = len(counts) > 1 and len(set(counts)) == 1
    return f"{before}offload {f'{counts[0]} a stage' if uniform else counts}{after}"


def offload_line(result: dict) -> str:
    """Activation offload: what moves per layer, host memory, traffic and copy time against the slot."""
    o, pred = result["offload"], result["predicted"]
    return (
        f"offload: {_bytes(o['bytes_per_layer'])} per offloaded layer and micro batch to host memory and back "
        f"({_bytes(o['resident_bytes_per_layer'])} of Q, K, V stay); host memory "
        f"{max(o['host_gib_per_stage']):.1f} of {o['host_memory_gib']:g} GiB per device (worst stage); "
        f"{_bytes(o['bytes_per_step'])} each way per step over the {o['host_link_gbps']:g} GB/s host link, "
        f"{o['copy_s_per_micro_batch']:.3g} s per micro batch (exposed {pred['offload_exposed_s']:.3g} s per step)"
    )


def set_line(overrides: list[str]) -> str:
    """Overrides as the `--set` arguments of a command line (quoted where the shell needs it)."""
    return " ".join(f"--set '{o}'" if "[" in o else f"--set {o}" for o in overrides)


def search_text(devices: int, found: list[dict]) -> str:
    """The layouts `planner.search` found, best first, each with its `--set` line, how far below the best it is
    predicted against the speed model's error, and a flag where it fits within NEAR_BUDGET_GIB of the budget."""
    lines = [f"top {len(found)} layouts for {devices} devices (ranked by predicted tokens/s among plans that fit):"]
    best = found[0]["plan"]["predicted"]["tokens_per_s"]
    error = found[0]["plan"]["predicted"]["speed_model"]["error"]
    for rank, entry in enumerate(found, 1):
        p, pred = entry["plan"], entry["plan"]["predicted"]
        lay = p["layout"]
        lines.append(
            f"{rank}. dp {lay['data_parallel']} mp {lay['model_parallel']} {_context(lay, 'cp ')}"
            + (f"ep {lay['expert_parallel']} " if lay["expert_parallel"] > 1 else "")
            + f"pp {lay['pipeline_stage']}"
            + (f" x {lay['pipeline_interleave']} chunks" if lay["pipeline_interleave"] > 1 else "")
            + ", "
            f"micro batches {lay['micro_batch_num'] * lay['gradient_accumulation_steps']} x "
            f"{lay['micro_batch_size']}, recompute {lay['recompute']} {lay['recompute_layers']}{_comm(lay)}"
            + _offload_layers(lay, before=", ")
            + (", accumulation buffers sharded" if lay["gradient_accumulation_shard"] else "")
            + f": {pred['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {pred['mfu']:.1%}, bubble {pred['bubble_fraction']:.1%}, memory {p['memory_gib']['total']:.1f} of "
            f"{p['memory_budget_gib']:.1f} GiB"
            + (f" ({pred['tokens_per_s'] / best - 1:+.1%} vs layout 1)" if rank > 1 else "")
            + _near_budget(p, "; ")
        )
        lines.append(f"   {set_line(entry['overrides'])}")
    lines.append(spread_line(found, error))
    return "\n".join(lines)


def spread_line(found: list[dict], error: float | None) -> str:
    """How far apart the top layouts are predicted, against the speed model's error: those within it of the best
    are not told apart by the model."""
    rates = [e["plan"]["predicted"]["tokens_per_s"] for e in found]
    spread = 1 - rates[-1] / rates[0]
    if not error:
        return (
            f"the {len(found)} layouts span {spread:.1%} of predicted tokens/s; the profile's speed model is not "
            "calibrated, so how much of that is real is not known"
        )
    close = sum(1 for r in rates if 1 - r / rates[0] <= error)
    return (
        f"the {len(found)} layouts span {spread:.1%} of predicted tokens/s; the speed model's median error on "
        f"published 910B figures is {error:.0%}, so "
        + (
            f"layouts 1 to {close} are within it of each other: the model does not tell them apart"
            if close > 1
            else "layout 1 leads the others by more than that error"
        )
    )


def search_json(found: list[dict]) -> dict:
    """The best layout's plan, with every layout `planner.search` found under "search", best first."""
    best = dict(found[0]["plan"])
    top = found[0]["plan"]["predicted"]["tokens_per_s"]
    best["search"] = [
        {
            "rank": i,
            "overrides": e["overrides"],
            "set": set_line(e["overrides"]),
            "predicted": e["plan"]["predicted"],
            "memory_gib": e["plan"]["memory_gib"],
            "layout": e["plan"]["layout"],
            "fits": e["plan"]["fits"],
            "vs_best": e["plan"]["predicted"]["tokens_per_s"] / top - 1,
            "near_budget": bool(_near_budget(e["plan"])),
        }
        for i, e in enumerate(found, 1)
    ]
    best["search_spread"] = spread_line(found, found[0]["plan"]["predicted"]["speed_model"]["error"])
    return best


def readme_table(configs: list[Path], peak_tflops: float | None = None) -> str:
    """Markdown table of `configs` (files of this checkout) and their plans; the README includes it for
    `shipped_configs()`."""
    rows = [
        "| config | params | cards | dp/mp/pp | micro batches x size | recompute (offload) | memory per card (GiB) "
        "| MindSpore's plan (GiB, dry run) | predicted MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors = set()
    records = compiled_memory.load()
    for path in configs:
        cfg = load_config(path)
        record = compiled_memory.current(records, path, cfg)
        result = plan(cfg, peak_tflops)
        errors.add(result["predicted"]["speed_model"]["error"])
        lay = result["layout"]
        micro = lay["micro_batch_num"] * lay["gradient_accumulation_steps"]
        recompute = (
            lay["recompute"]
            if lay["recompute"] != "full" or cfg.recompute.layers is None
            else f"full {lay['recompute_layers']}"
        )
        recompute += _comm(lay) + _offload_layers(lay, before=" (", after=")")
        rows.append(
            f"| `{path.relative_to(REPO_ROOT)}` | {_count(result['params'])} | {result['devices']} "
            f"({cfg.hardware.name}) | {lay['data_parallel']}/{lay['model_parallel']}/{lay['pipeline_stage']}"
            f"{f' x {v} chunks' if (v := lay['pipeline_interleave']) > 1 else ''}"
            f"{f', cp {c}' if (c := lay['context_parallel']) > 1 else ''}"
            f"{f', ep {e}' if (e := lay['expert_parallel']) > 1 else ''} "
            f"| {micro} x {lay['micro_batch_size']} | {recompute} | "
            f"{result['memory_gib']['total']:.1f} of {result['device_memory_gib']:g} | "
            f"{_compiled_peak(path, record)} | {result['predicted']['mfu']:.1%} |"
        )
    rows.append("")
    calibrated = f", median error {errors.pop():.0%} on them" if len(errors) == 1 and None not in errors else ""
    rows.append(
        "Generated by `python tools/plan.py --readme-table`; MFU predicted by the planner's speed model "
        f"(docs/planner.md: fitted on published 910B figures{calibrated}; not measured). MFU "
        "counts the attention core whole (PaLM's definition) while flash attention computes its causal half, "
        "so at 128K, where the core is most of the FLOPs, MFU exceeds what the hardware does. `+ comm`: "
        "`recompute.comm`, the backward gathers the sequence-parallel inputs again instead of keeping them "
        "gathered (docs/planner.md). MindSpore's plan: its level-1 dry run of the first and last stage, the busiest "
        "rank with fragments, inside MindSpore's pool (`hardware.max_device_memory_gib`); no kernel workspaces or "
        "HCCL buffers (docs/dryrun.md); recorded by `python bench/compiled_memory.py`, `-` where the config's "
        "layout has not been compiled so. It is compiled as one kernel graph, within MindSpore's 64 calls of the "
        "layer graph; \"with ... planner's\": the planner's bytes for what the shipped step holds beyond it (the "
        "chunk forwards a cut leaves out, the views its many kernel graphs keep: docs/planner.md)."
    )
    return "\n".join(rows)


def _compiled_peak(path: Path, record: dict | None) -> str:
    if not record:
        return "-"
    rank = compiled_memory.busiest(path, record)
    extra = compiled_memory.shipped_extra_mib(path, record, rank["stage"])
    planner = f" (with {extra / 1024:.1f} planner's)" if extra >= 0.05 * 1024 else ""
    total = compiled_memory.shipped_mib(path, record, rank, "peak_mib")
    return f"{total / 1024:.1f} of {rank['pool_mib'] / 1024:g}{planner}"
