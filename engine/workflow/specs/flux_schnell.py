"""``flux.1-schnell``: FLUX.1 [schnell], timestep-distilled: ~4 steps, no guidance (flux_common.py)."""

from engine.workflow.specs.flux_common import flux_spec

# Its model card: 4 steps, max_sequence_length 256, guidance_scale 0 (the transformer has no guidance
# embedding, so the spec takes no guidance_scale: a request that sends one is refused, naming it). Distilled
# for 1-4 steps, more do not help it; 16 leaves room to try.
SPEC = flux_spec("flux.1-schnell", "FLUX.1 [schnell] text-to-image in ~4 steps: a prompt to a png",
                 steps=4, max_steps=16, sequence=256, guidance=None)
