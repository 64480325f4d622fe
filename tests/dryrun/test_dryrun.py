"""Sharded training graphs compiled by MindSpore's dry run (tools/dryrun.py) on this CPU host.

Each compile is MindSpore's own semi-auto-parallel compiler (strategies, redistribution, pipeline
split, optimizer shard) for one rank, with CANN stand-ins in place of an Ascend install; nothing
executes, so these tests prove what the compiler accepts and what the compiled graph contains
(layouts, collectives), not kernels, numerics or speed.

* Scaled twins (tools/dryrun.py --twin, mindscale/config/twin.py): every shipped Ascend config with its widths,
  keys and degrees kept, few layers, micro batches and tokens; its first and last pipeline stage compile, the
  planner's per-rank bytes and shapes equal the compiled ones exactly, and the step moves what the layout
  implies: the optimizer shard's gathers and reduce-scatters of the parameters it slices at full size, and
  activation offload's copies.
* The SFT configs' twins are fed packed data (segment_ids: flash attention in its TND layout), and compile
  the parameters and collectives of their pretraining configs' twins.
* Extra layouts (LoRA and packed SFT under model parallel) and what the compiled graph must show:
  one gradient reduction per step under accumulation, the gradient norm's all-reduce within and
  across stages, pipeline sends, and a bad strategy refused.
"""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mindscale.config import REPO_ROOT, Layout, load_config, parse_yaml
from mindscale.config.twin import twin_overrides
from mindscale.launch.compiled_ir import read_validate_ir
from mindscale.launch.dryrun_ranks import Job, compile_ranks, for_ascend, line, ring_send_bytes
from mindscale.io import CheckpointError
from mindscale.perf import planner
from mindscale.train.checkpoints import folder as ckpt
from mindscale.perf.planner.text import SCALE_DIRS
from models import mf_convert
from models.weights import SlicedWeights, load_weights, merge_slices, take_slice
from tests import shared
from tests.integration import tiny_runs
from tools import dryrun as dryrun_tool

SHIPPED = sorted(
    p
    for d in (*SCALE_DIRS, "finetune")
    for p in (REPO_ROOT / "configs" / d).glob("*.yaml")
    if p.name != "base.yaml" and load_config(p).hardware.device_target == "Ascend"
)
SFT = [p for p in SHIPPED if p.parent.name == "finetune"]  # their twins compile fed packed data, as the headers ask
TINY_LLAMA = REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml"
TINY_GPT = REPO_ROOT / "configs" / "tiny" / "gpt_tiny.yaml"
SMALL = [
    "hardware=ascend910b",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=64",
    "model.num_layers=4",
    "train.global_batch_size=null",
]


# Twins compiled at MindSpore's level 1 (tools/dryrun.py --memory), so that their reports carry MindSpore's own
# device-memory plan for the planner to be held to; level 1 costs about 15 s more a rank here than level 0
LEVEL_1_TWINS = {"llama2_7b"}
PLANNER_BAND = (0.9, 1.1)  # the planner's device memory over MindSpore's plan, as for full-size configs


def dryrun(config, *overrides, ranks="first,last", packed=False, ir_dir=None, as_twin=False, memory=False):
    """tools/dryrun.py --json as a user runs it, called in this process (its ranks compile in their own): one
    report per rank (with `ir_dir`, each rank's validate IR kept in <ir_dir>/rank<R>; with `as_twin`, --twin: the
    scaled twin of the config with `overrides`, at level 1 for LEVEL_1_TWINS; with `memory`, at level 1 and with
    `ir_dir` MindSpore's SOMAS plan kept beside the IR). A successful compile without
    `ir_dir` is compiled once in the session and shared by every test (and xdist worker) asking for the same
    arguments (tests/shared.py; test_input_rows.py reads the shipped twins' compiles)."""
    memory = memory or (as_twin and Path(config).stem in LEVEL_1_TWINS)

    def compile_ranks():
        log_dir = tempfile.mkdtemp(dir=shared.ROOT, prefix="dryrun-")
        argv = [
            "--config",
            str(config),
            "--ranks",
            ranks,
            "--jobs",
            "2",
            "--json",
            "--log-dir",
            log_dir,
            "--timeout",
            "900",
            *[a for o in overrides for a in ("--set", o)],
            *(["--packed"] if packed else []),
            *(["--ir-dir", str(ir_dir)] if ir_dir else []),
            *(["--twin"] if as_twin else []),
            *(["--memory"] if memory else []),
        ]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = dryrun_tool.main(argv)
        reports = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]
        assert code == 0 and all(r["compiled"] for r in reports), [r.get("error") for r in reports] or log_dir
        return reports

    return (
        compile_ranks()
        if ir_dir
        else shared.once(["dryrun", str(config), overrides, ranks, packed, as_twin, memory], compile_ranks)
    )


def twin(path) -> list[str]:
    """The overrides of a config's scaled twin (mindscale.config.twin: its widths and layout, few layers)."""
    return twin_overrides(load_config(path))


def kind(name: str) -> str:
    """A parameter's name with its layer index left out: `layers.*.attention.wq.weight`."""
    return re.sub(r"^layers\.\d+\.", "layers.*.", name)


