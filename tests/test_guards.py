"""Guards on the layout: the rules that keep the project importable and light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_platform_is_a_source_folder_not_a_package() -> None:
    assert (REPO_ROOT / "platform" / "onepiece_platform").is_dir()
    assert not (REPO_ROOT / "platform" / "__init__.py").exists()


def test_stdlib_platform_wins_from_repo_root() -> None:
    r = _py("import platform, uuid, sys; print(platform.__file__); print(platform.python_version())")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert "onepiece" not in first and (REPO_ROOT / "platform").as_posix() not in first


def test_import_engine_is_light() -> None:
    """`import engine` (and its CLI's entry module) loads neither torch nor the socket module: the check
    runs in a fresh interpreter that has imported nothing else, so a module listed is one engine pulled in."""
    r = _py(
        "import sys; import engine, engine.envs, engine.cli;"
        "heavy = [m for m in ('django', 'torch', 'diffusers', 'transformers', 'numpy', 'redis', 'zmq',"
        " 'socket', '_socket', 'ssl') if m in sys.modules]; print(heavy)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_light_import_guard_sees_a_socket() -> None:
    """The guard above can fail: the same check lists the socket module when an import pulls it in on the way
    (urllib.request does, through http.client)."""
    r = _py("import sys; import engine, urllib.request; print([m for m in ('socket',) if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['socket']"


def test_engine_never_imports_django() -> None:
    offenders = []
    for path in (REPO_ROOT / "engine").rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import django", "from django", "import onepiece_platform", "from onepiece_platform")):
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {s}")
    assert offenders == []


def test_engine_never_starts_django() -> None:
    """The launcher (which starts the platform's processes) lives outside engine/ (onepiece_launcher): no
    engine module names the platform's settings variable or its manage.py."""
    offenders = [f"{path.relative_to(REPO_ROOT)}:{n}" for path in (REPO_ROOT / "engine").rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "DJANGO_SETTINGS_MODULE" in line or "manage.py" in line]
    assert offenders == []
    assert (REPO_ROOT / "onepiece_launcher" / "up.py").is_file()


def test_manage_py_check_passes() -> None:
    r = subprocess.run(
        [sys.executable, "manage.py", "check", "--fail-level", "WARNING"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_is_clean_with_a005() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run(
        [str(ruff), "check", "--extend-select", "A005", "."], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_help_lists_only_working_commands() -> None:
    r = subprocess.run(
        [str(Path(sys.executable).parent / "onepiece"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    from engine.cli import COMMANDS

    for name in COMMANDS:
        assert name in r.stdout
        sub = subprocess.run(
            [str(Path(sys.executable).parent / "onepiece"), name, "--help"],
            capture_output=True, text=True, timeout=60,
        )
        assert sub.returncode == 0, f"{name}: {sub.stderr}"
