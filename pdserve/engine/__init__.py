"""The inference engine: block pool, scheduler, model runner, sampler and the engine loop."""
