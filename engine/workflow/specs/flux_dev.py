"""``flux.1-dev``: FLUX.1 [dev], guidance-distilled: 28 steps, embedded guidance 3.5 (flux_common.py)."""

from engine.workflow.specs.flux_common import flux_spec

# FluxPipeline's defaults, which are dev's model card: 28 steps, guidance_scale 3.5, 512 T5 tokens.
SPEC = flux_spec("flux.1-dev", "FLUX.1 [dev] text-to-image with embedded guidance: a prompt to a png",
                 steps=28, max_steps=100, sequence=512, guidance=3.5)
