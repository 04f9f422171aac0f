"""Native CPU kernels: decode PagedAttention compiled once with the system C++ compiler, called by ctypes.

Also fused RMSNorm (+ residual), SiLU-and-mul and rotary embedding (`csrc/elementwise_cpu.cpp`), one
pass over memory each where torch runs several ops with temporaries, and the sampler's inverse-CDF draw
and log-sum-exp over the vocabulary (`csrc/sampling_cpu.cpp`).

The torch reference gathers every sequence's K/V into a padded copy before attending; on the CPU that copy
and SDPA's small-query overhead were most of a decode step. `csrc/paged_attention_cpu.cpp` reads the
blocks in place instead. It has no torch headers, so it builds in about a second (`-O3 -march=native`,
for the machine it runs on) into `<cache>/kernels/`, keyed by a hash of the source, flags, compiler and
CPU. Where no compiler is found, the build fails, or `PAGEDSERVE_CPU_KERNELS=0`, callers get None and
use the torch reference; nothing else changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "paged_attention_cpu.cpp", _CSRC / "elementwise_cpu.cpp", _CSRC / "sampling_cpu.cpp")
HEADERS = (_CSRC / "cpu_common.h",)
ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
CACHE_ENV = "PAGEDSERVE_CACHE"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many sequences per thread, one call is cheaper than handing work to another thread.
_MIN_SEQS_PER_THREAD = 8

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False
_pool: ThreadPoolExecutor | None = None
_table: tuple[tuple, torch.Tensor] | None = None


def enabled() -> bool:
    """False when PAGEDSERVE_CPU_KERNELS is 0/false/off/torch."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    return value not in ("0", "false", "off", "no", "torch")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: a cache folder shared between different CPUs must not mix builds."""
    keys = ("flags", "Features", "model name", "CPU part")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            first_cpu = info.read().split("\n\n", 1)[0]
    except OSError:
        first_cpu = ""
    lines = [line for line in first_cpu.splitlines() if line.startswith(keys)]
    return "\n".join([os.uname().machine, *lines])


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    parts = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        digest.update(part)
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedserve")
    return root / "kernels" / f"pagedserve_cpu-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                                check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(library: ctypes.CDLL, name: str, argtypes: list) -> None:
    fn = getattr(library, name)
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (with one warning) where it cannot be had."""
    global _library, _load_failed
    if _library is not None or _load_failed or not enabled():
        return _library if enabled() else None
    with _lock:
        if _library is not None or _load_failed:
            return _library
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
            path = _library_path(compiler)
            if not path.exists():
                logger.info("building the native CPU attention kernel into %s", path)
                _build(compiler, path)
            library = ctypes.CDLL(str(path))
            _declare(library, "pagedserve_decode_attention", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8
                     + [ctypes.c_float, ctypes.c_int])
            _declare(library, "pagedserve_rms_norm", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
                     + [ctypes.c_float, ctypes.c_int])
            _declare(library, "pagedserve_silu_and_mul", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                     + [ctypes.c_int])
            _declare(library, "pagedserve_bf16_to_float", [ctypes.c_void_p] * 2 + [ctypes.c_int64])
            _declare(library, "pagedserve_sample", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2)
            _declare(library, "pagedserve_logsumexp", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
            _declare(library, "pagedserve_rotary_and_cache", [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 7
                     + [ctypes.c_int])
            _declare(library, "pagedserve_rotary", [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_int])
            _library = library
        except Exception as exc:  # any failure means the torch path, never a broken engine
            _load_failed = True
            logger.warning("native CPU attention kernel unavailable (%s); using the torch reference", exc)
    return _library


def dtype_code(tensor: torch.Tensor) -> int | None:
    """The kernels' code for this tensor's dtype, None where they do not serve it."""
    return _DTYPE_CODES.get(tensor.dtype) if tensor.device.type == "cpu" else None


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"native {name} failed with status {status}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm of contiguous [T, H] rows; same contract as the reference."""
    library = load()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    _check(library.pagedserve_rms_norm(
        out.data_ptr(), summed.data_ptr() if summed is not None else None, x.data_ptr(),
        residual.data_ptr() if residual is not None else None, weight.data_ptr(), x.shape[0], x.shape[1],
        eps, _DTYPE_CODES[x.dtype]), "rms_norm")
    return out if summed is None else (out, summed)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(first half) * second half of contiguous [T, 2I] rows."""
    library = load()
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _check(library.pagedserve_silu_and_mul(out.data_ptr(), x.data_ptr(), out.numel() // max(inter, 1), inter,
                                           _DTYPE_CODES[x.dtype]), "silu_and_mul")
    return out


def _float_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The cos/sin table as contiguous fp32, converted once per table (the model keeps one for its life)."""
    global _table
    if cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous():
        return cos_sin_cache
    key = (cos_sin_cache.data_ptr(), cos_sin_cache.dtype, tuple(cos_sin_cache.shape))
    if _table is None or _table[0] != key:
        _table = (key, cos_sin_cache.float().contiguous())
    return _table[1]


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding into new contiguous tensors; query/key rows may be strided views (a QKV split)."""
    library = load()
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    table = _float_table(cos_sin_cache)
    pos = positions.to(torch.int64).contiguous()
    _check(library.pagedserve_rotary(
        q_out.data_ptr(), k_out.data_ptr(), query.data_ptr(), key.data_ptr(), pos.data_ptr(),
        table.data_ptr(), num_tokens, num_q_heads, num_kv_heads, head_dim, query.stride(0),
        key.stride(0), _DTYPE_CODES[query.dtype]), "rotary")
    return q_out, k_out


def sample_from_logits(logits: torch.Tensor, inv_temps: torch.Tensor, min_ps: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per fp32 row and the row's normaliser; same contract as the reference."""
    library = load()
    rows, vocab = logits.shape
    logits = logits.contiguous()
    inv_temps = inv_temps.to(torch.float32).contiguous()
    min_ps = min_ps.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    status = library.pagedserve_sample(logits.data_ptr(), inv_temps.data_ptr(), min_ps.data_ptr(),
                                       uniforms.data_ptr(), tokens.data_ptr(), lse.data_ptr(), rows, vocab)
    if status == 2:
        raise ValueError("a logits row has no finite value to sample from")
    _check(status, "sample")
    return tokens, lse


