"""`make bench` phase 13: the communication optimisations' targets (docs/communication.md), as the planner predicts them.

    python bench/communication_targets.py [--json] [--markdown]

Three kinds of target, each a prediction of the planner's speed model (docs/planner.md; nothing runs on Ascend):
the 405B configs' MFU on 8,192 cards; LLaMA-2 7B, 13B and 70B at MindSpeed-LLM's card counts against the MFU it
publishes for them (bench/published_ascend.yaml, rows msl-mfu-*), with the search's best layout at that count and
where its step goes; and the exposed communication of BENCHMARKS.md section 6's two comparison layouts with the
optimisations MindScale's compiled graph has (their shipped `communication:` keys) against none of them. Where a
target is missed the section says which part of the step stands in the way. `--markdown` splices the section into
BENCHMARKS.md.
"""

from __future__ import annotations

import sys

from bench.data_index import phase_main
from mindscale.config import REPO_ROOT, load_config
from mindscale.perf import flops, planner
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.perf.planner import published

META_MFU = 0.43  # Llama 3 on 16K H100s, 38-43% (the target for the 405B configs)
MINDSPEED = {  # config: (cards, MindSpeed-LLM's published MFU row, its tokens/s row at the same model)
    "llama2_7b": (8, "msl-mfu-llama2-7b", "msl-llama2-7b"),
    "llama2_13b": (8, "msl-mfu-llama2-13b", "msl-llama2-13b"),
    "llama2_70b": (32, "msl-mfu-llama2-70b", "msl-llama2-70b"),
}
COMPARED = ("llama2_13b", "llama2_70b")  # their shipped layouts are BENCHMARKS.md section 6's
EXPOSED_TARGET = 0.5
EXPOSED = ("tensor_parallel", "expert_parallel", "context_parallel", "pipeline_sends", "data_parallel_exposed")
NO_OPTIMISATION = ["communication.grad_matmul_communication_overlap=false", "communication.micro_batch_interleave=1"]
# multi-copy parallel at its smallest: two copies of a micro batch of two rows (inlined layers), the global batch kept
COPIES = [
    "train.micro_batch_size=2",
    "communication.micro_batch_interleave=2",
    "run.reuse_layer_graph=false",
    "parallel.gradient_accumulation_shard=false",  # sharded buffers need a reused graph
]


def _config(name: str, overrides: list[str] | None = None):
    [path] = (REPO_ROOT / "configs").glob(f"*/{name}.yaml")
    return load_config(path, overrides or [])


def _shares(predicted: dict) -> dict:
    return {k: v / predicted["step_time_s"] for k, v in predicted["step_breakdown_s"].items() if v}


def run(log=print) -> dict:
    log("communication targets: the 405B configs, LLaMA-2 at MindSpeed-LLM's card counts, section 6's layouts")
    rows = {r["id"]: r for r in published.rows()}
    out = {"meta": [], "mindspeed": [], "exposed": []}
    for name in ("llama3_405b", "llama3_1_405b"):
        cfg = _config(name)
        out["meta"].append({"config": name, "cards": cfg.devices, "mfu": planner.plan(cfg)["predicted"]["mfu"]})
    for name, (cards, mfu_row, tokens_row) in MINDSPEED.items():
        cfg = _config(name)
        best = planner.search(cfg, cards, top=1)[0]
        predicted, layout = best["plan"]["predicted"], best["plan"]["layout"]
        anchor_tokens = rows[tokens_row]["tokens_per_s_per_card"]
        out["mindspeed"].append(
            {
                "config": name,
                "cards": cards,
                "anchor_mfu": rows[mfu_row]["mfu"],
                "anchor_tokens_mfu": anchor_tokens
                * flops.model_flops_per_token(cfg.model)
                / (device_peak_tflops(cfg) * 1e12),
                "anchor_tokens_row": tokens_row,
                "mfu": predicted["mfu"],
                "layout": {
                    k: layout[k] for k in ("data_parallel", "model_parallel", "pipeline_stage", "pipeline_interleave")
                },
                "shares": _shares(predicted),
                "efficiency": predicted["efficiency"],
            }
        )
    for name in COMPARED:
        exposed = {}
        for label, extra in (("compiled", []), ("none", NO_OPTIMISATION)):
            predicted = planner.plan(_config(name, extra))["predicted"]
            exposed[label] = {k: predicted["step_breakdown_s"][k] for k in EXPOSED}
            exposed.setdefault("compiled_bubble", predicted["step_breakdown_s"]["bubble"])
        cfg, bubble = _config(name), exposed.pop("compiled_bubble")
        two = None
        if cfg.parallel.model_parallel > 1:  # copies hide tensor-parallel collectives only (refused without them)
            plan = planner.plan(
                _config(name, [*COPIES, f"parallel.micro_batch_num={cfg.parallel.micro_batch_num // 2}"])
            )
            two = {
                "exposed": sum(plan["predicted"]["step_breakdown_s"][k] for k in EXPOSED),
                "bubble": (bubble, plan["predicted"]["step_breakdown_s"]["bubble"]),
                "memory_gib": plan["memory_gib"]["total"],
                "budget_gib": plan["memory_budget_gib"],
            }
        out["exposed"].append({"config": name, "cards": cfg.devices, **exposed, "two_copies": two})
    return out


def _ratio(row: dict) -> float | None:
    before = sum(row["none"].values())
    return sum(row["compiled"].values()) / before if before else None


