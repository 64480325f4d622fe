"""Context parallel (parallel.context_parallel c = 2) compiled by MindSpore's dry run, read from the saved IR.

One LLaMA twin (GQA, bf16, flash attention) on tp2 x cp2 x pp2, compiled for rank 0 (first stage, sequence
chunk 0) and rank 6 (last stage, chunk 1), once per algorithm and once with colossalai_cp's load balance. What each
rank's validate IR must show:

* activations [B, S/c, h]: the token lookup gives [1, S/2, h], the residual adds and the attention's
  projections work on S/2 tokens, a stage sends S/2 tokens per micro batch;
* colossalai_cp: K and V all-gathered over the rank's cp group, [S/2] -> [S] (their gradients reduce-scattered
  back), FlashAttentionScore with the rank's queries [1, S/2, .] against [1, S, .] keys, its causal mask turned
  into the band Layout's flash_causal_band predicts for the rank's chunk;
* colossalai_cp with parallel.context_parallel_load_balance (MindSpore's flash attention load balance): two
  FlashAttentionScore nodes a layer, each on half the rank's queries [1, S/2c, .], with the bands of the half
  chunks `load_balanced_chunks` names (rank 0: chunks 0 and 3 of 4, rank 6: 2 and 1), the half exchanged with the
  partner rank and its output sent back by all-gathers over the pair (reduce-scattered in the backward);
* ulysses_cp: AlltoAll over the cp group only (q, k, v in, the output back, forward and backward),
  FlashAttentionScore over the whole sequence on heads / (t x c) heads with the plain causal mask;
* the planner's context-parallel bytes equal the compiled collectives', and its per-rank weight, gradient
  and optimizer bytes the compiled ones.

A dry run proves compiler acceptance only: not the kernels, numerics, speed or device memory
(tests/models/test_context_parallel_masks.py executes the per-rank arithmetic on CPU).
"""

import re

import pytest

from mindscale.config import Layout, load_config
from mindscale.config.layout import flash_causal_band, load_balanced_chunks
from mindscale.launch.compiled_ir import read_validate_ir
from mindscale.launch.dryrun_ranks import ring_send_bytes
from mindscale.perf import planner
from test_dryrun import TINY_LLAMA, dryrun

CP_TWIN = [
    "hardware=ascend910b",
    "model.hidden_size=128",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=256",
    "model.seq_length=64",
    "model.num_layers=4",
    "model.compute_dtype=bfloat16",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=1",
    "parallel.model_parallel=2",
    "parallel.context_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
]
RANKS = "0,6"  # stage 0 chunk 0, stage 1 chunk 1
_SHAPE = re.compile(r"<Tensor\[\w+\], \(([\d, ]*)\)")


def ops_named(ir: str, op: str, scoped: bool = False) -> list[tuple]:
    """(the node's line, [its input shapes..., its output shape]) of every `op` node in a validate IR, and with
    `scoped` its "Fullname with scope" line as a third item."""
    lines = ir.splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.search(rf"= (?:PrimFunc_)?{op}\(", line):
            shapes = [tuple(int(x) for x in m.split(", ") if x) for m in _SHAPE.findall(lines[i + 1])]
            found.append((line, shapes, lines[i + 2]) if scoped else (line, shapes))
    return found


BALANCED = "_load_balance"  # a param's suffix: with parallel.context_parallel_load_balance


@pytest.fixture(scope="module", params=["colossalai_cp", "ulysses_cp", "colossalai_cp" + BALANCED])
def compiled(request, tmp_path_factory):
    """(algorithm, config, layout, [(report, validate IR)] for ranks 0 and 6)."""
    algo = request.param.removesuffix(BALANCED)
    sets = [*CP_TWIN, f"parallel.context_parallel_algo={algo}"]
    sets += ["parallel.context_parallel_load_balance=true"] if request.param.endswith(BALANCED) else []
    ir_dir = tmp_path_factory.mktemp(request.param)
    reports = dryrun(TINY_LLAMA, *sets, ranks=RANKS, ir_dir=ir_dir)
    cfg = load_config(TINY_LLAMA, sets)
    return (algo, cfg, Layout.of(cfg, "Ascend"), [(r, read_validate_ir(ir_dir / f"rank{r['rank']}")) for r in reports])


