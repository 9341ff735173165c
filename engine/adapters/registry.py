"""The operators' adapter registry: which LoRA adapters exist, for which workflow, and their files.

The registry lives in the adapter store, a folder every node reads (the model
store: ``ONEPIECE_ADAPTER_STORE``, default ``<state dir>/adapters``; on several
hosts, a shared mount like the model folders)::

    <store>/registry.json                      {"adapters": {name: entry}}, replaced atomically
    <store>/files/<sha256>.safetensors         the adapter's bytes, named by their digest
    <store>/.lock                              flock(2) of writers (add, remove)

Only operators write it (``onepiece adapters add|remove``, the admin); the
Proxy, the web platform and the stage workers read it through
:class:`AdapterStore` (torch-free: validation reads safetensors headers only).
A client names an adapter; it never gives a path: :meth:`AdapterStore.file`
resolves an entry to a file inside the store and refuses anything else.

Adding validates before anything is served: a ``.safetensors`` file (given as
such, or as the folder diffusers' ``save_lora_weights`` writes) in the
diffusers/PEFT LoRA format (``<component>.<module>.lora_A.weight`` and
``.lora_B.weight`` pairs), every target module a weight of that workflow's
denoise model with matching shapes, the rank at most :data:`MAX_RANK`, the file
at most :data:`MAX_BYTES`; the entry records the content digest, which the
request carries to the ledger and the worker checks before loading.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine import envs
from engine.adapters.formats import NotSafetensors, read_header, shown, weight_shapes

#: workflow -> (the denoise model's component, the diffusers pipeline whose LoRA loader reads its adapters)
ADAPTABLE: dict[str, tuple[str, str]] = {
    "sd-t2i": ("unet", "StableDiffusionPipeline"),
    "wan2.1-i2v": ("transformer", "WanImageToVideoPipeline"),
    "wan2.1-t2v": ("transformer", "WanPipeline"),
}
MAX_RANK = 256
MAX_BYTES = 4 << 30
MAX_TARGETS = 4096
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
SCALE_MIN, SCALE_MAX = -4.0, 4.0
_DTYPES = {"F32", "F16", "BF16"}
_KEY_RE = re.compile(r"(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<half>[AB])\.weight")
#: the file diffusers' ``save_lora_weights`` writes in its folder (and ``load_lora_weights`` looks for first)
WEIGHT_NAME = "pytorch_lora_weights.safetensors"


class AdapterError(ValueError):
    """An adapter the registry refuses (bad name, file, format, targets, limits); ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Adapter:
    """One registered adapter. ``file`` is relative to the store (never shown to clients)."""

    name: str
    workflow: str
    digest: str  # sha256 of the file's bytes, hex
    file: str
    targets: tuple[str, ...]
    rank: int
    bytes: int
    scale_default: float = 1.0
    created: float = field(default_factory=time.time)

    def public(self) -> dict[str, Any]:
        """What clients may see: no path."""
        return {"name": self.name, "workflow": self.workflow, "targets": list(self.targets), "rank": self.rank,
                "scale_default": self.scale_default, "digest": self.digest, "created": self.created}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Adapter:
        return cls(**{**obj, "targets": tuple(obj.get("targets", ()))})


