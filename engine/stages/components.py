"""Helpers shared by the torch stage executors: loading components, devices, images.

Imported only by executor modules, so torch is imported here at module level.
"""

from __future__ import annotations

import copy
import functools
import importlib
import io
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.lazy import lazy
from engine.stages.base import InvalidInput, StageExecutor, compute_dtype_name, resolve_device
from engine.stages.layout import check_component
from engine.workflow.message import TensorData

if TYPE_CHECKING:
    import torch
else:
    torch = lazy("torch")

# transformers models take ``dtype=``; diffusers models and pipelines ``torch_dtype=``.
_DTYPE_KWARG = {"transformers": "dtype", "diffusers": "torch_dtype"}


def model_index(model_dir: str | Path) -> dict[str, Any]:
    """The folder's ``model_index.json`` (empty when absent: single components still load)."""
    path = Path(model_dir) / "model_index.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def read_config(model_dir: str | Path, component: str) -> dict[str, Any]:
    """A component's ``config.json`` without loading its weights.

    Stages read derived settings (VAE scale factors, patch sizes) this way from
    the component that defines them, instead of trusting a pipeline's fallback
    for a component it was not given (see MODELS.md, "Pitfall").
    """
    return json.loads((check_component(model_dir, component) / "config.json").read_text())


def load_component(
    model_dir: str | Path, component: str, default: tuple[str, str], dtype: torch.dtype | None = None,
    device: str | None = None,
) -> Any:
    """Load ``model_dir/component`` with the class ``model_index.json`` names (else ``default``).

    Using the recorded class is what ``DiffusionPipeline.from_pretrained`` does,
    so a stage and the one-call pipeline get the same objects from one folder.
    """
    folder = check_component(model_dir, component)
    library, class_name = model_index(model_dir).get(component) or default
    if library is None:
        library, class_name = default
    cls = getattr(importlib.import_module(library), class_name)
    kwargs: dict[str, Any] = {}
    if dtype is not None and isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        kwargs[_DTYPE_KWARG.get(library, "torch_dtype")] = dtype
    obj = cls.from_pretrained(str(folder), **kwargs)
    if device is not None and isinstance(obj, torch.nn.Module):
        obj = obj.to(device).eval()
    return obj


def no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``@torch.no_grad()`` that imports torch at the first call, not when the class is defined
    (:mod:`engine.lazy`): the first call wraps ``fn`` with torch's own decorator, and every call goes through
    that wrapper (one Python call more than the decorator itself)."""
    wrapped: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal wrapped
        if wrapped is None:
            wrapped = torch.no_grad()(fn)
        return wrapped(*args, **kwargs)

    return call


class TorchStage(StageExecutor):
    """A stage executor on torch: resolves the device and the compute dtype once.

    A stage that sets ``classes`` (component -> the ``(library, class)`` to load it with when
    ``model_index.json`` names none) and not ``components`` gets ``components`` from its keys, and
    :meth:`load_components` loads them all."""

    components: ClassVar[tuple[str, ...]] = ()
    classes: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "classes" in cls.__dict__ and "components" not in cls.__dict__:
            cls.components = tuple(cls.classes)

    def load_components(self, model_dir: Path) -> dict[str, Any]:
        """Every component in ``classes``, by name; the modules in the compute dtype, on the device."""
        return {c: load_component(model_dir, c, default, self.dtype, self.device)
                for c, default in self.classes.items()}

    def load(self, model_dir: str | Path, device: str | None = None) -> None:
        for c in self.components:
            check_component(model_dir, c)
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype_name = compute_dtype_name(self.device)
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self._load(self.model_dir)

    def _load(self, model_dir: Path) -> None:
        """Load this stage's components (called once by :meth:`load`)."""

    def fresh_scheduler(self, scheduler: Any) -> Any:
        """A scheduler of ``scheduler``'s class and config in its initial state, for one request (schedulers
        keep per-run state: step index, history): a deep copy of a pristine one made once per config by
        ``from_config`` and never stepped, the same object ``from_config`` gives at a quarter of its CPU
        (diffusers reads the class's signature on every ``from_config``)."""
        key = (type(scheduler), json.dumps(scheduler.config, sort_keys=True, default=str))
        pristine = self.__dict__.setdefault("_pristine_schedulers", {})
        if key not in pristine:
            pristine[key] = type(scheduler).from_config(scheduler.config)
        return copy.deepcopy(pristine[key])


def decode_image(data: bytes | bytearray | memoryview, name: str = "image") -> Any:
    """Bytes of an image file -> RGB ``PIL.Image``; :class:`InvalidInput` if not an image."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(bytes(data)))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput(name, f"{name} is not a readable image: {exc}") from exc
    return ImageOps.exif_transpose(img).convert("RGB")


def to_uint8(images: Any) -> Any:
    """Float images in [0, 1] -> uint8, exactly as diffusers' ``numpy_to_pil`` rounds."""
    return (images * 255).round().astype("uint8")


def to_torch(t: TensorData) -> torch.Tensor:
    """Wrap a decoded message tensor as a torch tensor without copying.

    The tensor aliases the message buffer: treat it as read-only and do not
    keep it past the buffer's lifetime (``.clone()`` if you must).
    """
    import warnings

    n = math.prod(t.shape)
    if n == 0:
        return torch.empty(t.shape, dtype=getattr(torch, t.dtype))
    with warnings.catch_warnings():
        # Read-only buffers (bytes) trigger a warning; stages never write inputs.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(t.data, dtype=getattr(torch, t.dtype), count=n)
    return flat.view(t.shape)


def from_torch(tensor: torch.Tensor) -> TensorData:
    """Describe a tensor for the codec: moved to CPU, made contiguous, viewed as bytes."""
    cpu = tensor.detach().to("cpu").contiguous()
    if cpu.numel() and cpu.stride()[-1] != 1:  # an expanded size-1 dim counts as contiguous but has stride 0
        cpu = torch.empty_like(cpu, memory_format=torch.contiguous_format).copy_(cpu)
    # A flat uint8 view works for every dtype, bfloat16 included (numpy has none).
    data = cpu.reshape(-1).view(torch.uint8).numpy() if cpu.numel() else b""
    return TensorData(str(cpu.dtype).removeprefix("torch."), tuple(cpu.shape), data)


def values_to_message(values: Mapping[str, Any]) -> tuple[dict[str, TensorData], dict[str, Any]]:
    """Split stage outputs into codec tensors and blobs."""
    tensors: dict[str, TensorData] = {}
    blobs: dict[str, Any] = {}
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            tensors[name] = from_torch(v)
        else:
            blobs[name] = v
    return tensors, blobs
