"""Qwen-Image text_encode -> denoise -> vae_decode, each a named subset of diffusers' QwenImage modular blocks.

The blocks are the text-to-image ones of ``QwenImageAutoBlocks``
(diffusers/modular_pipelines/qwenimage/modular_blocks_qwenimage.py: ``QwenImageCoreDenoiseStep``,
``QwenImageDecodeStep``), in order and by name. True classifier-free guidance follows QwenImagePipeline:
on when the request has a ``negative_prompt`` and ``true_cfg_scale`` > 1 (the blocks' guider would use an
empty negative prompt otherwise; the text stage always encodes one, so every message has the same values).
"""

from __future__ import annotations

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
    return 2 ** len(vae["temperal_downsample"])


def cfg_scale(params: Mapping[str, Any]) -> float:
    """The guider's scale: ``true_cfg_scale`` where QwenImagePipeline guides, 1 (one pass) otherwise."""
    scale = float(params["true_cfg_scale"])
    return scale if params.get("negative_prompt") is not None and scale > 1.0 else 1.0


class _Qwen(ModularStage):
    pipeline = "qwenimage.QwenImageModularPipeline"
    vae_scale = staticmethod(_vae_scale)


class QwenTextEncode(_Qwen, BatchedModularStage):
    """Prompt and negative prompt -> their Qwen2.5-VL embeddings and masks (the chat template's system
    prefix dropped, as the pipeline does).

    Requests whose prompt and negative prompt have the same token counts encode in one call
    (BatchedModularStage): the tokenizer pads a batch to its longest prompt, so only prompts of one length
    share one, and each item is its solo bytes (tests/engine/stages/test_light_batching.py)."""

    batched_inputs: ClassVar[tuple[str, ...]] = ("prompt", "negative_prompt")
    per_sample: ClassVar[bool] = True  # measured: a batch's projections differ in the last bits otherwise

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
        # the block encodes "" for a missing negative prompt (``negative_prompt or ""``): in a list, each item
        return {"prompt": params["prompt"], "negative_prompt": params.get("negative_prompt") or "",
                "max_sequence_length": int(params["max_sequence_length"])}

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        block = self.block_seq.sub_blocks["text_encoder"]
        lengths = tuple(len(self.pipe.tokenizer(block.prompt_template_encode.format(p)).input_ids)
                        for p in (params["prompt"], params.get("negative_prompt") or ""))
        return (int(params["max_sequence_length"]), *lengths)


class QwenDenoise(_Qwen, SteppedModularStage):
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
    # quality below lossless: TaylorSeer lite (engine.stages.caching), a cache per guidance pass as
    # QwenImagePipeline's cache_context("cond") / ("uncond") gives diffusers' hook
    denoiser: ClassVar[str | None] = "denoiser"
    cache_per_pass: ClassVar[bool] = True
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

    def setup_loop(self, components: Any, block_state: Any) -> None:
        super().setup_loop(components, block_state)
        block_state.additional_cond_kwargs = {}  # as QwenImageDenoiseLoopWrapper.__call__ starts it

    def batch_key(self, params: Mapping[str, Any], options: Options = DEFAULT_OPTIONS) -> Any:
        # one latent shape; the text lengths may differ (each step groups the rows by length: step_batch)
        if type(self.pipe.guider).__name__ != "ClassifierFreeGuidance":
            return None  # another guider may change the model between its passes (prepare_models)
        return (int(params["height"]), int(params["width"]))

    def step_batch(self, states: list[Any]) -> None:
        """QwenImageLoopDenoiser's work for several requests: each request's guider (its own scale) splits it
        into its cond (and uncond) pass; the passes of every request whose text has one length run in one
        transformer call (a timestep per row), then each request's guider combines its passes, the norm
        rescale follows, and its own scheduler steps (the loop's after_denoiser). A pass whose cache
        predicts this step takes its prediction and joins no call (a request below lossless steps here even
        alone)."""
        loop = self._loop_block()
        # what this reproduces: QwenImageDenoiseStep's sub-blocks, the denoiser's by hand (another set, as
        # inpainting's or a controlnet's, would be skipped)
        assert list(loop.sub_blocks) == ["before_denoiser", "denoiser", "after_denoiser"], list(loop.sub_blocks)
        before, after = loop.sub_blocks["before_denoiser"], loop.sub_blocks["after_denoiser"]
        accepted = self._transformer_args()
        plans = []
        rows: dict[tuple[int, bool], list[tuple[Any, Any, Any]]] = {}
        for st in states:
            bs, t = st.block_state, st.timesteps[st.i]
            before(st.components, bs, i=st.i, t=t)
            guider_inputs = {
                "encoder_hidden_states": (getattr(bs, "prompt_embeds", None), getattr(bs, "negative_prompt_embeds", None)),
                "encoder_hidden_states_mask": (getattr(bs, "prompt_embeds_mask", None),
                                               getattr(bs, "negative_prompt_embeds_mask", None)),
            }
            bs.additional_cond_kwargs.update({k: v for k, v in bs.denoiser_input_fields.items()
                                              if k in accepted and k not in guider_inputs})
            guider = st.components.guider
            guider.set_state(step=st.i, num_inference_steps=bs.num_inference_steps, timestep=t)
            passes = guider.prepare_inputs(guider_inputs)
            plans.append((st, passes))
            for n, p in enumerate(passes):
                cache = None if st.cache is None else st.cache.of(n)
                if cache is not None and not cache.should_compute():
                    p.noise_pred = cache.predict()  # this pass's transformer call is skipped
                    continue
                key = (int(p.encoder_hidden_states.shape[1]), p.encoder_hidden_states_mask is None)
                rows.setdefault(key, []).append((st, p, cache))
        for group in rows.values():
            self._call(group)
        for st, passes in plans:
            guided = st.components.guider(passes)
            pred_cond_norm = torch.norm(guided.pred_cond, dim=-1, keepdim=True)
            pred_norm = torch.norm(guided.pred, dim=-1, keepdim=True)
            st.block_state.noise_pred = guided.pred * (pred_cond_norm / pred_norm)
            after(st.components, st.block_state, i=st.i, t=st.timesteps[st.i])

    def _call(self, group: list[tuple[Any, Any, Any]]) -> None:
        """One transformer call over passes (request, pass, its cache) whose text has one length; each pass
        takes its row of the output, and its cache takes it too."""
        bss = [st.block_state for st, _, _ in group]
        masks = [p.encoder_hidden_states_mask for _, p, _ in group]
        extra: dict[str, Any] = {}
        for k in bss[0].additional_cond_kwargs:
            vals = [b.additional_cond_kwargs[k] for b in bss]
            extra[k] = [x for v in vals for x in v] if isinstance(vals[0], list) else torch.cat(vals)
        out = self.pipe.transformer(
            hidden_states=torch.cat([b.latent_model_input for b in bss]),
            timestep=torch.cat([b.timestep for b in bss]) / 1000,
            attention_kwargs=bss[0].attention_kwargs, return_dict=False,
            encoder_hidden_states=torch.cat([p.encoder_hidden_states for _, p, _ in group]),
            encoder_hidden_states_mask=None if masks[0] is None else torch.cat(masks),
            **extra)[0]
        for k, (_, p, cache) in enumerate(group):
            p.noise_pred = out[k:k + 1]
            if cache is not None:
                cache.update(p.noise_pred)

    def _transformer_args(self) -> set[str]:
        import inspect

        return set(inspect.signature(self.pipe.transformer.forward).parameters)

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