def targets(data: dict) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the Where-we-stand table."""
    out = [
        (
            f"predicted MFU of `{r['config']}` on {r['cards']:,} cards ≥ {META_MFU:.0%} (§13)",
            f"{r['mfu']:.1%}",
            r["mfu"] >= META_MFU,
        )
        for r in data["meta"]
    ]
    out += [
        (
            f"predicted MFU of `{r['config']}` on {r['cards']} cards ≥ MindSpeed-LLM's {r['anchor_mfu']:.1%} (§13)",
            f"{r['mfu']:.1%}",
            r["mfu"] >= r["anchor_mfu"],
        )
        for r in data["mindspeed"]
    ]
    for r in data["exposed"]:
        ratio = _ratio(r)
        out.append(
            (
                f"`{r['config']}`'s §6 layout: exposed communication ≤ {EXPOSED_TARGET:g}× without the optimisations (§13)",
                f"{ratio:.2f}×" if ratio is not None else "none",
                ratio is not None and ratio <= EXPOSED_TARGET,
            )
        )
    return out


def section(results: dict) -> list[str]:
    data = results.get("communication_targets")
    if not data:
        return []
    out = [
        "## 13. Communication optimisations: the targets (bench/communication_targets.py)",
        "",
        "Predictions of the planner's speed model (docs/planner.md), which credits only the overlaps the compiled graph "
        "has (docs/communication.md); nothing ran on Ascend. MindSpeed-LLM's MFU is its own formula against a peak it "
        "does not state (bench/published_ascend.yaml, rows msl-mfu-*); beside it, MindScale's formula on the tokens/s "
        "MindSpeed-LLM publishes for the same model and card count at an earlier release.",
        "",
        "| target | config, cards | predicted MFU | the anchor | where the step goes (predicted) | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["meta"]:
        out.append(
            f"| ≥ {META_MFU:.0%} MFU (Meta's Llama 3 on 16K H100s: 38-43%) | `{r['config']}`, {r['cards']:,} | "
            f"{r['mfu']:.1%} | - | - | {'yes' if r['mfu'] >= META_MFU else '**no**'} |"
        )
    for r in data["mindspeed"]:
        lay = r["layout"]
        shares = ", ".join(
            f"{k.replace('_', ' ')} {v:.1%}" for k, v in sorted(r["shares"].items(), key=lambda kv: -kv[1])
        )
        chunks = f" x {lay['pipeline_interleave']}" if lay["pipeline_interleave"] > 1 else ""
        out.append(
            f"| ≥ MindSpeed-LLM's MFU | `{r['config']}`, {r['cards']} (search: dp {lay['data_parallel']} tp "
            f"{lay['model_parallel']} pp {lay['pipeline_stage']}{chunks}) | {r['mfu']:.1%} | {r['anchor_mfu']:.1%} "
            f"(`{r['anchor_tokens_row']}`'s tokens/s: {r['anchor_tokens_mfu']:.1%} by MindScale's formula) | {shares}; "
            f"kernels at {r['efficiency']:.0%} of the peak | {'yes' if r['mfu'] >= r['anchor_mfu'] else '**no**'} |"
        )
    for r in data["exposed"]:
        ratio = _ratio(r)
        parts = lambda d: ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in d.items() if v) or "none"  # noqa: E731
        out.append(
            f"| exposed communication ≤ {EXPOSED_TARGET:g}× without the optimisations | `{r['config']}` (§6 layout), "
            f"{r['cards']} | - | - | seconds a step with its compiled optimisations: {parts(r['compiled'])}; "
            f"without: {parts(r['none'])} | "
            f"{'yes' if ratio is not None and ratio <= EXPOSED_TARGET else '**no**'} "
            f"({f'{ratio:.2f}×' if ratio is not None else 'none'}) |"
        )
    missed = [r for r in data["mindspeed"] if r["mfu"] < r["anchor_mfu"]]
    if missed:
        out += [
            "",
            "Where a MindSpeed-LLM figure is not reached, the predicted step is compute for all but a per cent or "
            "two: no communication optimisation closes the gap. What separates the figures is the kernels' "
            "efficiency (the speed model's, fitted on the published table: docs/planner.md) and the anchor's MFU "
            "formula and peak, which its repository does not state. Its fused kernels (RMSNorm, SwiGLU, rotary, "
            "bench/published_ascend.yaml's `optimisations`) are what MindScale's graph does not name.",
        ]
    if any((_ratio(r) or 1) > EXPOSED_TARGET for r in data["exposed"]):
        out += [
            "",
            "The rest of the exposed communication is the pipeline sends and the data-parallel reduction, which no "
            "option compiled here overlaps (grad_computation_allreduce_overlap is a backend pass the dry run does not "
            "time); a layout without tensor parallel has nothing else. Multi-copy parallel, which would hide the "
            "tensor-parallel rest, needs two rows a micro batch:",
            "",
        ]
        for r in data["exposed"]:
            two = r["two_copies"]
            if two is None:
                continue
            out.append(
                f"- `{r['config']}` with two copies ({', '.join(COPIES)}, half the micro batches): exposed "
                f"communication {two['exposed']:.2f} s, bubble {two['bubble'][0]:.2f} -> {two['bubble'][1]:.2f} s, "
                f"memory {two['memory_gib']:.1f} GiB of the {two['budget_gib']:.1f} budget"
                f"{' (does not fit)' if two['memory_gib'] > two['budget_gib'] else ''}."
            )
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    return phase_main(argv, __doc__, "communication_targets", section, lambda parser: None, {}, lambda a, log: run(log))


if __name__ == "__main__":
    sys.exit(main())
