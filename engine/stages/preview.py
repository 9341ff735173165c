"""Live previews of a denoise stage: the current latents -> a small JPEG in the job store.

A request with ``preview_every`` = N > 0 gets, after every N-th denoising step, a picture of its current
latents, published to the job store (``JobStore.preview.add``, a Redis stream per job, never the ring) for
the job's websocket and ``GET .../preview``. The denoise loop hands over a copy, never a reference (the next
step may write its latents in place): on the CPU, once the projection is fitted, the small uint8 picture
itself (:meth:`Renderer.keep`: one matrix product over the latent grid, ~0.1 ms); otherwise (the first
previews, latents on a GPU) a :func:`snapshot` copied on their device, with no host sync. This module makes
the pictures; the worker's publisher that renders and writes them off the step loop is
:class:`engine.worker.previews.Previews`.

Two ways to make the picture (``METHODS``), measured in ``benchmarks/previews.md``:

* ``linear`` (the default): a per-channel linear map latent -> RGB plus a bias, as ComfyUI's
  ``latent_rgb_factors`` and diffusers' community callbacks do. The factors are not copied from a table
  for a published model: they are fitted, once per worker, by least squares against *the loaded VAE*'s
  decode of smooth random latents (:func:`fit_projection`), so they fit whatever model the folder holds
  (the tiny random-weight VAEs included). The VAE is then dropped.
* ``vae``: the model's VAE decoding the latents shrunk to at most :data:`MAX_SIDE` pixels.

The picture is encoded as JPEG (:data:`FORMATS`; PNG is the other choice): the PNG encode was three
quarters of a preview's CPU (``benchmarks/previews.md``), a JPEG of the same size (quality 90, 4:4:4) costs
about a tenth of it and is 2-5x fewer bytes; the store carries the mime type to both routes and the websocket.

Families (``preview_family`` on a denoise executor) say how the loop's latents reach the VAE: SD
(``/ scaling_factor``), FLUX (packed 2x2 tokens; ``/ scaling_factor + shift_factor``), Wan and Qwen-Image
(5-D, normalised by ``latents_mean`` / ``latents_std``; a video previews its middle latent frame).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the longest side of a preview, pixels
MAX_SIDE = 256
METHODS = ("linear", "vae")
#: encodings: Pillow format, its save options, mime type
#: (JPEG: 4:4:4, no chroma subsampling: an early step's preview is per-pixel colour noise, which 4:2:0 smears)
FORMATS = {"jpeg": ("JPEG", {"quality": 90, "subsampling": 0}, "image/jpeg"),
           "png": ("PNG", {"compress_level": 1}, "image/png")}


@dataclass(frozen=True)
class Family:
    """How one model family's loop latents become the VAE's input."""

    vae_class: tuple[str, str]
    five_d: bool  # the VAE takes (B, C, T, H, W)
    normalised: bool  # latents_mean / latents_std (Wan, Qwen-Image); else scaling_factor (+ shift_factor)


FAMILIES = {
    "sd": Family(("diffusers", "AutoencoderKL"), False, False),
    "flux": Family(("diffusers", "AutoencoderKL"), False, False),
    "wan": Family(("diffusers", "AutoencoderKLWan"), True, True),
    "qwen": Family(("diffusers", "AutoencoderKLQwenImage"), True, True),
}


def unpack(latents: Any, height: int, width: int) -> Any:
    """FLUX / Qwen-Image packed tokens (B, (h/2)(w/2), 4C) -> (B, C, h, w) (diffusers' ``_unpack_latents``;
    ``height``, ``width``: the latent grid)."""
    b, _n, c4 = latents.shape
    c = c4 // 4
    return (latents.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
            .reshape(b, c, height, width))


def pick(latents: Any) -> Any:
    """The part of loop latents a preview draws, as a view: the first item (a video's middle latent frame)."""
    z = latents.detach()[:1]
    return z[:, :, z.shape[2] // 2] if z.ndim == 5 else z


def snapshot(latents: Any) -> Any:
    """What a preview keeps of the loop's latents, on the loop's thread: :func:`pick`'s part, copied where it
    lies (the next step may write the loop's tensor in place; no host sync)."""
    return pick(latents).clone()


def plane(latents: Any, grid: tuple[int, int] | None = None) -> Any:
    """The first item's latents as one (1, C, h, w) float32 CPU plane: unpacked (``grid``: latent rows and
    columns of packed tokens), a video's middle latent frame."""
    import torch

    z = latents.detach()[:1]
    if z.ndim == 3:
        if grid is None:
            raise ValueError("packed latents need their latent grid")
        z = unpack(z, *grid)
    if z.ndim == 5:
        z = z[:, :, z.shape[2] // 2]
    return z.to("cpu", torch.float32)


def to_vae(z: Any, family: Family, config: Mapping[str, Any]) -> Any:
    """Loop-space latents (1..n, C, h, w) -> what the family's VAE decodes (5-D where it wants frames)."""
    import torch

    if family.normalised:
        c = z.shape[1]
        mean = torch.tensor(config["latents_mean"], dtype=z.dtype).view(1, c, 1, 1)
        std = torch.tensor(config["latents_std"], dtype=z.dtype).view(1, c, 1, 1)
        z = z * std + mean
    else:
        z = z / config["scaling_factor"] + (config.get("shift_factor") or 0.0)
    return z.unsqueeze(2) if family.five_d else z


def decode(vae: Any, z: Any, family: Family) -> Any:
    """(n, C, h, w) loop latents -> (n, 3, H, W) RGB in about [-1, 1], through the VAE."""
    import torch

    with torch.no_grad():
        x = to_vae(z.to(vae.device, vae.dtype), family, vae.config)
        img = vae.decode(x, return_dict=False)[0]
    return (img[:, :, 0] if family.five_d else img).float().cpu()


@dataclass
class Projection:
    """latent (C) -> RGB (3) by ``factors`` (C x 3) and ``bias`` (3), fitted to a VAE; ``r2``: the share of
    the decode's (pooled) variance the fit explains on its own samples; ``scale``: VAE pixels per latent."""

    factors: Any
    bias: Any
    r2: float
    scale: int
    _to8: dict[bool, tuple[Any, Any]] = field(default_factory=dict, repr=False, compare=False)

    def rgb(self, z: Any) -> Any:
        """(1, C, h, w) -> (3, h, w) in about [-1, 1]."""
        import torch

        return torch.einsum("bchw,cr->brhw", z, self.factors)[0] + self.bias.view(3, 1, 1)

    def _weights(self, packed: bool) -> tuple[Any, Any]:
        """The map straight to uint8 levels (``(x + 1) * 127.5``, + 0.5 so truncation rounds), made once:
        for packed tokens, one 3-colour block per 2x2 position (token channel ``c * 4 + p`` -> ``r * 4 + p``)."""
        if packed not in self._to8:
            import torch

            w, b = self.factors.contiguous() * 127.5, (self.bias.contiguous() + 1) * 127.5 + 0.5
            if packed:
                w, b = torch.kron(w, torch.eye(4)), b.repeat_interleave(4)
            self._to8[packed] = (w.contiguous(), b.contiguous())
        return self._to8[packed]

    def pixels(self, z: Any, grid: tuple[int, int] | None = None) -> Any:
        """The first item of loop latents (``snapshot``'s: (1, C, h, w), or packed tokens (1, n, 4C) on the
        latent ``grid``) -> (h, w, 3) uint8 on the CPU: one matrix product over the latent grid, no unpacking
        of the latents (packed tokens are projected as they lie; the small uint8 picture is reordered)."""
        import torch

        z = z.detach()[0].to("cpu", torch.float32)
        if z.ndim == 2:
            if grid is None:
                raise ValueError("packed latents need their latent grid")
            (h, w), x = grid, z
        else:
            h, w = z.shape[-2:]
            x = z.reshape(z.shape[0], h * w).t()
        weights, bias = self._weights(z.ndim == 2)
        y = torch.addmm(bias, x, weights).clamp_(0.0, 255.0).to(torch.uint8)
        if z.ndim == 2:
            return y.view(h // 2, w // 2, 3, 2, 2).permute(0, 3, 1, 4, 2).reshape(h, w, 3)
        return y.view(h, w, 3)


def fit_projection(vae: Any, family: Family, channels: int, samples: int = 4, side: int = 16) -> Projection:
    """Least squares of the VAE's decode (average-pooled to the latent grid) on the latents, over smooth
    random latents (bilinear-upsampled noise: decoders see image-like fields, not white noise)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    z = F.interpolate(torch.randn(samples, channels, side // 4, side // 4, generator=g), size=(side, side),
                      mode="bilinear", align_corners=False)
    img = decode(vae, z, family)
    scale = img.shape[-1] // side
    pooled = F.adaptive_avg_pool2d(img, (side, side))
    x = torch.cat([z.permute(0, 2, 3, 1).reshape(-1, channels), torch.ones(samples * side * side, 1)], dim=1)
    y = pooled.permute(0, 2, 3, 1).reshape(-1, 3)
    sol = torch.linalg.lstsq(x.double(), y.double()).solution.float()
    resid = y - x @ sol
    r2 = float(1.0 - resid.pow(2).sum() / (y - y.mean(0)).pow(2).sum().clamp_min(1e-12))
    return Projection(sol[:channels], sol[channels], r2, max(scale, 1))


def check_format(fmt: str) -> None:
    """``ValueError`` naming the choices unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"preview format must be one of {tuple(FORMATS)}, got {fmt!r}")


def to_levels(rgb: Any) -> Any:
    """(3, h, w) in [-1, 1] -> (h, w, 3) uint8."""
    import torch

    return ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0)


def encode(pixels: Any, side: int, fmt: str = "jpeg") -> bytes:
    """(h, w, 3) uint8 -> image bytes in ``fmt`` (:data:`FORMATS`), resized so its longest side is ``side``
    (at most MAX_SIDE)."""
    from PIL import Image

    arr = pixels.contiguous().numpy()
    img = Image.fromarray(arr, "RGB")
    h, w = arr.shape[:2]
    side = min(side, MAX_SIDE)
    if max(h, w) != side:
        k = side / max(h, w)
        img = img.resize((max(1, round(w * k)), max(1, round(h * k))), Image.BILINEAR)
    out = io.BytesIO()
    name, options, _mime = FORMATS[fmt]
    img.save(out, format=name, **options)
    return out.getvalue()


class Renderer:
    """Makes one executor's previews (its family, its model folder's VAE), by ``method``, encoded as ``fmt``."""

    def __init__(self, model_dir: Path, family: str, device: str = "cpu", method: str = "linear",
                 fmt: str = "jpeg") -> None:
        if method not in METHODS:
            raise ValueError(f"preview method must be one of {METHODS}, got {method!r}")
        check_format(fmt)
        self.model_dir, self.family, self.device, self.method = Path(model_dir), FAMILIES[family], device, method
        self.fmt, self.mime = fmt, FORMATS[fmt][2]
        self.vae: Any = None
        self.projection: Projection | None = None

    def _vae(self) -> Any:
        import torch

        from engine.stages.components import load_component

        return load_component(self.model_dir, "vae", self.family.vae_class, torch.float32, self.device)

    def ready(self, channels: int) -> None:
        """Fit the projection (linear) or load the VAE (vae), once."""
        if self.method == "linear" and self.projection is None:
            vae = self._vae()
            self.projection = fit_projection(vae, self.family, channels)
            log.info("preview projection fitted to %s's VAE (r2 %.3f)", self.model_dir.name, self.projection.r2)
        elif self.method == "vae" and self.vae is None:
            self.vae = self._vae()

    def keep(self, latents: Any, grid: tuple[int, int] | None) -> tuple[Any, Any]:
        """On the loop's thread, what a preview keeps of its latents, copied: ``(None, pixels)``, the uint8
        picture itself, where they are on the CPU and the projection is fitted (one small product, several
        times cheaper on the loop's warm thread than on the preview thread, which wakes cold); else
        ``(snapshot, None)`` (the fit and any device-to-host copy stay off the loop)."""
        z = pick(latents)
        if self.projection is not None and z.device.type == "cpu":
            return None, self.projection.pixels(z, grid)
        return z.clone(), None

    def picture(self, latents: Any, grid: tuple[int, int] | None = None, pixels: Any = None) -> bytes:
        """A :func:`snapshot` of loop latents (packed tokens on their latent ``grid``), or their ``pixels``
        from :meth:`keep` -> image bytes (:attr:`mime`) of at most MAX_SIDE a side; the linear map runs on
        the latent grid and the uint8 picture is resized to the VAE's pixels (capped) once."""
        if self.method != "linear":
            return self.render(plane(latents, grid))
        if pixels is None:
            self.ready(latents.shape[-1] // 4 if latents.ndim == 3 else latents.shape[1])
            assert self.projection is not None
            pixels = self.projection.pixels(latents, grid)
        assert self.projection is not None
        return encode(pixels, max(pixels.shape[:2]) * self.projection.scale, self.fmt)

    def render(self, z: Any) -> bytes:
        """(1, C, h, w) loop latents (a :func:`plane`) -> image bytes, as :meth:`picture`."""
        import torch.nn.functional as F

        self.ready(z.shape[1])
        if self.method == "linear":
            return self.picture(z)
        config = self.vae.config
        scale = 2 ** (len(config["temperal_downsample"]) if self.family.five_d else len(config["block_out_channels"]) - 1)
        h, w = z.shape[-2:]
        k = min(1.0, MAX_SIDE / (scale * max(h, w)))
        if k < 1.0:  # the VAE at reduced size: shrink the latents first
            z = F.interpolate(z, size=(max(1, round(h * k)), max(1, round(w * k))), mode="bilinear")
        img = decode(self.vae, z, self.family)[0]
        return encode(to_levels(img), max(img.shape[-2:]), self.fmt)
