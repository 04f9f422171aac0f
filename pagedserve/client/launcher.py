"""`pagedserve serve`: run tritonserver on the pagedserve model repository, plus the OpenAI shim.

Finds `tritonserver` (PATH, else the one shipped in the nvidia-pytriton wheel), lays out the Python
backend with the stub built for the running Python, fills the model path into a generated copy of the
repository, waits until the server is ready and stops the whole process group on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.backend.model.default_model import DEFAULT_MODEL_FORMS, MODEL_NAME, default_model_path
from pagedserve.client import fleet
from pagedserve.client.engine_flags import add_engine_arguments, engine_flag_parameters
from pagedserve.client.lora_options import add_lora_arguments, lora_modules, lora_parameters, lora_shim_flags
from pagedserve.client.media_options import add_media_arguments, media_shim_flags
from pagedserve.client.metrics_text import fetch_metrics, instance_metrics, model_metric  # noqa: F401 - callers' names
from pagedserve.client.model_repository import (  # noqa: F401 - launcher's names for its callers
    DEFAULT_MODEL_REPOSITORY,
    LLM_MODEL_NAME,
    MODEL_PATH_KEYS,
    fill_parameters,
    prepare_model_repository,
    set_instance_group,
)
from pagedserve.client.shim_flags import reasoning_parser_name

OPENAI_MODULE = "pagedserve.client.openai"
INSTANCE_KINDS = ("cpu", "gpu", "model")
# The ports `serve` listens on by default (the Dockerfile and docs/deploy/ expose these), and Triton's probes.
HTTP_PORT, GRPC_PORT, METRICS_PORT, OPENAI_PORT = 8000, 8001, 8002, 9000
READY_PATH, LIVE_PATH, METRICS_PATH = "/v2/health/ready", "/v2/health/live", "/metrics"
# Not ready once the llm model unloaded itself (its engine broke): docs/deploy's liveness probe restarts such a pod.
LLM_READY_PATH = "/v2/models/llm/ready"
TRITON_READY_URL_ENV = "PAGEDSERVE_TRITON_READY_URL"  # the same as pagedserve/backend/triton/settings.py's HEALTH_URL_ENV
# Every model loads at start as without it; explicit control lets a model whose engine broke (a tensor-parallel
# rank died) unload itself and read not ready.
EXPLICIT_MODEL_CONTROL = ("--model-control-mode=explicit", "--load-model=*")
# tritonserver's --exit-timeout-secs: how long a stopping server waits for its models to unload.
EXIT_TIMEOUT_SECONDS = 10


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and what it needs at run time live."""

    binary: Path
    lib_dirs: tuple[Path, ...] = ()
    python_backend: Path | None = None  # the wheel's backends/python; None: the server's own default
    stub_dir: Path | None = None  # python_backend_stubs/ with one stub per Python version
    cache_dir: Path | None = None


