"""Auxiliary-loss-free balancing compiled by MindSpore's dry run (tools/dryrun.py): configs/tiny/deepseek_v3_tiny.yaml
with bias_update_rate 0.001, sharded as on Ascend (expert parallel 2, tensor and sequence parallel 2, the optimizer
shard), in two layouts: dp 4 with 2 micro batches accumulated, and dp 2 over 2 pipeline stages of 2 layers with 2
micro batches, packed inputs and a multi-token-prediction module (on the last stage). Their first and last rank
(both tensor-parallel indices; under the pipeline, one of each stage), compiled once a layout, their IR read.

What each rank's compiled graph must show, for exactly the expert layers of its stage (all of them without a
pipeline; layer 0 is dense; the module's block with the last stage): every micro batch, each layer's token counts reach its counter through an AllReduce
(sum) of the [E] counts over the ranks that split the tokens: the data-parallel ranks of the rank's stage and
tensor-parallel index (an expert-parallel group is a subset of them; the tensor-parallel ranks route the same
tokens, so they are not in it); the step assigns each bias whole, [E] on the rank, the value chosen by a Select
whose condition is the step's overflow test on the global gradient norm (all-reduced across stages under the
pipeline, so every stage skips the same steps); and no other layer's bias or counter is a parameter of the rank.
Under the pipeline also: the module's parameters on the last stage only, with the copy of the embedding its
lookup reads, each slice and byte as the planner's."""

import re

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from tests.dryrun.test_dryrun import dryrun

DEEPSEEK_V3_TINY = REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml"
SHARDED = [
    "hardware=ascend910b",
    "model.seq_length=64",
    "model.vocab_size=256",
    "model.moe.bias_update_rate=0.001",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.model_parallel=2",
    "parallel.expert_parallel=2",
    "parallel.sequence_parallel=true",
    "parallel.optimizer_shard=true",
]
LAYOUTS = {
    "accumulated": [
        *SHARDED,
        "model.num_layers=3",
        "parallel.data_parallel=4",
        "parallel.gradient_accumulation_steps=2",
    ],
    "pipeline": [
        *SHARDED,
        "model.num_layers=4",
        "parallel.data_parallel=2",
        "parallel.pipeline_stage=2",
        "parallel.micro_batch_num=2",
        "model.mtp_depth=1",
    ],
}
SHAPES = {"accumulated": (4, 2, 2, 1, 2), "pipeline": (2, 2, 2, 2, 2)}  # dp, tp, ep, pp, micro batches
_NODE = re.compile(r"^\s+(%\d+)\(\S+\) = (\S+?)\((.*)$")
BIAS = r"(?:layers|mtp)\.[\w.]+?\.routing\.router_bias"  # layers.3.feed_forward..., mtp.0.block.feed_forward...
_COUNTER_ADD = re.compile(rf"PrimFunc_AssignAdd\(%para\d+_▸?expert_load\.({BIAS}), (%\d+),")
_BIAS_ASSIGN = re.compile(rf"PrimFunc_Assign\(%para\d+_({BIAS}), (%\d+),")
_BIAS_PARAMETER = re.compile(rf"^%para\d+_((?:expert_load\.)?{BIAS}):", re.M)


def subgraph_nodes(text: str):
    """Per subgraph (node ids are numbered per subgraph), {id: (op, rest of the line, the next line: its
    types)}, yielded with each line of that subgraph seen so far."""
    lines, graph = text.splitlines(), {}
    for i, line in enumerate(lines):
        if line.startswith("subgraph @"):
            graph = {}
        match = _NODE.match(line)
        if match:
            graph[match.group(1)] = (match.group(2), match.group(3), lines[i + 1] if i + 1 < len(lines) else "")
        yield graph, line


def counter_inputs(text: str) -> list[tuple[str, tuple[str, str, str]]]:
    """(bias, (op, attributes, types)) of what each bias's counter's AssignAdd adds."""
    found = []
    for graph, line in subgraph_nodes(text):
        add = _COUNTER_ADD.search(line)
        if add:
            found.append((add.group(1), graph[add.group(2)]))
    return found


def ancestors(graph: dict, node: str) -> set[str]:
    """The ops (with their instance names) `node` is computed from within its subgraph, itself included."""
    seen, todo, found = set(), [node], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in graph:
            continue
        seen.add(current)
        op, rest, _ = graph[current]
        name = re.search(r"\{instance name: (\w+)\}", rest)
        found.add(op if name is None else f"{op}:{name.group(1)}")
        todo.extend(re.findall(r"%\d+\b", rest))
    return found


