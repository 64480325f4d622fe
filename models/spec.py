"""What a model family is, as data: one `ArchSpec` per architecture, each in its own file in models/archs/.

An entry holds everything the rest of MindScale needs to know about a family (torchtitan's ModelSpec):

    traits        what the one pre-norm decoder (models/transformer.py) builds: norm, MLP, biases,
                  positions, GQA, head width, per-head q/k norm, a mixture-of-experts MLP
    plan          its tensor-parallel plan, cell path -> style (models/sharding.py applies it)
    hf            its Hugging Face adapter: the tensor table and the config.json mapping both ways
                  (models/hf_convert.py runs it)
    lora_targets  the Linear layers that may carry LoRA adapters
    config_dirs   the configs/ folders of its shipped scale configs (tools/plan.py's table)

Nothing here imports MindSpore: the config layer reads the names and traits (mindscale/config/schema.py)
without loading a framework. Adding a model: docs/design.md "Adding a model".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

# Plan styles (torchtitan's ParallelStyle); models/layers.py says per layer how each splits its ops.
# Activations are [tokens, features] between layers.
COLWISE = "colwise"  # output features split over tp (wq/wk/wv, w1/w3, and the per-head ops after them)
ROWWISE = "rowwise"  # input features split, partial sums reduced (wo, w2); a reduce-scatter under sp
EXPERT = "expert"  # routed experts split over expert_parallel, tokens dispatched to them (models/moe.py)
VOCAB = "vocab"  # vocabulary split over tp (embedding, head, loss) unless parallel.vocab_emb_dp
SEQUENCE = "sequence"  # tokens split over dp x tp under sp (norms, residual adds), over dp otherwise
REPLICATE = "replicate"  # data parallel only (the position table)


class HFUnsupported(ValueError):
    """A Hugging Face config an adapter cannot map, with the reason and the fix in one line
    (models/hf_convert.py reports it as an HFConversionError)."""


@dataclass(frozen=True)
class Rule:
    """MindScale tensor `ours` is (part `part[0]` of `part[1]` equal row blocks of) HF tensor `theirs`,
    transposed first when HF stores it [in, out]. `{i}` stands for the layer index; `{e}` in `theirs` for an
    expert's: then `ours` [E, ...] stacks the E expert tensors (a mixture of experts' batched weights)."""

    ours: str
    theirs: str
    transpose: bool = False
    part: tuple[int, int] | None = None

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.theirs


@dataclass(frozen=True)
class HFAdapter:
    """How a family's checkpoints look in transformers. Every conversion is a pure re-arrangement
    (rename, transpose, split, concatenate), so a round trip reproduces the tensors bit for bit."""

    model_type: str  # config.json's model_type
    table: tuple[Rule, ...]
    config_from_hf: Callable[[dict], dict]  # config.json -> our `model:` keys (raises HFUnsupported)
    config_to_hf: Callable[[object], dict]  # ModelConfig -> config.json
    unprefixed: str = ""  # a prefix some checkpoints omit (GPT-2's `transformer.`)
    # whether `rule` applies at layer `layer` (None: not a layer's) of the model whose `model:` keys are the dict
    # (nested sections as dicts); None = every rule everywhere. DeepSeek-V3: its dense first layers, its optional
    # query down-projection
    applies: Callable[[dict, Rule, int | None], bool] | None = None
    # the multi-token-prediction modules' own tensors (models/mtp.py; DeepSeek-V3's, stored as decoder layers
    # L + k after the L layers): `{k}` in `ours` is the module, `{i}` in `theirs` its layer L + k. Their blocks
    # follow the table's layer rules (models/hf_convert.py)
    mtp_table: tuple[Rule, ...] = ()
    # tensors stored per module that are the main model's (the shared embedding and head): not read on import,
    # written as copies on export; `ours` names the main model's tensor, `{i}` in `theirs` the module's layer
    mtp_shared: tuple[Rule, ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    name: str  # model.arch
    summary: str  # one clause for the config reference
    rms_norm: bool  # RMSNorm; else LayerNorm with a bias
    gated_mlp: bool  # SwiGLU (gate, up, down); else GELU (up, down)
    bias: bool  # biases on every linear layer
    qkv_bias: bool  # biases on the q/k/v projections
    rotary: bool  # rotary positions; else a learned position table
    plan: Mapping[str, str]
    hf: HFAdapter
    lora_targets: tuple[str, ...]
    config_dirs: tuple[str, ...]
    grouped_query: bool = True  # num_kv_heads may be below num_heads (GQA)
    free_head_dim: bool = True  # model.head_dim may differ from hidden_size / num_heads
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before the rotary embedding (Qwen3)
    moe: bool = False  # the feed-forward is a mixture of experts (models/moe.py, model.moe.*): the one
    # test of it (config validation makes model.moe.num_experts > 0 agree)
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3; models/mla.py, model.mla.*)
    optional_plan: tuple[str, ...] = ()  # plan paths a model of the family may lack (DeepSeek-V3's, by its keys)

    @property
    def learned_positions(self) -> bool:
        return not self.rotary