def test_activations_are_split_along_the_sequence(compiled):
    _, cfg, layout, ranks = compiled
    m = cfg.model
    local = m.seq_length // layout.cp
    assert [r["stage"] for r, _ in ranks] == [0, 1]
    for report, ir in ranks:
        assert report["devices"] == 8 and report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
        # the residual adds: a block's Adds (MindSpore may name either one after the other in a reused layer graph,
        # and it gives the loss's own Add a block's instance name too, so the scope decides)
        residuals = [
            shapes
            for line, shapes, scope in ops_named(ir, "Add", scoped=True)
            if re.search(r"instance name: \w+_residual", line) and "-TransformerBlock/" in scope
        ]
        assert residuals and all(s == [(local, m.hidden_size)] * 3 for s in residuals)
        if report["stage"] == 0:
            [(_, lookup)] = [(line, s) for line, s in ops_named(ir, "Gather") if "tok_embeddings.weight" in line]
            assert lookup[1:] == [(1, local), (1, local, m.hidden_size)]  # ids [B, S/c] -> [B, S/c, h]
        sent = sum(row["bytes"] for row in report["collectives"] if row["kind"] == "Send")
        assert sent == cfg.parallel.micro_batch_num * local * m.hidden_size * 2  # bf16 residual stream


def test_attention_gathers_or_swaps_over_the_cp_group_only(compiled):
    algo, cfg, layout, ranks = compiled
    m = cfg.model
    n, kv, d, tp, cp, s = m.num_heads, m.kv_heads, m.head_size, layout.tp, layout.cp, m.seq_length
    for report, ir in ranks:
        rank = report["rank"]
        group = layout.context_ranks(rank)
        layers = layout.layers_per_stage[report["stage"]] * cfg.parallel.micro_batch_num
        moved = [row for row in report["collectives"] if row["purpose"] == "redistribution"]
        assert {tuple(row["ranks"]) for row in moved} == {tuple(group)}
        flash = ops_named(ir, "FlashAttentionScore")
        # one graph serves every micro batch; the load balance attends the rank's two half chunks apart
        chunks = load_balanced_chunks(cp, layout.context_rank(rank)) if layout.cp_load_balance else None
        assert len(flash) == layout.layers_per_stage[report["stage"]] * (2 if chunks else 1)
        bands = []
        for line, shapes in flash:
            numbers = [int(x) for x in re.findall(r"I64\((-?\d+)\)", line.split("{", 1)[0])]
            head_num, pre_tokens, next_tokens, sparse_mode = numbers[0], numbers[1], numbers[2], numbers[-1]
            bands.append((sparse_mode, pre_tokens, next_tokens))
            if algo == "colossalai_cp":
                queries = s // (2 * cp) if chunks else s // cp
                assert shapes[:3] == [(1, queries, n * d // tp), (1, s, kv * d // tp), (1, s, kv * d // tp)]
                assert head_num == n // tp
            else:
                assert shapes[:3] == [(1, s, n * d // (tp * cp))] + [(1, s, kv * d // (tp * cp))] * 2
                assert head_num == n // (tp * cp)
                assert bands[-1] == (2, 2**31 - 1, 2**31 - 1)
        per_layer = [flash_causal_band(s, 2 * cp, j) for j in chunks] if chunks else []
        if chunks:  # each half under its own chunk's band: rank 0 chunks 0 and 3 of 4, rank 6 chunks 2 and 1
            assert sorted(bands) == sorted(per_layer * layout.layers_per_stage[report["stage"]])
        elif algo == "colossalai_cp":
            assert set(bands) == {flash_causal_band(s, cp, layout.context_rank(rank))}
        kinds = {row["kind"]: row["count"] for row in moved}
        if algo == "colossalai_cp":  # K and V gathered [S/c] -> [S]
            gathers = [shapes for _, shapes in ops_named(ir, "AllGather") if shapes]
            assert (s // cp, kv * d // tp) in {g[0] for g in gathers} and (s, kv * d // tp) in {g[-1] for g in gathers}
        if chunks:  # the half queries and their output exchanged with the partner c-1-i (here the cp group), and back
            exchanged = [
                row for row in report["collectives"] if row["purpose"] == "operator" and row["kind"] == "AllGather"
            ]
            index = layout.context_rank(rank)
            pair = sorted({group[index], group[cp - 1 - index]})
            assert [(row["ranks"], row["count"]) for row in exchanged] == [(pair, 2 * layers)]
            assert kinds == {"AllGather": 2 * layers, "ReduceScatter": 4 * layers}  # K, V and the exchange's grads
            moved += exchanged
        elif algo == "colossalai_cp":  # K and V forward, their gradients back
            assert kinds == {"AllGather": 2 * layers, "ReduceScatter": 2 * layers}
        else:  # q, k, v in and the output back, forward and backward
            assert kinds == {"AlltoAll": 2 * 4 * layers}
        assert sum(ring_send_bytes(row) for row in moved) == planner.communication(cfg, report["stage"])["cp"]
