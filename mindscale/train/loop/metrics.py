"""Per-interval training metrics: one JSON line in metrics.jsonl and one human line (or a progress bar),
which ends with the time since training started and an ETA at the recent pace.

Throughput and MFU/HFU follow docs/mfu.md through mindscale/perf/flops.py, the same functions
tools/mfu.py uses, so a logged MFU can be reproduced from the logged step time by hand.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import psutil

from mindscale.config import Config, Layout
from mindscale.perf import flops
from mindscale.perf.gemm_peak import device_peak_tflops
from mindscale.progress import clock
from mindscale.train.loop.tensorboard import TensorBoardLog


def memory_gib(device_target: str) -> float:
    """Peak device memory on Ascend/GPU; resident host memory of this worker on CPU."""
    if device_target != "CPU":
        import mindspore as ms

        return ms.runtime.max_memory_allocated() / 2**30
    return psutil.Process().memory_info().rss / 2**30


def perplexity(loss: float) -> float:
    """exp(loss) of a validation loss; inf where it overflows a float."""
    return math.exp(loss) if loss < 709 else float("inf")


class MetricsLogger:
    """Collects per-step values and writes one record every `train.log_interval` steps (rank 0)."""

    def __init__(self, cfg: Config, run_dir: Path, device_target: str, write: bool, first_step: int, drawn=None):
        self.cfg = cfg
        self.drawn = drawn  # step -> samples drawn per data source so far (DataStream.drawn), or None
        self.device_target = device_target
        self.write = write
        self.path = run_dir / "metrics.jsonl"
        self.tokens_per_step = cfg.samples_per_step * cfg.model.seq_length
        self.flops_per_token = flops.model_flops_per_token(cfg.model)
        layout = Layout.of(cfg)
        self.hflops_per_token = flops.hardware_flops_per_token(cfg.model, layout.recompute, len(layout.recomputed))
        # an unpinned `python run_train.py` on a 2-core host is measured against both cores
        self.peak = device_peak_tflops(cfg, cores=len(os.sched_getaffinity(0)))
        self.window: list[tuple[float, float, float, float]] = []  # (loss, grad_norm, step_time, data_wait)
        self.skipped = 0  # steps skipped for non-finite gradients, since this process started
        self.spike_skipped = 0  # ... for a loss over train.loss_spike_factor x the recent median
        self.save_blocked = 0.0  # seconds checkpoint saves blocked training since the last record
        self.started = time.time()
        self.first_step = first_step
        self.last_record = None  # (step, time) of the last record: the ETA's pace is the wall time since
        self.bar = None
        self.validation = None  # (loss, seconds) of a validation pass after the coming step
        self.routing: list[tuple[float, float]] = []  # a mixture of experts' (aux_loss, expert_load_max) per step
        self.predicted: list[float] = []  # the multi-token-prediction term per step (multi_token)
        # first: a missing tensorboardX stops the run before metrics.jsonl is touched
        self.tensorboard = TensorBoardLog(run_dir, first_step) if write and cfg.run.tensorboard else None
        if write:
            run_dir.mkdir(parents=True, exist_ok=True)  # the logging rank may not be rank 0 (pipeline)
            self._drop_records_after(first_step)
        if write and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=first_step, unit="step", dynamic_ncols=True)

    def _drop_records_after(self, step: int) -> None:
        """A resumed run re-logs the steps after its checkpoint; a fresh run (step 0) starts empty."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError):
                break  # a line cut by a kill: it and anything after it are dropped
        self.path.write_text("".join(kept))

    def step(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        step_time: float,
        overflow: bool,
        lr: float,
        loss_scale: float,
        force: bool = False,
        spiked: bool = False,
        data_wait: float = 0.0,
    ) -> dict | None:
        """Record optimizer step `step` (1-based); returns the record when one is written: every
        train.log_interval steps, after the first and the last step, and when `force`d (a stop).
        `data_wait` is the seconds the loop waited for the step's batch (not in `step_time`)."""
        self.skipped += int(overflow)
        self.spike_skipped += int(spiked)
        self.window.append((loss, grad_norm, step_time, data_wait))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        last = step == self.cfg.train.steps
        if (
            step % self.cfg.train.log_interval
            and not (last or force or self.validation)
            and step != self.first_step + 1
        ):
            return None
        record = {
            **self._record(step, lr, loss_scale),
            **self._routing_record(),
            **self._multi_token_record(),
            **self._validation_record(),
        }
        self.window.clear()
        self.save_blocked = 0.0
        if self.write:
            self.append(record)
            line = (
                f"step {step}/{self.cfg.train.steps} loss {record['loss']:.4f} lr {lr:.3e} "
                f"grad_norm {record['grad_norm']:.3f} step {record['step_time_s'] * 1e3:.0f} ms "
                f"data {record['data_wait_s'] * 1e3:.1f} ms "
                f"{record['tokens_per_s']:.0f} tok/s MFU {record['mfu'] * 100:.2f}% "
                f"(peak {self.peak:.3g} TFLOP/s/device) mem {record['memory_gib']:.2f} GiB "
                f"elapsed {clock(record['elapsed_s'])} ETA {clock(record['eta_s'])}"
            )
            if "aux_loss" in record:
                line += (
                    f" aux_loss {record['aux_loss']:.4f} seq_aux_loss {record['seq_aux_loss']:.4f}"
                    f" expert_load_max {record['expert_load_max']:.2f}"
                )
            if "mtp_loss" in record:
                line += f" mtp_loss {record['mtp_loss']:.4f}"
            if "val_loss" in record:
                line += f" val_loss {record['val_loss']:.4f} val_ppl {record['val_ppl']:.2f}"
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        return record

    def append(self, record: dict) -> None:
        """The one place a record is written: a line of metrics.jsonl and, with run.tensorboard, its scalars."""
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def _eta(self, step: int, now: float) -> float | None:
        """Seconds to train.steps at the wall-clock pace since the last record (saves, logging and data
        included); None at the first record, whose window holds the compile."""
        last, self.last_record = self.last_record, (step, now)
        if last is None or step == last[0]:
            return None
        return (now - last[1]) / (step - last[0]) * (self.cfg.train.steps - step)

    def validated(self, loss: float, seconds: float, by_source: dict | None = None) -> None:
        """A validation pass (mindscale/train/loop/evaluate.py) ran after the coming step: its record holds
        val_loss, val_ppl and val_time_s (and a held-out blend's val_loss_by_source), and is written whatever
        train.log_interval says."""
        self.validation = (loss, seconds, by_source)

    def _validation_record(self) -> dict:
        if self.validation is None:
            return {}
        (loss, seconds, by_source), self.validation = self.validation, None
        return {
            "val_loss": loss,
            "val_ppl": perplexity(loss),
            "val_time_s": seconds,
            **({"val_loss_by_source": by_source} if by_source else {}),
        }

    def routed(self, aux_loss: float, expert_load_max: float, seq_aux_loss: float) -> None:
        """A mixture of experts' router statistics of the step just taken (models/transformer.py, CausalLMLoss):
        the next record holds their means over its steps as aux_loss (the load-balancing loss, averaged over
        layers), expert_load_max (the busiest expert's tokens over the mean, the most loaded layer's) and
        seq_aux_loss (DeepSeek-V3's sequence-wise balance loss, averaged over layers)."""
        self.routing.append((aux_loss, expert_load_max, seq_aux_loss))

    def _routing_record(self) -> dict:
        if not self.routing:
            return {}
        n, (aux, load, seq_aux) = len(self.routing), zip(*self.routing)
        self.routing.clear()
        return {"aux_loss": sum(aux) / n, "expert_load_max": sum(load) / n, "seq_aux_loss": sum(seq_aux) / n}

    def multi_token(self, mtp_loss: float) -> None:
        """The multi-token-prediction term the step's loss includes (models/transformer.py, CausalLMLoss: lambda / D
        x the modules' cross entropies, of its last micro batch): the next record holds its mean as mtp_loss, so
        loss - mtp_loss is the next-token loss (with the balance losses)."""
        self.predicted.append(mtp_loss)

    def _multi_token_record(self) -> dict:
        if not self.predicted:
            return {}
        record = {"mtp_loss": sum(self.predicted) / len(self.predicted)}
        self.predicted.clear()
        return record

    def saved(self, blocked_s: float) -> None:
        """A checkpoint save blocked training for `blocked_s` (in the next record's save_blocked_s)."""
        self.save_blocked += blocked_s

    def _record(self, step: int, lr: float, loss_scale: float) -> dict:
        now = time.time()
        n = len(self.window)
        loss = sum(w[0] for w in self.window) / n
        grad_norm = sum(w[1] for w in self.window) / n
        step_time = sum(w[2] for w in self.window) / n
        data_wait = sum(w[3] for w in self.window) / n
        devices = self.cfg.devices
        tokens_per_s = self.tokens_per_step / step_time
        tflops = tokens_per_s * self.flops_per_token / devices / 1e12
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / devices,
            "samples_per_s_per_device": self.cfg.samples_per_step / step_time / devices,
            "tflops_per_device": tflops,
            "mfu": flops.utilization(tokens_per_s, self.flops_per_token, devices, self.peak),
            "hfu": flops.utilization(tokens_per_s, self.hflops_per_token, devices, self.peak),
            "peak_tflops": self.peak,
            "memory_gib": memory_gib(self.device_target),
            "devices": devices,
            "steps_in_window": n,
            "skipped_steps": self.skipped,
            "spike_skipped_steps": self.spike_skipped,
            "loss_scale": loss_scale,
            "save_blocked_s": self.save_blocked,
            "elapsed_s": now - self.started,
            "eta_s": self._eta(step, now),
            **self._data_tokens(step),
        }

    def _data_tokens(self, step: int) -> dict:
        """data_tokens: tokens drawn from each data source (its config path) in steps 1..step, from the
        sample index (samples x model.seq_length); none for synthetic data."""
        drawn = self.drawn(step) if self.drawn is not None else {}
        if not drawn:
            return {}
        return {"data_tokens": {path: n * self.cfg.model.seq_length for path, n in drawn.items()}}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
