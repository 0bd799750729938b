"""bf16 products through cuBLASLt with a chosen algorithm (ctypes over the library torch loads),
for bench/decode_products.py to time every algorithm cuBLASLt's heuristic offers.

torch's products take the heuristic's first algorithm. `algorithms` lists its candidates (for
operands at any 16-byte offset) and `Product` runs one of them on torch's current stream, so
CUDA graphs capture it like any other kernel. (Chained alone, the fastest of them beat the first
by 1-10% on some decode-step products; captured into whole decode steps they did not: session
41, bench/RESULTS-gpu.md. So the engine keeps torch's products.)

y = x @ w.T with x (M, K) and w (N, K), both row-major: in cuBLAS's column-major terms
y.T (N, M) = op_T(w) (N, K) @ x.T (K, M), which is the layout torch itself asks for.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

# cublasLt's enums (cublasLt.h, library_types.h): stable across CUDA 11-13.
_COMPUTE_32F = 68
_R_32F, _R_16BF = 0, 14
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # of A, B, C and D, in bytes (default 256)
ALIGNMENT = 16  # what every operand's address must be a multiple of: TMA's
WORKSPACE_BYTES = 32 << 20  # what torch gives cuBLASLt on Hopper


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublasLt torch has loaded (a product first makes sure it is)."""
    a = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.preferred_blas_library()
    (a @ a).sum().item()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    if not paths:
        raise CublasLtError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed: cublasStatus {status}")


_local = threading.local()


def _handle() -> ctypes.c_void_p:
    if not hasattr(_local, "handle"):
        handle = ctypes.c_void_p()
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _local.handle = handle
    return _local.handle


@functools.cache
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


def _layout(rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    layout = ctypes.c_void_p()
    _check(
        _library().cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _R_16BF, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
            ctypes.c_int64(ld),
        ),
        "cublasLtMatrixLayoutCreate",
    )  # fmt: skip
    return layout


@dataclass
class _Descriptors:
    matmul: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    d: ctypes.c_void_p


@functools.cache
def _descriptors(m: int, n: int, k: int) -> _Descriptors:
    lib = _library()
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "DescCreate")
    for attribute, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
        op = ctypes.c_int32(value)
        _check(
            lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(op), 4),
            "DescSetAttribute",
        )
    return _Descriptors(desc, _layout(k, n, k), _layout(k, m, k), _layout(n, m, n))


def algorithms(m: int, n: int, k: int, count: int = 32) -> list[_Algo]:
    """Up to `count` of the heuristic's algorithms for (m, k) @ (n, k).T, best guess first."""
    lib = _library()
    d = _descriptors(m, n, k)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    size = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(
        lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
        "PreferenceSetAttribute",
    )
    alignment = ctypes.c_uint32(ALIGNMENT)  # operands are views at any 16-byte offset
    for attribute in _PREF_MIN_ALIGNMENT:
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, attribute, ctypes.byref(alignment), 4),
            "PreferenceSetAttribute",
        )
    results = (_Heuristic * count)()
    returned = ctypes.c_int(0)
    status = lib.cublasLtMatmulAlgoGetHeuristic(
        _handle(), d.matmul, d.a, d.b, d.d, d.d, pref, count, results, ctypes.byref(returned)
    )
    lib.cublasLtMatmulPreferenceDestroy(pref)
    _check(status, "cublasLtMatmulAlgoGetHeuristic")
    return [results[i].algo for i in range(returned.value) if results[i].state == 0]


class Product:
    """out = x @ w.T for bf16 x (m, k), w (n, k) and out (m, n), all contiguous, with one
    algorithm (None: the heuristic's first)."""

    def __init__(self, m: int, n: int, k: int, algo: _Algo | None = None) -> None:
        self.shape = (m, n, k)
        self.d = _descriptors(m, n, k)
        self.algo = algo if algo is not None else algorithms(m, n, k, 1)[0]
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        m, n, k = self.shape
        if x.shape != (m, k) or w.shape != (n, k) or out.shape != (m, n):
            raise ValueError(f"shapes {tuple(x.shape)} @ {tuple(w.shape)}.T -> {tuple(out.shape)}")
        if not all(t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in (x, w, out)):
            raise ValueError(f"operands must be contiguous and {ALIGNMENT}-byte aligned")
        workspace = _workspace(x.device.index or 0)
        _check(
            _library().cublasLtMatmul(
                _handle(), self.d.matmul, ctypes.byref(self._one),
                ctypes.c_void_p(w.data_ptr()), self.d.a, ctypes.c_void_p(x.data_ptr()), self.d.b,
                ctypes.byref(self._zero), ctypes.c_void_p(out.data_ptr()), self.d.d,
                ctypes.c_void_p(out.data_ptr()), self.d.d, ctypes.byref(self.algo),
                ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES),
                ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
            ),
            "cublasLtMatmul",
        )  # fmt: skip
        return out
