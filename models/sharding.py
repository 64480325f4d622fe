"""Per-model tensor-parallel plans as data, and the one function that applies them.

A plan maps cell paths (`*` = one path component, e.g. a layer index) to a parallel style, like
torchtitan's `parallelize_plan`:

    colwise    output features split over model_parallel (wq/wk/wv, w1/w3; and the per-head or
               per-feature ops that consume those outputs: rotary, attention core, activations)
    rowwise    input features split, partial sums reduced (wo, w2); under sequence parallel the
               reduction is a reduce-scatter along tokens (out_strategy)
    vocab      vocabulary split over model_parallel (token embedding, output head), unless
               parallel.vocab_emb_dp keeps them data-parallel; the loss reduces over the
               vocabulary split over model_parallel either way (models.transformer.ShardedCrossEntropy)
    sequence   tokens split over data x model parallel when parallel.sequence_parallel (norms,
               residual adds), data-parallel otherwise
    replicate  data-parallel only (position table)

`apply_sharding_plan` turns styles into `.shard()` strategies for the layout's data/model parallel
degrees, sets `pipeline_stage` per cell (mindscale.config.layout: stage_offset) and a gradient `comm_fusion`
group per layer. It does so only for sharded layouts (semi-auto parallel); stand-alone and
data-parallel runs (CPU) compile no strategies, so their numbers are unchanged.
Activations are [tokens, features] between layers, so "dp" below splits tokens (batch x seq).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from operator import attrgetter

from mindspore.nn.utils import no_init_parameters

from models.attention import CompositeAttention, FlashAttention
from models.lora import LoraLinear
from models.layers import (Embedding, FusedRMSNorm, GeluMLP, LayerNorm, Linear, OutputHead, RMSNorm,
                           RotaryEmbedding, SwiGLU)
from models.transformer import CausalLM, ShardedCrossEntropy, TransformerBlock
from mindscale.config import Config
from mindscale.config import Layout

COLWISE, ROWWISE, VOCAB, SEQUENCE, REPLICATE = "colwise", "rowwise", "vocab", "sequence", "replicate"

LLAMA_PLAN = {
    "tok_embeddings": VOCAB,
    "layers.*": SEQUENCE,
    "layers.*.attention_norm": SEQUENCE,
    "layers.*.attention.wq": COLWISE,
    "layers.*.attention.wk": COLWISE,
    "layers.*.attention.wv": COLWISE,
    "layers.*.attention.rotary": COLWISE,
    "layers.*.attention.core": COLWISE,
    "layers.*.attention.wo": ROWWISE,
    "layers.*.ffn_norm": SEQUENCE,
    "layers.*.feed_forward": COLWISE,
    "layers.*.feed_forward.w1": COLWISE,
    "layers.*.feed_forward.w3": COLWISE,
    "layers.*.feed_forward.w2": ROWWISE,
    "norm": SEQUENCE,
    "output": VOCAB,
    "loss": VOCAB,
}

GPT_PLAN = {
    "": REPLICATE,  # the position add
    "tok_embeddings": VOCAB,
    "pos_embeddings": REPLICATE,
    "layers.*": SEQUENCE,
    "layers.*.attention_norm": SEQUENCE,
    "layers.*.attention.wq": COLWISE,
    "layers.*.attention.wk": COLWISE,
    "layers.*.attention.wv": COLWISE,
    "layers.*.attention.core": COLWISE,
    "layers.*.attention.wo": ROWWISE,
    "layers.*.ffn_norm": SEQUENCE,
    "layers.*.feed_forward": COLWISE,
    "layers.*.feed_forward.w1": COLWISE,
    "layers.*.feed_forward.w2": ROWWISE,
    "norm": SEQUENCE,
    "output": VOCAB,
    "loss": VOCAB,
}

PLANS = {"llama": LLAMA_PLAN, "gpt": GPT_PLAN}


@dataclass(frozen=True)
class Mesh:
    dp: int
    mp: int
    sequence_parallel: bool
    vocab_emb_dp: bool

    @classmethod
    def of(cls, layout: Layout) -> "Mesh":
        return cls(layout.dp, layout.mp, layout.sequence_parallel, not layout.vocab_parallel)

    def tokens(self, style: str) -> int:
        """How the token dimension is split for a `sequence` / other style."""
        return self.dp * self.mp if style == SEQUENCE and self.sequence_parallel else self.dp


# ---------------------------------------------------------------------------------------------
# Style -> strategies, per layer type. Each returns {primitive attribute: (in_strategy, out_strategy)}.


def _linear(cell: Linear, style: str, mesh: Mesh) -> dict:
    dp, mp = mesh.dp, mesh.mp
    if style == COLWISE:
        rules = {"matmul": (((dp, 1), (mp, 1)), None), "bias_add": (((dp, mp), (mp,)), None)}
    elif style == ROWWISE:
        scatter = ((dp * mp, 1),) if mesh.sequence_parallel else None
        tokens = mesh.tokens(SEQUENCE)
        rules = {"matmul": (((dp, mp), (1, mp)), scatter), "bias_add": (((tokens, 1), (1,)), None)}
    else:
        rules = {"matmul": (((dp, 1), (1, 1)), None), "bias_add": (((dp, 1), (1,)), None)}
    if cell.bias is None:
        del rules["bias_add"]
    return rules


def _lora_linear(cell: LoraLinear, style: str, mesh: Mesh) -> dict:
    """The wrapped Linear's strategies (as `base.*`), and adapters that follow its split: A reads the
    input as the base matmul does (whole for colwise, split over its features for rowwise, partial
    sums reduced); B writes the output as the base does (features split for colwise, whole for rowwise),
    so the low-rank update adds to the base output without a redistribution."""
    dp, mp = mesh.dp, mesh.mp
    rules = {f"base.{attr}": strategy for attr, strategy in _linear(cell.base, style, mesh).items()}
    if style == COLWISE:
        a, b, out = ((dp, 1), (1, 1)), ((dp, 1), (mp, 1)), (dp, mp)
    elif style == ROWWISE:
        a, b, out = ((dp, mp), (1, mp)), ((dp, 1), (1, 1)), (mesh.tokens(SEQUENCE), 1)
    else:
        a, b, out = ((dp, 1), (1, 1)), ((dp, 1), (1, 1)), (dp, 1)
    rules.update({"matmul_a": (a, None), "matmul_b": (b, None), "scale_mul": ((out, ()), None),
                  "lora_add": ((out, out), None)})
    return rules


def _embedding(cell: Embedding, style: str, mesh: Mesh) -> dict:
    if style == VOCAB:
        rows = 1 if mesh.vocab_emb_dp else mesh.mp
        return {"gather": (((rows, 1), (mesh.dp, 1)), None)}
    return {"gather": (((1, 1), (1,)), None)}  # the position table, indexed by [S] positions


def _output_head(cell: OutputHead, style: str, mesh: Mesh) -> dict:
    rows = mesh.mp if style == VOCAB and not mesh.vocab_emb_dp else 1
    return {"matmul": (((mesh.dp, 1), (rows, 1)), None)}


def _rms_norm(cell: RMSNorm, style: str, mesh: Mesh) -> dict:
    x = (mesh.tokens(style), 1)
    return {"square": ((x,), None), "mean": ((x,), None), "add": ((x, ()), None), "rsqrt": ((x,), None),
            "mul": ((x, x), None), "mul_weight": ((x, (1,)), None)}


def _fused_rms_norm(cell: FusedRMSNorm, style: str, mesh: Mesh) -> dict:
    return {"norm": (((mesh.tokens(style), 1), (1,)), None)}


def _layer_norm(cell: LayerNorm, style: str, mesh: Mesh) -> dict:
    return {"norm": (((mesh.tokens(style), 1), (1,), (1,)), None)}


def _block(cell: TransformerBlock, style: str, mesh: Mesh) -> dict:
    x = (mesh.tokens(style), 1)
    return {"attention_residual": ((x, x), None), "ffn_residual": ((x, x), None)}


def _rotary(cell: RotaryEmbedding, style: str, mesh: Mesh) -> dict:
    heads = (mesh.dp, 1, mesh.mp, 1)  # [B, S, heads, d]
    return {"slice_low": ((heads,), None), "slice_high": ((heads,), None), "concat": ((heads, heads), None),
            "mul_cos": ((heads, (1, 1, 1)), None), "mul_sin": ((heads, (1, 1, 1)), None),
            "add": ((heads, heads), None)}


def _composite_attention(cell: CompositeAttention, style: str, mesh: Mesh) -> dict:
    dp, mp = mesh.dp, mesh.mp
    bsnd = (dp, 1, mp, 1)    # [B, S, heads, d]
    heads = (dp, mp, 1, 1)   # [B, kv_heads, group * S, d] and [B, heads, S, d]
    grouped = (dp, mp, 1, 1, 1)  # [B, kv_heads, group, S, S]
    return {"future": (((1, 1), (1, 1)), None), "mask_scale": (((1, 1), ()), None),
            "scale_q": ((bsnd, ()), None), "transpose_q": ((bsnd,), None), "transpose_k": ((bsnd,), None),
            "transpose_v": ((bsnd,), None), "bmm_qk": ((heads, heads), None),
            "mask_add": ((grouped, (1, 1)), None), "softmax": ((grouped,), None),
            "other_segment": (((dp, 1, 1, 1, 1), (dp, 1, 1, 1, 1)), None), "segment_cast": ((((dp, 1, 1, 1, 1),)), None),
            "segment_scale": (((dp, 1, 1, 1, 1), ()), None), "segment_add": ((grouped, (dp, 1, 1, 1, 1)), None),
            "bmm_pv": ((heads, heads), None), "transpose_out": ((heads,), None)}


def _flash_attention(cell: FlashAttention, style: str, mesh: Mesh) -> dict:
    bsh = (mesh.dp, 1, mesh.mp)  # BSH layout, heads inside H
    return {"flash": ((bsh, bsh, bsh, (1, 1)), None)}


def _swiglu(cell: SwiGLU, style: str, mesh: Mesh) -> dict:
    x = (mesh.dp, mesh.mp)
    return {"act": ((x,), None), "gate_mul": ((x, x), None)}


def _gelu_mlp(cell: GeluMLP, style: str, mesh: Mesh) -> dict:
    return {"act": (((mesh.dp, mesh.mp),), None)}


def _loss(cell: ShardedCrossEntropy, style: str, mesh: Mesh) -> dict:
    """[N, V] ops split the vocabulary over model_parallel; the token sums reduce over data parallel."""
    split, rows = (mesh.dp, mesh.mp), (mesh.dp, 1)
    return {"row_max": ((split,), None), "shift": ((split, rows), None), "exp": ((split,), None),
            "sum_exp": ((split,), None), "log": ((rows,), None), "one_hot": ((split, (), ()), None),
            "pick": ((split, split), None), "sum_picked": ((split,), None), "token_ce": ((rows, rows), None),
            "apply_mask": ((rows, rows), None), "sum_loss": ((rows,), None), "sum_mask": ((rows,), None)}


def _root(cell: CausalLM, style: str, mesh: Mesh) -> dict:
    return {"pos_add": (((mesh.dp, 1, 1), (1, 1)), None)} if cell.pos_embeddings is not None else {}


RULES = {Linear: _linear, LoraLinear: _lora_linear, Embedding: _embedding, OutputHead: _output_head, RMSNorm: _rms_norm,
         FusedRMSNorm: _fused_rms_norm, LayerNorm: _layer_norm, TransformerBlock: _block,
         RotaryEmbedding: _rotary, CompositeAttention: _composite_attention, FlashAttention: _flash_attention,
         SwiGLU: _swiglu, GeluMLP: _gelu_mlp, ShardedCrossEntropy: _loss, CausalLM: _root}


def _pattern(path: str) -> re.Pattern:
    return re.compile("^" + re.escape(path).replace(r"\*", r"[^.]+") + "$")


def planned_strategies(model: CausalLM, cfg: Config, layout: Layout) -> list[tuple[str, str, str, tuple, tuple | None]]:
    """(cell path, style, primitive attribute, in_strategy, out_strategy) for every planned op."""
    mesh = Mesh.of(layout)
    plan = [(_pattern(path), style) for path, style in PLANS[cfg.model.arch].items()]
    rows = []
    for path, cell in model.cells_and_names():
        style = next((s for p, s in plan if p.match(path)), None)
        if style is None:
            continue
        rule = next((RULES[kind] for kind in type(cell).__mro__ if kind in RULES), None)  # a subclass: its base's
        if rule is None:
            raise TypeError(f"{path} is a {type(cell).__name__}, which the {style} style has no strategies for: "
                            "build the model with the layout the plan is applied for")
        for attr, (in_strategy, out_strategy) in rule(cell, style, mesh).items():
            rows.append((path, style, attr, in_strategy, out_strategy))
    return rows


# The primitive input each parameter of a layer feeds: the plan's strategy for that input is how the
# parameter itself is split (MindSpore slices a parameter as the op that reads it is sharded).
PARAMETER_INPUTS = {Linear: {"weight": ("matmul", 1), "bias": ("bias_add", 1)},
                    LoraLinear: {"lora_a": ("matmul_a", 1), "lora_b": ("matmul_b", 1)},
                    Embedding: {"weight": ("gather", 0)}, OutputHead: {"weight": ("matmul", 1)},
                    RMSNorm: {"weight": ("mul_weight", 1)}, FusedRMSNorm: {"weight": ("norm", 1)},
                    LayerNorm: {"weight": ("norm", 1), "bias": ("norm", 2)}}


def parameter_splits(model: CausalLM, cfg: Config, layout: Layout) -> dict[str, tuple[tuple, str]]:
    """Parameter name -> (into how many parts the plan splits each of its dimensions (all 1 when the
    layout is not sharded), the primitive attribute that reads it). The planner sizes every rank's
    slices from this; tests check it against the shapes MindSpore's compiler gives them."""
    rows = planned_strategies(model, cfg, layout) if layout.sharded else []
    strategies = {f"{path}.{attr}" if path else attr: in_strategy for path, _s, attr, in_strategy, _o in rows}
    splits = {}
    for path, cell in model.cells_and_names():
        inputs = next((PARAMETER_INPUTS[kind] for kind in type(cell).__mro__ if kind in PARAMETER_INPUTS), {})
        for leaf, (attr, index) in inputs.items():
            param = getattr(cell, leaf, None)
            if param is None:  # a tied head, a Linear without bias
                continue
            strategy = strategies.get(f"{path}.{attr}")
            splits[param.name] = (tuple(strategy[index]) if strategy else (1,) * len(param.shape), attr)
    return splits