def implied_by_the_layout(full, cfg, stage: int, report: dict) -> None:
    """What the layout makes the compiled step move, against the full-size config `full` and its twin `cfg`:
    the optimizer shard slices the parameters of the kinds it slices at full size (the twin keeps every shape),
    all-gathers them and reduce-scatters their gradients (every micro batch with the accumulation buffers
    sharded), the gradient traffic being the planner's (gradient_reduce_bytes); activation offload
    copies the planner's bytes of each offloaded layer out to host memory and back, every micro batch (and a
    2-byte scalar of the attention: tests/dryrun/test_offload.py)."""
    layout, full_layout = Layout.of(cfg, "Ascend"), Layout.of(full, "Ascend")
    sharded = {
        kind(p.name)
        for p in planner.parameter_slices(full, full_layout)
        if stage in p.stages and planner.optimizer_shard(p, full_layout) > 1
    }
    compiled = {
        kind(name)
        for name, (*_, group) in report["layouts"].items()
        if group and not name.startswith(("adam_", "accu_grads."))
    }
    assert compiled == sharded
    rows = report["collectives"]
    if sharded:
        assert {("AllGather", "optimizer_shard"), ("ReduceScatter", "optimizer_shard")} <= {
            (row["kind"], row["purpose"]) for row in rows
        }
    # (within 1e-4: the planner counts a sharded bias's all-gather in the parameter dtype, where MindSpore gathers
    # it cast to the compute dtype: gpt3_175b's twin 46,080 bytes of 8.8 GB, its two layers' fp32 w1.bias)
    once, per_micro_batch = planner.gradient_reduce_bytes(cfg, stage)
    gradients = sum(ring_send_bytes(row) for row in rows if row["purpose"] in ("grad_reduce", "optimizer_shard"))
    assert gradients == pytest.approx(once + per_micro_batch * layout.micro_steps, rel=1e-4)
    copies = {copy["to"]: (copy["count"], copy["bytes"]) for copy in report["offload_copies"]}
    layers = layout.offloaded_in(stage)
    assert bool(layers) == bool(full_layout.offloaded_in(stage)) == bool(copies)
    if layers:
        # context parallel's all-gathered K and V stay on the device (the gather carries no offload mark); the
        # planner counts them among the moved bytes (planner.offloaded_layer_bytes; llama3_1_70b_128k's twin). The
        # kernel's [1] softmax_out placeholder (2 bytes) moves too, unless the context-parallel load balance keeps
        # the kernel's outputs on the device (planner.offload_resident_bytes)
        placeholder = 0 if layout.cp_load_balance else 2
        moved = planner.offloaded_layer_bytes(cfg, layout) - planner.gathered_kv_bytes(cfg) + placeholder
        assert copies["CPU"] == copies["Ascend"] and copies["CPU"][1] == layout.micro_steps * layers * moved


# keys whose values reach the compiled graph only as host-computed constants (RoPE's frequencies: models/layers.py
# rope_frequencies): two configs that differ in nothing else compile the same ops, strategies and shapes
CONSTANTS_ONLY = re.compile(r"run\.name|model\.rope_\w+")


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def compiled_as(path):
    """The shipped config whose twin compiles `path`'s graph: its YAML base when the two differ only in
    CONSTANTS_ONLY keys (LLaMA-3.1 over LLaMA-3: RoPE scaling; the 128K configs compile that scaling themselves),
    else `path`. Such a twin is compiled once, under its base's name."""
    base = parse_yaml(path.read_text()).get("base")
    if not base or (path.parent / base).resolve() not in SHIPPED:
        return path
    base = (path.parent / base).resolve()
    mine, theirs = flat(load_config(path).to_dict()), flat(load_config(base).to_dict())
    differing = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
    return base if all(CONSTANTS_ONLY.fullmatch(k) for k in differing) else path


def test_configs_sharing_a_twin_differ_in_constants_only():
    shared_twins = {p.stem: compiled_as(p).stem for p in SHIPPED if compiled_as(p) != p}
    assert shared_twins == {"llama3_1_8b": "llama3_8b", "llama3_1_70b": "llama3_70b", "llama3_1_405b": "llama3_405b"}
    assert compiled_as(REPO_ROOT / "configs/llama3_1/llama3_1_8b_128k.yaml").stem == "llama3_1_8b_128k"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_scaled_twin_of_every_shipped_config_compiles_and_matches_the_planner(path):
    full = load_config(path)
    cfg = load_config(path, twin(path))
    layout = Layout.of(cfg, "Ascend")
    reports = dryrun(compiled_as(path), as_twin=True, packed=path in SFT)
    assert [r["stage"] for r in reports] == sorted({0, layout.pp - 1})
    for report in reports:
        planned = report["planned"]
        assert report["devices"] == cfg.devices == full.devices
        implied_by_the_layout(full, cfg, report["stage"], report)
        assert planned["shape_mismatches"] == {}
        assert report["bytes"] == {k: planned[k] for k in ("weights", "grads", "optimizer")}
        # MindSpore's pool is capped at the number the planner budgets (not the whole device)
        assert report["memory_pool_gib"] == cfg.hardware.memory_pool_gib < cfg.hardware.memory_gib
        # the gradient norm is completed over the stage's ranks (and across stages with a pipeline)
        norm_groups = sorted(row["group_size"] for row in report["collectives"] if row["purpose"] == "grad_norm")
        assert norm_groups == sorted([layout.stage_devices] + ([layout.pp] if layout.pp > 1 else []))
        if path.stem in LEVEL_1_TWINS:  # MindSpore's own plan of the rank's device memory, against the planner's
            memory = report["device_memory"]
            assert memory["used_bytes"] <= memory["peak_bytes"] and memory["somas_bytes"] > 0
            assert PLANNER_BAND[0] <= planned["device_memory_ratio"] <= PLANNER_BAND[1], planned
            assert PLANNER_BAND[0] <= planned["device_memory_bytes"] / memory["used_bytes"] <= PLANNER_BAND[1]
        if layout.ep > 1:  # the expert AlltoAlls, a fully recomputed layer's twice forward (expert_alltoall_bytes)
            alltoall = [
                row for row in report["collectives"] if row["kind"] == "AlltoAll" and row["group_size"] == layout.ep
            ]
            assert sum(map(ring_send_bytes, alltoall)) == pytest.approx(
                planner.communication(cfg, report["stage"])["ep"], rel=1e-3
            )


