"""Packed SFT data under flash attention, compiled by MindSpore's dry run and read from the saved validate IR.

One LLaMA twin (GQA, bf16, flash attention) on dp2 x tp2 x pp2 with sequence parallel, 2 micro batches of 2
rows per data-parallel rank, fed segment_ids (tools/dryrun.py --packed), compiled for rank 0 (first stage) and
rank 4 (last stage). What each rank's IR must show:

* every FlashAttentionScore in the TND layout (input_layout 4 in MindSpore's FASInputLayoutMode), causal per
  sequence (sparse_mode 3, next_tokens 0), on the rank's own tokens: q [2 rows x S, heads / tp, d], k and v
  [2 x S, kv heads / tp, d];
* actual_seq_qlen and actual_seq_kvlen one node, MindSpore's tuple of the rank's 2 x (data.max_packed_examples
  + 1) int64 ends, computed in the layer from segment_ids by FlashAttention.sequence_ends ([1, 2, S, slots] on
  the rank: its own rows, no rows gathered);
* no collective moves integer data (the ends and segment_ids stay on their rank), and the planner's weight,
  gradient and optimizer bytes equal the compiled ones.

The shipped SFT configs' twins compile packed in tests/dryrun/test_dryrun.py. A dry run proves compiler
acceptance only: not the kernel's handling of the ends, numerics, speed or memory
(tests/models/test_packed_flash_lengths.py executes the conversion and checks its mask on CPU).
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mindscale.config import REPO_ROOT, Layout, load_config
from mindscale.launch.compiled_ir import read_validate_ir
from test_context_parallel import ops_named
from test_dryrun import SMALL, TINY_LLAMA, dryrun
from tests import shared

TWIN = [
    *SMALL,
    "model.num_kv_heads=2",
    "model.compute_dtype=bfloat16",
    "train.micro_batch_size=2",
    "parallel.data_parallel=2",
    "parallel.model_parallel=2",
    "parallel.pipeline_stage=2",
    "parallel.micro_batch_num=2",
    "parallel.sequence_parallel=true",
]
TND, RIGHT_DOWN_CAUSAL = 4, 3
_COLLECTIVE = re.compile(r"= (?:PrimFunc_)?(AllGather|AllReduce|ReduceScatter|AlltoAll|Send|Receive)\(")


@pytest.fixture(scope="module")
def compiled():
    """(config, layout, [(report, validate IR)] of the first and the last stage), compiled once in the session
    (tests/shared.py: each test here is a work unit of its own, and may run in either xdist worker)."""

    def compile_and_read():
        with tempfile.TemporaryDirectory() as ir_dir:
            reports = dryrun(TINY_LLAMA, *TWIN, packed=True, ir_dir=Path(ir_dir))
            return [(r, read_validate_ir(Path(ir_dir) / f"rank{r['rank']}")) for r in reports]

    cfg = load_config(TINY_LLAMA, TWIN)
    return cfg, Layout.of(cfg, "Ascend"), shared.once(["packed flash IR", TWIN], compile_and_read)


def test_flash_attention_takes_each_ranks_tokens_in_the_tnd_layout(compiled):
    cfg, layout, ranks = compiled
    m = cfg.model
    tokens, slots = cfg.train.micro_batch_size * m.seq_length, layout.packed_examples + 1
    assert layout.attention == "flash" and layout.sp and [r["stage"] for r, _ in ranks] == [0, 1]
    for report, ir in ranks:
        flash = ops_named(ir, "FlashAttentionScore")
        assert len(flash) == layout.layers_per_stage[report["stage"]]  # one graph serves every micro batch
        for line, shapes in flash:
            assert "instance name: flash_packed" in line
            head_num, pre_tokens, next_tokens, *_, input_layout, sparse_mode = [
                int(x) for x in re.findall(r"I64\((-?\d+)\)", line.split("{", 1)[0])
            ]
            assert (input_layout, sparse_mode, pre_tokens, next_tokens) == (TND, RIGHT_DOWN_CAUSAL, 2**31 - 1, 0)
            assert head_num == m.num_heads // layout.tp
            assert (
                shapes[:3]
                == [(tokens, m.num_heads // layout.tp, m.head_size)]
                + [(tokens, m.kv_heads // layout.tp, m.head_size)] * 2
            )
            q_len, kv_len = re.search(r"None, (%[\w.]+), (%[\w.]+), I64", line).groups()
            assert q_len == kv_len  # actual_seq_qlen = actual_seq_kvlen: equal query and key lengths
            lengths = ir.splitlines()[ir.splitlines().index(line) + 1]
            assert re.findall(r"Tuple\[Int64\*(\d+)\]", lengths) == [str(cfg.train.micro_batch_size * slots)] * 2


def test_the_ends_are_computed_from_the_ranks_own_rows(compiled):
    cfg, layout, ranks = compiled
    for report, ir in ranks:
        rows, s, slots = cfg.train.micro_batch_size, cfg.model.seq_length, layout.packed_examples + 1
        in_slot = [shapes for line, shapes in ops_named(ir, "LessEqual") if "instance name: in_slot" in line]
        # segment_ids [1 block, 2 rows, S, 1] against the slots: this rank's rows only
        assert in_slot and all(shapes == [(1, rows, s, 1), (1, 1, 1, slots), (1, rows, s, slots)] for shapes in in_slot)
        segments = report["inputs"][2]  # tokens, loss_mask, segment_ids
        assert segments["gathered_over"] == [] and segments["rows"] * layout.dp == segments["global_rows"]
        lines = ir.splitlines()
        moved = [lines[i + 1] for i, line in enumerate(lines) if _COLLECTIVE.search(line)]
        assert moved and not [types for types in moved if "Int" in types.split("->")[0]]


def test_the_planner_bytes_equal_the_compiled_ones(compiled):
    _, _, ranks = compiled
    for report, _ in ranks:
        planned = report["planned"]
        assert planned["shape_mismatches"] == {}
        assert report["bytes"] == {k: planned[k] for k in ("weights", "grads", "optimizer")}


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["parallel.context_parallel=2", "train.micro_batch_size=1"],
            "packed SFT data (segment_ids) with parallel.context_parallel=2",
        ),
        (
            ["train.micro_batch_size=16"],
            "train.micro_batch_size=16 x (data.max_packed_examples=127 + 1) = 2048 sequences",
        ),
    ],
    ids=["context_parallel", "too_many_sequences"],
)
def test_packed_flash_the_kernel_cannot_take_is_one_line_and_exit_2(sets, needle):
    argv = ["--config", str(TINY_LLAMA), *[a for o in (*TWIN, *sets) for a in ("--set", o)], "--packed"]
    proc = subprocess.run(
        [sys.executable, "tools/dryrun.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
