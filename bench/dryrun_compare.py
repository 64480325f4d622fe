"""`make bench` phase 6: MindScale and MindFormers compiled side by side under MindSpore's dry run.

For the layouts of configs/llama2/llama2_13b.yaml and llama2_70b.yaml (data, tensor and pipeline degrees,
sequence parallel, optimizer shard, vocabulary split, recompute, flash attention, bf16), each stack's
training step is compiled for the first rank of the first and of the last pipeline stage
(tools/dryrun.py's worker for MindScale, bench/mf_dryrun.py for MindFormers 1.9's LlamaForCausalLM),
and read for:
  * the collectives of one step by kind, with the bytes one rank sends (ring cost, as the planner);
  * the compile seconds of the step (host-side graph compile of that stage);
  * the rank's local weights, gradient storage and AdamW moments.
The planner's Megatron volumes for the same layout (mindscale/perf/planner/) are the third column.

Widths are scaled (SCALED, the same for both stacks) so that four compiles of each layout fit in a
benchmark run on a 2-core host; the layout, sequence length, vocabulary and micro-batch structure
are the config's, the micro-batch count is cut to MICRO_PER_STAGE x the stages. A dry run compiles
and runs nothing: these are what MindSpore's parallel compiler produced for each stack, not Ascend
speed or device memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mindscale.config import REPO_ROOT, ConfigError, load_config
from mindscale.launch.dryrun_ranks import Job, choose_ranks, compile_ranks, for_ascend, ring_send_bytes

LAYOUTS = ("configs/llama2/llama2_13b.yaml", "configs/llama2/llama2_70b.yaml")
MICRO_PER_STAGE = 2
# 2 layers per stage at a quarter of LLaMA-2 7B's width; 70B's grouped-query attention kept (8 KV heads)
SCALED = {"model.hidden_size": 1024, "model.num_heads": 16, "model.ffn_hidden_size": 2816}
WORKERS = {"mindscale": "mindscale.launch.dryrun_worker", "mindformers": "bench.mf_dryrun"}
TIMEOUT_S = 1800


def overrides(path: str) -> list[str]:
    """The scaled widths, two layers per stage and MICRO_PER_STAGE micro batches per stage."""
    cfg = load_config(REPO_ROOT / path)
    pp = cfg.parallel.pipeline_stage
    kv = min(cfg.model.kv_heads, SCALED["model.num_heads"])
    return [f"{k}={v}" for k, v in SCALED.items()] + [
        f"model.num_kv_heads={kv if kv < SCALED['model.num_heads'] else 'null'}",
        f"model.num_layers={2 * pp}",
        f"parallel.micro_batch_num={MICRO_PER_STAGE * pp}",
        "parallel.stage_offset=0",
        "train.global_batch_size=null",
    ]


def by_kind(report: dict) -> dict[str, dict]:
    """Collectives of one step grouped by kind: count and the bytes this rank sends (a report's row
    already totals its `count` calls)."""
    kinds: dict[str, dict] = {}
    for row in report["collectives"]:
        kind = kinds.setdefault(row["kind"], {"count": 0, "sent_bytes": 0.0})
        kind["count"] += row["count"]
        kind["sent_bytes"] += ring_send_bytes(row)
    return kinds


def summary(report: dict) -> dict:
    """What the comparison keeps of one rank's dry-run report."""
    if not report["compiled"]:
        return {"rank": report["rank"], "compiled": False, "error": report.get("error")}
    return {
        "rank": report["rank"],
        "stage": report["stage"],
        "compiled": True,
        "compile_s": report["compile_s"],
        "host_peak_rss_gib": report.get("host_peak_rss_gib"),
        "bytes": report["bytes"],
        "collectives": by_kind(report),
        "sent_bytes": report["planned"]["compiled_comm_bytes_per_step"],
        "planned_sent_bytes": report["planned"]["comm_bytes_per_step"],
        "planned_bytes": {k: report["planned"][k] for k in ("weights", "grads", "optimizer")},
    }


def compare(path: str, log_dir: Path, jobs: int = 2, sets: list[str] | None = None, ranks: str = "first,last") -> dict:
    """Both stacks' first and last stage of one layout (`sets`: its overrides, default the scaled widths)."""
    sets = overrides(path) if sets is None else sets
    cfg, layout = for_ascend(load_config(REPO_ROOT / path, sets))
    ranks = choose_ranks(ranks, layout)
    out = {
        "config": path,
        "overrides": sets,
        "ranks": ranks,
        "devices": layout.devices,
        "layout": {
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "sp": layout.sp,
            "micro_batches": layout.micro_steps,
            "optimizer_shard": layout.optimizer_shard,
            "attention": layout.attention,
            "recompute": layout.recompute,
        },
    }
    for system, worker in WORKERS.items():
        folder = log_dir / Path(path).stem / system
        folder.mkdir(parents=True, exist_ok=True)
        job = Job(config=str(REPO_ROOT / path), overrides=tuple(sets), log_dir=folder, timeout=TIMEOUT_S, worker=worker)
        out[system] = [summary(r) for r in compile_ranks(cfg, job, ranks, workers=jobs)]
    return out


def run(log, jobs: int = 2, layouts=LAYOUTS) -> list[dict]:
    """Phase 6 of bench/run_all.py: every layout, logged as it goes."""
    results = []
    with tempfile.TemporaryDirectory(prefix="mindscale-dryrun-compare-") as tmp:
        for path in layouts:
            log(f"dry-run comparison: {path}")
            try:
                results.append(compare(path, Path(tmp), jobs))
            except ConfigError as exc:
                results.append({"config": path, "error": str(exc)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="layouts to compare (default: both LLaMA-2 configs)")
    parser.add_argument("--jobs", type=int, default=2, help="ranks compiled at once")
    args = parser.parse_args(argv)
    for result in run(lambda text: print(text, file=sys.stderr, flush=True), args.jobs, args.config or LAYOUTS):
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
