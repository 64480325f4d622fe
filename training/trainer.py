"""The pretraining / fine-tuning loop behind run_train.py.

Start order: the latest complete checkpoint in the run folder (full resume: weights, optimizer,
loss scale, data position) -> `checkpoint.load_path` (weights only, for fine-tuning) -> fresh init.
With LoRA (finetune.lora.rank > 0) checkpoints hold only the adapters: the frozen base always comes
from `checkpoint.load_path`, and a resume puts the saved adapters on top of it.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor

import models
from training import checkpoint as ckpt
from training.config import Config, ConfigError
from training.data import build_dataset
from training.metrics import MetricsLogger
from training.schedule import lr_at
from training.profiling import ProfileWindow
from training.runtime import Runtime, set_input_layout
from training.train_step import build_train_graph


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def parameters_as_numpy(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


class Trainer:
    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg = cfg = models.resolve_model_dims(cfg)  # finetune.hf_dims
        self.rt = rt
        self.layout = layout = rt.layout
        self.run_dir = run_dir_of(cfg)
        # Sharded layouts (Ascend/GPU semi-auto parallel): every rank holds slices, so every rank writes
        # its own checkpoints (with MindSpore's strategy file in <run>/strategy/) and resumes from them.
        self.ckpt_dir = self.run_dir / "checkpoints"
        if layout.sharded:
            self.ckpt_dir = self.ckpt_dir / f"rank_{rt.rank}"
        graph = build_train_graph(cfg, layout)
        self.model, self.network, self.optimizer, self.step_cell = graph.model, graph.network, graph.optimizer, graph.step
        # optimizer state to save: moments, step counter, loss scale; not the LR table, which comes from the
        # config (so a resumed run may change train.steps or the schedule), nor the accumulation buffers
        not_state = ({p.name for p in self.model.get_parameters()}
                     | {p.name for p in self.optimizer.learning_rate.get_parameters()})
        self.optimizer_params = [p for p in self.step_cell.get_parameters()
                                 if p.name not in not_state and not p.name.startswith("accu_grads.")]
        # what checkpoints hold: every weight, or only the trained adapters under LoRA (the base is frozen)
        self.saved_params = (self.network.trainable_params() if models.lora_enabled(cfg)
                             else list(self.model.get_parameters()))
        latest = ckpt.latest_checkpoint(self.ckpt_dir) if cfg.checkpoint.resume else None
        self.start_step = ckpt.checkpoint_step(latest) if latest else 0
        self.batches = self._batches()
        self.first_batch = next(self.batches)
        # Sharded parameters take their local shapes when the step compiles: restore after that.
        set_input_layout(layout, len(self.first_batch))
        self.step_cell.compile(*self.first_batch)
        self._restore(latest)

    # -- start-up ---------------------------------------------------------------------------------
    def _restore(self, latest: Path | None) -> None:
        if latest is not None:
            weights, optimizer_state, state = ckpt.load_checkpoint(latest)
            if models.lora_enabled(self.cfg):
                self._load_pretrained()
            layouts = self.step_cell.parameter_layout_dict
            ckpt.assign(self.saved_params, weights, str(latest), layouts, self.rt.rank)
            ckpt.assign(self.optimizer_params, optimizer_state, f"{latest} optimizer state", layouts, self.rt.rank)
            self._say(f"resumed from {latest} at step {state['step']}")
        elif self.cfg.checkpoint.load_path:
            self._load_pretrained()
            self._say(f"loaded weights from {self.cfg.checkpoint.load_path} (optimizer state and step start fresh)")

    def _load_pretrained(self) -> None:
        models.load_weights_into(self.model, models.load_pretrained(self.cfg.checkpoint.load_path, self.cfg),
                                 self.step_cell.parameter_layout_dict, self.rt.rank)

    def _say(self, text: str) -> None:
        if self.rt.is_main:
            print(text, flush=True)

    # -- the loop ---------------------------------------------------------------------------------
    def _batches(self):
        """[rows, seq] tensors for each optimizer step, this rank's micro batches stacked (+ segment_ids
        when packed). Ranks read by their data-parallel index (Layout.data_rank)."""
        g = self.cfg.parallel.gradient_accumulation_steps
        source = iter(build_dataset(self.cfg, self.layout.data_rank(self.rt.rank), self.layout.dp, self.start_step))
        while True:
            micro = [next(source) for _ in range(g)]
            keys = [k for k in ("input_ids", "labels", "loss_mask", "segment_ids") if k in micro[0]]
            if "segment_ids" in keys and self.layout.attention == "flash":
                raise ConfigError("packed SFT data (segment_ids) needs model.attention=composite: flash attention "
                                  "here has no per-example mask; set it, or preprocess without --pack")
            yield tuple(Tensor(np.concatenate([m[key] for m in micro])) for key in keys)

    def save(self, step: int, loss_scale: float) -> Path | None:
        if not (self.rt.is_main or self.layout.sharded):
            return None
        state = {"loss_scale": loss_scale, "seed": self.cfg.run.seed,
                 "samples_consumed": step * self.cfg.global_batch_size}
        return ckpt.save_checkpoint(self.ckpt_dir, step, parameters_as_numpy(self.saved_params),
                                    parameters_as_numpy(self.optimizer_params), state, self.cfg.to_yaml(),
                                    keep_last=self.cfg.checkpoint.keep_last)

    def train(self) -> list[dict]:
        cfg = self.cfg
        if self.rt.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        # the loss exists on the last pipeline stage (the others compute zeros): its first rank logs
        logs = self.rt.rank == self.layout.stage_ranks(self.layout.pp - 1)[0]
        logger = MetricsLogger(cfg, self.run_dir, self.rt.device_target, logs, self.start_step)
        profile = ProfileWindow(cfg.profile, self.run_dir / "profile")
        records, scale = [], 0.0
        for step in range(self.start_step, cfg.train.steps):
            batch = self.first_batch if step == self.start_step else next(self.batches)
            profile.before(step)
            began = time.perf_counter()
            loss, grad_norm, overflow, scale = self.step_cell(*batch)
            loss = float(loss.asnumpy())
            elapsed = time.perf_counter() - began
            profile.after(step)
            scale = float(scale.asnumpy())
            record = logger.step(step + 1, loss, float(grad_norm.asnumpy()), elapsed, bool(overflow.asnumpy()),
                                 lr_at(step, cfg.train), scale)
            if record:
                records.append(record)
            interval = cfg.checkpoint.save_interval
            if interval and (step + 1) % interval == 0 and step + 1 < cfg.train.steps:
                self.save(step + 1, scale)
        profile.close()
        logger.close()
        if cfg.checkpoint.save_at_end and self.start_step < cfg.train.steps:
            saved = self.save(cfg.train.steps, scale)
            if saved:
                self._say(f"checkpoint: {saved}")
        print(f"rank {self.rt.rank}: weights sha256 {self.weights_digest()}", flush=True)
        return records

    def weights_digest(self) -> str:
        """A digest of every weight, printed by each rank: data-parallel ranks must agree."""
        digest = hashlib.sha256()
        for name, value in sorted(parameters_as_numpy(self.model.get_parameters()).items()):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        return digest.hexdigest()[:16]
