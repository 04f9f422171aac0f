"""A wheel built from the repository serves: installed into a fresh venv (no editable install), it carries the
model repository and every native source, its native kernels build from the installed sources, and its
`pagedserve serve` answers a generate request with text.

The fresh venv reuses this interpreter's installed dependencies through a plain path line in a .pth file: a
path line adds the folder to sys.path without running that folder's own .pth files, so the editable install's
finder there never loads, and the wheel's pagedserve (earlier on sys.path) is the one imported.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pagedserve.client.launcher import free_loopback_ports
from pagedserve.testing import make_tiny_model
from tests.support.servers import RunningTriton

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedserve"
SERVE_DEADLINE_SECONDS = 300
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Installed:
    """The fresh venv: its python, its site-packages and the environment to run its commands in."""

    python: Path
    site_packages: Path
    env: dict[str, str]
    cwd: Path  # away from the repository, whose pagedserve/ would shadow the installed one

    def run(self, code: str, **extra_env: str) -> str:
        """Run `code` in the venv's python; its stdout (the test fails with stderr on a non-zero exit)."""
        result = subprocess.run([str(self.python), "-c", code], cwd=self.cwd, env={**self.env, **extra_env},
                                capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout


def _build_wheel(work: Path) -> Path:
    """`pip wheel` from a copy of the package sources (a stale build/ in the checkout must not leak in)."""
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "pagedserve", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(dist), str(source)], check=True, timeout=300)
    (wheel,) = dist.glob("pagedserve-*.whl")
    return wheel


def _fresh_venv(work: Path, wheel: Path) -> Installed:
    """A new venv with the wheel installed (--no-deps) and this interpreter's dependencies on its path."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", "--no-compile", str(wheel)], check=True, timeout=300)
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip())
    (site_packages / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]))
    cwd = work / "run"
    cwd.mkdir()
    return Installed(python=python, site_packages=site_packages, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel of this checkout, installed into a fresh venv."""
    work = tmp_path_factory.mktemp("wheel")
    return _fresh_venv(work, _build_wheel(work))


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the served wheel loads the kernels the build test made from the same installed
    sources (the same key) instead of compiling them a second time."""
    return tmp_path_factory.mktemp("wheel-cache")


def _repository_files(suffixes: set[str]) -> set[str]:
    return {str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*")
            if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts}


def test_the_installed_package_is_the_wheel_with_the_model_repository_and_every_native_source(installed):
    imported = Path(installed.run("import pagedserve; print(pagedserve.__file__)").strip())
    assert imported.parent == installed.site_packages / "pagedserve"
    present = {str(path.relative_to(installed.site_packages)) for path in
               (installed.site_packages / "pagedserve").rglob("*") if path.is_file()}
    models = {path.parent.name for path in (PACKAGE / "model_repository").glob("*/config.pbtxt")}
    assert {"llm", "ensemble", "preprocessing", "postprocessing"} <= models
    assert {f"pagedserve/model_repository/{model}/config.pbtxt" for model in models} <= present
    assert {f"pagedserve/model_repository/{model}/1/model.py" for model in models} <= present
    native = _repository_files({".cpp", ".h"})
    assert {"pagedserve/kernels/lora/lora_cpu.cpp", "pagedserve/kernels/quant_linear/quant_gemm.cpp"} <= native
    assert native <= present, sorted(native - present)


def test_the_native_kernels_build_from_the_installed_sources(installed, kernel_cache):
    code = ("import json, logging; logging.basicConfig(); from pagedserve.kernels import native; "
            "print(json.dumps({'loaded': native.load() is not None, "
            "'sources': [str(s) for s in (*native.SOURCES, *native.HEADERS)]}))")
    built = json.loads(installed.run(code, PAGEDSERVE_CACHE=str(kernel_cache), PAGEDSERVE_CPU_KERNELS="1"))
    assert built["loaded"]
    sources = {str(Path(source).relative_to(installed.site_packages)) for source in built["sources"]}
    assert sources == _repository_files({".cpp", ".h"})
    assert len(list((kernel_cache / "kernels").glob("pagedserve_cpu-*.so"))) == 1


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_pagedserve_serve_from_the_wheel_answers_with_text(installed, kernel_cache, tmp_path):
    model_path = make_tiny_model(tmp_path / "tiny", "llama")
    http_port, grpc_port, metrics_port = free_loopback_ports(3)
    running = RunningTriton(http_url=f"127.0.0.1:{http_port}", grpc_url=f"127.0.0.1:{grpc_port}",
                            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics", model_path=model_path)
    command = [str(installed.python.parent / "pagedserve"), "serve", f"--model={model_path}", "--no-openai",
               f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
               "--param", "max_model_len=256", "--param", "num_blocks=64"]
    env = {**installed.env, "TMPDIR": str(tmp_path), "PAGEDSERVE_CACHE": str(kernel_cache)}
    launcher = subprocess.Popen(command, cwd=installed.cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SERVE_DEADLINE_SECONDS
        while not _ready(f"http://{running.http_url}/v2/health/ready"):
            assert launcher.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the server did not become ready:\n" + "".join(lines)
            time.sleep(1)
        answer = running.generate("llm", {"text_input": "Hello", "max_tokens": ANSWER_TOKENS, "temperature": 0,
                                          "ignore_eos": True, "exclude_input_in_output": True})
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(timeout=30)
    assert isinstance(answer.get("text_output"), str) and answer["text_output"].strip(), answer
    assert launcher.returncode == 0, "".join(lines)
    # Installed without .pyc files, so a compiled llm_model shows the stub imported the wheel's, not the checkout's.
    assert list((installed.site_packages / "pagedserve/backend/triton/__pycache__").glob("llm_model.*.pyc"))