def test_a_sharded_step_loaded_from_the_compile_cache_has_the_layouts_it_compiled_to(tmp_path):
    """run.compile_cache in sharded layouts (mindscale/train/loop/compile_cache.py): rank 0 of tiny LLaMA
    dp2·tp2·pp2 with the optimizer shard compiled, then loaded from the cache. MindSpore 2.9's load leaves every
    layout's full shape empty; completed from the layouts kept beside the cache, the loaded step's layouts and
    local shapes equal the compiled ones, parameter by parameter."""
    sets = (*SMALL, "parallel.data_parallel=2", "parallel.model_parallel=2", "parallel.pipeline_stage=2")
    sets += ("parallel.micro_batch_num=2", "parallel.optimizer_shard=true")
    cfg, _ = for_ascend(load_config(TINY_LLAMA, list(sets)))
    job = Job(str(TINY_LLAMA), sets, tmp_path, collectives=False, compile_cache=tmp_path / "cache")
    compiled, loaded = (next(compile_ranks(cfg, job, [0])) for _ in range(2))
    assert (compiled["compile_cache"], loaded["compile_cache"]) == ("miss", "hit"), loaded.get("error")
    assert loaded["layouts"] == compiled["layouts"] and loaded["local_shapes"] == compiled["local_shapes"]
    assert all(layout[2] for layout in loaded["layouts"].values())  # every full shape, sharded ones among them


def test_accumulation_reduces_each_gradient_once_per_step():
    layout = ["parallel.data_parallel=4", "parallel.model_parallel=2", "model.num_kv_heads=2"]
    once, twice = (
        dryrun(TINY_LLAMA, *SMALL, *layout, f"parallel.gradient_accumulation_steps={g}", ranks="0")[0] for g in (1, 4)
    )

    def reduced(report):
        return {
            (row["group_size"], row["count"], row["bytes"])
            for row in report["collectives"]
            if row["purpose"] == "grad_reduce"
        }

    assert reduced(once) == reduced(twice)  # 4 micro batches: the same reductions, of the same bytes
    trained = [name for name in twice["local_shapes"] if name.startswith("adam_m.")]
    assert sum(count for _, count, _ in reduced(twice)) == len(trained)
    assert all(f"accu_grads.{name[7:]}" in twice["local_shapes"] for name in trained)


# Pipelines at widths whose weights (67 and 77 MB of fp32) make one stage's share of them measurable
GPT_PP2 = [
    *SMALL,
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.ffn_hidden_size=2048",
    "model.vocab_size=8192",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=4",
    "parallel.optimizer_shard=true",
    "model.tie_embeddings=true",
]
LLAMA_PP4 = [
    *SMALL,
    "model.hidden_size=384",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=1024",
    "model.vocab_size=8192",
    "model.num_layers=8",
    "parallel.data_parallel=1",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=4",
    "parallel.micro_batch_num=4",
]


@pytest.fixture(scope="module")
def gpt_pp2():
    """(config, overrides, a report per stage): GPT dp2·mp2·pp2, optimizer shard, tied embeddings."""
    return TINY_GPT, GPT_PP2, dryrun(TINY_GPT, *GPT_PP2, ranks="stages")


@pytest.fixture(scope="module")
def llama_pp4():
    """(config, overrides, a report per stage): LLaMA (GQA) mp2·pp4."""
    return TINY_LLAMA, LLAMA_PP4, dryrun(TINY_LLAMA, *LLAMA_PP4, ranks="stages")


def test_data_parallel_accumulation_orders_its_micro_batches_and_reduces_once():
    """Data parallel only, 4 accumulation steps: compiled under semi-auto parallel (Layout.sharded), the
    graph finishes each micro batch's backward before the next one's forward starts, so it holds one micro
    batch's activations at a time, and reduces each gradient once per step out of its accumulation buffer.
    (Compiled under DATA_PARALLEL, as before, nothing ordered the micro batches: docs/launch.md.)"""
    report = dryrun(
        TINY_LLAMA, *SMALL, "parallel.data_parallel=2", "parallel.gradient_accumulation_steps=4", ranks="0"
    )[0]
    assert report["ordered_micro_batches"] == [0, 1, 2]
    trained = [name[7:] for name in report["local_shapes"] if name.startswith("adam_m.")]
    assert trained and all(f"accu_grads.{name}" in report["local_shapes"] for name in trained)
    reduced = [row for row in report["collectives"] if row["purpose"] == "grad_reduce"]
    assert sum(row["count"] for row in reduced) == len(trained)
    assert sum(row["bytes"] for row in reduced) == report["bytes"]["grads"]  # every gradient, once
    assert report["planned"]["shape_mismatches"] == {}


def test_the_text_report_shows_each_figure_in_a_unit_that_shows_it():
    """tools/dryrun.py without --json: weights, gradients and optimizer state in the binary unit that leaves a
    number of at least 1 (every figure of a narrow twin read `0.000 GiB`), the compiled ones then the planner's."""
    report = dryrun(
        TINY_LLAMA, *SMALL, "parallel.data_parallel=2", "parallel.gradient_accumulation_steps=4", ranks="0"
    )[0]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    figures = re.findall(r"\b([\d.]+) (B|KiB|MiB|GiB)\b", line(report).split("GiB)", 1)[1])  # after the host peak
    assert [float(n) * units[u] for n, u in figures] == pytest.approx(
        [report["bytes"][k] for k in ("weights", "grads", "optimizer")]
        + [report["planned"][k] for k in ("weights", "grads", "optimizer")],
        rel=1e-3,
    )
    assert all(float(n) >= 1 for n, u in figures if u != "B")


def test_pipeline_stages_send_activations_and_reduce_the_norm_across_stages(gpt_pp2):
    _, sets, reports = gpt_pp2
    layout = Layout.of(load_config(TINY_GPT, sets))
    for report, peer in zip(reports, (4, 0)):
        rows = report["collectives"]
        norm = {tuple(row["ranks"]) for row in rows if row["purpose"] == "grad_norm"}
        assert norm == {tuple(layout.stage_ranks(report["stage"])), tuple(sorted((report["rank"], peer)))}
        # per micro batch, activations forward and their gradients back, between the same pair of ranks
        sends = [row for row in rows if row["kind"] in ("Send", "Receive")]
        assert {row["kind"] for row in sends} == {"Send", "Receive"}
        assert all(row["ranks"] == sorted([report["rank"], peer]) and row["count"] >= 4 for row in sends)
    # each stage holds only its own layers (and, the head being tied, the last one a copy of the embedding)
    first, last = (set(r["local_shapes"]) for r in reports)
    assert "layers.0.attention.wq.weight" in first and "layers.0.attention.wq.weight" not in last
    assert "layers.3.attention.wq.weight" in last and "tok_embeddings.weight" in first & last


