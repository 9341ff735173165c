"""Stage pools: the stages of different workflows that are the same computation, served by one set of instances.

Wan2.1's text-to-video and image-to-video releases ship the same umT5 text encoder and the same VAE, and
both end in the same mp4 encoder: served per workflow, each of those stages holds its weights twice and
idles twice. A **pool** is the set of ``(workflow, stage)`` pairs whose executor class and components are
the same: decided by a digest of the *content* of the components the executor loads (every file of each
component folder, and the class ``model_index.json`` records for it), never by folder or workflow name, so two
folders with the same bytes share and a fine-tuned VAE under the same name does not. The executor class
declares its components (``StageExecutor.components``); this module, below the stages, is handed them
(:func:`engine.stages.registry.pools` reads them off the executor classes, without torch).

One instance of a pool serves every member: it publishes a route for each ``(workflow, stage)`` it serves,
takes any member's messages, and hands each request on to *its own workflow's* next stage
(:class:`engine.worker.taskworker.TaskWorker`). The Node Manager sizes a pool from its members' summed
demand (Theorem 1 over the union of the chains: :mod:`engine.manager.planner`).

Digests read every byte of the weights once per process (a 14B transformer is ~28 GB: seconds to tens of
seconds), so they are cached by each file's size and modification time, in memory and, where the folder is
writable, in a small ``.onepiece-digest.json`` beside the files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.workflow import get_workflow

log = logging.getLogger(__name__)

DIGEST_FILE = ".onepiece-digest.json"
_CHUNK = 1 << 22
_memo: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def _files(folder: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file under ``folder`` (symlinks followed), sorted."""
    out = []
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            if name == DIGEST_FILE:
                continue
            path = Path(root) / name
            st = path.stat()
            out.append((path.relative_to(folder).as_posix(), st.st_size, st.st_mtime_ns))
    return out


def folder_digest(folder: str | Path) -> str:
    """sha256 over every file's relative path and bytes under ``folder``; cached by (size, mtime)."""
    folder = Path(folder).resolve()
    files = tuple(_files(folder))
    key = (str(folder), files)
    if key in _memo:
        return _memo[key]
    cache = folder / DIGEST_FILE
    stamp = [list(f) for f in files]
    try:
        saved = json.loads(cache.read_text())
        if saved.get("files") == stamp and isinstance(saved.get("sha256"), str):
            _memo[key] = saved["sha256"]
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    for rel, size, _ in files:
        h.update(f"{rel}\0{size}\0".encode())
        with open(folder / rel, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    _memo[key] = digest
    try:  # best effort: a read-only model store is hashed once per process instead
        tmp = cache.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"files": stamp, "sha256": digest}))
        tmp.replace(cache)
    except OSError:
        pass
    return digest


def stage_digest(workflow: str, stage: str, model_dir: str | Path, components: Sequence[str]) -> str | None:
    """What makes a stage the computation it is: its executor class, and for each component it loads
    (``components``, its executor's) the class the model folder records for it and the digest of its files.
    None when a component folder is missing or unreadable (the stage then shares with nothing; its worker will
    say what is missing)."""
    h = hashlib.sha256(get_workflow(workflow).stage(stage).executor.encode())
    index: dict[str, object] = {}
    if components:
        try:
            index = json.loads((Path(model_dir) / "model_index.json").read_text())
        except (OSError, ValueError):
            return None
    for c in sorted(components):
        folder = Path(model_dir) / c
        if not folder.is_dir():
            return None
        try:
            h.update(f"\0{c}\0{json.dumps(index.get(c))}\0{folder_digest(folder)}".encode())
        except OSError as exc:
            log.warning("cannot read %s (%s): %s/%s shares with no other workflow", folder, exc, workflow, stage)
            return None
    return h.hexdigest()


@dataclass(frozen=True)
class Pool:
    """The ``(workflow, stage)`` pairs one set of instances serves; the first (sorted) names the pool."""

    members: tuple[tuple[str, str], ...]
    digest: str = ""

    @property
    def name(self) -> str:
        """``workflow/stage`` of the first member (instance ids and operators' bounds use it)."""
        return "/".join(self.members[0])

    @property
    def workflow(self) -> str:
        return self.members[0][0]

    @property
    def stage(self) -> str:
        return self.members[0][1]

    @property
    def shared(self) -> bool:
        return len(self.members) > 1

    def workflows(self) -> list[str]:
        return [w for w, _ in self.members]


def pools(model_dirs: Mapping[str, str], components: Callable[[str, str], Sequence[str]]) -> list[Pool]:
    """The pools of the workflows in ``model_dirs`` (workflow -> model folder), in route order of the first
    workflow that uses each; ``components(workflow, stage)``: what the stage's executor loads. Stages whose
    digest cannot be computed are pools of their own."""
    by_digest: dict[str, list[tuple[str, str]]] = {}
    order: list[str] = []
    for w in sorted(model_dirs):
        for s in get_workflow(w).route():
            digest = stage_digest(w, s, model_dirs[w], components(w, s)) or f"unshared:{w}/{s}"
            if digest not in by_digest:
                by_digest[digest] = []
                order.append(digest)
            by_digest[digest].append((w, s))
    return [Pool(tuple(sorted(by_digest[d])), "" if d.startswith("unshared:") else d) for d in order]


def pool_of(found: list[Pool]) -> dict[tuple[str, str], Pool]:
    """(workflow, stage) -> its pool."""
    return {m: p for p in found for m in p.members}


def link_identical(root: str | Path) -> int:
    """Keep one copy on disk of every component folder that several model folders under ``root`` hold with
    the same bytes (``make-tiny``: the Wan2.1 pair's umT5, tokenizer and VAE, as the published releases share
    them): the later copies' files become hard links to the first's. Returns the bytes saved."""
    first: dict[str, Path] = {}
    saved = 0
    for model in sorted(p for p in Path(root).iterdir() if (p / "model_index.json").exists()):
        for comp in sorted(c for c in model.iterdir() if c.is_dir()):
            digest = folder_digest(comp)
            keep = first.setdefault(digest, comp)
            if keep == comp:
                continue
            for rel, size, _ in _files(comp):
                src, dst = keep / rel, comp / rel
                if src.stat().st_ino == dst.stat().st_ino:
                    continue
                tmp = dst.with_name(dst.name + f".link-{os.getpid()}")
                os.link(src, tmp)
                tmp.replace(dst)
                saved += size
    return saved
