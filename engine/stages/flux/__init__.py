"""Stage executors of ``flux.1-schnell`` and ``flux.1-dev``: Modular Diffusers' Flux blocks, cut into stages
(engine.stages.modular)."""
