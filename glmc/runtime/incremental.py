"""Incremental checkpoints: a snapshot written as its exact difference from the last full one.

    delta = encode(state, base)          # bytes-only skeleton, each tensor a compressed XOR
    assert_equal(decode(delta, base), state)   # bit for bit

Each tensor of the snapshot that the base holds at the same place with the same shape and dtype
is stored as the XOR of its bits with the base's, split into byte planes (all first bytes, then
all second bytes, ...: after a few optimizer steps the sign, exponent and high mantissa bytes
barely change, so their planes are mostly zeros) and compressed with zstd (zlib where the
`zstandard` module is missing; the codec is recorded). Other tensors (new optimizer state, a
changed shape) are stored whole, compressed the same way. Everything else in the snapshot (the
step, the data position, RNG states) is kept as is. Restoring XORs the planes back onto the
base: exact by construction.

A delta depends only on its full checkpoint (never on another delta), so restoring reads two
files whatever the interval, and losing a delta loses nothing else.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from glmc.errors import CheckpointError


@dataclass
class Packed:
    """One tensor of a delta: its byte planes, compressed; `xor` when XORed with the base's."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    xor: bool
    codec: str
    data: torch.Tensor  #: the compressed bytes as uint8 (torch.save stores tensors raw)


def encode(state: Any, base: Any, level: int = 3) -> Any:
    """`state` with every tensor replaced by a `Packed` difference from `base`."""
    known = dict(_tensors(base))

    def pack(path: tuple, t: torch.Tensor) -> Packed:
        b = known.get(path)
        same = b is not None and b.shape == t.shape and b.dtype == t.dtype
        bits = _bits(t)
        if same:
            bits = np.bitwise_xor(bits, _bits(b))
        size = t.element_size()
        codec, data = _compress(bits.view(np.uint8).reshape(-1, size).T.tobytes(), level)
        return Packed(t.dtype, tuple(t.shape), same, codec,
                      torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                      torch.empty(0, dtype=torch.uint8))

    return _map(state, (), pack)


def decode(delta: Any, base: Any) -> Any:
    """The snapshot `encode(state, base)` was made from, bit for bit."""
    known = dict(_tensors(base))

    def unpack(path: tuple, p: Packed) -> torch.Tensor:
        size = torch.empty((), dtype=p.dtype).element_size()
        n = 1
        for d in p.shape:
            n *= d
        raw = _decompress(p.codec, p.data.numpy().tobytes())
        if len(raw) != n * size:
            raise CheckpointError(f"incremental checkpoint: tensor {'/'.join(map(str, path))} "
                                  f"holds {len(raw)} bytes, expected {n * size}")
        bits = np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(size, n).T)
        bits = bits.view(_INT[size]).reshape(-1)
        if p.xor:
            b = known.get(path)
            if b is None or tuple(b.shape) != p.shape or b.dtype != p.dtype:
                raise CheckpointError(f"incremental checkpoint: its full checkpoint has no "
                                      f"tensor {'/'.join(map(str, path))} of {list(p.shape)} "
                                      f"{p.dtype}: the base is not the one it was written "
                                      "against")
            bits = np.bitwise_xor(bits, _bits(b))
        return torch.from_numpy(bits).view(p.dtype).reshape(p.shape)

    return _map(delta, (), unpack, kind=Packed)


def clone_tensors(state: Any) -> Any:
    """`state` with every tensor cloned (a base that later in-place updates cannot change)."""
    return _map(state, (), lambda path, t: t.detach().clone())


def packed_bytes(delta: Any) -> int:
    """Compressed bytes of a delta's tensors."""
    return sum(p.data.numel() for _, p in _tensors(delta, kind=Packed))


_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width (a flat numpy view)."""
    flat = t.detach().reshape(-1).contiguous()
    size = flat.element_size()
    return flat.view(_TORCH_INT[size]).numpy().view(_INT[size])


def _compress(raw: bytes, level: int) -> tuple[str, bytes]:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - zstandard is a dependency; zlib keeps it working
        return "zlib", zlib.compress(raw, 1)
    return "zstd", zstandard.ZstdCompressor(level=level, threads=-1).compress(raw)


def _decompress(codec: str, data: bytes) -> bytes:
    if codec == "zlib":
        return zlib.decompress(data)
    if codec == "zstd":
        import zstandard
        return zstandard.ZstdDecompressor().decompress(data)
    raise CheckpointError(f"incremental checkpoint: unknown codec {codec!r}")


def _tensors(x: Any, path: tuple = (), kind: type = torch.Tensor) -> Iterator[tuple[tuple, Any]]:
    if isinstance(x, kind):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _tensors(v, (*path, k), kind)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _tensors(v, (*path, i), kind)


def _map(x: Any, path: tuple, fn: Any, kind: type = torch.Tensor) -> Any:
    if isinstance(x, kind):
        return fn(path, x)
    if isinstance(x, dict):
        return {k: _map(v, (*path, k), fn, kind) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        out = [_map(v, (*path, i), fn, kind) for i, v in enumerate(x)]
        return out if isinstance(x, list) else tuple(out)
    return x


__all__ = ["encode", "decode", "packed_bytes", "clone_tensors", "Packed"]
