"""MindFormers 1.9's LlamaForCausalLM compiled for one rank under MindSpore's dry run, with the layout,
dtypes, recompute, attention and optimizer of a MindScale config (bench/dryrun_compare.py runs it).

MindSpore's context (device, parallel mode, pipeline stages, optimizer shard, dataset strategy) is set by
MindScale's own `setup`, so both stacks compile under one context; MindFormers gets its own parallel
config (TransformerOpParallelConfig) with the same degrees, and the wrappers its trainer builds: the
network in MindSpore's PipelineCell under pipeline stages, then MFPipelineWithLossScaleCell (or
MFTrainOneStepCell without micro batches), with MindScale's optimizer (MindSpore's AdamWeightDecay,
same parameter groups) so the optimizer state is the same by construction.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np

from mindscale.config import ConfigError
from mindscale.launch import dryrun_worker as dryrun
from mindscale.launch.dryrun_worker import compile_step


@contextlib.contextmanager
def host_reshape():
    """Tensor.reshape on the host while MindFormers builds its model: its generation mixin reshapes a
    constant eagerly at construction, which the dry run has no device to run (training never uses it)."""
    from mindspore import Tensor

    device_reshape = Tensor.reshape
    Tensor.reshape = lambda self, *shape: Tensor(self.asnumpy().reshape(*shape))
    try:
        yield
    finally:
        Tensor.reshape = device_reshape


def mindformers_llama(cfg, layout):
    """LlamaForCausalLM with `cfg.model`'s dims and dtypes and the layout's degrees."""
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig, TransformerRecomputeConfig

    m, p, r = cfg.model, cfg.parallel, cfg.recompute
    recompute = TransformerRecomputeConfig(
        recompute=r.mode == "full", select_recompute=r.mode == "selective", recompute_slice_activation=r.mode != "none"
    )
    parallel = TransformerOpParallelConfig(
        data_parallel=layout.dp,
        model_parallel=layout.tp,
        pipeline_stage=layout.pp,
        micro_batch_num=layout.micro_steps if layout.pp > 1 else 1,
        use_seq_parallel=p.sequence_parallel,
        vocab_emb_dp=p.vocab_emb_dp,
        recompute=recompute,
        gradient_aggregation_group=4,
    )
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
        compute_dtype=m.compute_dtype,
        param_init_type=m.param_dtype,
        layernorm_compute_type="float32",
        softmax_compute_type="float32",
        rotary_dtype="float32",
        use_flash_attention=layout.attention == "flash",
        use_rope_slice=False,
        fused_rms_norm=True,
        parallel_config=parallel,
        offset=p.stage_offset,
    )
    with host_reshape():
        return LlamaForCausalLM(config)


def train_cell(cfg, layout, network):
    from mindspore import Tensor, nn
    from mindspore.nn.wrap.cell_wrapper import _VirtualDatasetCell  # what MindFormers' trainer wraps
    from mindformers.wrapper.wrapper import MFPipelineWithLossScaleCell, MFTrainOneStepCell

    from mindscale.train.loop.optim import build_optimizer

    network.set_train(True)
    # MindFormers' pipeline cell copies the optimizer's learning rate: a schedule cell as MindFormers' own
    # (MindScale's per-step table is a Parameter, whose copy would repeat its name)
    t = cfg.train
    optimizer = build_optimizer(network.trainable_params(), t, nn.CosineDecayLR(t.min_lr, t.lr, t.steps))
    wrapped = nn.PipelineCell(network, micro_size=layout.micro_steps) if layout.pp > 1 else network
    wrapped = _VirtualDatasetCell(wrapped)
    clip = cfg.train.grad_clip > 0
    if layout.micro_steps > 1:
        return MFPipelineWithLossScaleCell(
            wrapped,
            optimizer,
            use_clip_grad=clip,
            max_grad_norm=cfg.train.grad_clip,
            scale_sense=Tensor(1.0),
            micro_batch_num=layout.micro_steps,
        )
    return MFTrainOneStepCell(
        wrapped, optimizer, use_clip_grad=clip, max_grad_norm=cfg.train.grad_clip, scale_sense=Tensor(1.0)
    )


def compile_rank(cfg, packed: bool = False, ir_dir: Path | None = None) -> dict:
    """Compile this process's rank of MindFormers' LLaMA; the same report as MindScale's dry-run worker."""
    from mindspore import Tensor
    from mindspore.nn.utils import no_init_parameters

    from mindscale.train.loop.runtime import PIPELINE_OWN_ROWS, setup

    if packed:
        raise ConfigError("--packed: the MindFormers comparison feeds plain token ids only")
    os.environ.setdefault("LOG_MF_PATH", str(Path.cwd() / "mindformers_log"))
    rt = setup(cfg)
    os.environ.pop(PIPELINE_OWN_ROWS, None)  # MindFormers' trainer slices its micro batches as MindSpore's default
    with no_init_parameters():
        network = mindformers_llama(cfg, rt.layout)
        step = train_cell(cfg, rt.layout, network)
    # MindFormers' LLaMA takes [rows, seq + 1] ids and shifts them into inputs and labels itself
    ids = Tensor(np.zeros((rt.layout.rows_per_step, cfg.model.seq_length + 1), np.int32))
    return compile_step(step, (ids,), network, network, rt, ir_dir)


def main(argv: list[str] | None = None) -> int:
    """The dry-run worker's command line, compiling MindFormers' model (mindscale.launch.dryrun_forks calls it)."""
    return dryrun.main(argv, compile_fn=compile_rank)


if __name__ == "__main__":
    sys.exit(main())
