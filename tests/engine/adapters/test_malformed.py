"""Issue 39, finding 6: a malformed safetensors file (deep nesting, bad ``data_offsets``, ``shape`` or ``dtype``,
a header length past the end, a header that is not UTF-8 or not an object ...) is refused from its header alone:
:class:`NotSafetensors` from the reader, :class:`AdapterError` on ``path`` from the registry, and from
``onepiece adapters add`` one ``error:`` line on stderr with exit status 2, never a traceback. Torch-free and
model-free: the header is checked before the workflow's model is read."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.adapters.formats import NotSafetensors, read_header
from engine.adapters.registry import AdapterError, AdapterStore
from engine.cli import main

KEY = "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight"


def _file(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _one(dtype: Any = "F32", shape: Any = (2, 2), offsets: Any = (0, 16), data: bytes = bytes(16)) -> bytes:
    info = {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}
    return _file({KEY: info}, data)


DEEP = "[" * 5000 + "]" * 5000
MALFORMED: dict[str, bytes] = {
    "deep": _file(('{"' + KEY + '": ' + DEEP + "}").encode()),
    "deep-metadata": _file(('{"__metadata__": {"a": ' + DEEP + "}}").encode()),
    "offsets-one": _one(offsets=[0]),
    "offsets-three": _one(offsets=[0, 8, 16]),
    "offsets-strings": _one(offsets=["0", "16"]),
    "offsets-floats": _one(offsets=[0.0, 16.0]),
    "offsets-bools": _one(offsets=[False, True]),
    "offsets-reversed": _one(offsets=[16, 0]),
    "offsets-negative": _one(offsets=[-16, 0]),
    "offsets-past-end": _one(offsets=[0, 1 << 40]),
    "offsets-not-list": _one(offsets=16),
    "offsets-size-mismatch": _one(shape=(2, 3)),
    "shape-string": _one(shape="2,2"),
    "shape-negative": _one(shape=(-2, -2)),
    "shape-float": _one(shape=[2.0, 2.0]),
    "shape-nested": _one(shape=[[2], [2]]),
    "shape-huge": _one(shape=(10**30, 10**30)),
    "dtype-list": _one(dtype=["F32"]),
    "dtype-object": _one(dtype={"F32": 1}),
    "dtype-unknown": _one(dtype="F99"),
    "dtype-null": _one(dtype=None),
    "entry-not-object": _file({KEY: [1, 2, 3]}),
    "entry-missing-shape": _file({KEY: {"dtype": "F32", "data_offsets": [0, 0]}}),
    "length-past-end": _file({}, length=1000),
    "length-huge": _file({}, length=(1 << 64) - 1),
    "length-zero": _file(b"", length=0),
    "shorter-than-8": b"\x01\x02",
    "empty": b"",
    "not-utf8": _file(b'{"\xff\xfe": 1}'),
    "utf16": _file(json.dumps({}).encode("utf-16")),
    "not-json": _file(b"not json at all!"),
    "not-object-list": _file([]),
    "not-object-string": _file("x"),
    "not-object-number": _file(7),
    "metadata-not-strings": _file({"__metadata__": {"format": {"pt": 1}}}),
    "metadata-list": _file({"__metadata__": ["pt"]}),
    "long-name": _file({"x" * 100_000: {"dtype": "F99", "shape": [], "data_offsets": [0, 4]}}, bytes(4)),
    "huge-int": _file(('{"' + KEY + '": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}')
                      .encode(), bytes(4)),
}


@pytest.fixture
def malformed(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, raw in MALFORMED.items():
        p = tmp_path / "files" / f"{name}.safetensors"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(raw)
        out[name] = p
    return out


def test_the_reader_refuses_every_malformed_header(malformed: dict[str, Path], tmp_path: Path) -> None:
    for name, p in malformed.items():
        with pytest.raises(NotSafetensors) as err:
            read_header(p)
        assert "\n" not in str(err.value) and len(str(err.value)) < 400, (name, str(err.value)[:500])
    # and a well-formed one still reads, zero-sized tensors and an empty header included
    good = tmp_path / "good.safetensors"
    good.write_bytes(_file({"__metadata__": {"format": "pt"}, "a": {"dtype": "F16", "shape": [2, 0],
                                                                       "data_offsets": [0, 0]},
                            KEY: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)))
    header, meta = read_header(good)
    assert meta == {"format": "pt"} and header[KEY]["shape"] == [2, 2] and set(header) == {"a", KEY}
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(_file({}))
    assert read_header(empty) == ({}, {})


def test_the_registry_refuses_them_on_path_before_reading_the_model(malformed: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    reg = AdapterStore(tmp_path / "store")
    for name, p in malformed.items():
        with pytest.raises(AdapterError) as err:
            reg.add("x", p, "sd-t2i", tmp_path / "no-model-here")
        assert err.value.field == "path", (name, err.value.field, str(err.value))
    assert reg.list() == []


def test_the_cli_answers_one_error_line_and_status_2(malformed: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    for name, p in malformed.items():
        rc = main(["adapters", "--store", store, "add", "x", str(p), "--workflow", "sd-t2i",
                   "--model", str(tmp_path / "no-model-here")])
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert rc == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: path: "), (name, rc, err[:500])
        assert len(lines[0]) < 400, (name, lines[0][:500])
    assert main(["adapters", "--store", store, "list"]) == 0 and capsys.readouterr().out == ""


def test_the_cli_process_prints_no_traceback_for_a_deeply_nested_header(malformed: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "engine.cli", "adapters", "--store", str(tmp_path / "s"), "add", "x",
                        str(malformed["deep"]), "--workflow", "sd-t2i", "--model", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nested too deeply" in r.stderr, r.stderr[-2000:]
