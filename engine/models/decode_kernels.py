"""The engine's own C kernels for a CPU decode step, its attention and its linear products,
built with the machine's C compiler into one library and loaded through ctypes.

A decode step's attention is one query per row against that row's keys and values: per
key/value head, a ``(group, dim) x (dim, columns)`` product for the scores and a ``(group,
columns) x (columns, dim)`` one for the output. PyTorch runs them as batched matrix products
(MKL), whose packing of each small operand reads the keys about twice: on this project's
machines the score product ran at 5.6 GB/s of keys where a plain read of the same keys ran at
14 GB/s (``scripts/attention_bench.py``). The kernel here (``csrc/decode_attention.c``) reads
each kept column's key and value once, straight from the cache's buffers (any row, head and
column strides), and never reads a padding column (the rows' padding mask says which), so a
batch of rows of different lengths reads only what they use, each key and value prefetched 8
columns ahead. Each (row, head) pair's scores,
their softmax (a vectorized exp of its own, Cephes' polynomial, within 2 units in the last
place) and the weighted values run one after the other in a buffer of the thread's own.

The kernel sums each dot product and each output in its own order (a vectorized loop over
``dim``, then over the kept columns; the softmax's sum from the row's first kept column), not
MKL's: results differ from the batched products and SDPA by rounding
(``tests/engine/test_decode_kernels.py`` bounds it), and a row's result is the same bits
whatever its batch-mates' lengths (the frame's padding).

It is built once per source, compiler and CPU into ``<cache root>/kernels`` (``cc -O3
-march=native -fopenmp -shared``, about a second) by :func:`prepare`, which the engine calls
when it loads a model on a CPU (never in a request); where there is no compiler, or the build
or load fails, :func:`library` is None (logged once) and the batched products run.
``APHRODITE_DECODE_ATTENTION_KERNEL=0`` turns it off.

The linear kernel (``csrc/decode_linear.c``, :func:`linear`) is the products of a step of a
few rows. oneDNN's packed product reads a weight at 8-10 GB/s for 4-8 rows on these machines
and MKL's at 5-7, where one row, or a plain read, runs at 12-14; the kernel streams a copy of
the weight packed at load into panels of 16 output columns, three panels side by side, each
prefetched ahead, with up to 8 rows' sums in registers: 11-13 GB/s at 1-8 rows
(``scripts/linear_bench.py``). Each output is one chain of multiply-adds over the input in
order, so a row's result is the same bits whatever its batch-mates, their number (it takes a
step of any number of rows: past 64, 1.1-1.3x oneDNN's time, see docs/performance.md) and
threads, and within the rounding bound of any float32 sum
(``tests/engine/test_decode_linear.py``); not the bits of MKL's or oneDNN's sums. Its copy
of each weight is memory beside the weight itself (and a oneDNN copy where
:mod:`engine.models.cpu_linear` packs one for prefills).
``APHRODITE_DECODE_LINEAR_KERNEL=0`` turns it off. With ``--quantization int8`` the same
kernel streams panels of int8 rows (:func:`linear_int8`: a byte an element, widened to
float32 in registers, each column's sum times its row's scale): a quarter of the bytes, the
activations in float32 (PyTorch's int8 product takes them in bfloat16).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import envs, paths

logger = logging.getLogger(__name__)

#: the C sources, built into one library
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.c", "decode_linear.c", "decode_ops.c",
                             "decode_step.c"))
#: the headers they include (part of the build's key)
HEADERS = (Path(__file__).with_name("csrc") / "vec.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
#: on x86, the widest vectors the processor has (GCC uses 256 bits on some AVX-512 ones)
X86_FLAGS = ("-mprefer-vector-width=512",)
#: weights of fewer elements stay on PyTorch's product (the tiny test models' 2 K-57 K: there
#: a call through ctypes cost 1.5x F.linear's)
MIN_LINEAR_WEIGHT = 1 << 16
#: compilers tried in turn
COMPILERS = ("cc", "gcc", "clang")
#: seconds a build may take
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _flags() -> tuple[str, ...]:
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return FLAGS + X86_FLAGS if x86 else FLAGS


def _build(compiler: str, target: Path) -> None:
    """Build into ``target``; where the compiler has no OpenMP (Apple's clang, a clang
    without libomp) build again without it (the kernels then run on one thread). Stale
    libraries of other keys beside it are removed (a process that loaded one keeps its
    mapping)."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *_flags(), "-o", tmp, *map(str, SOURCES), "-lm"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.CalledProcessError:
            serial = [c for c in command if c != "-fopenmp"]
            subprocess.run(serial, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
            logger.warning("decode kernels built without OpenMP (%s has none): they run on "
                           "one thread", compiler)
        os.replace(tmp, target)  # (atomic: another process may build the same one)
    finally:
        Path(tmp).unlink(missing_ok=True)
    for old in [*target.parent.glob("decode_kernels-*.so"),
                *target.parent.glob("decode_attention-*.so")]:
        if old != target:
            old.unlink(missing_ok=True)


def _private(path: Path) -> bool:
    """Whether ``path`` (the library, its folder) is this user's and no one else may write
    it: a library others could replace would run inside the engine."""
    info = path.stat()
    return (not hasattr(os, "getuid") or info.st_uid == os.getuid()) and \
        not info.st_mode & 0o022


def _load() -> ctypes.CDLL:
    compiler = next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None:
        raise FileNotFoundError(f"no C compiler found (tried {', '.join(COMPILERS)})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in (*SOURCES, *HEADERS)),
                                    " ".join(_flags()),
                                    version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = paths.cache_root() / "kernels" / f"decode_kernels-{key}.so"
    if not target.exists():
        _build(compiler, target)
    if not (_private(target) and _private(target.parent)):
        raise PermissionError(f"{target} or its folder is not this user's alone (others may "
                              "write it): not loaded; set APHRODITE_CACHE_ROOT to a private "
                              "folder")
    lib = ctypes.CDLL(str(target))
    f, i, p, lng = ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_long
    lib.ap_decode_attention.argtypes = [p, p, lng, lng, lng, p, lng, lng, lng, p, lng, p,
                                        lng, lng, lng, lng, lng, f, i]
    lib.ap_decode_attention.restype = i
    lib.ap_linear_pack.argtypes = [p, lng, lng, p, lng]
    lib.ap_linear_pack.restype = None
    lib.ap_linear.argtypes = [p, lng, lng, lng, p, p, lng, p, lng, i]
    lib.ap_linear.restype = None
    lib.ap_linear_pack_i8.argtypes = [p, lng, lng, p, lng]
    lib.ap_linear_pack_i8.restype = None
    lib.ap_linear_i8.argtypes = [p, lng, lng, lng, p, p, p, lng, p, lng, i]
    lib.ap_linear_i8.restype = None
    lib.ap_linear_group_columns.restype = lng
    lib.ap_vector_floats.restype = lng
    lib.ap_add_rms.argtypes = [p, p, p, f, p, lng, lng]
    lib.ap_add_rms.restype = None
    lib.ap_rotate_qk.argtypes = [p, lng, p, p, p, p, lng, lng, lng, lng]
    lib.ap_rotate_qk.restype = None
    lib.ap_silu_mul.argtypes = [p, p, lng, lng]
    lib.ap_silu_mul.restype = None
    lib.ap_decode_layers.argtypes = [p, lng, lng, lng, lng, lng, f, f, p, p, p, p, p, lng, lng,
                                     i]
    lib.ap_decode_layers.restype = i
    lib.ap_decode_step.argtypes = [p, lng, lng, lng, lng, lng, f, f, p, lng, p, p, p, p, p, p,
                                   p, lng, lng, i]
    lib.ap_decode_step.restype = i
    lib.ap_decode_step_at.argtypes = [p, lng, lng, lng, lng, lng, f, f, p, lng, p, p, p, p, p,
                                      p, p, lng, p, p, lng, lng, i]
    lib.ap_decode_step_at.restype = i
    lib.ap_argmax_rows.argtypes = [p, lng, lng, p]
    lib.ap_argmax_rows.restype = None
    lib.ap_step_layer_bytes.restype = lng
    lib.group_columns = lib.ap_linear_group_columns()
    lib.vector_floats = lib.ap_vector_floats()
    group, dim = ctypes.c_int(), ctypes.c_int()
    lib.ap_decode_limits(ctypes.byref(group), ctypes.byref(dim))
    lib.max_group, lib.max_dim = group.value, dim.value
    return lib


def prepare() -> ctypes.CDLL | None:
    """Build (once per machine: cached) and load the kernel where it is on; None where it is
    off or cannot be had (the reason logged once)."""
    if not (envs.APHRODITE_DECODE_ATTENTION_KERNEL or envs.APHRODITE_DECODE_LINEAR_KERNEL):
        return None
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _load()
            except (OSError, subprocess.SubprocessError, AttributeError) as exc:
                detail = getattr(exc, "stderr", None) or exc
                if isinstance(detail, bytes):
                    detail = detail.decode(errors="replace")[-400:]
                logger.warning("decode kernels unavailable (attention runs batched products, "
                               "linear layers oneDNN's or PyTorch's): %s", detail)
                _state["lib"] = None
        return _state["lib"]


def library() -> ctypes.CDLL | None:
    """The loaded library, if :func:`prepare` has loaded it (never builds here) and the
    attention kernel is on."""
    return _state.get("lib") if envs.APHRODITE_DECODE_ATTENTION_KERNEL else None


def linear(weight: Any, bias: Any, wider: Callable[[Any], Any] | None = None
           ) -> Callable[[Any], Any] | None:
    """``x -> F.linear(x, weight, bias)`` through the linear kernel (``csrc/decode_linear.c``)
    for float32 CPU inputs of any number of rows (a row's result the same bits whatever its
    batch-mates: a step of many rows is not sent elsewhere, where the sums would be another
    product's), with ``weight`` packed into the kernel's panels now (a copy: ``weight`` stays
    as it is); other dtypes and inputs that need gradients go to ``wider`` (``F.linear`` by
    default). None where the kernel is off or not loaded (see :func:`prepare`), ``weight`` is
    under :data:`MIN_LINEAR_WEIGHT` elements (a call costs more than it saves) or not a 2-D
    float32 CPU tensor (or ``bias`` not a matching vector)."""
    import torch
    import torch.nn.functional as F

    if weight.dtype != torch.float32:
        return None
    return _packed(weight, None, bias, wider or (lambda x: F.linear(x, weight, bias)))


def linear_int8(qweight: Any, scale: Any, bias: Any, wider: Callable[[Any], Any]
                ) -> Callable[[Any], Any] | None:
    """``x -> F.linear(x, qweight * scale[:, None], bias)`` for int8 rows ``qweight`` with a
    float32 ``scale`` per row (``--quantization int8``, :mod:`engine.models.int8_linear`),
    through the linear kernel as :func:`linear` (panels of a byte an element: a quarter of
    float32's reads; each column's sum of products in float32 times its scale, then the
    bias); other inputs go to ``wider``. None where :func:`linear` would be, or ``qweight``
    is not int8 or ``scale`` not a float32 vector of its rows."""
    import torch

    if qweight.dtype != torch.int8 or scale.dtype != torch.float32 or \
            tuple(scale.shape) != (qweight.shape[0],) or scale.device.type != "cpu":
        return None
    return _packed(qweight, scale, bias, wider)


def _padded(vector: Any, size: int) -> Any:
    import torch

    if vector is None:
        return None
    out = torch.zeros(size, dtype=torch.float32)
    out[:vector.shape[0]] = vector.detach()
    return out


def _packed(weight: Any, scale: Any, bias: Any, other: Callable[[Any], Any]
            ) -> Callable[[Any], Any] | None:
    """:func:`linear`'s and :func:`linear_int8`'s product: ``weight`` (float32, or int8
    with ``scale``) packed into the kernel's panels."""
    import torch

    lib = ops()
    if lib is None or weight.dim() != 2 or weight.numel() < MIN_LINEAR_WEIGHT or \
            weight.device.type != "cpu" or (bias is not None and (
                bias.dtype != torch.float32 or tuple(bias.shape) != (weight.shape[0],))):
        return None
    n, k = weight.shape
    width = lib.group_columns
    padded = -(-n // width) * width
    with torch.no_grad():
        w = weight.detach().contiguous()
        panels = torch.empty(padded * k, dtype=w.dtype)
        pack = lib.ap_linear_pack if scale is None else lib.ap_linear_pack_i8
        pack(w.data_ptr(), n, k, panels.data_ptr(), padded)
        padded_scale, padded_bias = _padded(scale, padded), _padded(bias, padded)
    bias_ptr = None if padded_bias is None else padded_bias.data_ptr()
    if scale is None:
        def run(x: Any, rows: int, out: Any) -> None:
            lib.ap_linear(x.data_ptr(), rows, x.stride(0), k, panels.data_ptr(), bias_ptr, n,
                          out.data_ptr(), n, torch.get_num_threads())
    else:
        def run(x: Any, rows: int, out: Any) -> None:
            lib.ap_linear_i8(x.data_ptr(), rows, x.stride(0), k, panels.data_ptr(),
                             padded_scale.data_ptr(), bias_ptr, n, out.data_ptr(), n,
                             torch.get_num_threads())

    def product(x: Any) -> Any:
        rows = x.numel() // k if x.dim() and x.shape[-1] == k else 0
        if rows == 0 or x.dtype != torch.float32 or \
                x.device.type != "cpu" or (torch.is_grad_enabled() and (
                    x.requires_grad or weight.requires_grad)):
            return other(x)
        flat = x.reshape(rows, k)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        run(flat, rows, out)
        return out

    product.panels = panels  # type: ignore[attr-defined]  # (kept alive with the product)
    product.shape = (n, k)  # type: ignore[attr-defined]
    product.scale = padded_scale  # type: ignore[attr-defined]
    product.bias = padded_bias  # type: ignore[attr-defined]
    product.blocked = getattr(other, "blocked", None)  # type: ignore[attr-defined]
    return product


def decode_attention(query: Any, key: Any, value: Any, keep: Any, scaling: float) -> Any:
    """One query per row: ``query`` ``(rows, heads, 1, dim)``, ``key`` and ``value`` ``(rows,
    kv_heads, columns, dim)`` (any strides but a contiguous last dimension), ``keep`` the
    rows' bool padding mask ``(rows, columns)`` or None (every column); ``(rows, 1, heads,
    dim)``, or None where the kernel does not take these (not loaded, not float32, a head
    group or head size past its limits)."""
    import torch

    lib = library()
    rows, heads, _, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    if lib is None or heads % kv_heads or heads // kv_heads > lib.max_group or \
            dim > lib.max_dim or not all(t.dtype == torch.float32 and t.stride(-1) == 1 and
                                         t.device.type == "cpu" for t in (query, key, value)) \
            or tuple(key.shape) != (rows, kv_heads, columns, dim) or \
            tuple(value.shape) != tuple(key.shape) or \
            (keep is not None and (keep.dtype != torch.bool or keep.stride(-1) != 1 or
                                   tuple(keep.shape) != (rows, columns))):
        return None
    group = heads // kv_heads
    q = query.reshape(rows, kv_heads, group, dim).contiguous()
    out = torch.empty(rows, kv_heads, group, dim, dtype=torch.float32)
    keep_ptr, keep_stride = (None, 0) if keep is None else (keep.data_ptr(), keep.stride(0))
    if lib.ap_decode_attention(q.data_ptr(), key.data_ptr(), key.stride(0), key.stride(1),
                               key.stride(2), value.data_ptr(), value.stride(0),
                               value.stride(1), value.stride(2), keep_ptr, keep_stride,
                               out.data_ptr(), rows, kv_heads, group, dim, columns, scaling,
                               torch.get_num_threads()):
        return None  # (a thread's scores buffer could not be allocated)
    return out.view(rows, 1, heads, dim)


def ops() -> ctypes.CDLL | None:
    """The library for the linear kernel and the small operations between a step's products
    (``csrc/decode_ops.c``: :func:`add_rms`, :func:`rotate_qk`, :func:`silu_mul`), loaded and
    on with ``APHRODITE_DECODE_LINEAR_KERNEL``; None otherwise."""
    return _state.get("lib") if envs.APHRODITE_DECODE_LINEAR_KERNEL else None


def add_rms(lib: ctypes.CDLL, h: Any, delta: Any, weight: Any, eps: float, out: Any) -> None:
    """``h += delta`` (None: nothing), then ``out = weight * RMSNorm(h)`` (transformers'
    Qwen2/Llama RMSNorm in float32): ``h``, ``delta``, ``out`` contiguous ``(rows, n)``
    float32, ``weight`` ``(n,)``."""
    _require(h.dim() == 2 and _plain32(h) and _plain32(out) and out.shape == h.shape and
             _plain32(weight) and weight.numel() == h.shape[1] and
             (delta is None or (_plain32(delta) and delta.shape == h.shape)), "add_rms")
    lib.ap_add_rms(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                   eps, out.data_ptr(), h.shape[0], h.shape[1])


def _plain32(t: Any) -> bool:
    import torch

    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"decode kernel {what}: its tensors are not the contiguous float32 "
                         "CPU tensors of matching shapes it needs")


def rotate_qk(lib: ctypes.CDLL, qkv: Any, cos: Any, sin: Any, heads: int, kv_heads: int,
              dim: int) -> tuple[Any, Any]:
    """The query and key heads of the fused product's rows ``qkv`` (``(rows, ...)``, last
    dimension contiguous) rotated by ``cos``/``sin`` (contiguous ``(rows, dim)``), as
    ``(rows, heads, 1, dim)`` and ``(rows, kv_heads, 1, dim)``."""
    import torch

    rows = qkv.shape[0]
    _require(qkv.dim() == 2 and qkv.dtype == torch.float32 and qkv.stride(-1) == 1 and
             qkv.shape[1] >= (heads + kv_heads) * dim and _plain32(cos) and _plain32(sin) and
             cos.shape == sin.shape == (rows, dim), "rotate_qk")
    q = torch.empty(rows, heads, 1, dim, dtype=torch.float32)
    k = torch.empty(rows, kv_heads, 1, dim, dtype=torch.float32)
    lib.ap_rotate_qk(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                     q.data_ptr(), k.data_ptr(), rows, heads, kv_heads, dim)
    return q, k


def silu_mul(lib: ctypes.CDLL, gate_up: Any) -> Any:
    """``silu(gate) * up`` of contiguous ``(rows, 2 * width)`` rows: ``(rows, width)``."""
    import torch

    _require(gate_up.dim() == 2 and _plain32(gate_up) and gate_up.shape[1] % 2 == 0,
             "silu_mul")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    lib.ap_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out
