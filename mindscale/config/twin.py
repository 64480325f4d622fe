"""A config's scaled twin: the overrides that make its sharded step cheap to compile and keep what it compiles.

A dry-run compile allocates nothing (the graph is built under no_init_parameters), so tensor sizes cost it next
to nothing; what it pays for is the graph: every layer of the model (each rank parses them all before the
pipeline pass cuts its stage out), every micro batch, every interleaved chunk. A twin therefore keeps the
config's widths (hidden, heads, MLP, vocabulary, experts, MLA ranks), and with them every parameter's shape,
its sharding plan and MindSpore's optimizer shard of it (parameters of at least OPTIMIZER_SHARD_MIN_KIB whose
first dimension divides over the ranks holding the slice: the same ones as at full size), and its every key
and degree, and shrinks only:

* the layers: per pipeline stage, one layer for each run of like layers the stage holds (recomputed, offloaded,
  or kept; with dense first layers, dense or with experts), so each stage still recomputes, offloads and keeps
  layers where it does at full size; only kept layers beside offloaded ones of their kind get no layer of
  their own (they compile alike but for the offload's copies: gpt_1t's twin would hold 128 layers, not 64);
* interleaving to at most 2 chunks per stage, and no more layers a stage than that needs;
* the micro batches: as many as stages, at most 2 accumulation steps;
* the sequence to 64 tokens (2 a rank of each context-parallel and sequence-parallel split at least), on which
  only activations' shapes depend, and GPT's learned positions (the tests check that they shard as at full size).

tests/dryrun compiles every shipped config's twin (and tests/unit/test_twin.py checks what it keeps);
`tools/dryrun.py --twin` compiles a config's twin for a user (docs/dryrun.md).
"""

from __future__ import annotations

from mindscale.config.layout import Layout
from mindscale.config.schema import Config

TWIN_SEQ_LENGTH = 64
TWIN_INTERLEAVE = 2  # chunks a stage at most: p x v layers at a shipped v of 6-8 would multiply the compile


def layer_role(layout: Layout, layer: int) -> str:
    """What a layer does with its activations: recomputed, offloaded (to host memory) or kept."""
    return "recomputed" if layer in layout.recomputed else "offloaded" if layer in layout.offloaded else "kept"


def stage_runs(cfg: Config, layout: Layout, stage: int) -> list[tuple[str, bool]]:
    """(role, dense) of each run of like layers on `stage`, in the stage's order (layer_role; dense: a dense
    first layer of a mixture of experts)."""
    runs = []
    for layer in layout.layers_of_stage(stage):
        kind = (layer_role(layout, layer), cfg.model.spec.moe and layer < cfg.model.moe.dense_layers)
        if not runs or runs[-1] != kind:
            runs.append(kind)
    return runs


def twin_stage(runs: list[tuple[str, bool]], least: int, multiple: int) -> list[tuple[str, bool]]:
    """A twin stage's layers: one per run, but none for kept layers beside offloaded ones of their kind (the two
    compile alike but for the offload's copies), then kept layers of the last kind up to at least `least` layers
    and a multiple of `multiple`."""
    layers = [(role, dense) for role, dense in runs if role != "kept" or ("offloaded", dense) not in runs]
    while len(layers) < least or len(layers) % multiple:
        layers.append(("kept", layers[-1][1]))
    return layers


def twin_overrides(cfg: Config) -> list[str]:
    """The --set overrides that turn `cfg` into its twin (module docstring)."""
    layout = Layout.of(cfg, "Ascend")
    p, pp = cfg.parallel, layout.pp
    chunks = min(p.pipeline_interleave, TWIN_INTERLEAVE)
    # without a pipeline 2 layers: a layer's reused graph (lazy_inline) is called twice
    stages = [twin_stage(stage_runs(cfg, layout, s), chunks if pp > 1 else 2, chunks) for s in range(pp)]
    num_layers = sum(map(len, stages))
    split = 2 * p.context_parallel * (p.model_parallel if p.sequence_parallel else 1)
    seq = min(cfg.model.seq_length, max(TWIN_SEQ_LENGTH, split))
    out = [
        f"model.num_layers={num_layers}",
        f"model.seq_length={seq}",
        "train.global_batch_size=null",
        f"parallel.micro_batch_num={pp if pp > 1 else 1}",
        f"parallel.gradient_accumulation_steps={min(p.gradient_accumulation_steps, 2)}",
        f"parallel.pipeline_interleave={chunks}",
        f"parallel.stage_offset={_list([len(s) - num_layers // pp for s in stages]) if pp > 1 else 0}",
    ]
    if cfg.recompute.mode != "none":
        out.append(f"recompute.layers={_list([sum(r == 'recomputed' for r, _ in s) for s in stages])}")
    if layout.offloaded:
        out.append(f"offload.layers={_list([sum(r == 'offloaded' for r, _ in s) for s in stages])}")
    if cfg.model.spec.moe and cfg.model.moe.dense_layers:  # dense first layers: the twin's leading dense ones
        dense = [d for _, d in model_order(stages, chunks)]
        out.append(f"model.moe.dense_layers={dense.index(False) if False in dense else len(dense)}")
    return out


def model_order(stages: list[list], chunks: int) -> list:
    """The layers of `stages` (each in its stage's order) in the model's order: chunk 0 of every stage, then
    chunk 1 (Layout's round-robin), each stage's layers split evenly over its chunks."""
    return [
        layer
        for c in range(chunks)
        for stage in stages
        for layer in stage[c * len(stage) // chunks : (c + 1) * len(stage) // chunks]
    ]


def _list(values: list[int]) -> str:
    return f"[{','.join(map(str, values))}]"