@pytest.mark.parametrize("fp32_residual", [False, True], ids=["bf16_stream", "fp32_stream"])
def test_stages_send_the_residual_stream_and_reduce_in_the_compute_dtype(fp32_residual):
    """bf16 compute, tp2·pp2: the first stage sends each micro batch's [tokens, h] in the residual dtype,
    as the planner counts (half the bytes unless model.fp32_residual_connection), and every tensor-parallel
    all-reduce there, the vocabulary-split lookup's included, moves bf16 (its table is read in the
    compute dtype, like every weight)."""
    sets = [
        *SMALL,
        "model.compute_dtype=bfloat16",
        f"model.fp32_residual_connection={str(fp32_residual).lower()}",
        "parallel.data_parallel=1",
        "parallel.model_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
    ]
    cfg = load_config(TINY_LLAMA, sets)
    rows = dryrun(TINY_LLAMA, *sets, ranks="0")[0]["collectives"]
    hidden = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size
    sent = sum(row["bytes"] for row in rows if row["kind"] == "Send")
    assert sent == planner.communication(cfg, 0)["pp_send_recv"] == 2 * hidden * (4 if fp32_residual else 2)
    reductions = [row for row in rows if row["kind"] == "AllReduce" and row["purpose"] == "operator"]
    assert reductions and all(row["bytes"] == row["count"] * hidden * 2 for row in reductions)


def test_lora_under_model_parallel_trains_only_the_adapters():
    lora = [
        "finetune.lora.rank=4",
        "finetune.lora.target_modules=[wq,wv,wo]",
        "finetune.lora.dropout=0.05",
        "checkpoint.load_path=/not/read/by/a/dry/run",
        "model.num_kv_heads=2",
    ]
    report = dryrun(
        TINY_LLAMA,
        *SMALL,
        *lora,
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.optimizer_shard=true",
        ranks="0",
    )[0]
    moments = {name[7:] for name in report["local_shapes"] if name.startswith("adam_m.")}
    assert moments and all(name.endswith(("lora_a", "lora_b")) for name in moments)
    assert report["planned"]["shape_mismatches"] == {}
    # colwise wq: B's rows split like the weight's; rowwise wo: A's columns split like the weight's
    shapes = report["local_shapes"]
    assert shapes["layers.0.attention.wq.lora_b"] == [64 // 2, 4] and shapes["layers.0.attention.wo.lora_a"] == [4, 32]


def test_the_loss_spike_guard_compiles_in_a_sharded_step():
    """train.loss_spike_factor puts a limit parameter and a comparison before the update into the step;
    under model parallel the compiler must place them (the loss there is already the global one)."""
    report = dryrun(
        TINY_LLAMA,
        *SMALL,
        "model.num_kv_heads=2",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "train.loss_spike_factor=2",
        ranks="0",
    )[0]
    assert report["compiled"] and report["planned"]["shape_mismatches"] == {}


_IR_NODE = re.compile(r"^\s+%(\d+)\(\S*?\) = (?:PrimFunc_)?(\w+)\((.*)$")


def ir_nodes(text: str) -> dict[str, dict[str, tuple]]:
    """{graph: {node id: (op, input ids, line)}} of a validate IR file."""
    graphs, current = {}, None
    for ir_line in text.splitlines():
        if ir_line.startswith("subgraph @"):
            current = graphs.setdefault(ir_line.split("@", 1)[1].split("(", 1)[0], {})
        elif current is not None and (node := _IR_NODE.match(ir_line)):
            args = re.split(r"\) \{| primitive_attrs:| cnode_attrs:", node.group(3))[0]
            current[node.group(1)] = (node.group(2), re.findall(r"%(\d+)", args), ir_line)
    return graphs


def ancestors(nodes: dict, node: str) -> set[str]:
    """The ops `node` depends on within its graph (itself included)."""
    seen, todo = set(), [node]
    while todo:
        if (n := todo.pop()) in nodes and n not in seen:
            seen.add(n)
            todo += nodes[n][1]
    return {nodes[n][0] for n in seen}


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.model_parallel=2"],
        [
            "parallel.model_parallel=2",
            "parallel.pipeline_stage=2",
            "parallel.micro_batch_num=2",
            "parallel.optimizer_shard=true",
            "model.param_dtype=float16",
        ],
    ],
    ids=["dp2_tp2", "dp2_tp2_pp2_fp16_params"],
)
def test_a_910a_step_ors_the_float_status_of_every_rank_into_its_overflow(layout, tmp_path):
    """hardware=ascend910a saturates fp16 overflow instead of giving inf, so the norm test alone would apply
    saturated gradients: the compiled step reads NPUGetFloatStatusV2 after the gradient norm, sums it over
    all ranks (every stage too), clears it once summed, and ORs it with the norm test into the overflow
    that drives the dynamic loss scale and the skip. With fp16 parameters the fp32 AdamW moments are sliced
    and sharded like their parameters, as the planner counts them."""
    sets = [
        *SMALL,
        "hardware=ascend910a",
        "model.compute_dtype=float16",
        "train.loss_scale=dynamic",
        "model.num_kv_heads=2",
        "parallel.data_parallel=2",
        *layout,
    ]
    devices = load_config(TINY_LLAMA, sets).devices
    for report in dryrun(TINY_LLAMA, *sets, ranks="stages", ir_dir=tmp_path):
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
        graphs = ir_nodes(read_validate_ir(tmp_path / f"rank{report['rank']}"))
        nodes = next((g for g in graphs.values() if any(op == "NPUGetFloatStatusV2" for op, _, _ in g.values())), None)
        assert nodes, f"rank {report['rank']}: no NPUGetFloatStatusV2 in the compiled step"
        by_op = {}
        for n, (op, _, _) in nodes.items():
            by_op.setdefault(op, []).append(n)
        [read], [clear] = by_op["NPUGetFloatStatusV2"], by_op["NPUClearFloatStatusV2"]
        [summed] = [n for n in by_op["AllReduce"] if read in nodes[n][1]]
        assert f"group_rank_ids: ({', '.join(map(str, range(devices)))})" in nodes[summed][2]
        assert "Sqrt" in ancestors(nodes, read) and "AllReduce" in ancestors(nodes, clear)
        decided = [n for n in by_op["LogicalOr"] if {"IsFinite", "NPUGetFloatStatusV2"} <= ancestors(nodes, n)]
        assert decided, "the float status is not OR-ed with the norm test"


