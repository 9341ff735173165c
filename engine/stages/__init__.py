"""Stage executors over diffusers/transformers components, and the tiny-model builder.

Importing this package is light; torch, diffusers and transformers are imported
by the executor modules (``engine.stages.wan.*``, ``engine.stages.sd.*``) when a
worker loads them.
"""
