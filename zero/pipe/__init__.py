"""Pipeline parallelism: DeepSpeed's PipelineModule / LayerSpec API on torch.distributed.pipelining,
composed with ZeRO over each stage's data-parallel group (see docs/parallelism.md).

    model = zero.pipe.PipelineModule(layers=[LayerSpec(...), ...], num_stages=2, loss_fn=loss)
    engine, *_ = zero.initialize(model=model, config=config)
    loss = engine.train_batch(data_iter)
"""
from zero.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
