"""MindScale training entry point.

    python run_train.py --config configs/tiny/llama_tiny.yaml [--set train.steps=10 ...]

Under msrun (scripts/run_distribute.sh) every worker runs this file. Exit status: 0 success,
2 bad input (config, data, checkpoint, worker count) with one line on stderr, 1 anything else.
A health guard (mindscale/train/resilience/health.py) stops a diverged run with one line, exit 1; under the
launcher it leaves that line in logs/worker_<rank>.diverged too, so the run is not restarted.
SIGTERM or SIGUSR1 finishes the step, saves a committed checkpoint and exits 0 (a second signal stops
at once): mindscale/train/resilience/stop.py.
"""

import argparse
import gc
import os
import sys

from mindscale.config import UserError
from mindscale.cli import add_config_arguments, config_from_args, fail
from mindscale.train.resilience.health import TrainingDiverged
from mindscale.train.resilience.heartbeat import record_divergence
from mindscale.launch.runlock import HOLDER_ENV
from mindscale.train.resilience.stop import StopRequest


def main(argv=None) -> int:
    # first: a signal during start-up must not kill the process; under the launcher it escalates, not we
    stop = StopRequest(escalate=HOLDER_ENV not in os.environ).install()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)

    from mindscale.launch import runlock
    from mindscale.launch.msrun import QUIET_MINDSPORE

    os.environ.setdefault(*QUIET_MINDSPORE)  # before MindSpore loads: its warnings only when GLOG_v asks
    from mindscale.train.loop.runtime import setup
    from mindscale.train.loop.trainer import Trainer

    gc.freeze()  # the imports' objects live as long as the process: no collection walks them (~7% of a tiny CPU run)
    try:
        runtime = setup(cfg)
        # the launcher holds this run folder's lock for its workers; run without it, rank 0 takes it
        with runlock.hold(cfg.run_dir, runtime.is_main and not runlock.held_by_launcher(cfg.run_dir)):
            Trainer(cfg, runtime).train(stop)
    except UserError as exc:  # every error a user can fix: one line, exit 2
        fail(str(exc))
    except TrainingDiverged as exc:  # a health guard stopped the run: one line, exit 1
        record_divergence(runtime.rank, str(exc))
        fail(str(exc), code=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
