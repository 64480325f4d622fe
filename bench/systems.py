"""The three training stacks of the peer benchmark behind one interface.

Each `build_<system>(cfg, batch)` builds the LLaMA that `cfg.model` describes in that stack, with the
same initialisation scale, optimizer hyper-parameters (AdamW: lr table, betas, eps, decoupled weight
decay on matrices only, global-norm clip) and batch, and returns a `System` whose `step()` runs one
optimizer step and returns the loss as a Python float (which waits for the step to finish).

* mindscale:   the TrainStep `run_train.py` trains (`mindscale.train.loop.step.build_train_graph`), after its runtime setup.
* mindformers: mindformers 1.9.0 `LlamaForCausalLM` in graph mode (`use_rope_slice=True,
  fused_rms_norm=False, use_flash_attention=False`) with MindSpore's AdamWeightDecay and a
  TrainOneStepCell that clips the global gradient norm (MindFormers' own MFTrainOneStepCell needs
  the Ascend-only NPUGetFloatStatusV2 and fails to compile on CPU).
* hf:          transformers `LlamaForCausalLM` (`attn_implementation="sdpa"`) with torch.optim.AdamW.

Every system sees the same token/label pairs: `batch` is [B, S + 1] ids; inputs are batch[:, :-1], labels
batch[:, 1:], every position counted in the loss.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bench import SYSTEMS
from mindscale.config import REPO_ROOT, Config


@dataclass
class System:
    step: Callable[[], float]
    params: int  # trainable parameters (equal across systems when the configs agree)
    framework: str  # "mindspore 2.9.0", "torch 2.13.0", ...
    compile: Callable[[], None] | None = None  # MindSpore: the step's graph compile on its own


def fixed_batch(cfg: Config) -> np.ndarray:
    """[micro_batch_size, seq_length + 1] token ids in [1, vocab): id 0 is MindFormers' pad id, which
    its loss would mask out, so it is left out for all three."""
    rng = np.random.default_rng(cfg.run.seed)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length + 1)
    return rng.integers(1, cfg.model.vocab_size, shape, dtype=np.int32)


def threads() -> int:
    """Operator threads: one per core this process may run on (the bench pins it first)."""
    return len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------------------------
# MindScale


def build_mindscale(cfg: Config, batch: np.ndarray) -> System:
    import mindspore as ms
    from mindspore import Tensor

    from mindscale.train.loop.runtime import setup
    from mindscale.train.loop.step import build_train_graph

    rt = setup(cfg)  # graph mode, CPU, threads_num = cores of this process
    # The graph the Trainer trains (build_train_graph), not the Trainer: it compiles the step on its first
    # batch while it is built, so the first step() would not time the compile, and its data reader's thread
    # would share the one core the steps are timed on.
    graph = build_train_graph(cfg, rt.layout)
    step_cell = graph.step
    # The trainer's batch layout: the stored tokens [rows, seq + 1] (a step's micro batches stacked; one here)
    tokens = Tensor(batch)

    def step() -> float:
        loss, _grad_norm, _overflow, _scale = step_cell(tokens)
        return float(loss.asnumpy())

    return System(
        step,
        _mindspore_param_count(graph.model.trainable_params()),
        f"mindspore {ms.__version__}",
        lambda: step_cell.compile(tokens),
    )


def _mindspore_param_count(params) -> int:
    return sum(int(np.prod(p.shape)) for p in params)


# ----------------------------------------------------------------------------------------------
# MindFormers


def _clipping_train_cell(network, optimizer, max_norm: float):
    """nn.TrainOneStepCell plus a global-norm gradient clip (MindSpore's AdamW has none built in).
    Defined here so that importing this module does not import MindSpore (the hf process must not
    carry MindSpore's ~350 MB in its peak RSS)."""
    from mindspore import nn, ops

    class ClippingTrainOneStepCell(nn.TrainOneStepCell):
        def __init__(self, network, optimizer, max_norm: float):
            super().__init__(network, optimizer)
            self.max_norm = max_norm

        def construct(self, *inputs):
            loss = self.network(*inputs)
            sens = ops.fill(loss.dtype, loss.shape, self.sens)
            grads = self.grad_reducer(self.grad(self.network, self.weights)(*inputs, sens))
            if self.max_norm > 0:
                grads = ops.clip_by_global_norm(grads, self.max_norm)
            return ops.depend(loss, self.optimizer(grads))

    return ClippingTrainOneStepCell(network, optimizer, max_norm)


def build_mindformers(cfg: Config, batch: np.ndarray) -> System:
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.common.initializer import Normal, initializer

    from mindscale.train.loop.optim import build_optimizer

    # MindFormers logs to ./output/log unless told otherwise; keep its files in the bench folder.
    os.environ.setdefault("LOG_MF_PATH", str(REPO_ROOT / "output" / "bench" / "mindformers_log"))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.device_context.cpu.op_tuning.threads_num(threads())
    ms.set_seed(cfg.run.seed)
    import mindformers
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    config = LlamaConfig(
        batch_size=cfg.train.micro_batch_size,
        seq_length=m.seq_length,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        n_kv_heads=m.kv_heads,
        intermediate_size=m.ffn_hidden_size,
        vocab_size=m.vocab_size,
        rms_norm_eps=m.norm_eps,
        theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings,
        compute_dtype="float32",
        param_init_type="float32",
        layernorm_compute_type="float32",
        softmax_compute_type="float32",
        rotary_dtype="float32",
        init_method_std=m.init_std,
        use_rope_slice=True,
        fused_rms_norm=False,
        use_flash_attention=False,
    )
    network = LlamaForCausalLM(config)
    network.set_train(True)
    # MindFormers draws its lm_head with a different std; give every matrix the shared init scale.
    for p in network.trainable_params():
        if len(p.shape) == 2:
            p.set_data(initializer(Normal(m.init_std), p.shape, p.dtype))
    optimizer = build_optimizer(network.trainable_params(), cfg.train)  # MindSpore AdamWeightDecay, same groups
    train_cell = _clipping_train_cell(network, optimizer, cfg.train.grad_clip)
    input_ids = Tensor(batch)  # MindFormers slices [:, :-1] as inputs and [:, 1:] as labels itself

    def step() -> float:
        return float(train_cell(input_ids).asnumpy().reshape(-1)[0])

    return System(
        step,
        _mindspore_param_count(network.trainable_params()),
        f"mindspore {ms.__version__}, mindformers {mindformers.__version__}",
        lambda: train_cell.compile(input_ids),
    )


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers on torch


def optimizer_rules() -> tuple[Callable, Callable]:
    """`lr_at` and `decays`, MindScale's schedule and decay rule (mindscale/train/loop/schedule.py imports no
    MindSpore, which would add ~350 MB to the hf process's peak RSS)."""
    from mindscale.train.loop.schedule import decays, lr_at

    return lr_at, decays


def build_hf(cfg: Config, batch: np.ndarray) -> System:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads())
    torch.manual_seed(cfg.run.seed)
    m, t = cfg.model, cfg.train
    lr_at, decays = optimizer_rules()
    config = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_length,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
        torch_dtype=torch.float32,
    )
    model = LlamaForCausalLM(config).train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": t.weight_decay},
        {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, t) / t.lr)
    tokens = torch.from_numpy(batch.astype(np.int64))
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].contiguous()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        # shift_labels: the labels are already shifted, so every position counts, as in the others
        loss = model(input_ids=input_ids, labels=labels, shift_labels=labels).loss
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        schedule.step()
        return float(loss.detach())

    return System(
        step, sum(p.numel() for _, p in named), f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


BUILDERS = {"mindscale": build_mindscale, "mindformers": build_mindformers, "hf": build_hf}
assert tuple(BUILDERS) == SYSTEMS
