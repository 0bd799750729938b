"""A handle names an array in another process's arena: small, immutable, checked on arrival.

Wire format of `Handle.to_bytes()` (little-endian; services carry it in a protobuf `bytes` field):

    offset  size     field
    0       1        format version (1)
    1       1        dtype code: index into DTYPES
    2       1        ndim (<= MAX_NDIM)
    3       1        length L of the segment name
    4       8        offset       u64
    12      8        nbytes       u64
    20      8        generation   u64
    28      8*ndim   shape        u64 each
    28+8*ndim  L     segment name, ASCII

A handle for a 2-D array is about 74 bytes.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass

import numpy as np

from shm.errors import ShmError
from shm.segment import check_name

FORMAT_VERSION = 1
MAX_NDIM = 8
# Plain fixed-size numbers only: no objects, strings or records, whose bytes are not just data.
# bfloat16 travels as uint16 and is reinterpreted by the consumer (tensor.view(torch.bfloat16)).
DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64",
)  # fmt: skip
_CODES = {name: code for code, name in enumerate(DTYPES)}
_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}
_FIXED = struct.Struct("<BBBBQQQ")
_LIMIT = 1 << 62  # larger offsets, sizes or dimensions cannot describe a real mapping


@dataclass(frozen=True, slots=True)
class Handle:
    segment: str  # "/tandem-<pid>-<16 hex>", the arena segment holding the region
    offset: int  # bytes from the start of the mapping to the array's first byte
    nbytes: int  # prod(shape) * itemsize; at most the region's capacity
    dtype: str  # one of DTYPES
    shape: tuple[int, ...]  # C order
    generation: int  # the region's generation when it was handed out (odd)

    def __post_init__(self) -> None:
        # Handles arrive from other processes: every field is checked here, once, cheaply.
        check_name(self.segment)
        itemsize = _ITEMSIZE.get(self.dtype) if isinstance(self.dtype, str) else None
        if itemsize is None:
            raise ShmError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        offset = _integer(self, "offset", self.offset)
        nbytes = _integer(self, "nbytes", self.nbytes)
        _integer(self, "generation", self.generation)
        shape = self.shape
        if type(shape) is not tuple or not all(type(d) is int for d in shape):
            try:
                shape = tuple(operator.index(d) for d in shape)
            except TypeError:
                raise ShmError(f"handle shape {self.shape!r} is not a tuple of integers") from None
            object.__setattr__(self, "shape", shape)
        if len(shape) > MAX_NDIM:
            raise ShmError(f"handle has {len(shape)} dimensions, at most {MAX_NDIM} are allowed")
        count = 1
        for d in shape:
            if not 0 <= d < _LIMIT:
                raise ShmError(f"handle shape {shape} has a negative or absurd dimension")
            count *= d
        if count * itemsize != nbytes:
            raise ShmError(
                f"handle says {nbytes} bytes, but {self.dtype}{list(shape)} is "
                f"{count * itemsize} bytes"
            )
        if offset + nbytes >= _LIMIT:
            raise ShmError(f"handle offset {offset} + {nbytes} bytes is out of range")

    def to_bytes(self) -> bytes:
        name = self.segment.encode("ascii")
        fixed = _FIXED.pack(
            FORMAT_VERSION,
            _CODES[self.dtype],
            len(self.shape),
            len(name),
            self.offset,
            self.nbytes,
            self.generation,
        )
        return fixed + struct.pack(f"<{len(self.shape)}Q", *self.shape) + name

    @classmethod
    def from_bytes(cls, data: bytes) -> Handle:
        """Parse and validate; any malformed input is a ShmError, never another exception."""
        if len(data) < _FIXED.size:
            raise ShmError(f"handle is {len(data)} bytes, shorter than its {_FIXED.size}-byte head")
        version, code, ndim, name_len, offset, nbytes, gen = _FIXED.unpack_from(data, 0)
        if version != FORMAT_VERSION:
            raise ShmError(f"handle format version {version}, expected {FORMAT_VERSION}")
        if code >= len(DTYPES):
            raise ShmError(f"handle dtype code {code} is unknown")
        if ndim > MAX_NDIM:
            raise ShmError(f"handle has {ndim} dimensions, at most {MAX_NDIM} are allowed")
        end = _FIXED.size + 8 * ndim + name_len
        if len(data) != end:
            raise ShmError(f"handle is {len(data)} bytes, its fields say {end}")
        shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
        try:
            name = bytes(data[end - name_len : end]).decode("ascii")
        except UnicodeDecodeError:
            raise ShmError("handle segment name is not ASCII") from None
        return cls(name, offset, nbytes, DTYPES[code], shape, gen)

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        return f"handle({self.segment}@{self.offset} {self.dtype}[{dims}] gen {self.generation})"


def _integer(handle: Handle, field: str, value: object) -> int:
    """`value` as a plain int in [0, 2**62), stored back into the (frozen) handle if converted."""
    if type(value) is int and 0 <= value < _LIMIT:
        return value
    if type(value) is not int:
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise ShmError(f"handle {field} {value!r} is not an integer") from None
        object.__setattr__(handle, field, value)
    if not 0 <= value < _LIMIT:
        raise ShmError(f"handle {field} {value} is out of range")
    return value
