"""What a layer keeps for its backward under tensor + sequence parallel, read from the validate IR MindSpore's dry run
compiles (docs/planner.md, "What MindSpore keeps beyond the paper under tensor parallel").

One LLaMA twin of llama3_405b's kind (GQA, bf16, flash attention, dp2 x tp2 with sequence parallel, one micro batch,
so each layer is its own reused graph): layer 0 fully recomputed, layer 1 offloaded, layer 2 kept; compiled with
recompute.comm false and true. What the IR must show, and the planner count:
* the kept layer's weight-gradient MatMuls of wq/wk/wv/w1/w3 read the forward's AllGather output (the gathered input
  is kept), or with recompute.comm the backward's own AllGather, which regathers it (marked recompute);
* the offloaded layer moves the planner's offloaded_layer_bytes: the gathered inputs, or the split ones;
* the fully recomputed layer's recomputed forward repeats no collective and reads the forward's gathered inputs and
  reduce-scatter output, or with recompute.comm repeats them and reads only the layer input: the planner's bytes
  for a fully recomputed layer either way;
* the compiled traffic grows with recompute.comm by what the planner adds.
A dry run proves what the compiler built, not memory or speed on a device.
"""

import re

import pytest

from mindscale.config import Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from mindscale.perf import flops, planner
from test_dryrun import dryrun
from test_offload import LLAMA3_405B, SMALL, moves_of, nbytes

TWIN = [
    *SMALL,
    "model.num_layers=3",
    "parallel.pipeline_stage=1",
    "parallel.micro_batch_num=1",
    "parallel.pipeline_interleave=1",
    "parallel.gradient_accumulation_shard=false",
    "recompute.mode=full",
    "recompute.layers=1",
    "offload.layers=1",
]
RECOMPUTED, OFFLOADED, KEPT = 0, 1, 2
COLUMN_PARALLEL = (
    "attention-Attention/wq",
    "attention-Attention/wk",
    "attention-Attention/wv",
    "feed_forward-SwiGLU/w1",
    "feed_forward-SwiGLU/w3",
)
TENSOR = re.compile(r"<Tensor\[(\w+)\], \(([\d, ]*)\)>")


def subgraphs(ir: str) -> dict[str, tuple[str, str]]:
    """name -> (its '# Parameters:' line, its body) of every graph in a validate IR."""
    out = {}
    for block in ir.split("\nsubgraph attr:")[1:]:
        name = re.search(r"\nsubgraph @(\S+?)\(", block).group(1)
        params = re.search(r"\n# Parameters: [^\n]*", block)
        out[name] = (params.group(0) if params else "", block[block.index(f"subgraph @{name}(") :])
    return out


def layer_graphs(graphs: dict, layer: int) -> dict:
    """The graphs whose parameters are layer `layer`'s weights: its forward, its recomputed forward."""
    return {name: g for name, g in graphs.items() if f"ref_key=layers.{layer}." in g[0]}


def nodes(body: str) -> dict[str, tuple[str, str, str]]:
    """%N or its name -> (op, the rest of its line, its scope)."""
    out = {}
    for m in re.finditer(
        r"^  %(\d+)\(([^)]*)\) = (\w+)\(([^\n]*)\n[^\n]*\n(?:\s*# Fullname with scope: \(([^)]*)\))?", body, re.M
    ):
        index, name, op, rest, scope = m.groups()
        out[f"%{index}"] = out[name] = (op, rest, scope or "")
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """recompute.comm -> (config, layout, report, graphs, moves) of rank 0 (the only stage)."""
    out = {}
    for comm in (False, True):
        sets = [*TWIN, f"recompute.comm={str(comm).lower()}"]
        ir_dir = tmp_path_factory.mktemp(f"comm_{comm}")
        [report] = dryrun(LLAMA3_405B, *sets, ir_dir=ir_dir)
        ir = read_validate_ir(ir_dir / "rank0")
        moves = [(where, size, layer) for where, _, size, layer in moves_of(ir)]
        cfg = load_config(LLAMA3_405B, sets)
        out[comm] = cfg, Layout.of(cfg, "Ascend"), report, subgraphs(ir), moves
    return out


