"""The configuration: every key (schema), how a YAML file becomes a validated Config (load, validate),
and every decision derived from the parallel keys (layout). Of ours it imports only the architecture
registry below it (models/spec.py, models/archs/), which is data.
"""

from mindscale.config.errors import ConfigError, UserError
from mindscale.config.layout import (
    OPTIMIZER_SHARD_MIN_KIB,
    Layout,
    offload_layer_counts,
    recompute_layer_counts,
    stage_layer_counts,
)
from mindscale.config.load import (
    HARDWARE_DIR,
    REPO_ROOT,
    apply_override,
    config_from_tree,
    load_config,
    load_yaml_tree,
    parse_yaml,
    reference_markdown,
)
from mindscale.config.schema import (
    TEMPLATE_NAMES,
    CheckpointConfig,
    Config,
    DataConfig,
    FinetuneConfig,
    HardwareConfig,
    LoraConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    OffloadConfig,
    ParallelConfig,
    ProfileConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
)
from mindscale.config.validate import validate, validate_packed

__all__ = [
    "ConfigError",
    "UserError",
    "OPTIMIZER_SHARD_MIN_KIB",
    "Layout",
    "offload_layer_counts",
    "recompute_layer_counts",
    "stage_layer_counts",
    "HARDWARE_DIR",
    "REPO_ROOT",
    "apply_override",
    "config_from_tree",
    "load_config",
    "load_yaml_tree",
    "parse_yaml",
    "reference_markdown",
    "TEMPLATE_NAMES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "FinetuneConfig",
    "HardwareConfig",
    "LoraConfig",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
    "OffloadConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RecomputeConfig",
    "RunConfig",
    "TrainConfig",
    "validate",
    "validate_packed",
]