def _comm_fusion_group(name: str, num_layers: int) -> int:
    """Gradient all-reduce fusion group: 1 = embeddings, 2 + i = layer i, num_layers + 2 = the head."""
    if name.startswith("layers."):
        return 2 + int(name.split(".")[1])
    return 1 if name.startswith(("tok_embeddings", "pos_embeddings")) else num_layers + 2


def apply_sharding_plan(model: CausalLM, cfg: Config, layout: Layout) -> list[tuple]:
    """Apply the model's plan for a sharded layout; a no-op (returns []) otherwise."""
    if not layout.sharded:
        return []
    rows = planned_strategies(model, cfg, layout)
    cells = dict(model.cells_and_names())
    for path, _style, attr, in_strategy, out_strategy in rows:
        primitive = attrgetter(attr)(cells[path])
        if out_strategy is None:
            primitive.shard(in_strategy)
        else:
            primitive.shard(in_strategy=in_strategy, out_strategy=out_strategy)
    if layout.pp > 1:
        for path in ("tok_embeddings", "pos_embeddings", "norm", "output", "loss"):
            if getattr(model, path, None) is not None:
                getattr(model, path).pipeline_stage = layout.stage_of(path)
        for i, layer in enumerate(model.layers):
            layer.pipeline_stage = layout.stages_of_layers[i]
    for param in model.get_parameters():
        param.comm_fusion = _comm_fusion_group(param.name, cfg.model.num_layers)
    return rows


