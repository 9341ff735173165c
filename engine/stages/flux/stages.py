"""FLUX.1 text_encode -> denoise -> vae_decode, each a named subset of diffusers' Flux modular blocks.

The blocks are the ones diffusers assembles into ``FluxAutoBlocks`` for text-to-image
(diffusers/modular_pipelines/flux/modular_blocks_flux.py), in its order and under its names; what crosses
a stage boundary is the spec's outputs (flux_common.py): the two text embeddings, then the unpacked latents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from engine.stages.components import to_uint8
from engine.stages.modular import ModularStage, seeded


def _vae_scale(vae: dict[str, Any]) -> int:
    return 2 ** (len(vae["block_out_channels"]) - 1)


class _Flux(ModularStage):
    pipeline = "flux.FluxModularPipeline"
    vae_scale = staticmethod(_vae_scale)


class FluxTextEncode(_Flux):
    """Prompt -> ``prompt_embeds`` (T5, ``max_sequence_length`` tokens) and ``pooled_prompt_embeds`` (CLIP)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "CLIPTokenizer"), "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"), "text_encoder_2": ("transformers", "T5EncoderModel"),
    }
    blocks: ClassVar[dict[str, str]] = {"text_encoder": "flux.encoders.FluxTextEncoderStep"}
    outputs: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_embeds",
                                         "pooled_prompt_embeds": "pooled_prompt_embeds"}

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {"prompt": params["prompt"], "max_sequence_length": int(params["max_sequence_length"])}


class FluxDenoise(_Flux):
    """Embeddings -> ``denoised`` latents (unpacked): noise from the seed, timesteps shifted by the image's
    token count where the scheduler says so (dev), the transformer's guidance embedding where it has one."""

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
