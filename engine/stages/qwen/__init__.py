"""Stage executors of ``qwen-image``: Modular Diffusers' QwenImage blocks, cut into stages
(engine.stages.modular)."""
