"""The balancing keys of model.moe (bias_update_rate, seq_aux_loss_coeff): bad values are refused in one line
naming the key and the fix, exit 2 from the command line."""

import re
import subprocess
import sys

import pytest

from mindscale.config import REPO_ROOT, ConfigError, load_config

DEEPSEEK_V3_TINY = REPO_ROOT / "configs" / "tiny" / "deepseek_v3_tiny.yaml"
MIXTRAL_TINY = REPO_ROOT / "configs" / "tiny" / "mixtral_tiny.yaml"


@pytest.mark.parametrize(
    "config, key, message",
    [
        (DEEPSEEK_V3_TINY, "model.moe.bias_update_rate=-0.001", "model.moe.bias_update_rate=-0.001: must be >= 0"),
        (DEEPSEEK_V3_TINY, "model.moe.seq_aux_loss_coeff=-1", "model.moe.seq_aux_loss_coeff=-1.0: must be >= 0"),
        (
            DEEPSEEK_V3_TINY,
            "train.eval_interval=10",
            "model.moe.bias_update_rate=0.001 with train.eval_interval=10: the held-out passes would add their "
            "tokens to the next step's expert counts; set eval_interval to 0 or bias_update_rate to 0",
        ),
        (
            MIXTRAL_TINY,
            "model.moe.bias_update_rate=0.001",
            "model.moe.bias_update_rate=0.001 with model.moe.router=softmax: only the sigmoid router has a bias "
            "to update; set bias_update_rate to 0 or use router: sigmoid",
        ),
    ],
)
def test_bad_balancing_keys_are_refused(config, key, message):
    keys = [key] if "bias_update_rate" in key else [key, "model.moe.bias_update_rate=0.001"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config, keys)


def test_the_deepseek_v3_config_trains_with_the_reports_balancing_under_its_stages():
    """DeepSeek-V3 §2.1.2 and §4.2: the bias update at gamma 0.001 and the sequence-wise loss at alpha 1e-4, no
    batch-wise auxiliary loss, under the config's 16 pipeline stages (each stage moves the biases of its own
    layers: tests/dryrun/test_expert_balance.py); the default is a frozen bias."""
    path = REPO_ROOT / "configs" / "deepseek_v3" / "deepseek_v3_671b.yaml"
    cfg = load_config(path)
    moe = cfg.model.moe
    assert (moe.bias_update_rate, moe.seq_aux_loss_coeff, moe.aux_loss_coeff) == (0.001, 0.0001, 0.0)
    assert cfg.parallel.pipeline_stage == 16
    assert load_config(DEEPSEEK_V3_TINY).model.moe.bias_update_rate == 0.0


@pytest.mark.integration
def test_a_negative_rate_is_one_line_and_exit_2():
    bad = subprocess.run(
        [
            sys.executable,
            "tools/config.py",
            "--config",
            str(DEEPSEEK_V3_TINY),
            "--set",
            "model.moe.bias_update_rate=-1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "bias_update_rate=-1.0" in bad.stderr
