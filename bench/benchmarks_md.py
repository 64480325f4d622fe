"""BENCHMARKS.md from bench/run_all.py's results (also: `python bench/benchmarks_md.py [results.json]`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import (
    communication_targets,
    compiled_memory,
    data_index,
    data_wait,
    micro_batch_compile,
    preprocess_throughput,
    published_ascend,
)
from mindscale.cli import fail
from mindscale.io import write_atomically
from mindscale.perf.flops import formula_text
from mindscale.perf.gemm_peak import CHAIN, GEMM_SIZE, REPEATS

NAMES = {"mindscale": "MindScale", "mindformers": "MindFormers 1.9.0", "hf": "HF transformers / torch"}
TARGETS = {"hf": 1.1, "mindformers": 1.3}  # MindScale tokens/s over the peer
MEMORY_TARGET = 1.5  # MindScale peak host RSS over HF/torch's, throughput runs
COMPILE_TARGET = 1 / 3  # MindScale compile time over MindFormers', at 32 and 80 layers
COMPILE_TARGET_DEPTHS = (32, 80)
LINEARITY_TARGET = 0.95
NOISE_ABOVE = 1.05  # 2 workers cannot be more than linear: above this, load noise


def fmt(value, digits: int = 1, unit: str = "") -> str:
    return "—" if value is None else f"{value:,.{digits}f}{unit}"


def spread(stat: dict | None, digits: int = 1) -> str:
    if not stat:
        return "failed"
    if stat["n"] == 1:
        return fmt(stat["median"], digits)
    return f"{fmt(stat['median'], digits)} ({fmt(stat['min'], digits)}–{fmt(stat['max'], digits)})"


def times(ratio: dict | None, digits: int = 2) -> str:
    return f"{spread(ratio, digits)}×" if ratio else "failed"


def verdict(ok: bool | None) -> str:
    return "n/a (failed)" if ok is None else ("met" if ok else "**not met**")


def failures(runs: list[dict]) -> list[str]:
    return [
        f"- {NAMES.get(r['system'], r['system'])}"
        + (f" at {r['depth']} layers" if "depth" in r else "")
        + f" (rep {r.get('rep', 0) + 1}): `{r['error']}` — command: `{r['command']}`"
        for r in runs
        if r.get("error")
    ]


def targets_table(results: dict) -> list[str]:
    s = results["summary"]
    rows = ["| target | measured | status |", "|---|---|---|"]
    for peer, target in TARGETS.items():
        ratio = s["ratio_vs"].get(peer)
        rows.append(
            f"| MindScale tokens/s ≥ {target:g}× {NAMES[peer]} | {times(ratio, 3)} | "
            f"{verdict(None if not ratio else ratio['median'] >= target)} |"
        )
    for depth in COMPILE_TARGET_DEPTHS:
        ratio = s["compile_by_depth"].get(depth, {}).get("ratio") if depth in s["compile_by_depth"] else None
        if depth in s["compile_by_depth"] or depth in results["settings"]["depths"]:
            rows.append(
                f"| compile time ≤ 1/3 of MindFormers' at {depth} layers | {times(ratio, 3)} | "
                f"{verdict(None if not ratio else ratio['median'] <= COMPILE_TARGET)} |"
            )
    memory = s["peak_rss_gib"]
    if memory.get("mindscale") and memory.get("hf"):
        ratio = memory["mindscale"]["median"] / memory["hf"]["median"]
        rows.append(
            f"| MindScale peak host RSS ≤ {MEMORY_TARGET:g}× {NAMES['hf']}'s | {ratio:.2f}× "
            f"({memory['mindscale']['median']:.2f} / {memory['hf']['median']:.2f} GiB, medians) | "
            f"{verdict(ratio <= MEMORY_TARGET)} |"
        )
    rows += [
        f"| dry run, every compared rank (§6): {label} | {measured} | {verdict(ok)} |"
        for label, measured, ok in dryrun_targets(results.get("dryrun_compare") or [])
    ]
    if results.get("micro_batch_compile"):
        label, measured, ok = micro_batch_compile.targets(results["micro_batch_compile"])
        rows.append(f"| dry run (§10): {label} | {measured} | {verdict(ok)} |")
    if results.get("published_ascend"):
        rows += [
            f"| {label} | {measured} | {verdict(ok)} |"
            for label, measured, ok in published_ascend.targets(results["published_ascend"])
        ]
    if results.get("communication_targets"):
        rows += [
            f"| {label} | {measured} | {verdict(ok)} |"
            for label, measured, ok in communication_targets.targets(results["communication_targets"])
        ]
    lin, ceiling = linearity_value(results), results["linearity"].get("ceiling")
    bound = f" (all-reduce ceiling {fmt(ceiling['value'], 3)}, §3)" if ceiling else ""
    rows.append(
        f"| CPU data-parallel linearity ≥ {LINEARITY_TARGET} (2 workers) | {fmt(lin, 3)}{bound} | "
        f"{linearity_verdict(lin)} |"
    )
    return rows


def lower_sweep(lin: dict) -> dict | None:
    """The sweep (one per 1-worker base run) with the lower 2-worker linearity: the one reported."""
    sweeps = lin.get("sweeps", [])
    return min(sweeps, key=lambda s: s["points"][-1]["linearity"]) if sweeps and not lin.get("error") else None


def linearity_value(results: dict) -> float | None:
    """The lower of the 2-worker linearities (one per 1-worker base run)."""
    sweep = lower_sweep(results["linearity"])
    return None if sweep is None else sweep["points"][-1]["linearity"]


def linearity_verdict(value: float | None) -> str:
    if value is not None and value > NOISE_ABOVE:
        return (
            "inconclusive: above 1, so the 1-worker runs were slowed by other load on the machine "
            "more than the 2-worker run"
        )
    return verdict(None if value is None else value >= LINEARITY_TARGET)


def peak_samples(gemm: dict, name: str) -> str:
    """' (higher of: start X, end Y)' when the peak was measured at both ends of the run."""
    if "at_start" not in gemm:  # results from before the second measurement
        return ""
    return (
        f" (the higher of the start, {fmt(gemm['at_start'].get(name), 4)}, and the end of the run, "
        f"{fmt(gemm['at_end'].get(name), 4)})"
    )


def machine_section(results: dict) -> list[str]:
    m, g = results["machine"], results["gemm"]
    v = m["versions"]
    peak = g.get("mindspore_tflops")
    lines = [
        f"- CPU: {m['cpu']}, {m['logical_cores']} logical cores (usable {m['usable_cores']}), "
        f"{m['memory_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python {m['python']}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- GEMM peak (the MFU denominator), measured in this run: MindSpore fp32, {CHAIN} chained "
        f"{GEMM_SIZE}³ MatMuls in one graph on one core, one thread, best of {REPEATS} = "
        f"**{fmt(peak, 4)} TFLOP/s**"
        + peak_samples(g, "mindspore_tflops")
        + (f" (failed: {g['mindspore_tflops_error']})" if "mindspore_tflops_error" in g else ""),
        f"- Same GEMM with torch on the same core: {fmt(g.get('torch_tflops'), 4)} TFLOP/s"
        + peak_samples(g, "torch_tflops")
        + (f" ({g['torch_tflops'] / peak:.2f}× MindSpore's)" if peak and g.get("torch_tflops") else "")
        + (f" (failed: {g['torch_tflops_error']})" if "torch_tflops_error" in g else ""),
        f"- Machine load (1-minute load average): {results['load_1m_start']:.2f} at the start, "
        f"{results['load_1m_end']:.2f} at the end; per run in `output/bench/results.json`. The machine "
        "is shared: absolute numbers move between runs, the interleaved ratios much less.",
        f"- Started {results['started']}, took {results['duration_s'] / 60:.1f} min.",
    ]
    return lines


def throughput_section(results: dict) -> list[str]:
    s = results["summary"]
    rows = [
        "| system | tokens/s | model TFLOP/s | CPU MFU | MindScale ÷ system | compile + first step, s | "
        "params | first loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, name in NAMES.items():
        ok = [r for r in results["throughput"] if r["system"] == system and not r.get("error")]
        if not ok:
            rows.append(f"| {name} | failed (see below) | | | | | | |")
            continue
        ratio = "1.00" if system == "mindscale" else spread(s["ratio_vs"].get(system), 2)
        mfu = s["mfu"].get(system)
        rows.append(
            f"| {name} | {spread(s['tokens_per_s'].get(system))} | {spread(s['tflops'].get(system), 4)} | "
            f"{fmt(None if mfu is None else mfu * 100, 1, '%')} | {ratio} | "
            f"{spread(s['compile_s'].get(system))} | {ok[0]['params']:,} | {ok[0]['losses'][0]:.3f} |"
        )
    return rows


def memory_section(results: dict) -> list[str]:
    s = results["summary"]["peak_rss_gib"]
    rows = ["| system | peak host RSS, GiB (throughput run) |", "|---|---|"]
    rows += [f"| {name} | {spread(s.get(system), 2)} |" for system, name in NAMES.items()]
    return rows


def compile_section(results: dict) -> list[str]:
    rows = [
        "| layers | MindScale, s | MindFormers, s | MindScale ÷ MindFormers | cores (MindScale/MindFormers) |",
        "|---|---|---|---|---|",
    ]
    for depth, entry in results["summary"]["compile_by_depth"].items():
        systems = entry["systems"]
        cores = {
            s: [str(r["core"]) for r in results["compile"] if r["depth"] == depth and r["system"] == s and "core" in r]
            for s in ("mindscale", "mindformers")
        }
        rows.append(
            f"| {depth} | {spread(systems.get('mindscale'))} | {spread(systems.get('mindformers'))} | "
            f"{spread(entry['ratio'], 2)} | {','.join(cores['mindscale']) or '—'}/"
            f"{','.join(cores['mindformers']) or '—'} |"
        )
    return rows


def allreduce_lines(lin: dict) -> list[str]:
    """The gradient all-reduce measured alone, and the linearity ceiling it sets."""
    ar = lin.get("allreduce")
    if ar is None:  # results from before bench/allreduce.py
        return []
    if ar.get("error"):
        return ["", f"Gradient all-reduce (`bench/allreduce.py`): failed: `{ar['error']}` — command: `{ar['command']}`"]
    cap = lin.get("ceiling")
    bound = (
        f"{cap['value']:.3f} = {cap['one_worker_step_s']:.3f} / ({cap['one_worker_step_s']:.3f} + "
        f"{cap['allreduce_wall_s']:.3f}) (base `{cap['base_run']}`)"
        if cap
        else "— (no linearity sweep)"
    )
    return [
        "",
        f"Gradient all-reduce alone (`bench/allreduce.py`: {ar['workers']} workers, one core and one operator "
        f"thread each, one AllReduce per trainable parameter in one graph as nn.DistributedGradReducer does; "
        f"median of {len(ar['wall_s_calls'])} calls after a warm-up):",
        "",
        "| gradients | wall, s | CPU-s (rank 0's process) | MB/s | linearity ceiling t1 / (t1 + all-reduce) |",
        "|---|---|---|---|---|",
        f"| {ar['bytes'] / 1e6:.1f} MB in {ar['tensors']} tensors | {ar['wall_s']:.3f} | {ar['cpu_s']:.3f} | "
        f"{ar['mb_per_s']:.0f} | {bound} |",
        "",
        "MindSpore's only CPU collective backend (MCCL) reduces on the CPU of the calling process, so with "
        "one core per worker the all-reduce cannot overlap the backward pass: it adds to every step, and "
        "2-worker linearity cannot exceed this ceiling even before the workers contend for memory bandwidth.",
    ]


def linearity_section(results: dict) -> list[str]:
    lin = results["linearity"]
    if lin.get("error"):
        return [f"Failed: `{lin['error']}`", *allreduce_lines(lin)]
    per_run = {}
    for sweep in lin["sweeps"]:
        for p in sweep["points"]:
            per_run[p["run"]] = p
    rows = [
        "| run, in order | workers (1 core each) | tokens/s | tokens/s per worker | step, s | load before → after |",
        "|---|---|---|---|---|---|",
    ]
    for r in lin["runs"]:
        p = per_run[r["run"]]
        rows.append(
            f"| `{r['run']}` | {r['workers']} | {p['tokens_per_s']:.1f} | {p['tokens_per_s_per_device']:.1f} | "
            f"{p['step_time_s']:.3f} | {fmt(r['load_1m_before'], 2)} → {fmt(r['load_1m_after'], 2)} |"
        )
    values = ", ".join(f"{s['points'][-1]['linearity']:.3f} (base `{s['points'][0]['run']}`)" for s in lin["sweeps"])
    return rows + ["", f"Linearity of 2 workers: {values}; the lower one is reported above.", *allreduce_lines(lin)]


def checkpoint_section(results: dict) -> list[str]:
    """Phase 5 (bench/checkpoint_io.py); results from before it render nothing."""
    io = results.get("checkpoint_io")
    if io is None:
        return []
    rows = [
        "| save | training blocked per save, s (median; each) | step on disk | write GB/s while blocked |",
        "|---|---|---|---|",
    ]
    for run in io["saves"]:
        kind = "`checkpoint.async_save: true`" if run["async"] else "synchronous"
        if run.get("error"):
            rows.append(f"| {kind} | failed: `{run['error']}` — command: `{run['command']}` | | |")
            continue
        each = ", ".join(f"{b:.3f}" for b in run["blocked_s"])
        rows.append(
            f"| {kind} | {run['median_blocked_s']:.3f} ({each}) | {run['step_bytes'] / 1e6:.1f} MB | "
            f"{run['step_bytes'] / 1e9 / run['median_blocked_s']:.2f} |"
        )
    rows += [
        "",
        "| reshard (`tools/reshard.py`) | ranks written | GB (weights + AdamW moments) | read + cut + "
        "write, s | GB/s | dry-run compile of the target, s |",
        "|---|---|---|---|---|---|",
    ]
    for run in io["reshard"]:
        if run.get("error"):
            rows.append(f"| into {run['into']} | failed: `{run['error']}` — command: `{run['command']}` | | | | |")
            continue
        rows.append(
            f"| into {run['into']} | {run['ranks']} | {run['bytes'] / 1e9:.3f} | "
            f"{run['seconds'] - run['compile_s']:.2f} | {run['gb_per_s']:.2f} | {run['compile_s']:.1f} |"
        )
    commands = [r["command"] for r in io["saves"] + io["reshard"]]
    return [
        "## 5. Checkpoint I/O (this host's disk)",
        "",
        "The peer config saving every 2 steps, three saves per run; `save_blocked_s` of metrics.jsonl is "
        "the time the training loop waited for each save (`bench/checkpoint_io.py`). A synchronous save "
        "blocks for the whole write; an asynchronous one for the copy to host memory (and for the previous "
        "write, when it is still running). Resharding cuts the synchronous run's step into a sharded "
        "layout whose slices come from a dry-run compile (docs/dryrun.md), then merges that back. These are "
        "CPU-host figures; nothing here ran on an Ascend device or its storage.",
        "",
        *rows,
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in commands) + ".",
        "",
    ]


KINDS = ("AllReduce", "AllGather", "ReduceScatter", "Send")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def dryrun_targets(layouts: list[dict]) -> list[tuple[str, str, bool]]:
    """Issue 17's targets over every rank both stacks compiled: (target, worst measured value, met)."""
    pairs = [
        (o, p)
        for r in layouts
        if not r.get("error")
        for o, p in zip(r["mindscale"], r["mindformers"])
        if o["compiled"] and p["compiled"] and p["sent_bytes"] and o["planned_sent_bytes"]
    ]
    if not pairs:
        return []
    vs_peer = max(o["sent_bytes"] / p["sent_bytes"] for o, p in pairs)
    vs_plan = max(o["sent_bytes"] / o["planned_sent_bytes"] for o, _ in pairs)
    compile_ratio = max(o["compile_s"] / p["compile_s"] for o, p in pairs)
    equal = sum(o["bytes"] == o["planned_bytes"] for o, _ in pairs)
    return [
        ("bytes sent ≤ 1.0× MindFormers'", f"{vs_peer:.2f}×", vs_peer <= 1.0),
        ("bytes sent ≤ 1.1× the analytic volume", f"{vs_plan:.2f}×", vs_plan <= 1.1),
        ("stage compile ≤ 1/3 of MindFormers'", f"{compile_ratio:.2f}×", compile_ratio <= 1 / 3),
        ("weights / grads / AdamW = the planner's", f"{equal} of {len(pairs)} ranks", equal == len(pairs)),
    ]


