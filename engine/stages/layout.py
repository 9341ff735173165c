"""Which files make a component in a model folder (the published diffusers layout).

Torch-free, so ``onepiece run`` and ``onepiece models check`` can refuse a bad
folder before importing anything heavy.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.stages.base import MissingComponent

_WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# component -> (required config file, needs weights)
_KINDS: dict[str, tuple[str, bool]] = {
    "tokenizer": ("tokenizer_config.json", False),
    "text_encoder": ("config.json", True),
    "tokenizer_2": ("tokenizer_config.json", False),  # FLUX.1's second (T5) text encoder
    "text_encoder_2": ("config.json", True),
    "image_encoder": ("config.json", True),
    "image_processor": ("preprocessor_config.json", False),
    "feature_extractor": ("preprocessor_config.json", False),
    "vae": ("config.json", True),
    "transformer": ("config.json", True),
    "unet": ("config.json", True),
    "scheduler": ("scheduler_config.json", False),
}


def check_component(model_dir: str | Path, component: str) -> Path:
    """Return the component's folder, or raise :class:`MissingComponent` naming what is absent."""
    root = Path(model_dir)
    if not root.is_dir():
        raise MissingComponent(component, root, "model folder does not exist")
    folder = root / component
    if not folder.is_dir():
        raise MissingComponent(component, folder, "folder not found")
    config, weights = _KINDS.get(component, ("config.json", False))
    if not (folder / config).is_file():
        raise MissingComponent(component, folder / config, "config file not found")
    if weights and not any(any(folder.glob(pattern)) for pattern in _WEIGHTS):
        raise MissingComponent(component, folder, "no weight files (*.safetensors or *.bin)")
    return folder


def check_components(model_dir: str | Path, components: Iterable[str]) -> None:
    """Check every component; raises on the first one missing."""
    for c in components:
        check_component(model_dir, c)