LLAMA3_2_1B = REPO_ROOT / "configs" / "llama3_2" / "llama3_2_1b.yaml"


@pytest.mark.parametrize(
    "config, overrides",
    [
        # the shipped twin without its accumulation (refused with validation): optimizer shard, vocabulary split
        (LLAMA3_2_1B, (*twin(LLAMA3_2_1B), "parallel.gradient_accumulation_steps=1")),
        (
            TINY_LLAMA,
            (
                *SMALL,
                "model.num_kv_heads=2",
                "parallel.data_parallel=2",
                "parallel.model_parallel=2",
                "parallel.sequence_parallel=true",
            ),
        ),
        (TINY_LLAMA, (*SMALL, "parallel.data_parallel=2", "parallel.pipeline_stage=2", "parallel.micro_batch_num=2")),
    ],
    ids=["llama3_2_1b_twin_no_accumulation", "tiny_dp2_mp2_sp", "tiny_dp2_pp2"],
)
def test_the_validation_graph_compiles_next_to_the_sharded_step(config, overrides):
    """train.eval_interval: the forward-only validation graph (mindscale/train/loop/evaluate.py) compiles after
    the step, on its sliced weights, with the step's own report unchanged by it."""
    for plain, report in zip(
        dryrun(config, *overrides, ranks="stages"),
        dryrun(config, *overrides, "train.eval_interval=100", "data.valid_path=/not/read/by/a/dry/run", ranks="stages"),
    ):
        assert report["compiled"] and report["eval_compile_s"] > 0 and "eval_compile_s" not in plain
        assert {k: report[k] for k in ("local_shapes", "bytes", "collectives")} == {
            k: plain[k] for k in ("local_shapes", "bytes", "collectives")
        }


@pytest.mark.parametrize("path", SFT, ids=lambda p: p.stem)
def test_packed_sft_twins_compile_what_their_pretraining_twins_do(path):
    """Packing adds no parameter bytes and no communication: a shipped SFT config's twin, fed segment_ids (flash
    attention in the TND layout, tests/dryrun/test_packed_flash.py), compiles the same parameters and collectives
    as the twin of the pretraining config it is based on, unpacked, whose layout it keeps. Only the loss mask
    SFT data carries adds one: the last stage's count of trained tokens, a float32 all-reduce over the loss's
    row group per micro batch (pretraining trains every token and divides by their static count)."""
    base = (path.parent / parse_yaml(path.read_text())["base"]).resolve()
    layout = Layout.of(load_config(path, twin(path)), "Ascend")
    assert layout == Layout.of(load_config(base, twin(base)), "Ascend")
    for packed, plain in zip(dryrun(path, as_twin=True, packed=True), dryrun(base, as_twin=True)):
        assert packed["rank"] == plain["rank"]
        for key in ("local_shapes", "bytes"):
            assert packed[key] == plain[key], key
        counted = {(c["kind"], c["purpose"], tuple(c["ranks"])): (c["count"], c["bytes"]) for c in plain["collectives"]}
        extra = [
            (
                c["kind"],
                c["purpose"],
                c["count"] - counted.get((c["kind"], c["purpose"], tuple(c["ranks"])), (0, 0))[0],
                c["bytes"] - counted.get((c["kind"], c["purpose"], tuple(c["ranks"])), (0, 0))[1],
            )
            for c in packed["collectives"]
        ]
        extra = [e for e in extra if e[2:] != (0, 0)]
        last = packed["stage"] == layout.pp - 1
        assert extra == ([("AllReduce", "operator", layout.micro_steps, 4 * layout.micro_steps)] if last else []), extra
        assert len(packed["collectives"]) == len(plain["collectives"])


def test_packed_sft_with_composite_attention_under_model_parallel():
    report = dryrun(
        TINY_LLAMA,
        *SMALL,
        "model.num_kv_heads=2",
        "model.attention=composite",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        ranks="0",
        packed=True,
    )[0]
    assert report["compiled"]