def _fmt(strategy) -> str:
    return "-" if strategy is None else str(strategy).replace(" ", "")


def describe_plan(cfg: Config) -> str:
    """The plan a run of `cfg` on its hardware compiles, as a table: cell, style, op, in_strategy,
    out_strategy, pipeline stage(s). Every layer shares one plan, so layers are shown once as
    `layers.*` with their stage range."""
    layout = Layout.of(cfg)
    p = cfg.parallel
    header = (f"sharding plan: {cfg.model.arch}, data_parallel={p.data_parallel} model_parallel={p.model_parallel} "
              f"pipeline_stage={p.pipeline_stage} sequence_parallel={p.sequence_parallel} "
              f"vocab_emb_dp={p.vocab_emb_dp}")
    if not layout.sharded:
        return header + "\n(not sharded: stand-alone or data-parallel, no strategies are compiled)"
    one_layer = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=1))
    with no_init_parameters():
        model = CausalLM(one_layer, dataclasses.replace(layout, stages_of_layers=(0,), recomputed=(), graph_reuse="none"))
    table = [("cell", "style", "op", "in_strategy", "out_strategy", "stage")]
    stages = layout.stages_of_layers
    layer_stage_range = f"{stages[0]}-{stages[-1]}" if stages[0] != stages[-1] else str(stages[0])
    for path, style, attr, in_strategy, out_strategy in planned_strategies(model, cfg, layout):
        shown = re.sub(r"^layers\.0(?=\.|$)", "layers.*", path) or "(model)"
        stage = layer_stage_range if path.startswith("layers.") else str(layout.stage_of(path))
        table.append((shown, style, attr, _fmt(in_strategy), _fmt(out_strategy), stage))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [header] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    first = 0
    for stage, n in enumerate(layout.layers_per_stage):
        lines.append(f"stage {stage}: layers {first}-{first + n - 1} ({n})")
        first += n
    lines.append("comm_fusion: 1 = embeddings, 2+i = layer i, "
                 f"{cfg.model.num_layers + 2} = final norm and output")
    return "\n".join(lines)