def dryrun_compare_section(results: dict) -> list[str]:
    """Phase 6 (bench/dryrun_compare.py); results from before it render nothing."""
    layouts = results.get("dryrun_compare")
    if layouts is None:
        return []
    rows = [
        "| layout (cards) | rank (stage) | stack | compile s | weights / grads / AdamW MiB (planner) | "
        + " / ".join(KINDS)
        + " MB sent | sent per step MB | vs MindFormers | vs analytic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in layouts:
        name = f"`{Path(result['config']).stem}`"
        if result.get("error"):
            rows.append(f"| {name} | failed: `{result['error']}` | | | | | | | |")
            continue
        lay = result["layout"]
        shape = f"{name} dp{lay['dp']}·tp{lay['tp']}{'+sp' if lay['sp'] else ''}·pp{lay['pp']} ({result['devices']})"
        for ours, peer in zip(result["mindscale"], result["mindformers"]):
            for stack, rank in (("MindScale", ours), ("MindFormers", peer)):
                where = f"{rank['rank']} ({rank.get('stage', '?')})"
                if not rank["compiled"]:
                    rows.append(f"| {shape} | {where} | {stack} | failed: `{rank['error']}` | | | | | |")
                    continue
                b, planned = rank["bytes"], rank["planned_bytes"]
                memory = " / ".join(_mib(b[k]) for k in ("weights", "grads", "optimizer"))
                memory += " (=)" if b == planned else " (" + " / ".join(_mib(planned[k]) for k in planned) + ")"
                kinds = " / ".join(f"{rank['collectives'].get(k, {}).get('sent_bytes', 0) / 1e6:,.1f}" for k in KINDS)
                vs_peer = (
                    f"{rank['sent_bytes'] / peer['sent_bytes']:.2f}× bytes, "
                    f"{rank['compile_s'] / peer['compile_s']:.2f}× compile"
                    if stack == "MindScale" and peer["compiled"] and peer["sent_bytes"]
                    else ""
                )
                vs_plan = (
                    f"{rank['sent_bytes'] / rank['planned_sent_bytes']:.2f}×" if rank["planned_sent_bytes"] else ""
                )
                rows.append(
                    f"| {shape} | {where} | {stack} | {rank['compile_s']:.0f} | {memory} | {kinds} | "
                    f"{rank['sent_bytes'] / 1e6:,.1f} | {vs_peer} | {vs_plan} |"
                )
    targets = dryrun_targets(layouts)
    if targets:
        targets = [
            "",
            "Targets (every rank above, worst rank shown): "
            + "; ".join(f"{label} {measured}: {verdict(ok)}" for label, measured, ok in targets)
            + ".",
        ]
    sets = " ".join(f"`{o}`" for o in layouts[0].get("overrides", [])) if layouts else ""
    return [
        "## 6. Sharded training step under MindSpore's dry run: MindScale vs MindFormers",
        "",
        "Each stack's training step compiled by MindSpore's dry run (docs/dryrun.md) for the first rank of "
        "the first and the last pipeline stage, with the layouts of the named configs (data, tensor and "
        "pipeline degrees, sequence parallel, optimizer shard, flash attention, bf16) at scaled widths, the "
        f"same for both stacks ({sets}; `bench/dryrun_compare.py`). MindFormers 1.9 is its LlamaForCausalLM "
        "in MindSpore's PipelineCell under MFPipelineWithLossScaleCell, its trainer's wrappers. Bytes sent are "
        "one rank's per step at ring cost; the analytic column is the planner's Megatron volume for the "
        "layout (mindscale/perf/planner/). The dry run compiles and runs nothing: these are what MindSpore's "
        "parallel compiler produced, not Ascend speed or device memory, and the compile seconds are this "
        "host's.",
        "",
        *rows,
        *targets,
        "",
    ]


def render(results: dict, changes: str) -> str:
    st = results["settings"]
    overrides = "".join(f" --set {o}" for o in st["overrides"])
    depth_set = " ".join(f"--set {o}" for o in results["depth_sweep_set"])
    p = results["peer"]
    out = [
        "# Benchmarks: MindScale vs MindFormers vs Hugging Face/torch (CPU)",
        "",
        "Generated by `make bench` (`bench/run_all.py`); do not edit by hand — the change log at the end comes "
        "from `bench/changes.md`.",
        "",
    ]
    if st["overrides"]:
        out += [f"**Not the peer config: run with{overrides}.**", ""]
    out += [
        "## Where we stand",
        "",
        *targets_table(results),
        "",
        "## Machine",
        "",
        *machine_section(results),
        "",
        "## 1. Training throughput (peer config: bench/llama_peer.yaml)",
        "",
        f"LLaMA fp32, batch {p['batch']}, seq {p['seq']}, hidden {p['hidden']}, {p['layers']} layers, "
        f"{p['heads']} heads ({p['kv_heads']} kv), FFN {p['ffn']}, vocab {p['vocab']} (`bench/llama_peer.yaml`); "
        f"AdamW (lr {p['lr']:g} {p['schedule']}, β {p['betas']}, eps {p['eps']:g}, weight decay "
        f"{p['weight_decay']:g} on matrices, global-norm clip {p['grad_clip']:g}), normal(0, {p['init_std']:g}) "
        "init of every matrix (MindScale scales wo/w2 by 1/sqrt(2L) as GPT-2 does), the same token batch "
        "for all three. "
        f"{st['reps']} repetitions interleaved (MindScale, MindFormers, HF, MindScale, …), each a fresh "
        f"process pinned to the same single core with one operator thread; per run: first step (compile) and "
        f"{st['warmup']} warm-up step(s) excluded, tokens/s from the median of {st['steps']} timed steps. "
        "Cells: median (min–max) over repetitions; ratios are the median of per-repetition ratios. "
        "HF compiles nothing: its “compile” column is its first step.",
        "",
        *throughput_section(results),
        "",
        f"MFU: {formula_text()}; peak = the one-core GEMM above.",
        "",
        "## 2. Compile time vs depth (graph compile + first step)",
        "",
        f"Width: `{depth_set}`. MindScale and MindFormers compile side by side, one process per core, "
        f"so both see the same machine load; {st['depth_reps']} repetition(s); which system gets which core "
        "alternates between depths and repetitions (on a shared machine one core can be busier).",
        "",
        *compile_section(results),
        "",
        "## 3. Data-parallel linearity (CPU)",
        "",
        "The peer config through `scripts/run_distribute.sh` with 1 worker, 2 workers, then 1 worker again, "
        "each worker pinned to its own core, same per-worker batch; `tools/linearity.py` (median step after "
        "the compile step) of the 2-worker run against each 1-worker run.",
        "",
        *linearity_section(results),
        "",
        "## 4. Peak host memory",
        "",
        "Peak resident set (VmHWM) of each throughput process: framework, model, optimizer state, "
        "activations and — for MindSpore — the compiled graph.",
        "",
        *memory_section(results),
        "",
        *checkpoint_section(results),
        *dryrun_compare_section(results),
        *data_index.section(results),
        *preprocess_throughput.section(results),
        *data_wait.section(results),
        *micro_batch_compile.section(results),
        *published_ascend.section(results),
        *compiled_memory.section(results),
        *communication_targets.section(results),
    ]
    failed = failures(results["throughput"]) + failures(results["compile"])
    if failed:
        out += ["## Failed runs", "", *failed, ""]
    out += [
        "## How to rerun",
        "",
        "```",
        "make bench                                   # everything, rewrites this file",
        "python bench/bench_train.py --system mindscale --json      # one system, one number",
        "python bench/bench_train.py --system mindformers --layers 32 --steps 0 --json",
        "python bench/bench_train.py --system hf --json",
        "python bench/benchmarks_md.py output/bench/results.json          # re-render this file",
        "```",
        "",
        f"This run: `{results['command']}`; per-run commands are in `output/bench/results.json`; "
        "linearity: " + "; ".join(f"`{c}`" for c in results["linearity"]["commands"]) + ".",
        "",
        "## Changes and their effect",
        "",
        changes.strip(),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else Path("output/bench/results.json")
    repo = Path(__file__).resolve().parent.parent
    if not path.is_file():
        fail(f"{path} does not exist; run `make bench` first or pass the results.json of a run")
    try:
        results = json.loads(path.read_text())
        results["summary"]["compile_by_depth"] = {int(k): v for k, v in results["summary"]["compile_by_depth"].items()}
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
        fail(f"{path} is not the results.json of a `make bench` run ({type(exc).__name__}: {exc})")
    write_atomically(repo / "BENCHMARKS.md", render(results, (repo / "bench" / "changes.md").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
