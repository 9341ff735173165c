"""Qwen-Image text_encode -> denoise -> vae_decode, each a named subset of diffusers' QwenImage modular blocks.

The blocks are the text-to-image ones of ``QwenImageAutoBlocks``
(diffusers/modular_pipelines/qwenimage/modular_blocks_qwenimage.py: ``QwenImageCoreDenoiseStep``,
``QwenImageDecodeStep``), in order and by name. True classifier-free guidance follows QwenImagePipeline:
on when the request has a ``negative_prompt`` and ``true_cfg_scale`` > 1 (the blocks' guider would use an
empty negative prompt otherwise; the text stage always encodes one, so every message has the same values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from engine.stages.components import to_uint8
from engine.stages.modular import ModularStage, seeded


def _vae_scale(vae: dict[str, Any]) -> int:
    return 2 ** len(vae["temperal_downsample"])


def cfg_scale(params: Mapping[str, Any]) -> float:
    """The guider's scale: ``true_cfg_scale`` where QwenImagePipeline guides, 1 (one pass) otherwise."""
    scale = float(params["true_cfg_scale"])
    return scale if params.get("negative_prompt") is not None and scale > 1.0 else 1.0


class _Qwen(ModularStage):
    pipeline = "qwenimage.QwenImageModularPipeline"
    vae_scale = staticmethod(_vae_scale)


class QwenTextEncode(_Qwen):
    """Prompt and negative prompt -> their Qwen2.5-VL embeddings and masks (the chat template's system
    prefix dropped, as the pipeline does)."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    }
    blocks: ClassVar[dict[str, str]] = {"text_encoder": "qwenimage.encoders.QwenImageTextEncoderStep"}
    outputs: ClassVar[dict[str, str]] = {
        "prompt_embeds": "prompt_embeds", "prompt_embeds_mask": "prompt_embeds_mask",
        "negative_prompt_embeds": "negative_prompt_embeds", "negative_prompt_embeds_mask": "negative_prompt_embeds_mask",
    }

    def prepare(self, params: Mapping[str, Any]) -> None:
        self.pipe.guider.guidance_scale = 2.0  # > 1: the negative embeddings are always made (see above)

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {"prompt": params["prompt"], "negative_prompt": params.get("negative_prompt"),
                "max_sequence_length": int(params["max_sequence_length"])}


class QwenDenoise(_Qwen):
    """Embeddings -> ``denoised`` latents (B, C, 1, H, W): noise from the seed, the exponential time shift
    by the image's token count, cond/uncond passes combined and renormalised as the pipeline does."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {
        "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    }
    blocks: ClassVar[dict[str, str]] = {
        "input": "qwenimage.inputs.QwenImageTextInputsStep",
        "prepare_latents": "qwenimage.before_denoise.QwenImagePrepareLatentsStep",
        "set_timesteps": "qwenimage.before_denoise.QwenImageSetTimestepsStep",
        "prepare_rope_inputs": "qwenimage.before_denoise.QwenImageRoPEInputsStep",
        "denoise": "qwenimage.denoise.QwenImageDenoiseStep",
        "after_denoise": "qwenimage.decoders.QwenImageAfterDenoiseStep",
    }
    outputs: ClassVar[dict[str, str]] = {"denoised": "latents"}
    preview_family: ClassVar[str] = "qwen"  # engine.stages.preview: packed tokens, latents_mean / latents_std

    def prepare(self, params: Mapping[str, Any]) -> None:
        self.pipe.guider.guidance_scale = cfg_scale(params)

    def before_step(self, block_state: Any) -> None:
        # QwenImagePipeline.encode_prompt passes no mask when every token counts (one prompt: always); the
        # blocks pass the all-ones mask on (their input step requires one), which makes the attention a
        # masked one: the same bytes on the CPU, but on CUDA a mask rules out the flash kernel. So the
        # transformer gets what the pipeline gives it.
        for key in ("prompt_embeds_mask", "negative_prompt_embeds_mask"):
            mask = getattr(block_state, key, None)
            if mask is not None and bool(mask.all()):
                setattr(block_state, key, None)

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        guided = cfg_scale(params) > 1.0
        out = {k: inputs[k].to(self.device) for k in ("prompt_embeds", "prompt_embeds_mask")}
        if guided:
            out.update({k: inputs[k].to(self.device) for k in ("negative_prompt_embeds", "negative_prompt_embeds_mask")})
        out.update(height=int(params["height"]), width=int(params["width"]),
                   num_inference_steps=int(params["num_inference_steps"]), generator=seeded(params))
        return out


class QwenVaeDecode(_Qwen):
    """``denoised`` -> ``pixels`` (1, H, W, 3) uint8: de-normalise (latents_mean/std), decode, post-process."""

    classes: ClassVar[dict[str, tuple[str, str]]] = {"vae": ("diffusers", "AutoencoderKLQwenImage")}
    blocks: ClassVar[dict[str, str]] = {"decode": "qwenimage.decoders.QwenImageDecoderStep",
                                        "postprocess": "qwenimage.decoders.QwenImageProcessImagesOutputStep"}
    outputs: ClassVar[dict[str, str]] = {"pixels": "images"}

    def block_inputs(self, inputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        return {"latents": inputs["denoised"].to(self.device, self.dtype), "output_type": "np"}

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: Any) -> dict[str, Any]:
        images = super().run(inputs, params, ctx)["pixels"]
        return {"pixels": torch.from_numpy(to_uint8(images))}