def test_restore_slices_full_weights_by_the_compiled_layouts(tmp_path):
    """What a sharded run's restore takes from a full tensor (models.weights), for every rank of a
    compiled layout: the compiled slice shape; the model-parallel part equal to MindSpore's own slicer
    (mindspore.parallel._tensor._load_tensor); the optimizer-shard parts of the ranks holding that slice,
    in rank order, tiling it. Read from a safetensors file (SlicedWeights), each rank's slice is the same."""
    from mindspore import Tensor
    from mindspore.parallel._tensor import _load_tensor

    sets = [
        *SMALL,
        "model.num_kv_heads=2",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.optimizer_shard=true",
        "parallel.vocab_emb_dp=false",
    ]
    reports = dryrun(TINY_LLAMA, *sets, ranks="0,1,2,3")
    sharded = 0
    names = [n for n in reports[0]["layouts"] if not n.startswith(("adam_", "accu_"))]
    fulls = {
        n: np.arange(math.prod(reports[0]["layouts"][n][2]), dtype=np.float32).reshape(reports[0]["layouts"][n][2])
        for n in names
    }
    save_file(fulls, str(tmp_path / "full.safetensors"))
    lazy = SlicedWeights.of_file(tmp_path / "full.safetensors")  # what checkpoint.load_path gives a sharded run
    for name in names:
        full = fulls[name]
        holders = {}
        for report in reports:
            dev_matrix, tensor_map, shape, group = report["layouts"][name]
            piece = take_slice(full, (dev_matrix, tensor_map, None, 1, True, group, shape), report["rank"])
            assert list(piece.shape) == report["local_shapes"][name], name
            if tensor_map:
                read = lazy.local(name, (dev_matrix, tensor_map, None, 1, True, group, shape), report["rank"])
                np.testing.assert_array_equal(read, piece)
            ours = take_slice(full, (dev_matrix, tensor_map, None, 1, True, "", shape), report["rank"])
            theirs = _load_tensor(Tensor(full), dev_matrix, tensor_map, shape, report["rank"]) if tensor_map else full
            np.testing.assert_array_equal(ours, theirs)
            if group:
                holders.setdefault(ours.tobytes(), [ours, []])[1].append(piece)
                sharded += 1
            else:
                np.testing.assert_array_equal(piece, ours)
        for whole, pieces in holders.values():
            np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert sharded  # the layout has optimizer-sharded parameters


def _raw(compact):
    """A report's [dev_matrix, tensor_map, full_shape, opt_group] as MindSpore's layout tuple."""
    dev_matrix, tensor_map, shape, group = compact
    return dev_matrix, tensor_map, None, 1, True, group, shape


def _cut(full, reports, devices):
    """Every rank's slices of the full tensors it holds: the ranks of a stage share its first rank's layouts."""
    per_stage = devices // len(reports)
    return {
        rank: {
            n: (_raw(lay), take_slice(full[n], _raw(lay), rank)) for n, lay in report["layouts"].items() if n in full
        }
        for report in reports
        for rank in range(report["rank"], report["rank"] + per_stage)
    }


def _merge(parts):
    names = {n for held in parts.values() for n in held}
    return {n: merge_slices(n, [(r, *held[n]) for r, held in sorted(parts.items()) if n in held]) for n in names}


def _write_sharded_step(run, step, parts, config_yaml):
    """A sharded run's step as the trainer writes it: rank_<r>/step_X with its weight slices and the
    compiled layouts of all it holds. Returns rank 0's folder."""
    for rank, held in parts.items():
        weights = {n: piece for n, (_, piece) in held.items() if not n.startswith("adam_")}
        layouts = {n: lay for n, (lay, _) in held.items()}
        ckpt.save_checkpoint(run / f"rank_{rank}", step, weights, state={"layouts": layouts}, config=config_yaml)
    return run / "rank_0" / ckpt.step_dir_name(step)


def test_resharding_round_trips_through_compiled_layouts(tmp_path):
    """Weights and AdamW moments cut into every rank's slices by compiled layouts and merged back are
    bit-identical: dp2 x mp2 x pp2 with optimizer shard, then across an mp and pp change (dp2 x mp4,
    one stage). Written as a sharded run's rank folders, any rank's folder loads as the whole step and
    converts to Hugging Face. Without one rank's slices the merge refuses."""
    common = [*SMALL, "model.num_kv_heads=4", "parallel.data_parallel=2", "parallel.optimizer_shard=true"]
    staged = dryrun(
        TINY_LLAMA, *common, "parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.micro_batch_num=2"
    )
    wide = dryrun(TINY_LLAMA, *common, "parallel.model_parallel=4", ranks="0")
    assert [r["rank"] for r in staged] == [0, 4]
    rng = np.random.default_rng(0)
    full = {
        n: rng.standard_normal(lay[2]).astype(np.float32)
        for r in staged
        for n, lay in r["layouts"].items()
        if not n.startswith("accu_grads.")
    }
    assert any(n.startswith("adam_m.") for n in full) and any(lay[3] for lay in staged[0]["layouts"].values())
    parts = _cut(full, staged, 8)
    assert set(parts[0]) != set(parts[4])  # each stage holds its own layers
    back = _merge(parts)
    assert back.keys() == full.keys() and all(np.array_equal(back[n], full[n]) for n in full)
    again = _merge(_cut(back, wide, 8))
    assert all(np.array_equal(again[n], full[n]) for n in full)
    # a sharded run's step as the trainer writes it: rank_<r>/step_X with its slices and compiled layouts
    cfg_yaml = load_config(
        TINY_LLAMA, [*common, "parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.micro_batch_num=2"]
    ).to_yaml()
    run = tmp_path / "checkpoints"
    _write_sharded_step(run, 6, parts, cfg_yaml)
    merged = load_weights(run / "rank_5" / "step_00000006")  # any rank's folder stands for the step
    assert merged.keys() == {n for n in full if not n.startswith("adam_")}
    assert all(np.array_equal(merged[n], full[n]) for n in merged)
    hf = subprocess.run(
        [
            sys.executable,
            "tools/convert_checkpoint.py",
            "--direction",
            "ms2hf",
            "--input",
            str(run / "rank_0" / "step_00000006"),
            "--output",
            str(tmp_path / "hf"),
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert hf.returncode == 0 and json.loads(hf.stdout)["tensors"] == len(merged), hf.stderr[-2000:]
    del parts[1]
    with pytest.raises(CheckpointError, match="a rank's checkpoint part is missing"):
        _merge(parts)


def _bf16_exact(rng, shape):
    """Random fp32 values that BF16 holds exactly, so every checkpoint format stores the same tensor."""
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def _write_hf_bf16(folder, full, cfg):
    """A Hugging Face folder of the weights `full`, in BF16, written by transformers' save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights
    from models.hf_convert import mindscale_to_hf

    state, config = mindscale_to_hf(full, cfg.model)
    with no_init_weights():  # every weight is set below
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    result = model.load_state_dict({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _write_mindformers_ckpt(file, full, m):
    """A MindFormers LLaMA .ckpt (qkv_concat: fused w_qkv and w_gate_hidden, laid out as models/mf_convert.py
    describes) with AdamW moments beside the weights, written by MindSpore's save_checkpoint."""
    import mindspore as ms

    fused = re.compile(r"layers\.\d+\.(attention\.w[qkv]|feed_forward\.w[13])\.weight")
    renames = {ours: theirs for theirs, ours in mf_convert.RENAMES.items()}
    tensors = {renames.get(n, f"model.{n}"): v for n, v in full.items() if not fused.fullmatch(n)}
    for i in range(m.num_layers):

        def per_group(w):  # [kv heads, heads of the group, head dim, hidden]
            return full[f"layers.{i}.attention.{w}.weight"].reshape(
                m.kv_heads, -1, m.hidden_size // m.num_heads, m.hidden_size
            )

        qkv = np.concatenate([per_group("wq"), per_group("wk"), per_group("wv")], axis=1)
        tensors[f"model.layers.{i}.attention.w_qkv.weight"] = qkv.reshape(-1, m.hidden_size)
        gate, up = (full[f"layers.{i}.feed_forward.{w}.weight"] for w in ("w1", "w3"))
        interleaved = np.stack([gate, up], axis=1).reshape(-1, m.hidden_size)
        tensors[f"model.layers.{i}.feed_forward.w_gate_hidden.weight"] = interleaved
    state = {**tensors, **{f"adam_m.{n}": v for n, v in tensors.items()}, "global_step": np.array([7], np.int32)}
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in state.items()], str(file))
    return file


