"""Plan a config before compiling it: parameters, FLOPs, per-device memory, communication, predicted
step time and MFU (mindscale/perf/planner.py; formulas and their sources in docs/planner.md).

    python tools/plan.py --config configs/llama2/llama2_70b.yaml [--set k=v ...] [--json]
    python tools/plan.py --config configs/llama2/llama2_70b.yaml --devices 64          # re-plan: data_parallel changes
    python tools/plan.py --config configs/llama2/llama2_70b.yaml --search --devices 64 # rank layouts, print --set lines
    python tools/plan.py --config configs/llama2/llama2_7b.yaml --strategies           # per-layer shard strategies
    python tools/plan.py --readme-table                                                # Markdown table of shipped configs
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mindscale.perf import flops, planner
from mindscale.config import REPO_ROOT, ConfigError, load_config
from mindscale.cli import add_config_arguments, config_from_args, fail

SCALE_DIRS = ("gpt3", "llama2", "llama3")


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


def text(result: dict) -> str:
    lay, mem, comm, pred = result["layout"], result["memory_gib"], result["comm_bytes_per_step"], result["predicted"]
    stages = lay["pipeline_stage"]
    lines = [
        f"{result['config']} on {result['devices']} x {result['hardware']}: data {lay['data_parallel']} x model "
        f"{lay['model_parallel']} x pipeline {stages}; {lay['micro_batch_num']} micro batch(es) of "
        f"{lay['micro_batch_size']} x {lay['gradient_accumulation_steps']} accumulation = global batch "
        f"{lay['global_batch_size']}; recompute {lay['recompute']} {lay['recompute_layers']}; "
        f"attention {lay['attention']}; sequence parallel {lay['sequence_parallel']}; "
        f"optimizer shard {lay['optimizer_shard']}" +
        (" (accumulation buffers sharded too)" if lay["gradient_accumulation_shard"] else ""),
        f"parameters      {result['params']:,} (matmul N = {result['matmul_params']:,})",
        f"FLOPs per token model {result['flops_per_token']:.4g} (6N + 12·L·H·Q·T), "
        f"hardware {result['hflops_per_token']:.4g} (with recompute)",
        f"memory per device, worst stage {result['memory_stage']} of {stages} (layers per stage "
        f"{lay['layers_per_stage']}):",
    ]
    for key in ("weights", "grads", "optimizer", "transient", "activations", "reserve", "total"):
        lines.append(f"  {key:<12}{_gib(mem[key])}")
    lines.append("  (weights, grads, optimizer: this rank's slices as MindSpore's compiler cuts them, exact; "
                 "tools/dryrun.py compares them)")
    verdict = "FITS" if result["fits"] else "DOES NOT FIT"
    lines.append(f"  budget      {_gib(result['memory_budget_gib'])} of {result['device_memory_gib']:g} GiB "
                 f"(memory_margin of what the reserve leaves): {verdict}")
    lines.append(f"communication per device per step: data-parallel gradients {_bytes(comm['dp_grad_reduce'])}, "
                 f"tensor-parallel {_bytes(comm['tp'])} ({_bytes(comm['tp_per_layer'])} per layer and micro "
                 f"batch), pipeline send/recv {_bytes(comm['pp_send_recv'])}")
    lines.append(f"predicted: step {pred['step_time_s']:.3g} s, {pred['tokens_per_s']:,.0f} tokens/s "
                 f"({pred['tokens_per_s_per_device']:,.1f}/device), MFU {pred['mfu']:.1%}, HFU {pred['hfu']:.1%} "
                 f"(peak {pred['peak_tflops']:g} TFLOP/s per device; bubble {pred['bubble_fraction']:.1%}, "
                 f"exposed communication {pred['comm_exposed_s']:.3g} s)")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in pred["assumptions"]]
    return "\n".join(lines)


def set_line(overrides: list[str]) -> str:
    return " ".join(f"--set '{o}'" if "[" in o else f"--set {o}" for o in overrides)


def search_text(devices: int, found: list[dict]) -> str:
    lines = [f"top {len(found)} layouts for {devices} devices (ranked by predicted tokens/s among plans that fit):"]
    for rank, entry in enumerate(found, 1):
        p, pred = entry["plan"], entry["plan"]["predicted"]
        lay = p["layout"]
        lines.append(f"{rank}. dp {lay['data_parallel']} mp {lay['model_parallel']} pp {lay['pipeline_stage']}, "
                     f"micro batches {lay['micro_batch_num'] * lay['gradient_accumulation_steps']} x "
                     f"{lay['micro_batch_size']}, recompute {lay['recompute']} {lay['recompute_layers']}"
                     + (", accumulation buffers sharded" if lay["gradient_accumulation_shard"] else "")
                     + f": {pred['tokens_per_s']:,.0f} tokens/s, "
                     f"MFU {pred['mfu']:.1%}, memory {p['memory_gib']['total']:.1f} of "
                     f"{p['memory_budget_gib']:.1f} GiB")
        lines.append(f"   {set_line(entry['overrides'])}")
    return "\n".join(lines)


def readme_table(peak_tflops: float | None = None) -> str:
    """Markdown table of every shipped scale config and its plan (the README includes this output)."""
    rows = ["| config | params | cards | dp/mp/pp | micro batches x size | recompute | memory per card (GiB) | predicted MFU |",
            "|---|---|---|---|---|---|---|---|"]
    for path in shipped_configs():
        cfg = load_config(path)
        result = planner.plan(cfg, peak_tflops)
        lay = result["layout"]
        micro = lay["micro_batch_num"] * lay["gradient_accumulation_steps"]
        recompute = lay["recompute"] if lay["recompute"] != "full" or cfg.recompute.layers is None else \
            f"full {lay['recompute_layers']}"
        rows.append(f"| `{path.relative_to(REPO_ROOT)}` | {_count(result['params'])} | {result['devices']} "
                    f"({cfg.hardware.name}) | {lay['data_parallel']}/{lay['model_parallel']}/{lay['pipeline_stage']} "
                    f"| {micro} x {lay['micro_batch_size']} | {recompute} | "
                    f"{result['memory_gib']['total']:.1f} of {result['device_memory_gib']:g} | "
                    f"{result['predicted']['mfu']:.1%} |")
    rows.append("")
    rows.append("Generated by `python tools/plan.py --readme-table`; MFU predicted at the efficiency and peaks "
                "stated in docs/planner.md (not measured).")
    return "\n".join(rows)


def strategies(cfg) -> str:
    try:
        from models.sharding import describe_plan
    except ImportError as exc:
        fail(f"--strategies needs models/sharding.py ({exc}); it is not in this checkout yet")
    return describe_plan(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plan memory, communication and MFU of a config before compiling.")
    add_config_arguments(parser, required=False)
    parser.add_argument("--devices", type=int, help="re-plan for N devices (data_parallel changes; with --search: "
                                                    "the device count to search)")
    parser.add_argument("--search", action="store_true", help="rank valid (dp, mp, pp, micro batches, recompute) "
                                                              "layouts and print the top ones as --set lines")
    parser.add_argument("--top", type=int, default=5, help="layouts printed by --search (default 5)")
    parser.add_argument("--strategies", action="store_true", help="print the per-layer sharding strategies")
    parser.add_argument("--readme-table", action="store_true", help="Markdown table of all shipped scale configs")
    parser.add_argument("--peak-tflops", type=float, help="override the hardware profile's peak per device")
    parser.add_argument("--efficiency", type=float, help="fraction of peak the hardware FLOPs run at "
                                                         f"(default {planner.DEFAULT_EFFICIENCY})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    if args.peak_tflops is not None and args.peak_tflops <= 0:
        fail(f"--peak-tflops {args.peak_tflops}: must be > 0")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        fail(f"--efficiency {args.efficiency}: must be in (0, 1]")
    if args.readme_table:
        print(readme_table(args.peak_tflops))
        return 0
    if not args.config:
        fail("--config is required (or --readme-table); e.g. --config configs/llama2/llama2_7b.yaml")
    cfg = config_from_args(args)
    if args.strategies:
        print(strategies(cfg))
        return 0
    try:
        if args.search:
            devices = args.devices or cfg.devices
            found = planner.search(cfg, devices, args.top, args.peak_tflops, args.efficiency)
            if args.json:
                best = dict(found[0]["plan"])
                best["search"] = [{"rank": i, "overrides": e["overrides"], "set": set_line(e["overrides"]),
                                   "predicted": e["plan"]["predicted"], "memory_gib": e["plan"]["memory_gib"],
                                   "layout": e["plan"]["layout"], "fits": e["plan"]["fits"]}
                                  for i, e in enumerate(found, 1)]
                print(json.dumps(best))
            else:
                print(search_text(devices, found))
            return 0
        if args.devices is not None and args.devices != cfg.devices:
            cfg = planner.replan_devices(cfg, args.devices)
        result = planner.plan(cfg, args.peak_tflops, args.efficiency)
    except (planner.PlanError, ConfigError) as exc:
        fail(str(exc))
    print(json.dumps(result) if args.json else text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