def test_the_twin_recomputes_offloads_and_keeps_one_layer_each(compiled):
    for comm, (_, layout, report, _, _) in compiled.items():
        assert (layout.recomputed, layout.offloaded, layout.graph_reuse) == ((RECOMPUTED,), (OFFLOADED,), "layer")
        assert layout.regathered == ((OFFLOADED, KEPT) if comm else ())
        assert report["planned"]["shape_mismatches"] == {}


def test_weight_gradients_read_the_forward_gather_or_a_regather(compiled):
    """The kept layer's forward hands its backward a Partial; in the backward the weight-gradient MatMul of each
    column-parallel Linear (Grad_MatMul with transpose_a) reads its input X: without recompute.comm a parameter
    of the backward graph that the forward computed by AllGather, with it an AllGather of the backward graph
    itself (the regather), which the parallel pass marked for recompute."""
    for comm, (_, _, _, graphs, _) in compiled.items():
        [forward] = [body for _, body in layer_graphs(graphs, KEPT).values() if "= Partial(@" in body]
        backward_name = re.search(r"= Partial\(@(\S+?),", forward).group(1)
        forward_nodes, backward_nodes = nodes(forward), nodes(graphs[backward_name][1])
        read = {}
        for op, rest, scope in backward_nodes.values():
            linear = next((c for c in COLUMN_PARALLEL if f"{c}-Linear/Grad_MatMul/" in scope), None)
            if op == "PrimFunc_MatMul" and linear and ", Bool(1), Bool(0))" in rest:
                read[linear] = rest.split(", ")[1]
        assert sorted(read) == sorted(COLUMN_PARALLEL)
        for x in read.values():
            if comm:
                op, rest, _ = backward_nodes[x]
                assert op == "AllGather" and "AllGather_recompute" in rest
            else:
                assert x.startswith("%para") and forward_nodes[x.split("_", 1)[1]][0] == "AllGather"


def test_the_offloaded_layer_moves_the_planners_bytes(compiled):
    """offloaded_layer_bytes (+ a 2-byte attention scalar): with recompute.comm the split inputs move instead of
    the gathered ones, 2·s·b·h·(1 - 1/t) compute-dtype bytes fewer."""
    moved = {}
    for comm, (cfg, layout, _, _, moves) in compiled.items():
        assert {layer for where, _, layer in moves if where == "CPU"} == {OFFLOADED}
        moved[comm] = sum(size for where, size, _ in moves if where == "CPU")
        assert moved[comm] == planner.offloaded_layer_bytes(cfg, layout) + 2
    cfg = compiled[False][0]
    tokens, t = planner.local_tokens(cfg), cfg.parallel.model_parallel
    assert moved[False] - moved[True] == 2 * tokens * cfg.model.hidden_size * 2 * (1 - 1 / t)


def test_a_fully_recomputed_layer_keeps_what_the_planner_counts(compiled):
    """Its recomputed forward (called from the backward) takes the layer input and, without recompute.comm, the
    forward's two gathered inputs and the attention's reduce-scatter output, repeating no collective; with it,
    only the input, and it gathers both inputs and reduce-scatters the attention output again."""
    for comm, (cfg, _, _, graphs, _) in compiled.items():
        [(params, body)] = [g for name, g in layer_graphs(graphs, RECOMPUTED).items() if "▸" in name]
        taken = sum(nbytes(dtype, shape) for dtype, shape in TENSOR.findall(params))
        assert taken == planner._model_layer_activation_bytes(cfg, "full", True)
        ops = [op for key, (op, _, _) in nodes(body).items() if key[1:].isdigit()]
        assert (ops.count("AllGather"), ops.count("ReduceScatter")) == ((2, 1) if comm else (0, 0))


def test_compiled_traffic_grows_with_comm_by_what_the_planner_adds(compiled):
    (_, _, off, _, _), (_, _, on, _, _) = compiled[False], compiled[True]
    compiled, planned = (
        [report["planned"][key] for report in (off, on)]
        for key in ("compiled_comm_bytes_per_step", "comm_bytes_per_step")
    )
    assert compiled[1] > compiled[0] and compiled[1] - compiled[0] == pytest.approx(planned[1] - planned[0])


# 2D (2 x 4) and 3D (2 x 2 x 2) tensor parallel of the same twin, no sequence parallel (the stream is split over t
# already), at widths that tell h/x, h/t, T/z, f/y and f/t apart: what each kind of layer keeps is the planner's
# nd_tp_layer_bytes.
ND_TWIN = [
    *TWIN,
    "model.num_heads=8",
    "model.num_kv_heads=8",
    "model.ffn_hidden_size=192",
    "model.seq_length=128",
    "parallel.data_parallel=1",
    "parallel.model_parallel=8",
    "parallel.sequence_parallel=false",
    "recompute.comm=false",
]
SPLITS = {"2d": ["parallel.tp_x=2", "parallel.tp_y=4"], "3d": ["parallel.tp_x=2", "parallel.tp_y=2", "parallel.tp_z=2"]}
OUTPUT = re.compile(r"\n  (%\d+)\([^)]*\) = (\w+)\([^\n]*\n\s*: \([^\n]*?\) -> \(([^\n]*)\)")


@pytest.fixture(scope="module", params=sorted(SPLITS))
def compiled_nd(request, tmp_path_factory):
    sets = [*ND_TWIN, *SPLITS[request.param]]
    ir_dir = tmp_path_factory.mktemp(request.param)
    [report] = dryrun(LLAMA3_405B, *sets, ir_dir=ir_dir)
    ir = read_validate_ir(ir_dir / "rank0")
    return load_config(LLAMA3_405B, sets), report, subgraphs(ir), moves_of(ir)


def test_a_2d_or_3d_layer_keeps_what_the_planner_counts(compiled_nd):
    """The kept layer's forward hands its backward (the Partial's arguments) its weights' compute-dtype copies (3D:
    gathered over z, t/z of each), its norm weights, and what the planner counts: the norms' fp32 inputs and
    outputs, the inputs all-gathered over y (h/x) and over x (the attention's and SwiGLU's products, /y), Q, K, V,
    the gate, up and SiLU(gate) split over t, the attention's output and statistics, and a 2-byte attention scalar.
    A fully recomputed layer's forward takes its input and the collective outputs it reads instead of
    communicating; the offloaded layer moves all that the planner says it does."""
    cfg, report, graphs, moves = compiled_nd
    layout = Layout.of(cfg, "Ascend")
    assert report["planned"]["shape_mismatches"] == {} and layout.nd_tp
    [forward] = [body for _, body in layer_graphs(graphs, KEPT).values() if "= Partial(@" in body]
    args = re.search(r"= Partial\(@\S+?, ([^)]*)\)", forward).group(1).split(", ")
    outputs = {name: (op, out) for name, op, out in OUTPUT.findall(forward)}
    kept = sum(
        sum(nbytes(dtype, shape) for dtype, shape in TENSOR.findall(out))
        for op, out in (outputs[a] for a in args if a in outputs)
        if op not in ("TensorMove", "Load")  # the norm weights
    )
    weights = flops.layer_matmul_params(cfg.model) / (layout.tp_x * layout.tp_y) * 2  # bf16
    assert kept == planner._model_layer_activation_bytes(cfg, "none", True) + 2 + weights
    [(params, _)] = [g for name, g in layer_graphs(graphs, RECOMPUTED).items() if "▸" in name]
    taken = sum(nbytes(dtype, shape) for dtype, shape in TENSOR.findall(params))
    assert taken == planner._model_layer_activation_bytes(cfg, "full", True)
    moved = sum(size for where, _, size, layer in moves if where == "CPU" and layer == OFFLOADED)
    assert moved == planner.offloaded_layer_bytes(cfg) + 2
