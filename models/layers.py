"""Building blocks shared by GPT and LLaMA, written on MindSpore primitives.

Every operation that matters for sharding or recompute is a Primitive held as an attribute, and the
layer that holds it says, next to it, how it is split:

    shard_strategies(style, layout)  {primitive attribute: (in_strategy, out_strategy)} for a plan
                                     style (below) on the layout's dp/tp/sp mesh
    PARAMETER_INPUTS                 {parameter: (primitive attribute, input index)}: a parameter is
                                     split as the op that reads it
    SELECTIVE_RECOMPUTE              the primitives selective recompute recomputes (large outputs,
                                     cheap to recompute; Korthikanti et al. 2022)

The per-model plans (cell path -> style) are in models/archs/, and models/sharding.py applies them;
a strategy naming an attribute the layer does not have is an error there, and so is such a
recompute mark in models/transformer.py.

Tensors flow as 2-D [tokens, features] (tokens = batch x sequence) between layers: MatMul is 2-D
and a flat layout needs no reshapes around every projection. Only attention views them per head.
Dtypes: parameters are stored in `param_dtype` and read in `compute_dtype` (matmuls, lookups); the
residual stream is in `ModelConfig.residual_dtype` (the compute dtype unless Megatron's
`fp32_residual_connection`); norms, softmax and the loss compute in fp32.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, One, Zero, initializer
from mindspore.ops.auto_generate import SiLU
from mindspore.parallel import Layout as DeviceMesh

from models.spec import COLWISE, REPLICATE, ROWWISE, SEQUENCE, VOCAB

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def token_split(layout, style: str) -> int:
    """Into how many parts an op of `style` splits the token dimension of [B*S, h]: data x context parallel
    (Layout.token_rows), and tensor parallel too for the sequence style under sequence parallel."""
    return layout.token_rows * (layout.tp if style == SEQUENCE and layout.sp else 1)


def tp_mesh(layout) -> DeviceMesh:
    """2D tensor parallel's device mesh of one stage (Layout.nd_tp): token rows (dp x cp), then y, then x. The tp index
    of a rank is then y_index * tp_x + x_index, the order of every op's tuple strategy: a tensor split ("y", "x")
    is split over tp as such an op splits it, while ("x", "y") is the transposed order of the residual stream.
    3D (tp_z > 1): (rows, y, z, x), the tp index y_index * tp_z * tp_x + z_index * tp_x + x_index: y outermost, so
    that the heads the projections split over y are the outer blocks of the attention's head split over tp, and q, k,
    v reach it by gathers over x and z only (with z outside y they were gathered over all three)."""
    if layout.tp_z > 1:
        return DeviceMesh((layout.token_rows, layout.tp_y, layout.tp_z, layout.tp_x), ("rows", "y", "z", "x"))
    return DeviceMesh((layout.token_rows, layout.tp_y, layout.tp_x), ("rows", "y", "x"))


def stream_axes(layout) -> tuple:
    """(token axes, width axes) of the residual stream [tokens, h] under 2D/3D tensor parallel: 2D splits the width
    over ("x", "y"); 3D splits the tokens over z and y as well and the width over x only (MindSpore's 3D in_strategy
    of a MatMul's activation, (("z", "y"), "x"))."""
    if layout.tp_z > 1:
        return ("rows", "z", "y"), "x"
    return "rows", ("x", "y")


def stream_split(layout, style: str):
    """The strategy of a residual-stream tensor [tokens, h] for an op of `style`: tokens split (token_split), or
    for the sequence style under 2D/3D tensor parallel the split the row-parallel projections leave it in
    (stream_axes, Linear.nd_tp_strategies)."""
    if layout.nd_tp and style == SEQUENCE:
        return tp_mesh(layout)(*stream_axes(layout))
    return token_split(layout, style), 1


def inner_split(layout):
    """The strategy of a column-parallel projection's output [tokens, e] (the MLP's inside): (rows, tp), or under 3D
    tensor parallel the tokens split over z and x and e over y, as the 3D MatMul leaves it."""
    if layout.nd_tp and layout.tp_z > 1:
        return tp_mesh(layout)(("rows", "z", "x"), "y")
    return layout.token_rows, layout.tp


def head_split(layout) -> tuple:
    """The strategy of a per-head view [B, S, heads, d]: batch over dp, sequence over cp, heads over tp."""
    return layout.dp, layout.cp, layout.tp, 1


def param(shape: tuple, dtype, init) -> Parameter:
    """A lazily initialised parameter: under `no_init_parameters` no memory is allocated."""
    return Parameter(initializer(init, shape, dtype), name="weight")


class Linear(nn.Cell):
    """y = x W^T (+ b), W stored [out, in] as in PyTorch/Hugging Face checkpoints."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        std: float,
        param_dtype=ms.float32,
        compute_dtype=ms.float32,
    ):
        super().__init__()
        self.weight = param((out_features, in_features), param_dtype, Normal(std))
        self.bias = Parameter(initializer(Zero(), (out_features,), param_dtype), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.Add()
        self.cast = ops.Cast()
        self.compute_dtype = compute_dtype
        self.cast_weight = param_dtype != compute_dtype

    def construct(self, x):
        weight = self.cast(self.weight, self.compute_dtype) if self.cast_weight else self.weight
        y = self.matmul(x, weight)
        if self.bias is not None:
            y = self.bias_add(y, self.cast(self.bias, self.compute_dtype) if self.cast_weight else self.bias)
        return y

    PARAMETER_INPUTS = {"weight": ("matmul", 1), "bias": ("bias_add", 1)}

    def regather_input(self) -> None:
        """Regather this (column-parallel) matmul's sequence-parallel input: the backward all-gathers it again for the
        weight gradient instead of keeping the forward's gathered copy. MindSpore recomputes the all-gather its
        parallel pass inserts before an op marked `recompute_comm_op` (MindFormers' select_comm_recompute)."""
        self.matmul.add_prim_attr("recompute_comm_op", True)

    def shard_strategies(self, style: str, layout) -> dict:
        if layout.nd_tp and style in (COLWISE, ROWWISE):
            return self.nd_tp_strategies(style, layout)
        rows, tp = layout.token_rows, layout.tp
        if style == COLWISE:
            rules = {"matmul": (((rows, 1), (tp, 1)), None), "bias_add": (((rows, tp), (tp,)), None)}
        elif style == ROWWISE:
            scatter = ((rows * tp, 1),) if layout.sp else None
            rules = {
                "matmul": (((rows, tp), (1, tp)), scatter),
                "bias_add": (((token_split(layout, SEQUENCE), 1), (1,)), None),
            }
        else:
            rules = {"matmul": (((rows, 1), (1, 1)), None), "bias_add": (((rows, 1), (1,)), None)}
        if self.bias is None:
            del rules["bias_add"]
        return rules

    def nd_tp_strategies(self, style: str, layout) -> dict:
        """2D tensor parallel (MindSpore's high-dimension tensor parallel; models/sharding.py sets the MatMul's
        enable_nd_tp). Column-parallel: the input's width split over ("x", "y"), the weight's input features over x
        and its output features over y; MindSpore all-gathers the input over y, multiplies, and reduce-scatters
        the partial sums over x, leaving the output split ("y", "x"). Row-parallel is the same with x and y
        swapped, from ("y", "x") back to the residual stream's ("x", "y"). No all-reduce, and no weight is
        replicated over tp. 3D (tp_z > 1; MindSpore's 3D in_strategy): the input's tokens split over z and the inner
        degree and its width over the outer, the weight's input features over (outer, z); MindSpore all-gathers the
        input over the inner degree and the weight over z, multiplies, and reduce-scatters over the outer degree,
        leaving the tokens split over (z, outer) and the output features over the inner degree."""
        mesh = tp_mesh(layout)
        outer, inner = ("x", "y") if style == COLWISE else ("y", "x")
        if layout.tp_z > 1:  # 3D: tokens over z and the inner degree, the weight's input features over (outer, z)
            x, weight, out = (
                mesh(("rows", "z", inner), outer),
                mesh(inner, (outer, "z")),
                mesh(("rows", "z", outer), inner),
            )
            bias = mesh(inner)
        else:
            x, weight, out = mesh("rows", (outer, inner)), mesh(inner, outer), mesh("rows", (inner, outer))
            bias = mesh((inner, outer))
        rules = {"matmul": ((x, weight), None)}
        if self.bias is not None:
            rules["bias_add"] = ((out, bias), None)
        return rules


class Embedding(nn.Cell):
    """Token (or position) lookup table [num, dim]: read in `read_dtype` (the compute dtype, like every
    weight, so the rows a vocabulary-split lookup finds on each rank are summed across tensor parallel
    in it), rows returned in `out_dtype` (the residual stream's).

    Under sequence parallel Megatron reduce-scatters that sum along tokens. MindSpore 2.9's gather takes
    a reduce-scatter output strategy, but on [B, S] ids it splits the batch rows (fewer than dp x tp),
    and on [B*S, 1] ids the compiler lays the output out as the all-reduce's (the next reshape fails
    to infer); so the lookup all-reduces and the stream's first op takes its token slice
    (docs/dryrun.md#against-mindformers).
    """

    def __init__(
        self, num: int, dim: int, std: float, param_dtype=ms.float32, read_dtype=ms.float32, out_dtype=ms.float32
    ):
        super().__init__()
        self.weight = param((num, dim), param_dtype, Normal(std))
        self.gather = ops.Gather()
        self.cast = ops.Cast()
        self.read_dtype, self.out_dtype = read_dtype, out_dtype
        self.cast_table, self.cast_out = param_dtype != read_dtype, read_dtype != out_dtype

    def construct(self, ids):
        table = self.cast(self.weight, self.read_dtype) if self.cast_table else self.weight
        out = self.gather(table, ids, 0)
        return self.cast(out, self.out_dtype) if self.cast_out else out

    PARAMETER_INPUTS = {"weight": ("gather", 0)}

    def shard_strategies(self, style: str, layout) -> dict:
        if style == VOCAB:  # ids [B, S]: rows over dp, the sequence over cp
            return {"gather": (((layout.tp if layout.vocab_parallel else 1, 1), (layout.dp, layout.cp)), None)}
        return {"gather": (((1, 1), (layout.cp,)), None)}  # the position table, at the rank's [S/cp] positions


class OutputHead(nn.Cell):
    """Logits = h E^T with its own weight `output.weight`, or with the token embedding when tied.

    A tied head owns no parameter (MindSpore names a shared Parameter after its last owner, which
    would rename `tok_embeddings.weight`); the caller passes the embedding weight in.
    """

    def __init__(
        self, hidden: int, vocab: int, tied: bool, std: float, param_dtype=ms.float32, compute_dtype=ms.float32
    ):
        super().__init__()
        self.weight = None if tied else param((vocab, hidden), param_dtype, Normal(std))
        self.matmul = ops.MatMul(transpose_b=True)
        self.cast = ops.Cast()
        self.compute_dtype = compute_dtype
        self.cast_weight = param_dtype != compute_dtype

    def construct(self, h, tied_weight):
        weight = tied_weight if self.weight is None else self.weight
        if self.cast_weight:
            weight = self.cast(weight, self.compute_dtype)
        return self.matmul(h, weight)

    PARAMETER_INPUTS = {"weight": ("matmul", 1)}

    def shard_strategies(self, style: str, layout) -> dict:
        rows, vocab = layout.logit_split
        return {"matmul": (((rows, 1), (vocab, 1)), None)}


class Fp32Norm(nn.Cell):
    """A norm that computes in fp32 whatever the input's and the parameters' dtypes, and returns the
    compute dtype: the scale `weight` [dim], the casts in and out, shared by the three norms below."""

    def __init__(self, dim: int, param_dtype, compute_dtype):
        super().__init__()
        self.weight = Parameter(initializer(One(), (dim,), param_dtype), name="weight")
        self.cast = ops.Cast()
        self.compute_dtype = compute_dtype

    def fp32(self, x):
        """x in fp32 (a residual stream or a parameter in the compute dtype is cast)."""
        return x if x.dtype == ms.float32 else self.cast(x, ms.float32)

    def out(self, y):
        return y if self.compute_dtype == ms.float32 else self.cast(y, self.compute_dtype)


class RMSNorm(Fp32Norm):
    """x / sqrt(mean(x^2) + eps) * g (LLaMA)."""

    def __init__(self, dim: int, eps: float, param_dtype=ms.float32, compute_dtype=ms.float32):
        super().__init__(dim, param_dtype, compute_dtype)
        self.eps = eps
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.add = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.mul = ops.Mul()
        self.mul_weight = ops.Mul()

    def construct(self, x):
        x = self.fp32(x)
        return self.out(
            self.mul_weight(
                self.mul(x, self.rsqrt(self.add(self.mean(self.square(x), -1), self.eps))), self.fp32(self.weight)
            )
        )

    PARAMETER_INPUTS = {"weight": ("mul_weight", 1)}

    def split(self, style: str, layout) -> tuple:
        """The strategy of x [tokens, dim]."""
        return token_split(layout, style), 1

    def shard_strategies(self, style: str, layout) -> dict:
        x = self.split(style, layout)
        return {
            "square": ((x,), None),
            "mean": ((x,), None),
            "add": ((x, ()), None),
            "rsqrt": ((x,), None),
            "mul": ((x, x), None),
            "mul_weight": ((x, (1,)), None),
        }


class WidthSplitRMSNorm(RMSNorm):
    """RMSNorm of a residual stream split along its width over ("x", "y") (2D tensor parallel, Layout.nd_tp; under
    3D over x, its tokens over (z, y): stream_axes). The
    mean of squares is a MatMul with a 1/dim column, which MindSpore shards by a device-mesh layout and all-reduces
    over the ranks splitting the width ([tokens, 1]; all tp in 2D, x in 3D): its ReduceMean takes no such layout
    ("does not support config layout", MindSpore 2.9)."""

    def __init__(self, dim: int, eps: float, param_dtype=ms.float32, compute_dtype=ms.float32):
        super().__init__(dim, eps, param_dtype, compute_dtype)
        self.inverse_width = Tensor(np.full((dim, 1), 1.0 / dim), ms.float32)
        self.row_mean = ops.MatMul()

    def construct(self, x):
        x = self.fp32(x)
        mean = self.row_mean(self.square(x), self.inverse_width)
        return self.out(self.mul_weight(self.mul(x, self.rsqrt(self.add(mean, self.eps))), self.fp32(self.weight)))

    def shard_strategies(self, style: str, layout) -> dict:
        mesh = tp_mesh(layout)
        tokens, width = stream_axes(layout)
        x, per_token = stream_split(layout, SEQUENCE), mesh(tokens, "None")
        # 2D: per_token as a tuple strategy for the ops around the scalar. 3D splits the tokens over (z, y), against
        # the mesh's order (y, z), which no tuple strategy expresses: layouts, the scalar's empty (mesh())
        rows = (layout.token_rows, 1)
        return {
            "square": ((x,), None),
            "row_mean": ((x, mesh(width, "None")), None),
            "add": ((per_token, mesh()), None) if layout.tp_z > 1 else ((rows, ()), None),
            "rsqrt": ((per_token if layout.tp_z > 1 else rows,), None),
            "mul": ((x, per_token), None),
            "mul_weight": ((x, mesh(width)), None),
        }


class HeadRMSNorm(RMSNorm):
    """RMSNorm over head_dim of q or k [B, S, heads, head_dim] (Qwen3's q_norm and k_norm): the heads
    stay split over tp as the projection before it split them."""

    def split(self, style: str, layout) -> tuple:
        return head_split(layout)


class FusedRMSNorm(Fp32Norm):
    """The same RMSNorm as one RmsNorm kernel (Atlas A2 only; never executed on CPU here)."""

    def __init__(self, dim: int, eps: float, param_dtype=ms.float32, compute_dtype=ms.float32):
        super().__init__(dim, param_dtype, compute_dtype)
        self.norm = ops.RmsNorm(epsilon=eps)

    def construct(self, x):
        y, _ = self.norm(self.fp32(x), self.fp32(self.weight))
        return self.out(y)

    PARAMETER_INPUTS = {"weight": ("norm", 1)}

    def shard_strategies(self, style: str, layout) -> dict:
        return {"norm": (((token_split(layout, style), 1), (1,)), None)}


class LayerNorm(Fp32Norm):
    """LayerNorm with a bias (GPT)."""

    def __init__(self, dim: int, eps: float, param_dtype=ms.float32, compute_dtype=ms.float32):
        super().__init__(dim, param_dtype, compute_dtype)
        self.bias = Parameter(initializer(Zero(), (dim,), param_dtype), name="bias")
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)

    def construct(self, x):
        y, _, _ = self.norm(self.fp32(x), self.fp32(self.weight), self.fp32(self.bias))
        return self.out(y)

    PARAMETER_INPUTS = {"weight": ("norm", 1), "bias": ("norm", 2)}

    def shard_strategies(self, style: str, layout) -> dict:
        return {"norm": (((token_split(layout, style), 1), (1,), (1,)), None)}


def rope_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """RoPE's inverse frequencies theta^(-2i/d); with `scaling` = (factor, low_freq_factor,
    high_freq_factor, original_max_positions), LLaMA-3.1's rule as Hugging Face's rope_type "llama3"
    applies it: wavelengths longer than original / low_freq_factor are divided by factor, shorter
    than original / high_freq_factor kept, and the band between blended linearly in original/wavelength."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * np.pi / inv_freq
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


@lru_cache(maxsize=4)
def rotary_tables(
    seq_length: int, head_dim: int, theta: float, scaling: tuple | None = None, dtype=ms.float32
) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin tables [seq, 1, head_dim] for the rotate-half convention, built once
    and shared by every layer (graph constants).

    rotate_half(x) = cat(-x2, x1); with the minus sign folded into the first half of the sin table,
    x*cos + rotate_half(x)*sin == x*cos + cat(x2, x1)*sin_signed, which saves a Neg per call.
    """
    angles = np.outer(np.arange(seq_length, dtype=np.float64), rope_frequencies(head_dim, theta, scaling))
    angles = np.concatenate([angles, angles], axis=-1)
    sin = np.sin(angles)
    sin[:, : head_dim // 2] *= -1.0
    return Tensor(np.cos(angles)[:, None, :], dtype), Tensor(sin[:, None, :], dtype)


class RotaryEmbedding(nn.Cell):
    """Rotary position embedding (Su et al. 2021) in the Hugging Face "rotate half" layout.

    Applied to [batch, seq, heads, head_dim]; the tables are constants computed once. Swapping the
    halves takes two slices and a concat: on CPU this measured as fast as a permutation matmul
    and, unlike a matmul over a flattened view, it shards per head.
    """

    def __init__(
        self, seq_length: int, head_dim: int, theta: float, scaling: tuple | None = None, compute_dtype=ms.float32
    ):
        super().__init__()
        self.cos, self.sin = rotary_tables(seq_length, head_dim, theta, scaling, compute_dtype)
        self.seq_length = seq_length
        self.half = head_dim // 2
        self.slice_low = ops.StridedSlice()
        self.slice_high = ops.StridedSlice()
        self.concat = ops.Concat(axis=-1)
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add = ops.Add()

    def construct(self, x):
        b, s, n, d = x.shape
        cos, sin = self.cos, self.sin
        if s != self.seq_length:
            cos, sin = cos[:s], sin[:s]
        low = self.slice_low(x, (0, 0, 0, 0), (b, s, n, self.half), (1, 1, 1, 1))
        high = self.slice_high(x, (0, 0, 0, self.half), (b, s, n, d), (1, 1, 1, 1))
        return self.add(self.mul_cos(x, cos), self.mul_sin(self.concat((high, low)), sin))

    def shard_strategies(self, style: str, layout) -> dict:
        """The tables [S, 1, d] split along the sequence as the heads are: each context-parallel rank
        rotates by its own positions (context_positions), sliced from the constants by the compiler. The
        replicate style rotates a single shared head, its heads dimension not split."""
        heads, table = head_split(layout), (layout.cp, 1, 1)  # [B, S, heads, d]
        if style == REPLICATE:  # one head shared by all (multi-head latent attention's rotary key): not split
            heads = (*heads[:2], 1, 1)
        return {
            "slice_low": ((heads,), None),
            "slice_high": ((heads,), None),
            "concat": ((heads, heads), None),
            "mul_cos": ((heads, table), None),
            "mul_sin": ((heads, table), None),
            "add": ((heads, heads), None),
        }


class SwiGLU(nn.Cell):
    """LLaMA feed-forward: w2(silu(w1 x) * w3 x), separate w1/w3 so nothing is sliced."""

    def __init__(self, hidden: int, ffn: int, std: float, out_std: float, param_dtype, compute_dtype):
        super().__init__()
        self.w1 = Linear(hidden, ffn, False, std, param_dtype, compute_dtype)
        self.w3 = Linear(hidden, ffn, False, std, param_dtype, compute_dtype)
        self.w2 = Linear(ffn, hidden, False, out_std, param_dtype, compute_dtype)
        self.act = SiLU()
        self.gate_mul = ops.Mul()

    def construct(self, x):
        return self.w2(self.gate_mul(self.act(self.w1(x)), self.w3(x)))

    SELECTIVE_RECOMPUTE = ("act", "gate_mul")
    REGATHERED_INPUT = ("w1", "w3")  # the Linears reading the MLP input, which sequence parallel all-gathers

    def shard_strategies(self, style: str, layout) -> dict:
        x = inner_split(layout)
        return {"act": ((x,), None), "gate_mul": ((x, x), None)}


class GeluMLP(nn.Cell):
    """GPT feed-forward: w2(gelu(w1 x + b1)) + b2; GELU in the tanh form of GPT-2/GPT-3."""

    def __init__(self, hidden: int, ffn: int, std: float, out_std: float, param_dtype, compute_dtype):
        super().__init__()
        self.w1 = Linear(hidden, ffn, True, std, param_dtype, compute_dtype)
        self.w2 = Linear(ffn, hidden, True, out_std, param_dtype, compute_dtype)
        self.act = ops.GeLU()

    def construct(self, x):
        return self.w2(self.act(self.w1(x)))

    SELECTIVE_RECOMPUTE = ("act",)
    REGATHERED_INPUT = ("w1",)

    def shard_strategies(self, style: str, layout) -> dict:
        return {"act": (((layout.token_rows, layout.tp),), None)}
