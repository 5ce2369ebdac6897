"""The few facts of a GGUF file's header that memory estimates need, read fast.

The `gguf` package's reader builds every metadata value and tensor record as
numpy objects: on a model with a 262k-token vocabulary that took 21 s. This
reader walks the header once through a memory map, skips array values by their
lengths without building them, keeps only the scalar keys asked for, and
remembers the result per file (path, size, modification time), so a model's
header is read once per engine however often it loads.

The same walk reads a header from any seekable binary file, a block at a time
(`read_header_from`): a file on the Hub, through a ranged file object, is
read with a few range requests before a byte of its weights is downloaded.
"""

import math
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

MAGIC = b"GGUF"
# Value types of the GGUF format (ggml's gguf_type), with the struct code and
# size of the fixed-width ones.
_FIXED = {
    0: ("B", 1),  # uint8
    1: ("b", 1),  # int8
    2: ("H", 2),  # uint16
    3: ("h", 2),  # int16
    4: ("I", 4),  # uint32
    5: ("i", 4),  # int32
    6: ("f", 4),  # float32
    7: ("?", 1),  # bool
    10: ("Q", 8),  # uint64
    11: ("q", 8),  # int64
    12: ("d", 8),  # float64
}
_STRING, _ARRAY = 8, 9
# A header that claims more than this is not a model file we can trust.
MAX_ITEMS = 1 << 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFHeader:
    """Scalar metadata (keys to ints, floats, strings or bools; an array of
    numbers appears as its first element) and the total parameter count."""

    metadata: dict[str, object]
    parameters: int
    vocabulary: int = 0  # tokens, from the token embedding's shape (0: none)
    # Bytes of the weights by where llama.cpp places them (offload planning,
    # engines/backends/offload.py): each repeating layer's `blk.N.*` tensors,
    # the token embedding (the input layer), and the rest (the output layer).
    layer_bytes: tuple[int, ...] = ()
    input_bytes: int = 0
    output_bytes: int = 0

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


class _Bytes(Protocol):
    """What the header is read from: a memory map, or `_Blocks`."""

    def __len__(self) -> int: ...

    def __getitem__(self, window: slice, /) -> bytes: ...


class _Blocks:
    """A seekable binary file read as bytes on demand, BLOCK bytes at a time,
    each block read once: a header read over HTTP range requests costs a
    request per block, not one per field."""

    BLOCK = 1 << 20

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self._handle = handle
        self._size = size
        self._blocks: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, window: slice, /) -> bytes:
        start, stop = window.start or 0, min(window.stop, self._size)
        if stop <= start:
            return b""
        first, last = start // self.BLOCK, (stop - 1) // self.BLOCK
        data = b"".join(self._block(number) for number in range(first, last + 1))
        offset = first * self.BLOCK
        return data[start - offset : stop - offset]

    def _block(self, number: int) -> bytes:
        block = self._blocks.get(number)
        if block is None:
            self._handle.seek(number * self.BLOCK)
            want = min(self.BLOCK, self._size - number * self.BLOCK)
            block = self._handle.read(want)
            if len(block) != want:
                raise GGUFFormatError("the file ended early")
            self._blocks[number] = block
        return block