def bf16_to_float(x: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a bf16 tensor (exact), in one vectorised pass."""
    library = load()
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _check(library.pagedserve_bf16_to_float(x.data_ptr(), out.data_ptr(), x.numel()), "bf16_to_float")
    return out


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of each contiguous fp32 row."""
    library = load()
    logits = logits.contiguous()
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    _check(library.pagedserve_logsumexp(logits.data_ptr(), lse.data_ptr(), *logits.shape), "logsumexp")
    return lse


def rotary_embedding_and_cache(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotated query (new tensor); the rotated key and the value go straight into their cache slots."""
    library = load()
    num_tokens, num_q_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    pos = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    _check(library.pagedserve_rotary_and_cache(
        q_out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), pos.data_ptr(),
        _float_table(cos_sin_cache).data_ptr(), slots.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        num_tokens, num_q_heads, key.shape[1], head_dim, query.stride(0), key.stride(0), value.stride(0),
        _DTYPE_CODES[query.dtype]), "rotary_and_cache")
    return q_out


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when decode_attention can serve these tensors (CPU, fp32/bf16, contiguous caches)."""
    return (
        dtype_code(query) is not None
        and key_cache.dtype == query.dtype
        and key_cache.is_contiguous()
        and load() is not None
    )


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers != workers:  # noqa: SLF001 - resize on a thread-count change
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedserve-attn")
        return _pool


def decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one query token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S], context length including the query token
    scale: float,
    out: torch.Tensor | None = None,  # [S, Hq, D]
) -> torch.Tensor:
    """Attention of each sequence's single query over its paged context, read in place; call supports() first."""
    library = load()
    if library is None:
        raise RuntimeError("the native CPU attention kernel is not available")
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    query = query if query.stride(2) == 1 and query.stride(1) == head_dim else query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    target = out
    if out is None or out.stride(2) != 1 or out.stride(1) != head_dim:
        out = torch.empty(query.shape, dtype=query.dtype)
    if num_seqs == 0:
        return out if target is None else target
    code = _DTYPE_CODES[query.dtype]

    def run(begin: int, end: int) -> None:
        status = library.pagedserve_decode_attention(
            out[begin].data_ptr(), query[begin].data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            tables[begin].data_ptr(), lens[begin].data_ptr(), end - begin, num_q_heads, num_kv_heads,
            head_dim, block_size, tables.stride(0), query.stride(0), out.stride(0), scale, code,
        )
        _check(status, "decode attention")

    workers = min(torch.get_num_threads(), num_seqs // _MIN_SEQS_PER_THREAD)
    if workers <= 1:
        run(0, num_seqs)
    else:
        # ctypes drops the GIL during the call, so threads split the sequences for real.
        bounds = [num_seqs * i // workers for i in range(workers + 1)]
        futures = [_executor(workers).submit(run, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        for future in futures:
            future.result()
    if target is not None and target is not out:
        target.copy_(out)
        return target
    return out
