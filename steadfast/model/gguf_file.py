"""A GGUF file read in one pass: its metadata as plain Python values and its tensors as numpy views
of the mapped file.

`gguf.GGUFReader` decodes every element of every array through numpy slicing: for a 49k-token
vocabulary and its merges that is ~6 s of CPU in every process that opens the model (launcher,
router, each worker), and minutes for a niced router restarted on a loaded machine. Here string
arrays are decoded with plain byte slicing and numeric arrays with one `frombuffer` each (~0.1 s).
The `gguf` package still supplies the type tables and dequantization.

Format (little-endian): magic `GGUF`, version (2 or 3), tensor count, metadata count; the metadata
key/value pairs; one info record per tensor (name, dims, type, offset); padding to the alignment;
the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_SCALARS: dict[int, np.dtype] = {
    gguf.GGUFValueType.UINT8: np.dtype("<u1"),
    gguf.GGUFValueType.INT8: np.dtype("<i1"),
    gguf.GGUFValueType.UINT16: np.dtype("<u2"),
    gguf.GGUFValueType.INT16: np.dtype("<i2"),
    gguf.GGUFValueType.UINT32: np.dtype("<u4"),
    gguf.GGUFValueType.INT32: np.dtype("<i4"),
    gguf.GGUFValueType.FLOAT32: np.dtype("<f4"),
    gguf.GGUFValueType.BOOL: np.dtype("?"),
    gguf.GGUFValueType.UINT64: np.dtype("<u8"),
    gguf.GGUFValueType.INT64: np.dtype("<i8"),
    gguf.GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (or the file is cut short)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # numpy order (shape reversed); a quantized tensor's rows as raw bytes


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError("no GGUF magic at the start of the file")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # --- parsing ---------------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise GGUFFormatError(f"the file ends inside its header (at byte {self._pos}, {n} more wanted)")
        view = self._buf[self._pos : end]
        self._pos = end
        return view

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _numbers(self, dtype: np.dtype, count: int) -> list[Any]:
        return np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).tolist()

    def _string(self) -> str:
        return bytes(self._take(self._scalar("<Q"))).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self._string()
        if kind == gguf.GGUFValueType.ARRAY:
            return self._array(self._scalar("<I"), self._scalar("<Q"))
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self._numbers(_SCALARS[kind], 1)[0]

    def _array(self, kind: int, count: int) -> list[Any]:
        if kind in _SCALARS:
            return self._numbers(_SCALARS[kind], count)
        if kind == gguf.GGUFValueType.STRING:
            buf, pos, out = self._buf, self._pos, []
            size = len(buf)
            for _ in range(count):  # byte slicing, not numpy: this loop is the whole speed-up
                if pos + 8 > size:
                    raise GGUFFormatError("the file ends inside a string array")
                n = int.from_bytes(buf[pos : pos + 8], "little")
                if pos + 8 + n > size:
                    raise GGUFFormatError("the file ends inside a string array")
                out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            self._pos = pos
            return out
        return [self._value(kind) for _ in range(count)]  # arrays of arrays: rare, small

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name}: unknown type {kind}") from None
        rows = tuple(reversed(dims[1:])) if dims else ()
        inner = dims[0] if dims else 1
        if inner % block:
            raise GGUFFormatError(f"tensor {name}: {inner} values per row is not a whole number of blocks")
        row_bytes = inner // block * type_size
        nbytes = row_bytes * int(np.prod(rows, dtype=np.int64))
        begin = start + offset
        if begin + nbytes > len(self._map):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        raw = self._map[begin : begin + nbytes]
        plain = _PLAIN.get(qtype)
        data = raw.view(plain).reshape(*rows, inner) if plain is not None else raw.reshape(*rows, row_bytes)
        return GGUFTensor(name, dims, qtype, data)