def bias_updates(text: str) -> dict[str, set[str]]:
    """{bias: what the skip condition of its Assign is computed from}: each Assign must write a Select."""
    found = {}
    for graph, line in subgraph_nodes(text):
        assign = _BIAS_ASSIGN.search(line)
        if assign:
            op, rest, _ = graph[assign.group(2)]
            assert op == "PrimFunc_Select", (op, rest[:200])
            found[assign.group(1)] = ancestors(graph, re.match(r"(%\d+)", rest).group(1))
    return found


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def compiled(request, tmp_path_factory):
    """(name, config, layout, the first and last rank's reports, their IR folder), compiled once a layout (the
    pipeline's with packed inputs: segment_ids and a loss mask, which the module shifts)."""
    name = request.param
    cfg = load_config(DEEPSEEK_V3_TINY, LAYOUTS[name])
    layout = Layout.of(cfg, "Ascend")
    last = layout.stage_devices * layout.pp - 1
    ir_dir = tmp_path_factory.mktemp(name)
    reports = dryrun(DEEPSEEK_V3_TINY, *LAYOUTS[name], ranks=f"0,{last}", ir_dir=ir_dir, packed=name == "pipeline")
    assert [r["rank"] for r in reports] == [0, last]
    return name, cfg, layout, reports, ir_dir


def test_each_stage_counts_and_moves_its_own_biases(compiled):
    name, cfg, layout, reports, tmp_path = compiled
    model = cfg.model
    moe = model.moe
    assert (layout.dp, layout.tp, layout.ep, layout.pp, layout.micro_steps) == SHAPES[name]
    biases = [f"layers.{i}.feed_forward.routing.router_bias" for i in range(moe.dense_layers, model.num_layers)] + [
        f"mtp.{k}.block.feed_forward.routing.router_bias" for k in range(model.mtp_depth)
    ]
    seen_stages = set()
    for report in reports:
        rank = report["rank"]
        stage = layout.stage_of_rank(rank)
        seen_stages.add(stage)
        # pipeline: layers.1's on stage 0, layers.2's, layers.3's and the module's on stage 1; accumulated: all
        own = sorted(b for b in biases if layout.stage_of(b) == stage)
        text = read_validate_ir(tmp_path / f"rank{rank}")
        token_ranks = tuple(r for r in layout.stage_ranks(stage) if r % layout.tp == rank % layout.tp)
        counted = []
        for bias, (op, attrs, types) in counter_inputs(text):
            assert op == "AllReduce" and 'op: "sum"' in attrs, (op, attrs[:200])
            ranks = tuple(int(r) for r in re.search(r"group_rank_ids: \(([\d, ]+)\)", attrs).group(1).split(","))
            assert ranks == token_ranks and "(<Tensor[Float32], (8)>)" in types, (ranks, types)
            counted.append(bias)
        # each counted once in the micro-batch graph MindSpore calls for every micro batch
        assert sorted(counted) == own, (rank, counted)
        updates = bias_updates(text)
        assert sorted(updates) == own, (rank, sorted(updates))
        norm = {"PrimFunc_IsFinite", "AllReduce:PARALLEL_GLOBALNORM_IN_STAGES"}
        if layout.pp > 1:
            norm.add("AllReduce:PARALLEL_GLOBALNORM_BETWEEN_STAGES")
        for bias, condition in updates.items():
            assert norm <= condition, (rank, bias, sorted(condition))
        # no other stage's bias or counter: neither in the graph nor held by the rank
        mine = sorted(prefix + b for b in own for prefix in ("", "expert_load."))
        assert sorted(set(_BIAS_PARAMETER.findall(text))) == mine
        assert sorted(k for k in report["layouts"] if k.endswith("routing.router_bias")) == mine
        for bias in own:
            assert report["layouts"][bias][2] == [8]  # whole on the rank
    assert seen_stages == set(range(layout.pp))


@pytest.mark.parametrize("compiled", ["pipeline"], indirect=True)
def test_the_mtp_module_and_an_embedding_copy_compile_on_the_last_stage_as_planned(compiled):
    """The module's parameters on the last stage only, and there a copy of the token embedding its lookup reads
    (as for a tied head), each slice as the planner cuts it, and the bytes equal to the planner's."""
    _, _, layout, (first, last), _ = compiled
    assert (layout.stage_of_rank(first["rank"]), layout.stage_of_rank(last["rank"])) == (0, 1)
    for report in (first, last):
        assert report["planned"]["shape_mismatches"] == {}
        assert report["bytes"] == {k: report["planned"][k] for k in ("weights", "grads", "optimizer")}
    assert not any(name.startswith("mtp.") for name in first["local_shapes"])
    held = [name for name in last["local_shapes"] if name.startswith("mtp.0.")]
    assert {"mtp.0.enorm.weight", "mtp.0.eh_proj.weight", "mtp.0.block.feed_forward.experts.w1"} <= set(held)
    assert "tok_embeddings.weight" in first["local_shapes"] and "tok_embeddings.weight" in last["local_shapes"]
    # the projection [h, 2h] whole on every tensor-parallel rank, its stored slice cut by the optimizer shard
    assert last["layouts"]["mtp.0.eh_proj.weight"][2] == [128, 256]