def find_tritonserver() -> TritonInstall:
    """Return the tritonserver on PATH, else the one inside the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(binary=Path(on_path))
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("tritonserver not found: put it on PATH or `pip install nvidia-pytriton`")
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return TritonInstall(
        binary=root / "bin" / "tritonserver",
        lib_dirs=(root.parent.parent / "nvidia_pytriton.libs",),
        python_backend=root / "backends" / "python",
        stub_dir=root / "python_backend_stubs",
        cache_dir=root / "caches",
    )


def layout_backend_dir(install: TritonInstall, work_dir: Path) -> Path | None:
    """Build `<work_dir>/backends/python` with the stub matching this interpreter; None if not needed."""
    if install.python_backend is None or install.stub_dir is None:
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = install.stub_dir / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"no triton_python_backend_stub for Python {version} in {install.stub_dir}")
    python_dir = work_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for item in install.python_backend.iterdir():
        if item.is_file():
            (python_dir / item.name).symlink_to(item)
    # The backend looks for the stub beside libtriton_python.so.
    shutil.copy2(stub, python_dir / stub.name)
    return work_dir / "backends"


def server_env(install: TritonInstall) -> dict[str, str]:
    """The environment tritonserver runs in: this interpreter first on PATH, its libpython findable.

    The Python backend stub embeds the `python` it finds on PATH; any other interpreter would load
    another numpy/ABI and garble string tensors.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    lib_dirs = [sysconfig.get_config_var("LIBDIR") or "", *map(str, install.lib_dirs)]
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in lib_dirs if d)
    return env


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies without cleaning up."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _client_host(host: str) -> str:
    """The address a local client uses to reach a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


class TritonServer:
    """One tritonserver process (and its Python stubs) in its own process group."""

    def __init__(
        self,
        model_repository: Path,
        *,
        work_dir: Path,
        host: str = "127.0.0.1",
        http_port: int = HTTP_PORT,
        grpc_port: int = GRPC_PORT,
        metrics_port: int = METRICS_PORT,
        log_verbose: int = 0,
        log_file: Path | None = None,
        install: TritonInstall | None = None,
    ):
        self.model_repository = Path(model_repository)
        self.work_dir = Path(work_dir)
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.log_verbose = log_verbose
        self.log_file = log_file
        self.install = install or find_tritonserver()
        self.process: subprocess.Popen | None = None
        self._log_handle = None

    @property
    def http_url(self) -> str:
        """`host:port` of the HTTP/REST endpoint (tritonclient style, no scheme)."""
        return f"{_client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` of the gRPC endpoint."""
        return f"{_client_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus metrics page."""
        return f"http://{_client_host(self.host)}:{self.metrics_port}{METRICS_PATH}"

    def command(self) -> list[str]:
        """The tritonserver command line."""
        cmd = [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            "--allow-cpu-metrics=false",
            f"--exit-timeout-secs={EXIT_TIMEOUT_SECONDS}",
            *EXPLICIT_MODEL_CONTROL,
        ]
        backend_dir = layout_backend_dir(self.install, self.work_dir)
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if self.install.cache_dir is not None:
            cmd.append(f"--cache-directory={self.install.cache_dir}")
        return cmd

    def start(self) -> None:
        """Start tritonserver in a new session (its own process group)."""
        if self.process is not None:
            raise RuntimeError("this TritonServer was already started")
        output = None
        if self.log_file is not None:
            self._log_handle = open(self.log_file, "ab")  # noqa: SIM115 - closed in stop()
            output = self._log_handle
        # The llm model's cancel watcher sees a stopping server here (pagedserve/backend/triton/settings.py HEALTH_URL_ENV).
        env = {**server_env(self.install), TRITON_READY_URL_ENV: f"http://{self.http_url}{READY_PATH}"}
        self.process = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until every model is loaded; raise with the log tail if the server dies or times out."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}{READY_PATH}"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited before it was ready{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{self._log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server, wait, then SIGKILL whatever is left of its process group."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def _log_tail(self, num_chars: int = 3000) -> str:
        """Why the server failed: its model-load errors first, then the end of its log."""
        if self.log_file is None or not Path(self.log_file).exists():
            return ""
        text = Path(self.log_file).read_text(errors="replace")
        load_errors = [line for line in text.splitlines() if "failed to load" in line]
        return "\n" + "\n".join([*load_errors, "--- tritonserver log tail ---", text[-num_chars:]])

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _parse_params(items: Sequence[str]) -> dict[str, str]:
    """`KEY=VALUE` strings to a dict, refusing anything without `=`."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        params[key.strip()] = value.strip()
    return params


def served_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model path to serve and the shim's naming flags: --model, else the default model in the form
    --default-model-form names, under its own name whichever form (the GGUF file's name is not the model's)."""
    if args.model is not None:
        if args.default_model_form is not None:
            raise SystemExit("--default-model-form applies only without --model")
        return str(Path(args.model).expanduser().resolve()), []
    form = args.default_model_form or DEFAULT_MODEL_FORMS[0]
    return str(Path(default_model_path(form)).resolve()), ["--model-name", MODEL_NAME]


def _start_openai_shim(args: argparse.Namespace, server: TritonServer, model: str,
                       naming: Sequence[str] = ()) -> subprocess.Popen | None:
    """Start the OpenAI shim beside the server when it is installed and wanted."""
    if args.no_openai or importlib.util.find_spec(OPENAI_MODULE) is None:
        return None
    return spawn_openai_shim(server.grpc_url, server.metrics_url, args.host, args.openai_port, "--model", model,
                             *naming, *_tool_flags(args), *lora_shim_flags(args), start_new_session=True,
                             preexec_fn=_die_with_parent)


def _tool_flags(args: argparse.Namespace) -> list[str]:
    """The shim's tool-calling flags as `serve` was given them (the shim checks the parser's name)."""
    flags = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    if args.tool_call_parser:
        flags += ["--tool-call-parser", args.tool_call_parser]
    if args.exclude_tools_when_tool_choice_none:
        flags.append("--exclude-tools-when-tool-choice-none")
    flags += ["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []
    return flags + media_shim_flags(args)  # and the media flags (client/media_options.py)


def spawn_openai_shim(triton_grpc_url: str, metrics_url: str, host: str, port: int, *shim_args: str,
                      **popen_kwargs) -> subprocess.Popen:
    """`python -m pagedserve.client.openai` in front of a running tritonserver."""
    cmd = [
        sys.executable, "-m", OPENAI_MODULE,
        "--triton-url", triton_grpc_url,
        "--metrics-url", metrics_url,
        "--host", host,
        "--port", str(port),
        *shim_args,
    ]  # fmt: skip
    return subprocess.Popen(cmd, **popen_kwargs)


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago (all bound at once, so distinct)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@contextlib.contextmanager
def openai_shim_running(triton_grpc_url: str, metrics_url: str, *shim_args: str,
                        timeout: float = 60.0) -> Iterator[str]:
    """A shim on a free loopback port, ready (its /health answers); yields its base URL, stops it after."""
    port = free_loopback_ports(1)[0]
    proc = spawn_openai_shim(triton_grpc_url, metrics_url, "127.0.0.1", port, *shim_args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http_ok(f"{url}/health", proc, timeout)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_http_ok(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll `url` until it answers 200; fail at once if `proc` exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with status {proc.returncode} before {url} answered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.2)


def process_group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, read from /proc: what a stop would leave behind."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _stop_process_group(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM a child's process group, then SIGKILL it if it lingers."""
    if proc is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=timeout)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `serve` options."""
    parser.add_argument("--model", help="model folder (safetensors + tokenizer) or .gguf file; default: "
                        "SmolLM2-135M-Instruct")
    parser.add_argument("--default-model-form", choices=DEFAULT_MODEL_FORMS, default=None,
                        help="without --model: gguf serves the default model's Q4_1 file as stored (the default, "
                        "fastest); folder serves it converted once to float32 safetensors")
    parser.add_argument("--instances", type=int, default=None, metavar="N",
                        help="llm model instances (engines; on the CPU they split the cores and the KV budget)")
    parser.add_argument("--instance-kind", choices=INSTANCE_KINDS, default=None,
                        help="with --instances: cpu, gpu (N per GPU, each on its own device) or model")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=HTTP_PORT)
    parser.add_argument("--grpc-port", type=int, default=GRPC_PORT)
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT)
    parser.add_argument("--openai-port", type=int, default=OPENAI_PORT)
    parser.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible shim")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='the shim serves tool_choice "auto", reading calls with --tool-call-parser')
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="the model's tool-call format: hermes, llama3_json, mistral or pythonic")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='the shim keeps the tools from the chat template when tool_choice is "none"')
    parser.add_argument("--reasoning-parser", default=None, metavar="NAME", type=reasoning_parser_name,
                        help="the shim splits the model's thinking from its answer: qwen3, deepseek_r1, ...")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="set an llm engine parameter of config.pbtxt, e.g. max_model_len=4096 (repeatable)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the models")
    add_engine_arguments(parser.add_argument_group("engine parameters (the llm model's config.pbtxt parameters)"))
    add_lora_arguments(parser)
    add_media_arguments(parser, limit_flag=False)  # --limit-mm-per-prompt: the engine parameter's flag above
    fleet.add_arguments(parser)


def llm_instances(args: argparse.Namespace) -> tuple[int, str | None] | None:
    """(count, config.pbtxt kind or None to keep the config's) of --instances / --instance-kind; None: neither."""
    if args.instances is None and args.instance_kind is None:
        return None
    return args.instances or 1, None if args.instance_kind is None else f"KIND_{args.instance_kind.upper()}"


def tensor_parallel_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The llm model's tensor_parallel_size parameter from --tensor-parallel-size; {} when not given."""
    return engine_flag_parameters(args, ("tensor_parallel_size",))


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM or until tritonserver exits; returns the exit status."""
    params = _parse_params(args.param)
    params.update(engine_flag_parameters(args))  # checked by the engine at load
    params.update(lora_parameters(args))
    model, naming = served_model(args)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    fleet.check_arguments(args)
    if args.data_parallel_size > 1:
        return fleet.run(args, params, model, naming)
    with tempfile.TemporaryDirectory(prefix="pagedserve-serve-") as tmp:
        work_dir = Path(tmp)
        repository = prepare_model_repository(args.model_repository, work_dir / "models", model, params,
                                              llm_instances(args), lora_modules(args))
        server = TritonServer(
            repository,
            work_dir=work_dir,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            log_verbose=args.log_verbose,
        )
        shim = None
        try:
            server.start()
            server.wait_ready(args.ready_timeout)
            shim = _start_openai_shim(args, server, model, naming)
            if shim is not None:
                url = f"http://{_client_host(args.host)}:{args.openai_port}/health"
                wait_for_http_ok(url, shim, args.ready_timeout)
            print(f"pagedserve is serving {model}", flush=True)
            print(f"  HTTP    http://{server.http_url}  (POST /v2/models/llm/generate_stream)", flush=True)
            print(f"  gRPC    {server.grpc_url}", flush=True)
            print(f"  metrics {server.metrics_url}", flush=True)
            if shim is not None:
                print(f"  OpenAI  http://{_client_host(args.host)}:{args.openai_port}/v1", flush=True)
            print("Ctrl-C stops it.", flush=True)
            return server.process.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _stop_process_group(shim)
            server.stop()