def _model_shapes(cfg) -> dict:
    from mindspore.nn.utils import no_init_parameters
    import models

    with no_init_parameters():
        return {p.name: list(p.shape) for p in models.build_model(cfg).get_parameters()}


STORED = {"mindscale": 4, "hf": 2, "rank_folders": 4, "mindformers": 4}  # bytes per element in each checkpoint
READ_SLACK = 1 << 20  # headers (safetensors, state.json, COMPLETE, config.json, a .ckpt's keys), library code first run
HELD_SLACK = 6 << 20  # resident memory beyond the values held: Python objects, one tensor's transient copy


@pytest.mark.parametrize("staged", ["gpt_pp2", "llama_pp4"])
def test_a_pipeline_stage_reads_and_holds_only_its_share_of_full_weights(staged, request, tmp_path):
    """checkpoint.load_path under a pipeline (issue 26): each stage's first rank, with the layouts the dry
    run compiled for it, loads full weights in a plain CPU process (tests/fixtures/load_stage.py) from a
    MindScale step folder, a BF16 Hugging Face folder written by transformers, and a sharded run's rank
    folders (GPT) or a MindFormers .ckpt with its optimizer state (LLaMA). Measured by the kernel: the
    bytes read are exactly its slices of the tensors its stage holds (its embedding or head included)
    plus headers, so at most the stage's share of the file, and its resident memory grows by what it
    holds, not by the other stages' tensors; every value equals the slice of the full tensor."""
    config, overrides, reports = request.getfixturevalue(staged)
    cfg = load_config(config, overrides)
    shapes = {n: lay[2] for r in reports for n, lay in r["layouts"].items() if not n.startswith(("adam_", "accu_"))}
    assert shapes == _model_shapes(cfg)  # the stages together hold the whole model
    rng = np.random.default_rng(0)
    full = {n: _bf16_exact(rng, shape) for n, shape in sorted(shapes.items())}
    paths = {
        "mindscale": ckpt.save_checkpoint(tmp_path / "ms", 0, full),
        "hf": _write_hf_bf16(tmp_path / "hf", full, cfg),
    }
    if cfg.model.arch == "gpt":
        parts = _cut(full, reports, cfg.devices)
        paths["rank_folders"] = _write_sharded_step(tmp_path / "run", 4, parts, cfg.to_yaml())
    else:
        paths["mindformers"] = _write_mindformers_ckpt(tmp_path / "mf.ckpt", full, cfg.model)
    loads = [
        {
            "rank": r["rank"],
            "layouts": r["layouts"],
            "local_shapes": r["local_shapes"],
            "path": str(paths[form]),
            "output": str(tmp_path / f"{form}_{r['rank']}.npz"),
            "form": form,
        }
        for r in reports
        for form in paths
    ]
    (tmp_path / "spec.json").write_text(json.dumps({"config": str(config), "overrides": overrides, "loads": loads}))
    proc = subprocess.run(
        [sys.executable, "tests/fixtures/load_stage.py", str(tmp_path / "spec.json")],
        cwd=REPO_ROOT,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(measured) == len(loads)
    by_rank = {r["rank"]: r for r in reports}
    for job, m in zip(loads, measured):
        report, stored = by_rank[job["rank"]], STORED[job["form"]]
        names = [n for n in report["layouts"] if n in full]  # the stage's weights
        local = sum(math.prod(report["local_shapes"][n]) for n in names)
        share = sum(full[n].size for n in names) * stored
        read = m["rchar"] + m["mapped"]
        assert local * stored <= read <= min(share, local * stored + READ_SLACK), job["form"]
        assert m["held"] <= local * 4 + HELD_SLACK, job["form"]
        values = np.load(job["output"])
        assert sorted(values.files) == sorted(names)
        for n in names:
            np.testing.assert_array_equal(
                values[n], take_slice(full[n], _raw(report["layouts"][n]), report["rank"]), err_msg=f"{job['form']} {n}"
            )
        print(
            f"{staged} stage {report['stage']} rank {report['rank']} {job['form']}: holds {local * 4} B, read "
            f"{read} B of its stage's {share} B (whole model {sum(v.nbytes for v in full.values())} B fp32), "
            f"resident +{m['held']} B"
        )


# beside tiny_runs.SMALL; 8 heads and kv heads so that 3D tensor parallel (2 x 2 x 2) splits them
CPU_SIZE = ["model.num_layers=2", "train.micro_batch_size=4", "model.num_heads=8", "model.num_kv_heads=8"]
CPU_RUN = [*tiny_runs.SMALL, *CPU_SIZE, "parallel.data_parallel=1"]


def _train(output, name, *overrides):
    """(stdout, losses) of 6 steps of the CPU run the reshard test starts from and resumes."""
    proc = tiny_runs.train(output, name, *CPU_SIZE, "train.steps=6", *overrides)
    return proc.stdout, tiny_runs.losses(output / name)


def _reshard(source, output, *overrides):
    argv = [
        sys.executable,
        "tools/reshard.py",
        "--input",
        str(source),
        "--config",
        str(TINY_LLAMA),
        "--output",
        str(output),
        "--jobs",
        "2",
        "--json",
        *[a for o in [*CPU_RUN, *overrides] for a in ("--set", o)],
    ]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_reshard_tool_round_trip_and_resume(tmp_path):
    """tools/reshard.py: a CPU run's step resharded into dp2 x mp2 x pp2 with optimizer shard (layouts
    compiled by the dry run) and back is bit-identical in weights and AdamW moments, and the CPU run
    resumed from it continues the losses of a run never resharded (one core: deterministic). So is the step
    resharded into 3D tensor parallel (2 x 2 x 2), whose projection weights split a dimension over two mesh axes
    (listed flat in the compiled layouts; models/weights.py groups them by the slice shape), and back."""
    _, straight = _train(tmp_path, "src", "checkpoint.save_interval=4")
    sharded = _reshard(
        tmp_path / "src" / "checkpoints" / "step_00000004",
        tmp_path / "sharded",
        "hardware=ascend910b",
        "parallel.data_parallel=2",
        "parallel.model_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "parallel.optimizer_shard=true",
        "train.micro_batch_size=1",
    )
    assert sharded["ranks"] == 8 and sharded["gb_per_s"] > 0 and (tmp_path / "sharded" / "COMMITTED").is_file()
    back_root = tmp_path / "back" / "checkpoints"
    _reshard(tmp_path / "sharded" / "rank_6" / "step_00000004", back_root)
    source, back = tmp_path / "src" / "checkpoints" / "step_00000004", back_root / "step_00000004"
    for name in (ckpt.WEIGHTS, ckpt.OPTIMIZER):
        a, b = ckpt.read_tensors(source / name), ckpt.read_tensors(back / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a), name
    stdout, resumed = _train(tmp_path, "back")
    assert "resumed from" in stdout and "step_00000004" in stdout
    assert [resumed[s] for s in (5, 6)] == [straight[s] for s in (5, 6)]
    nd = ["parallel.model_parallel=8", "parallel.tp_x=2", "parallel.tp_y=2", "parallel.tp_z=2"]
    assert _reshard(source, tmp_path / "nd", "hardware=ascend910b", *nd)["ranks"] == 8
    _reshard(tmp_path / "nd" / "rank_5" / "step_00000004", tmp_path / "nd_back")
    for name in (ckpt.WEIGHTS, ckpt.OPTIMIZER):
        a, b = ckpt.read_tensors(source / name), ckpt.read_tensors(tmp_path / "nd_back" / "step_00000004" / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a), name


def test_a_bad_strategy_is_refused_by_the_compiler():
    """The dry run is a real check: MindSpore's compiler rejects a colwise MatMul whose input is split
    along the contracting dimension while its weight is not, as it does on Ascend."""
    from mindscale.launch.standins import dryrun_environment

    sets = SMALL + [
        "model.num_kv_heads=4",
        "parallel.data_parallel=2",
        "parallel.model_parallel=4",
        "run.device_target=Ascend",
    ]
    code = f"""
from models.layers import Linear
from mindscale.config import load_config
from mindscale.launch.dryrun_worker import compile_rank
good = Linear.shard_strategies
def bad(cell, style, layout):
    rules = good(cell, style, layout)
    if style == "colwise":
        rules["matmul"] = (((layout.dp, 2), (layout.tp, 1)), None)
    return rules
Linear.shard_strategies = bad
print(compile_rank(load_config({str(TINY_LLAMA)!r}, {sets!r}))["error"])
"""
    env = {**dryrun_environment(dict(os.environ), 0, 8), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MatMul init failed" in proc.stdout and "layers.py" in proc.stdout, proc.stdout
    assert "Invalid strategy for mat_a [2, 2] and mat_b [4, 1]" in proc.stderr  # MindSpore's own reason


def test_ranks_preload_libgomp_and_jemalloc_once_and_keep_the_callers_libraries(tmp_path):
    from mindscale.launch.standins import dryrun_environment, jemalloc, libgomp

    mine = tmp_path / "libmine.so"
    caller = ":".join(filter(None, [str(mine), jemalloc() and os.path.realpath(jemalloc())]))
    preload = dryrun_environment({"LD_PRELOAD": caller}, 0, 8)["LD_PRELOAD"].split()
    assert preload == [libgomp(), *filter(None, [jemalloc()]), str(mine)]


def test_bad_input_is_one_line_and_exit_2():
    for argv, needle in (
        (["--config", str(TINY_LLAMA)], "hardware='cpu'"),
        (["--config", str(TINY_LLAMA), "--set", "hardware=ascend910b", "--ranks", "0,9"], "rank 9"),
        (["--config", str(TINY_LLAMA), "--set", "hardware=ascend910b", "--set", "model.num_heads=3"], "num_heads"),
        (
            ["--config", str(TINY_LLAMA), "--set", "hardware=ascend910a", "--set", "model.compute_dtype=bfloat16"],
            "no bf16 matmul",
        ),
        (
            ["--config", str(TINY_LLAMA), "--set", "hardware=ascend910b", "--set", "parallel.context_parallel=3"],
            "model.seq_length=128 is not divisible by parallel.context_parallel=3",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "tools/dryrun.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, (
            proc.stderr
        )
