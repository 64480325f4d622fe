"""Auxiliary-loss-free balancing compiled by MindSpore's dry run (tools/dryrun.py): configs/tiny/deepseek_v3_tiny.yaml
sharded as on Ascend (dp 4 with expert parallel 2, tensor and sequence parallel 2, the optimizer shard, 2 micro
batches accumulated) with bias_update_rate 0.001, its first and last rank, its IR read.

What the compiled graph must show: every micro batch, each expert layer's token counts reach its counter
through an AllReduce (sum) of the [E] counts over the ranks that split the tokens: the 4 data-parallel ranks
of the rank's tensor-parallel index (an expert-parallel group is a subset of them; the tensor-parallel ranks
route the same tokens, so they are not in it); and the step assigns each bias whole, [E] on every rank.
Pipeline stages are refused with the update on (validate.py; docs/models.md says what their compile showed)."""

import re

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from tests.dryrun.test_dryrun import dryrun

DEEPSEEK_V3_TINY = REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml"
SHARDED = [
    "hardware=ascend910b",
    "model.num_layers=3",
    "model.seq_length=64",
    "model.vocab_size=256",
    "model.moe.bias_update_rate=0.001",
    "train.micro_batch_size=1",
    "train.global_batch_size=null",
    "parallel.data_parallel=4",
    "parallel.model_parallel=2",
    "parallel.expert_parallel=2",
    "parallel.sequence_parallel=true",
    "parallel.optimizer_shard=true",
    "parallel.gradient_accumulation_steps=2",
]
_NODE = re.compile(r"^\s+(%\d+)\(\S+\) = (\S+?)\((.*)$")
_COUNTER_ADD = re.compile(r"PrimFunc_AssignAdd\(%para\d+_▸?expert_load\.layers\.(\d+)\.[\w.]+, (%\d+),")
_BIAS_ASSIGN = re.compile(r"PrimFunc_Assign\(%para\d+_layers\.(\d+)\.feed_forward\.routing\.router_bias, ")


def counter_inputs(text: str) -> list[tuple[int, tuple[str, str, str]]]:
    """(layer, (op, attributes, types)) of what each counter's AssignAdd adds, found in its own subgraph (node
    ids are numbered per subgraph)."""
    lines, graph, found = text.splitlines(), {}, []
    for i, line in enumerate(lines):
        if line.startswith("subgraph @"):
            graph = {}
        match = _NODE.match(line)
        if match:
            graph[match.group(1)] = (match.group(2), match.group(3), lines[i + 1] if i + 1 < len(lines) else "")
        add = _COUNTER_ADD.search(line)
        if add:
            found.append((int(add.group(1)), graph[add.group(2)]))
    return found


def test_the_counts_are_all_reduced_over_the_ranks_that_split_the_tokens(tmp_path):
    layout = Layout.of(load_config(DEEPSEEK_V3_TINY, SHARDED), "Ascend")
    assert (layout.dp, layout.tp, layout.ep, layout.pp, layout.micro_steps) == (4, 2, 2, 1, 2)
    reports = dryrun(DEEPSEEK_V3_TINY, *SHARDED, ranks="0,7", ir_dir=tmp_path)  # both tensor-parallel indices
    assert [r["rank"] for r in reports] == [0, 7]
    for report in reports:
        rank = report["rank"]
        text = read_validate_ir(tmp_path / f"rank{rank}")
        token_ranks = tuple(r for r in range(8) if r % layout.tp == rank % layout.tp)  # (0, 2, 4, 6), (1, 3, 5, 7)
        counted = []
        for layer, (op, attrs, types) in counter_inputs(text):
            assert op == "AllReduce" and 'op: "sum"' in attrs, (op, attrs[:200])
            ranks = tuple(int(r) for r in re.search(r"group_rank_ids: \(([\d, ]+)\)", attrs).group(1).split(","))
            assert ranks == token_ranks and "(<Tensor[Float32], (8)>)" in types, (ranks, types)
            counted.append(layer)
        # layers 1 and 2 have experts (layer 0 is dense), each counted once in the micro-batch graph MindSpore
        # calls for both micro batches
        assert sorted(counted) == [1, 2]
        assert sorted(int(m.group(1)) for m in _BIAS_ASSIGN.finditer(text)) == [1, 2]
        assert report["layouts"]["layers.1.feed_forward.routing.router_bias"][2] == [8]  # whole on every rank
