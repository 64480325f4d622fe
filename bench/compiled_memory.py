"""Record MindSpore's device-memory plan of shipped configs' first and last pipeline stage (level-1 dry run).

    python bench/compiled_memory.py --config configs/llama2/llama2_13b.yaml [--config ...]   # compile and record
    python bench/compiled_memory.py --stale                # the shipped configs with no record for their layout
    python bench/compiled_memory.py --markdown             # the records as docs/evidence/planner.md's table

Each config runs `tools/dryrun.py --memory --no-collectives --jobs 1 --json` for rank 0 and the last stage's first
rank, with its micro batches cut to twice its pipeline stages (`parallel.micro_batch_num=2p`, interleaved
`2p + m mod p`; without stages, `parallel.gradient_accumulation_steps` at most 2): under 1F1B stage k holds
min(p - k, m) micro batches in flight, under interleaved 1F1B (p + m mod p)(v-1) + 2(p-k-1) + 1 chunk forwards
(mindscale/perf/planner/schedule.py), neither growing with m beyond that, and the accumulation buffers do not
depend on their count, so the peak is the shipped config's, and a rank
compiles in minutes instead of the half hour and more that 256 micro batches take at level 1. Where that many
micro batches would call the layer graph more than MindSpore inlines, the cut goes lower (`fewer_micro_batches`).
The record goes to
bench/compiled_memory.json (mindscale/perf/planner/compiled_memory.py reads it for the README's table), keyed by
the config and its layout's fingerprint, with the date, commit and MindSpore version it was compiled with.

A full-size rank takes 150-500 s and 1.5-2.5 GiB of host memory on a 2-core host; compile one config at a time.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

from mindscale.cli import OneLineParser, fail
from mindscale.config import REPO_ROOT, Config, ConfigError, load_config
from mindscale.perf.planner import compiled_memory
from mindscale.perf.planner.schedule import ONE_GRAPH_CALLS, layer_graph_calls
from mindscale.perf.planner.text import shipped_configs

MIB = compiled_memory.MIB


def fewer_micro_batches(cfg) -> list[str] | None:
    """The overrides that cut a config's micro batches to what its peak needs (module docstring), within the calls
    of the layer graph MindSpore 2.9 still compiles as one kernel graph (schedule.ONE_GRAPH_CALLS; beyond, each call
    is a graph of its own and the plan no step's peak: compiled_memory.whole_step). Interleaved stages whose
    2p + m mod p micro batches exceed it are cut to p + m mod p: the last stages still hold their shipped chunk
    forwards, the first ones fewer (compiled_memory.shipped_extra_mib counts the rest). None where neither fits."""
    p = cfg.parallel
    if p.pipeline_stage == 1:
        return [
            f"parallel.gradient_accumulation_steps={min(p.gradient_accumulation_steps, 2)}",
            "train.global_batch_size=null",
        ]
    v = p.pipeline_interleave
    kept = p.micro_batch_num % p.pipeline_stage if v > 1 else 0  # the schedule's first round runs p + m mod p
    cuts = (2 * p.pipeline_stage + kept, p.pipeline_stage + kept)
    fits = [m for m in cuts if layer_graph_calls(p.pipeline_stage, v, m) <= ONE_GRAPH_CALLS]
    if not fits:
        return None
    return [f"parallel.micro_batch_num={min(p.micro_batch_num, fits[0])}", "train.global_batch_size=null"]


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    records = str(compiled_memory.RECORDS.relative_to(REPO_ROOT))  # written by every record: not the compiled code
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{records}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def rank_row(report: dict, micro_batches: int) -> dict:
    m, planned = report["device_memory"], report["planned"]
    top = m["top_tensors"][0] if m["top_tensors"] else None
    return {
        "rank": report["rank"],
        "stage": report["stage"],
        "micro_batches": micro_batches,
        "used_mib": round(m["used_bytes"] / MIB),
        "peak_mib": round(m["peak_bytes"] / MIB),
        "persistent_mib": round(m["persistent_bytes"] / MIB),
        "graphs": m["graphs"],  # kernel graphs of the rank: more than one, the reading is not the step's peak
        "host_copy_mib": round(m.get("host_copy_bytes", 0) / MIB),  # offload's, in the plan's block (on_device_mib)
        "pool_mib": round(m["reserve"]["pool_bytes"] / MIB),
        "planner_mib": round(planned["device_memory_bytes"] / MIB),
        "largest_at_peak": f"{top['node'].rsplit('/', 1)[-1]} {top['bytes'] / MIB:,.0f} MiB" if top else "",
        "top_at_peak": [[t["node"], round(t["bytes"] / MIB)] for t in m["top_tensors"][:8]],
        "compile_s": round(report["compile_s"]),
        "host_peak_gib": round(report["host_peak_rss_gib"], 1),
    }


def checked(config: Path) -> tuple[Config, list[str]]:
    """The config and the overrides it is compiled with, or one line naming why it cannot be recorded (exit 2),
    before anything compiles."""
    try:
        cfg = load_config(config)
        compiled_memory.key_of(config)
    except ConfigError as exc:
        fail(str(exc))
    except ValueError:
        fail(f"{config}: records are kept for this repository's configs; pass a YAML file under {REPO_ROOT}")
    overrides = fewer_micro_batches(cfg)
    if overrides is None:
        p = cfg.parallel
        fail(
            f"{config}: {p.pipeline_stage} stages x {p.pipeline_interleave} chunks call the layer graph more than "
            f"MindSpore 2.9's {ONE_GRAPH_CALLS} times at every micro-batch count that holds the peak, so its level-1 "
            "plan is many kernel graphs and no step's peak (docs/dryrun.md, \"Device memory\"); record a layout with "
            "fewer chunks (parallel.pipeline_interleave)"
        )
    return cfg, overrides


def record(config: Path, cfg: Config, overrides: list[str]) -> dict:
    args = [sys.executable, "tools/dryrun.py", "--config", str(config), "--memory", "--no-collectives", "--jobs", "1"]
    proc = subprocess.run(
        [*args, *(a for o in overrides for a in ("--set", o)), "--json"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [
        r.get("error", "no device_memory") for r in reports if not r.get("compiled") or not r.get("device_memory")
    ]
    if proc.returncode != 0 or failed or not reports:
        raise SystemExit(f"{config}: the level-1 dry run failed ({(failed or [proc.stderr.strip()[-300:]])[0]})")
    micro = load_config(config, overrides)
    micro_batches = micro.parallel.micro_batch_num * micro.parallel.gradient_accumulation_steps
    import mindspore

    return {
        "fingerprint": compiled_memory.fingerprint(cfg),
        "compiled": datetime.date.today().isoformat(),
        "commit": commit(),
        "mindspore": mindspore.__version__,
        "overrides": overrides,
        "ranks": [rank_row(r, micro_batches) for r in reports],
    }


def markdown(records: dict) -> str:
    """The records as a table; the planner column is the planner's figure now (the record keeps the one it had)."""
    rows = [
        "| config | rank (stage) | micro batches | MindSpore used MiB | with fragments MiB | persistent MiB "
        "| of it offload's host copies MiB | pool MiB | planner MiB | planner ÷ used / ÷ with fragments, on the device "
        "| largest at the peak | compile, host memory | compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in shipped_configs():
        record = compiled_memory.current(records, path, load_config(path))
        for r in record["ranks"] if record else []:
            r = {**r, "planner_mib": round(compiled_memory.planner_mib(path, record, r["stage"]))}
            used, peak = (compiled_memory.on_device_mib(r, figure) for figure in ("used_mib", "peak_mib"))
            rows.append(
                f"| `{path.stem}` | {r['rank']} ({r['stage']}) | {r['micro_batches']} | {r['used_mib']:,} | "
                f"{r['peak_mib']:,} | {r['persistent_mib']:,} | {r.get('host_copy_mib', 0):,} | {r['pool_mib']:,} | "
                f"{r['planner_mib']:,} | {r['planner_mib'] / used:.2f} / {r['planner_mib'] / peak:.2f} | "
                f"{r['largest_at_peak']} | {r['compile_s']} s, {r['host_peak_gib']} GiB | "
                f"{record['compiled']}, {record['commit']} |"
            )
    return "\n".join(rows)


def section(results: dict) -> list[str]:
    """BENCHMARKS.md's section: the records as they stand (make bench compiles nothing for it)."""
    records = compiled_memory.load()
    stale = [p.stem for p in shipped_configs() if not compiled_memory.current(records, p, load_config(p))]
    split = {
        p.stem: max(r.get("graphs", 1) for r in records[compiled_memory.key_of(p)]["ranks"])
        for p in shipped_configs()
        if compiled_memory.key_of(p) in records and not compiled_memory.whole_step(records[compiled_memory.key_of(p)])
    }
    return [
        "## 12. Device memory: MindSpore's plan of the shipped configs (bench/compiled_memory.json)",
        "",
        "MindSpore 2.9's level-1 dry run of each config's first and last pipeline stage at full size on this "
        "host (`python bench/compiled_memory.py --config C`; docs/dryrun.md, \"Device memory\"), micro batches cut "
        "to twice the stages (the peak is the shipped config's: the module's docstring), or to the stages where "
        f"that would call the layer graph more than the {ONE_GRAPH_CALLS} times MindSpore 2.9 still compiles as one "
        "kernel graph. Each plan is of that one-graph step; the shipped steps of more calls run as many graphs, "
        "which keep more (docs/evidence/planner.md, \"MindSpore's one-graph limit\"): the README's column and the "
        "spare add the planner's bytes for what the shipped step holds beyond the compiled one. Used: the tensors live at "
        "the plan's busiest step plus the persistent ones; with fragments: its whole block. Planner: its figure today for "
        "the rank inside the pool. With activation offload, MindSpore's level-1 plan places the host copies in the "
        "device block: the ratios and the spare figure leave them out. A plan of an Ascend rank made without one: no kernel workspaces (level 1 sizes "
        "none), HCCL buffers or driver memory (outside the pool); not a device measurement. The README's column "
        "shows each config's busiest rank; every recorded config leaves at least "
        f"{compiled_memory.SPARE_GIB:g} GiB of its pool free by it (tests/unit/test_compiled_memory.py).",
        "",
        markdown(records),
        "",
        f"Not yet compiled so for their current layout ({len(stale)}): "
        + ", ".join(f"`{n}`" for n in stale)
        + "."
        + "".join(
            f" `{p.stem}` cannot be: its {c.parallel.pipeline_stage} stages x {c.parallel.pipeline_interleave} chunks "
            f"call the layer graph more than {ONE_GRAPH_CALLS} times at any micro-batch count that holds its peak."
            for p in shipped_configs()
            if p.stem in stale and fewer_micro_batches(c := load_config(p)) is None
        ),
        *(
            [
                "Of them, compiled into several kernel graphs, whose plan is no step's peak (compiled_memory."
                "whole_step): " + ", ".join(f"`{n}` ({g} graphs)" for n, g in split.items()) + "."
            ]
            if split
            else []
        ),
        "",
    ]


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", type=Path, default=[], help="a config to compile and record")
    parser.add_argument("--stale", action="store_true", help="list shipped configs without a current record")
    parser.add_argument("--markdown", action="store_true", help="print the records as a Markdown table")
    args = parser.parse_args(argv)
    for config, cfg, overrides in [(c, *checked(c)) for c in args.config]:  # every refusal before any compile
        entry = record(config, cfg, overrides)
        records = compiled_memory.load()  # read again after the compile: another recorder may have written
        records[compiled_memory.key_of(config)] = entry
        compiled_memory.save(records)
        for r in entry["ranks"]:
            print(
                f"{config}: rank {r['rank']} (stage {r['stage']}): MindSpore {r['used_mib']:,} MiB used, "
                f"{r['peak_mib']:,} with fragments ({r['host_copy_mib']:,} of offload's host copies), of a "
                f"{r['pool_mib']:,} MiB pool; planner {r['planner_mib']:,}"
                + ("" if r["graphs"] == 1 else f"; {r['graphs']} kernel graphs: not the step's peak"),
                flush=True,
            )
    records = compiled_memory.load()
    if args.stale:
        for path in shipped_configs():
            if not compiled_memory.current(records, path, load_config(path)):
                print(path.relative_to(REPO_ROOT))
    if args.markdown:
        print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
