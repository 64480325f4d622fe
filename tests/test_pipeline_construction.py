"""The pipeline-parallel train step is built on CPU exactly as on Ascend (compiling it needs Ascend/GPU)."""
import mindspore as ms
import pytest
from mindspore.parallel.nn import Pipeline, PipelineGradReducer

import models
from training.config import REPO_ROOT, load_config
from training.optim import build_optimizer
from training.train_step import TrainStep


@pytest.fixture
def semi_auto_pipeline():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, device_num=8, pipeline_stages=2)
    yield
    ms.reset_auto_parallel_context()


def test_pipeline_train_step_is_constructed_with_stages_and_reducer(semi_auto_pipeline):
    cfg = load_config(REPO_ROOT / "configs" / "tiny" / "llama_tiny.yaml",
                      ["hardware=ascend910b", "model.num_layers=4", "parallel.data_parallel=2",
                       "parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.micro_batch_num=4",
                       "parallel.stage_offset=[1, -1]"])
    model = models.build_model(cfg)
    network = Pipeline(models.build_train_network(cfg, model), cfg.parallel.micro_batch_num)
    models.apply_sharding_plan(model, cfg)
    step = TrainStep(network, build_optimizer(network.trainable_params(), cfg.train), cfg)
    assert isinstance(step.reducer, PipelineGradReducer)
    assert [model.layers[i].pipeline_stage for i in range(4)] == [0, 0, 0, 1]
