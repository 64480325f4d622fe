"""Published 910B training throughput (bench/published_ascend.yaml): the rows, the planner's prediction of each
row's layout, and the rows that cover a config (tools/plan.py prints them beside its prediction).

The figures are the anchors' claims (MindFormers, MindSpeed-LLM), cited by repository, ref and file; nothing here
measures anything. A row is predicted by loading its `mindscale.config` with RESET and its `set` overrides applied,
and passing its `overlap` to predict (what the anchor's run hides behind compute that MindScale's graph does not).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import yaml

from mindscale.config import REPO_ROOT, Config, load_config
from mindscale.config.schema import CommunicationConfig
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.perf.planner.step_time import predict

TABLE = REPO_ROOT / "bench" / "published_ascend.yaml"

# What a row's overrides start from: one stage, no accumulation, no recompute, offload, context or expert
# parallel, a vocabulary-parallel head (Megatron's); the row then sets what its anchor's config sets.
RESET = [
    "parallel.data_parallel=1",
    "parallel.model_parallel=1",
    "parallel.pipeline_stage=1",
    "parallel.micro_batch_num=1",
    "parallel.gradient_accumulation_steps=1",
    "parallel.pipeline_interleave=1",
    "parallel.pipeline_scheduler=1f1b",
    "parallel.stage_offset=0",
    "parallel.sequence_parallel=false",
    "parallel.optimizer_shard=false",
    "parallel.gradient_accumulation_shard=false",
    "parallel.context_parallel=1",
    "parallel.context_parallel_load_balance=false",
    "parallel.expert_parallel=1",
    "parallel.vocab_emb_dp=false",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "recompute.mode=none",
    "recompute.layers=null",
    "recompute.comm=false",
    "offload.layers=0",
    # none of MindScale's communication optimisations: a row's `overlap` says what its anchor's run hides
    *(f"communication.{f.name}={f.default}".lower() for f in dataclasses.fields(CommunicationConfig)),
]


@functools.lru_cache(maxsize=1)
def rows() -> tuple[dict, ...]:
    """Every row of the table, in its order."""
    return tuple(yaml.safe_load(TABLE.read_text())["rows"])


def predicted_rows() -> list[dict]:
    """The rows with a published tokens/s per card and a MindScale layout: those the speed model is judged on."""
    return [r for r in rows() if "mindscale" in r and "tokens_per_s_per_card" in r]


@functools.lru_cache(maxsize=None)
def row_config(row_id: str) -> Config:
    """The MindScale config of a row's layout (its shipped config, RESET, then its overrides)."""
    row = next(r for r in rows() if r["id"] == row_id)
    spec = row["mindscale"]
    return load_config(REPO_ROOT / spec["config"], RESET + list(spec["set"]))


def predict_row(row: dict, efficiency: float | None = None) -> dict:
    """The planner's prediction of a row's layout with the anchor's overlaps (`efficiency`: flat, as predict)."""
    cfg = row_config(row["id"])
    return predict(cfg, device_peak_tflops(cfg), efficiency, tuple(row["mindscale"]["overlap"]))


def error(row: dict, tokens_per_s_per_device: float) -> float:
    """Predicted over published, minus 1."""
    return tokens_per_s_per_device / row["tokens_per_s_per_card"] - 1


def errors(hardware=None, only: list[str] | None = None) -> list[tuple[dict, float, float]]:
    """(row, predicted tokens/s per card, error) of every predicted row (or of the rows named in `only`), with the
    shipped profile or with `hardware` (a HardwareConfig: bench/speed_fit.py tries candidates this way)."""
    out = []
    for row in predicted_rows():
        if only is not None and row["id"] not in only:
            continue
        cfg = row_config(row["id"])
        if hardware is not None:
            cfg = _with_hardware(cfg, hardware)
        pred = predict(cfg, device_peak_tflops(cfg), None, tuple(row["mindscale"]["overlap"]))
        out.append((row, pred["tokens_per_s_per_device"], error(row, pred["tokens_per_s_per_device"])))
    return out


def _with_hardware(cfg: Config, hardware) -> Config:
    """`cfg` with another hardware profile object (same layout and model: the planner's caches stay valid)."""
    return dataclasses.replace(cfg, hardware=hardware)


def summary(found: list[tuple[dict, float, float]]) -> dict:
    """Median and worst absolute error, of the fitting rows and of the others."""

    def stats(part):
        errs = [abs(e) for _, _, e in part]
        return {
            "rows": len(errs),
            "median": statistics.median(errs) if errs else None,
            "worst": max(errs) if errs else None,
        }

    return {
        "fit": stats([f for f in found if f[0].get("fit")]),
        "held_out": stats([f for f in found if not f[0].get("fit")]),
        "all": stats(found),
    }


def _model_key(cfg: Config) -> tuple:
    model = cfg.model
    return (
        model.arch,
        model.hidden_size,
        model.num_layers,
        model.num_heads,
        model.kv_heads,
        model.ffn_hidden_size,
        model.vocab_size,
        model.seq_length,
        model.moe.num_experts,
        model.moe.top_k,
    )


def covering(cfg: Config) -> list[dict]:
    """The rows that publish a figure for `cfg`'s model (its widths and sequence length) on `cfg`'s card count."""
    key = _model_key(cfg)
    out = []
    for row in rows():
        if "mindscale" not in row:
            continue
        other = row_config(row["id"])
        if _model_key(other) == key and other.devices == cfg.devices:
            out.append(row)
    return out


def cite(row: dict) -> str:
    """Where a row's figure is printed: repository@ref file (config file)."""
    return f"{row['repository']}@{row['ref']} {row['figure_file']} ({row['config_file']})"


def entries(cfg: Config) -> list[dict]:
    """What tools/plan.py prints (and puts under "published" in --json) for `cfg`: each covering row's figure and
    citation, with the planner's prediction of the anchor's own layout."""
    out = []
    for row in covering(cfg):
        predicted = predict_row(row)["tokens_per_s_per_device"]
        out.append(
            {
                "id": row["id"],
                "anchor": row["anchor"],
                "source": cite(row),
                "model": row["model"],
                "hardware": row["hardware"],
                "layout": row["layout"],
                "global_batch": row["global_batch"],
                "recompute": row["recompute"],
                "tokens_per_s_per_card": row["tokens_per_s_per_card"],
                "predicted_tokens_per_s_per_card": predicted,
                "error": error(row, predicted),
                "fit": bool(row.get("fit")),
            }
        )
    return out
