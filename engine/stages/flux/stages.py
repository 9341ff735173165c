"""FLUX.1 text_encode -> denoise -> vae_decode, each a named subset of diffusers' Flux modular blocks.

The blocks are the ones diffusers assembles into ``FluxAutoBlocks`` for text-to-image
(diffusers/modular_pipelines/flux/modular_blocks_flux.py), in its order and under its names; what crosses
a stage boundary is the spec's outputs (flux_common.py): the two text embeddings, then the unpacked latents.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.components import to_uint8
from engine.stages.modular import BatchedModularStage, ModularStage, SteppedModularStage, seeded
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")


def _vae_scale(vae: dict[str, Any]) -> int:
    return 2 ** (len(vae["block_out_channels"]) - 1)


class _Flux(ModularStage):
    pipeline = "flux.FluxModularPipeline"
    vae_scale = staticmethod(_vae_scale)


class FluxTextEncode(_Flux, BatchedModularStage):
    """Prompt -> ``prompt_embeds`` (T5, ``max_sequence_length`` tokens) and ``pooled_prompt_embeds`` (CLIP).

    Requests of one ``max_sequence_length`` encode in one call (BatchedModularStage): both tokenizers pad to
    a fixed length (CLIP's 77, T5's ``max_sequence_length``), so each item is its solo bytes
    (tests/engine/stages/test_light_batching.py)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "CLIPTokenizer"), "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"), "text_encoder_2": ("transformers", "T5EncoderModel"),
    }
    blocks: ClassVar[dict[str, str]] = {"text_encoder": "flux.encoders.FluxTextEncoderStep"}
    outputs: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_embeds",
                                         "pooled_prompt_embeds": "pooled_prompt_embeds"}

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {"prompt": params["prompt"], "max_sequence_length": int(params["max_sequence_length"])}

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        return int(params["max_sequence_length"])


class FluxDenoise(_Flux, SteppedModularStage):
    """Embeddings -> ``denoised`` latents (unpacked): noise from the seed, timesteps shifted by the image's
    token count where the scheduler says so (dev), the transformer's guidance embedding where it has one.

    Steps batch (engine.worker.batching): requests of one size and text length share one transformer call
    per step, each with its own timestep, guidance, scheduler and generator."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "transformer": ("diffusers", "FluxTransformer2DModel"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    }
    blocks: ClassVar[dict[str, str]] = {
        "text_inputs": "flux.inputs.FluxTextInputStep",
        "prepare_latents": "flux.before_denoise.FluxPrepareLatentsStep",
        "set_timesteps": "flux.before_denoise.FluxSetTimestepsStep",
        "prepare_rope_inputs": "flux.before_denoise.FluxRoPEInputsStep",
        "denoise": "flux.denoise.FluxDenoiseStep",
        "unpack_latents": "flux.decoders.FluxUnpackLatentsStep",
    }
    outputs: ClassVar[dict[str, str]] = {"denoised": "latents"}
    preview_family: ClassVar[str] = "flux"  # engine.stages.preview: packed tokens, scaling and shift
    denoiser: ClassVar[str | None] = "denoiser"  # quality below lossless: TaylorSeer lite (engine.stages.caching)

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        out = {
            "prompt_embeds": inputs["prompt_embeds"].to(self.device),
            "pooled_prompt_embeds": inputs["pooled_prompt_embeds"].to(self.device),
            "height": int(params["height"]), "width": int(params["width"]),
            "num_inference_steps": int(params["num_inference_steps"]), "generator": seeded(params),
        }
        if "guidance_scale" in params:  # dev: embedded guidance (ignored by a transformer without the embedding)
            out["guidance_scale"] = float(params["guidance_scale"])
        return out

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        # the packed latents' token count and the T5 text length make the shapes; the RoPE ids follow from them
        return (int(params["height"]), int(params["width"]), int(params["max_sequence_length"]))

    def step_batch(self, states: list[Any]) -> None:
        """The loop's denoiser once over every request's rows (FluxLoopDenoiser reads ``t.flatten()``: a
        timestep per row), then each request's own scheduler step (FluxLoopAfterDenoiser) on its rows."""
        loop = self._loop_block()
        # what this reproduces: FluxDenoiseStep's sub-blocks (another set, as a controlnet's, would be skipped)
        assert list(loop.sub_blocks) == ["denoiser", "after_denoiser"], list(loop.sub_blocks)
        denoiser, after = loop.sub_blocks["denoiser"], loop.sub_blocks["after_denoiser"]
        together = copy.copy(states[0].block_state)
        for name in ("latents", "prompt_embeds", "pooled_prompt_embeds", "guidance"):
            parts = [getattr(st.block_state, name, None) for st in states]
            setattr(together, name, None if parts[0] is None else torch.cat(parts))
        t = torch.stack([st.timesteps[st.i] for st in states])
        denoiser(self.pipe, together, i=states[0].i, t=t)
        for k, st in enumerate(states):
            st.block_state.noise_pred = together.noise_pred[k:k + 1]
            after(st.components, st.block_state, i=st.i, t=st.timesteps[st.i])


class FluxVaeDecode(_Flux):
    """``denoised`` -> ``pixels`` (1, H, W, 3) uint8: de-scale, de-shift, VAE decode, post-process."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {"vae": ("diffusers", "AutoencoderKL")}
    blocks: ClassVar[dict[str, str]] = {"decode": "flux.decoders.FluxDecodeStep"}
    outputs: ClassVar[dict[str, str]] = {"pixels": "images"}

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {"latents": inputs["denoised"].to(self.device, self.dtype), "output_type": "np",
                "height": int(params["height"]), "width": int(params["width"])}

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        images = super().run(inputs, params, ctx)["pixels"]
        return {"pixels": torch.from_numpy(to_uint8(images))}