class _Cursor:
    def __init__(self, data: _Bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, code: str, size: int):
        if self.at + size > len(self.data):
            raise GGUFFormatError("the header runs past the end of the file")
        (value,) = struct.unpack("<" + code, self.data[self.at : self.at + size])
        self.at += size
        return value

    def count(self) -> int:
        value = self.take("Q", 8)
        if value > MAX_ITEMS:
            raise GGUFFormatError(f"implausible item count {value}")
        return value

    def string(self) -> str:
        size = self.count()
        if self.at + size > len(self.data):
            raise GGUFFormatError("a string runs past the end of the file")
        text = bytes(self.data[self.at : self.at + size]).decode("utf-8", "replace")
        self.at += size
        return text

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            size = self.count()
            self.at += size
        if self.at > len(self.data):
            raise GGUFFormatError("an array runs past the end of the file")

    def value(self, kind: int):
        """A value of type `kind`; arrays are skipped, returning their first
        number (or None)."""
        if kind in _FIXED:
            return self.take(*_FIXED[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown value type {kind}")
        inner, count = self.take("I", 4), self.count()
        if inner == _STRING:
            self.skip_strings(count)
            return None
        if inner not in _FIXED:
            raise GGUFFormatError(f"unsupported array of type {inner}")
        code, size = _FIXED[inner]
        first = self.take(code, size) if count else None
        self.at += size * max(count - 1, 0)
        if self.at > len(self.data):
            raise GGUFFormatError("an array runs past the end of the file")
        return first


def _walk(data: _Bytes, name: str) -> GGUFHeader:
    if data[0:4] != MAGIC:
        raise GGUFFormatError(f"{name} is not a GGUF file")
    cursor = _Cursor(data)
    cursor.at = 4
    version = cursor.take("I", 4)
    if version < 2 or version > 3:
        raise GGUFFormatError(f"GGUF version {version} is not supported")
    tensors, keys = cursor.count(), cursor.count()
    metadata: dict[str, object] = {}
    for _ in range(keys):
        key = cursor.string()
        value = cursor.value(cursor.take("I", 4))
        if value is not None:
            metadata[key] = value
    parameters = vocabulary = 0
    offsets: list[tuple[int, str]] = []
    for _ in range(tensors):
        tensor = cursor.string()
        dims = cursor.take("I", 4)
        if dims > 8:
            raise GGUFFormatError(f"a tensor with {dims} dimensions")
        shape = [cursor.take("Q", 8) for _ in range(dims)]
        cursor.at += 4  # its type
        offsets.append((cursor.take("Q", 8), tensor))
        parameters += math.prod(shape)
        if tensor == "token_embd.weight" and len(shape) == 2:
            vocabulary = shape[1]  # [embedding width, tokens]
    alignment = int(metadata.get("general.alignment", 32) or 32)
    data_start = -(-cursor.at // alignment) * alignment
    return GGUFHeader(
        metadata,
        parameters,
        vocabulary,
        *_placed_bytes(offsets, len(data) - data_start),
    )


def _placed_bytes(
    offsets: list[tuple[int, str]], data_bytes: int
) -> tuple[tuple[int, ...], int, int]:
    """Each repeating layer's bytes, the input layer's and the output
    layer's, from the tensors' data offsets (a tensor's size: up to the next
    one's offset, padding included; the last one's, up to the file's end). A
    model without an `output.weight` ties it to the token embedding, which
    llama.cpp then also places with the output layer."""
    layers: dict[int, int] = {}
    input_bytes = output_bytes = 0
    ordered = sorted(offsets)
    ends = [offset for offset, _ in ordered[1:]] + [data_bytes]
    for (offset, tensor), end in zip(ordered, ends, strict=True):
        size = max(end - offset, 0)
        number = tensor.split(".")[1] if tensor.startswith("blk.") else ""
        if number.isdigit():
            layers[int(number)] = layers.get(int(number), 0) + size
        elif tensor == "token_embd.weight":
            input_bytes += size
        else:
            output_bytes += size
    if "output.weight" not in {tensor for _, tensor in offsets}:
        output_bytes += input_bytes
    blocks = tuple(layers.get(n, 0) for n in range(max(layers, default=-1) + 1))
    return blocks, input_bytes, output_bytes


def _read(path: Path) -> GGUFHeader:
    with (
        open(path, "rb") as handle,
        mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        return _walk(data, path.name)


def read_header_from(
    handle: BinaryIO, size: int, *, name: str = "the file"
) -> GGUFHeader:
    """The header facts of a GGUF file of `size` bytes open as `handle` (any
    seekable binary file: a ranged file object over HTTP reads only the
    blocks the header spans). Refused from its first bytes when it is not
    GGUF."""
    return _walk(_Blocks(handle, size), name)


_cache: dict[tuple[str, int, int], GGUFHeader] = {}
_cache_lock = threading.Lock()


def read_header(path: Path | str) -> GGUFHeader:
    """The file's header facts, read once per (path, size, mtime)."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    header = _read(path)
    with _cache_lock:
        _cache[key] = header
    return header
