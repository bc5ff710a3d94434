"""A GGUF file's tensor directory, read without materializing its metadata.

``gguf.GGUFReader`` turns every metadata value into numpy views of the file, one per string of the
tokenizer's vocabulary and merges: for a 49k-token vocabulary that is about a million small arrays,
seconds of parsing and over a hundred megabytes resident while the weights are converted. The
weights need none of it (the tokenizer and config are read once, by transformers, and cached): this
reader steps over the metadata, keeps the two values it needs (the architecture and the data
alignment) and maps each tensor's bytes. The format is the one ``gguf`` documents (version 2 and 3,
little-endian); the type tables are ``gguf``'s own.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# byte sizes of GGUF's fixed-size value types
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` with rows first (GGUF lists the fastest dimension first; this is the
    reverse), ``data`` its bytes ``[rows..., row bytes]`` (uint8, a view of the file)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GGUFTensors:
    """The tensors of the GGUF file at ``path`` (``tensors``), its ``architecture`` and ``alignment``.

    Raises ValueError for a file that is not GGUF version 2 or 3 in little-endian order.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path.name}: not a GGUF file")
        version, = struct.unpack_from("<I", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path.name}: GGUF version {version} (big-endian or unsupported); "
                             "versions 2 and 3, little-endian, are read")
        n_tensors, n_kv = struct.unpack_from("<QQ", self._buf, 8)
        offs = 24
        values: dict[str, object] = {}
        for _ in range(n_kv):
            key, offs = self._string(offs)
            vtype, = struct.unpack_from("<I", self._buf, offs)
            offs += 4
            if key in ("general.architecture", "general.alignment"):
                values[key] = self._scalar(offs, GGUFValueType(vtype))
            offs = self._skip(offs, GGUFValueType(vtype))
        infos = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            n_dims, = struct.unpack_from("<I", self._buf, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offs + 4)
            qtype, rel = struct.unpack_from("<IQ", self._buf, offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(qtype), rel))
        self.architecture = str(values.get("general.architecture", ""))
        self.alignment = int(values.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{self.path.name}: alignment {self.alignment} is not a power of two")
        start = -(-offs // self.alignment) * self.alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType,
                rel: int) -> GGUFTensor:
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))
        if shape[-1] % block:
            raise ValueError(f"{self.path.name}: {name}'s rows ({shape[-1]}) are not whole {qtype.name} blocks")
        byte_shape = (*shape[:-1], shape[-1] // block * type_bytes)
        n_bytes = int(np.prod(byte_shape))
        at = start + rel
        if at + n_bytes > len(self.data):
            raise ValueError(f"{self.path.name}: {name} runs past the end of the file (truncated?)")
        return GGUFTensor(name, qtype, shape, at, n_bytes, self.data[at:at + n_bytes].reshape(byte_shape))

    def _string(self, offs: int) -> tuple[str, int]:
        n, = struct.unpack_from("<Q", self._buf, offs)
        return bytes(self._buf[offs + 8:offs + 8 + n]).decode("utf-8"), offs + 8 + n

    def _scalar(self, offs: int, vtype: GGUFValueType):
        if vtype == GGUFValueType.STRING:
            return self._string(offs)[0]
        fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}.get(_SCALAR_BYTES.get(vtype, 0))
        return None if fmt is None else struct.unpack_from("<" + fmt, self._buf, offs)[0]

    def _skip(self, offs: int, vtype: GGUFValueType) -> int:
        """The offset past a value of type ``vtype`` at ``offs``."""
        if vtype in _SCALAR_BYTES:
            return offs + _SCALAR_BYTES[vtype]
        if vtype == GGUFValueType.STRING:
            n, = struct.unpack_from("<Q", self._buf, offs)
            return offs + 8 + n
        if vtype == GGUFValueType.ARRAY:
            itype, count = struct.unpack_from("<IQ", self._buf, offs)
            itype = GGUFValueType(itype)
            offs += 12
            if itype in _SCALAR_BYTES:
                return offs + count * _SCALAR_BYTES[itype]
            for _ in range(count):
                offs = self._skip(offs, itype)
            return offs
        raise ValueError(f"{self.path.name}: unknown GGUF value type {vtype}")

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Let the kernel drop the file pages of ``tensor``'s bytes, once copied: pages read stay
        resident while the file is mapped, so a load's peak would hold the file and its converted
        copy at once."""
        mm = getattr(self.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = -(-tensor.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor
        end = (tensor.data_offset + tensor.n_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass
