"""Profile optimizer steps [start_step, stop_step) with mindspore.profiler into the run folder."""

from __future__ import annotations

from pathlib import Path

from mindscale.config import ProfileConfig


class ProfileWindow:
    """Starts the profiler before `start_step`, steps it once per step, stops after `stop_step - 1`.

    Steps are 0-based optimizer steps, the same numbering as `range(start, steps)` in the trainer.
    """

    def __init__(self, cfg: ProfileConfig, out_dir: Path):
        self.cfg = cfg
        self.out_dir = out_dir
        self.profiler = None

    def before(self, step: int) -> None:
        if not self.cfg.enable or step != self.cfg.start_step:
            return
        from mindspore.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.out_dir.mkdir(parents=True, exist_ok=True)
        active = self.cfg.stop_step - self.cfg.start_step
        self.profiler = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.NPU],
            schedule=schedule(wait=0, warmup=0, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.out_dir)),
        )
        self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        if step + 1 == self.cfg.stop_step:
            self.close()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
