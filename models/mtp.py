"""Multi-token prediction (DeepSeek-V3 report, section 2.2; model.mtp_depth D, model.mtp_loss_weight lambda).

After the decoder, D modules in sequence; module k (1..D), at every position i of the S input positions:

    h'_i = eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]     one Linear [h, 2h], no bias
    h^k  = block(h')                                             one more decoder block (causal, like the others)
    CE_k = cross entropy of head(norm(h^k_i)) against t_{i+k+1}  `norm`: the checkpoint's shared_head.norm

h^0 is the decoder's output after its final norm (what the main head reads), Emb and head are the main model's
(the same Parameters: no copy in the checkpoint, one gradient). The report writes the concatenation as
[h; Emb]; the released weights' eh_proj takes [Emb; h] (the order vLLM and Megatron-Core load them in), so it is
that. The loss network adds lambda / D x (CE_1 + ... + CE_D) to the main cross entropy.

With t_j = input_ids[j] and labels[j] = t_{j+1}, module k reads input_ids shifted left by k and predicts labels
shifted left by k. The last k positions have neither (their token is padded with 0) and are masked out of CE_k;
every other position i counts iff the main loss trains labels[i+k] (loss_mask, shifted with the labels) and,
with packed examples, token i+k is in the same example as token i (segment_ids): a module never predicts
across a document boundary. CE_k is the mean over the positions it keeps, as the main loss is over its.
The shifted tensors keep the sequence length S, so the block attends exactly as the decoder's layers do.

Under a pipeline the modules sit on the last stage with the head; the embedding lookup they need happens there,
in the token embedding MindSpore shares with that stage (as it does for a tied head; models/sharding.py).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from models.layers import DTYPES, Embedding, Linear
from models.spec import REPLICATE, SEQUENCE, VOCAB


def mtp_plan(plan: dict) -> dict:
    """The plan entries of the modules: each block split as a decoder layer is, the lookup as the embedding,
    the norms along the tokens, the projection whole on every tensor-parallel rank (it writes the stream)."""
    blocks = {
        "mtp.*.block" + path[len("layers.*") :]: style for path, style in plan.items() if path.startswith("layers.*")
    }
    return {
        "mtp.*": SEQUENCE,
        "mtp.*.embedding": VOCAB,
        "mtp.*.enorm": SEQUENCE,
        "mtp.*.hnorm": SEQUENCE,
        "mtp.*.eh_proj": REPLICATE,
        "mtp.*.norm": SEQUENCE,
        **blocks,
    }


def mtp_optional(optional: tuple) -> tuple:
    """The family's optional plan paths, for the modules' blocks too."""
    return tuple("mtp.*.block" + path[len("layers.*") :] for path in optional if path.startswith("layers.*"))


class SharedLookup(nn.Cell):
    """The token embedding's lookup in a table passed in (the main model's `tok_embeddings.weight`): it owns no
    parameter, so the table keeps its one name, and under a pipeline the lookup runs on this cell's stage."""

    def __init__(self, param_dtype, read_dtype, out_dtype):
        super().__init__()
        self.gather = ops.Gather()
        self.cast = ops.Cast()
        self.read_dtype, self.out_dtype = read_dtype, out_dtype
        self.cast_table, self.cast_out = param_dtype != read_dtype, read_dtype != out_dtype

    def construct(self, ids, table):
        table = self.cast(table, self.read_dtype) if self.cast_table else table
        out = self.gather(table, ids, 0)
        return self.cast(out, self.out_dtype) if self.cast_out else out

    def shard_strategies(self, style: str, layout) -> dict:
        return Embedding.shard_strategies(self, style, layout)


class MTPModule(nn.Cell):
    """Module k (`depth`): (h^{k-1} [B*S, h], input_ids, labels, loss_mask (None: all trained) and segment_ids
    (None: one example a row) [B, S] as the loss network has them, the embedding table, the router statistics
    or None) -> (h^k, CE_k's inputs: norm(h^k), its labels and mask [B, S], the router statistics)."""

    def __init__(self, m, layout, block: nn.Cell, norm: type, depth: int):
        super().__init__()
        pdt, cdt, rdt = DTYPES[m.param_dtype], DTYPES[m.compute_dtype], DTYPES[m.residual_dtype]
        self.depth = depth
        self.embedding = SharedLookup(pdt, cdt, rdt)
        self.enorm = norm(m.hidden_size, m.norm_eps, pdt, cdt)
        self.hnorm = norm(m.hidden_size, m.norm_eps, pdt, cdt)
        self.eh_proj = Linear(2 * m.hidden_size, m.hidden_size, False, m.init_std, pdt, cdt)
        self.join = ops.Concat(-1)
        self.block = block
        self.norm = norm(m.hidden_size, m.norm_eps, pdt, cdt)
        self.cast = ops.Cast()
        self.residual_dtype = rdt
        self.cast_stream = cdt != rdt
        self.ahead = ops.StridedSlice()  # columns k.. of a [B, S] tensor
        self.pad = ops.Concat(1)  # ... then k columns of 0
        self.same_example = ops.Equal()
        self.keep = ops.Mul()

    def shifted(self, x):
        """[B, S] -> x[:, k:] followed by k zeros."""
        rows, length = x.shape
        k = self.depth
        return self.pad((self.ahead(x, (0, k), (rows, length), (1, 1)), ops.zeros((rows, k), x.dtype)))

    def targets(self, input_ids, labels, loss_mask, segment_ids):
        """(the tokens k ahead, the labels k ahead, the positions CE_k keeps, fp32) [B, S]."""
        kept = ops.ones(input_ids.shape, ms.float32) if loss_mask is None else loss_mask
        mask = self.shifted(kept)
        if segment_ids is not None:
            mask = self.keep(mask, self.cast(self.same_example(self.shifted(segment_ids), segment_ids), mask.dtype))
        return self.shifted(input_ids), self.shifted(labels), mask

    def construct(self, hidden, input_ids, labels, loss_mask, segment_ids, table, routing):
        batch, seq = input_ids.shape
        ids, labels, mask = self.targets(input_ids, labels, loss_mask, segment_ids)
        emb = self.embedding(ids, table).reshape(batch * seq, -1)
        x = self.eh_proj(self.join((self.enorm(emb), self.hnorm(hidden))))
        x = self.cast(x, self.residual_dtype) if self.cast_stream else x
        x = self.block(x, batch, seq, segment_ids, routing, loss_mask if routing is not None else None)
        if routing is not None:
            x, routing = x
        return x, self.norm(x), labels, mask, routing

    def shard_strategies(self, style: str, layout) -> dict:
        rows = (layout.dp, 1)
        return {
            "ahead": ((rows,), None),
            "pad": ((rows, rows), None),
            "same_example": ((rows, rows), None),
            "keep": ((rows, rows), None),
            "join": (((layout.token_rows, 1), (layout.token_rows, 1)), None),
        }