def check_name(name: object, field: str = "name") -> str:
    """A registry name: 1-64 of ``a-z 0-9 _ . -``, starting with a letter or digit, no ``..``."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise AdapterError(field, f"an adapter name is 1-64 characters of a-z, 0-9, '_', '.', '-' (starting with a "
                                  f"letter or digit, no '..'), got {str(name)[:80]!r}")
    return name


def check_scale(scale: object, field: str = "scale") -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale \
            or not SCALE_MIN <= float(scale) <= SCALE_MAX:
        raise AdapterError(field, f"an adapter scale is a number in [{SCALE_MIN:g}, {SCALE_MAX:g}], got {scale!r}")
    return float(scale)


def denoise_component(workflow: str) -> str:
    try:
        return ADAPTABLE[workflow][0]
    except KeyError:
        raise AdapterError("workflow", f"workflow {workflow!r} takes no adapters; these do: "
                                       f"{', '.join(sorted(ADAPTABLE))}") from None


def digest_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_file(path: str | Path) -> Path:
    """The LoRA file ``path`` names: a file as it is; a folder as diffusers' ``save_lora_weights`` writes it
    (and ``load_lora_weights`` reads it): its :data:`WEIGHT_NAME`, else its one ``*.safetensors`` file.
    :class:`AdapterError` on ``path`` for a folder with neither, or with several candidates."""
    p = Path(path)
    if not p.is_dir():
        return p
    if (p / WEIGHT_NAME).is_file():
        return p / WEIGHT_NAME
    found = sorted(f.name for f in p.glob("*.safetensors") if f.is_file())
    if len(found) != 1:
        which = f"{len(found)} .safetensors files ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})" \
            if found else "no .safetensors file"
        raise AdapterError("path", f"folder {p} holds no {WEIGHT_NAME} and {which}; name the adapter's file")
    return p / found[0]


def inspect_file(path: str | Path, workflow: str, model_dir: str | Path) -> tuple[tuple[str, ...], int]:
    """(target modules, rank) of a LoRA file once it is valid for ``workflow``'s model in ``model_dir``;
    :class:`AdapterError` naming what is wrong otherwise. Reads headers only."""
    component = denoise_component(workflow)
    p = Path(path)
    if p.suffix != ".safetensors":
        raise AdapterError("path", f"adapters are .safetensors files only (no pickles), got {p.name!r}")
    if not p.is_file():
        raise AdapterError("path", f"no such file: {p}")
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise AdapterError("path", f"{p.name} is {size} bytes; the limit is {MAX_BYTES}")
    try:
        header, _meta = read_header(p)
    except NotSafetensors as exc:
        raise AdapterError("path", str(exc)) from None
    except OSError as exc:
        raise AdapterError("path", f"cannot read {p}: {exc.strerror or exc}") from None
    if not header:
        raise AdapterError("path", f"{p.name} holds no tensors")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    prefix = component + "."
    for key, info in header.items():
        m = _KEY_RE.fullmatch(key)
        if m is None or not key.startswith(prefix):
            raise AdapterError("path", f"{p.name}: tensor {shown(key)} is not a LoRA of {workflow}'s {component} in the "
                                       f"diffusers/PEFT format ({prefix}<module>.lora_A.weight / .lora_B.weight)")
        if info["dtype"] not in _DTYPES:
            raise AdapterError("path", f"{p.name}: tensor {shown(key)} has dtype {info['dtype']}; want F32, F16 or BF16")
        module = m["module"][len(prefix):]
        halves.setdefault(module, {})[m["half"]] = tuple(int(d) for d in info["shape"])
    if len(halves) > MAX_TARGETS:
        raise AdapterError("path", f"{p.name} targets {len(halves)} modules; the limit is {MAX_TARGETS}")
    folder = Path(model_dir) / component
    try:
        base = weight_shapes(folder)
    except (OSError, KeyError, ValueError) as exc:
        raise AdapterError("workflow", f"cannot read {workflow}'s {component} weights in {folder}: {exc}") from None
    ranks = set()
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError("path", f"{p.name}: module {module!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        w = base.get(f"{module}.weight")
        if w is None:
            raise AdapterError("path", f"{p.name}: target module {module!r} is not in {workflow}'s {component}")
        if len(a) < 2 or len(b) < 2 or a[0] != b[1] or w[0] != b[0] or w[1] != a[1]:
            raise AdapterError("path", f"{p.name}: module {module!r}: lora_A {a} and lora_B {b} do not fit its "
                                       f"weight {w}")
        ranks.add(a[0])
    rank = max(ranks)
    if rank > MAX_RANK or min(ranks) < 1:
        raise AdapterError("path", f"{p.name} has rank {rank}; the limit is {MAX_RANK}")
    return tuple(sorted(halves)), rank


class AdapterStore:
    """The registry and files in one store folder (see the module docstring). Reads are cached until the
    registry file changes; writers serialise on a file lock."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._cache: tuple[tuple[int, int, int], dict[str, Adapter]] | None = None

    @property
    def registry_path(self) -> Path:
        return self.root / "registry.json"

    # -- reading --------------------------------------------------------------------------------
    def _read(self) -> dict[str, Adapter]:
        try:
            st = self.registry_path.stat()
        except FileNotFoundError:
            return {}
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # a write replaces the file: a new inode
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        doc = json.loads(self.registry_path.read_text())
        entries = {n: Adapter.from_obj(o) for n, o in doc.get("adapters", {}).items()}
        self._cache = (stamp, entries)
        return entries

    def list(self, workflow: str | None = None) -> list[Adapter]:
        return [a for n, a in sorted(self._read().items()) if workflow is None or a.workflow == workflow]

    def get(self, name: str) -> Adapter | None:
        return self._read().get(name)

    def file(self, adapter: Adapter) -> Path:
        """The adapter's file, which must be a regular file inside ``<store>/files`` (never a link out)."""
        files = (self.root / "files").resolve()
        p = (self.root / adapter.file).resolve()
        if p.parent != files or p.is_symlink() or not p.is_file():
            raise AdapterError("lora", f"adapter {adapter.name!r}: its file is not in the adapter store")
        return p

    # -- writing (operators) ------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Adapter]]:
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._cache = None
            entries = dict(self._read())
            yield entries
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".registry.")
            with os.fdopen(fd, "w") as f:
                json.dump({"adapters": {n: {**asdict(a), "targets": list(a.targets)}
                                        for n, a in sorted(entries.items())}}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.registry_path)
            self._cache = None

    def add(self, name: str, path: str | Path, workflow: str, model_dir: str | Path,
            scale_default: float = 1.0) -> Adapter:
        """Validate ``path`` (a LoRA file, or a diffusers LoRA folder: :func:`weights_file`) against
        ``workflow``'s model in ``model_dir``, copy it into the store, record it. :class:`AdapterError` (nothing
        changed) when the name is taken or the file is refused."""
        check_name(name)
        path = weights_file(path)
        scale_default = check_scale(scale_default, "scale_default")
        targets, rank = inspect_file(path, workflow, model_dir)
        if self.get(name) is not None:
            raise AdapterError("name", f"an adapter named {name!r} exists; remove it first")
        digest = digest_of(path)
        rel = f"files/{digest}.safetensors"
        dest = self.root / rel
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        if not dest.is_file() or digest_of(dest) != digest:
            fd, tmp = tempfile.mkstemp(dir=self.root / "files", prefix=".copy.")
            os.close(fd)
            shutil.copyfile(path, tmp)
            if digest_of(tmp) != digest:  # changed while copied
                os.unlink(tmp)
                raise AdapterError("path", f"{path} changed while it was copied; try again")
            os.replace(tmp, dest)
        adapter = Adapter(name, workflow, digest, rel, targets, rank, dest.stat().st_size, scale_default)
        with self._locked() as entries:
            if name in entries:
                raise AdapterError("name", f"an adapter named {name!r} exists; remove it first")
            entries[name] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        """Forget ``name``; its file goes too unless another entry has the same bytes. False if unknown."""
        with self._locked() as entries:
            gone = entries.pop(name, None)
            if gone is None:
                return False
            if not any(a.file == gone.file for a in entries.values()):
                with contextlib.suppress(FileNotFoundError):
                    (self.root / gone.file).unlink()
        return True


def default_root() -> Path:
    return Path(envs.ADAPTER_STORE) if envs.ADAPTER_STORE else envs.STATE_DIR / "adapters"


_STORES: dict[Path, AdapterStore] = {}


def store(root: str | Path | None = None) -> AdapterStore:
    """The store at ``root`` (default: :func:`default_root`), one object per folder per process."""
    key = Path(root or default_root()).expanduser().resolve()
    if key not in _STORES:
        _STORES[key] = AdapterStore(key)
    return _STORES[key]
