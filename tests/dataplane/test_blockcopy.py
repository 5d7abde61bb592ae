"""The streaming block kernel: the same bytes as numpy, or a clear reason it is off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dataplane import blockcopy
from tests.dataplane.support import streaming_kernel


def _addresses(buf: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return (buf.ctypes.data + offsets).astype(np.int64)


@pytest.mark.parametrize(
    ("block_bytes", "shift"),
    [
        pytest.param(32 << 10, 0, id="vllm-block"),
        pytest.param(512, 0, id="small"),
        pytest.param(32 << 10, 8, id="unaligned"),  # not 16-byte aligned: memcpy
        pytest.param(1000, 0, id="odd-size"),  # not a multiple of 64: memcpy
        pytest.param(64, 0, id="one-line"),
    ],
)
def test_scattered_blocks_arrive_byte_for_byte(block_bytes: int, shift: int) -> None:
    kernel = streaming_kernel()
    rng = np.random.default_rng(block_bytes + shift)
    n = 40
    src = rng.integers(0, 256, size=(2 * n + 1) * block_bytes + 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    picked = rng.permutation(2 * n)[:n]  # gather: random source blocks ...
    src_off = picked.astype(np.int64) * block_bytes + shift
    dst_off = np.arange(n, dtype=np.int64) * block_bytes + shift  # ... into a row
    kernel.copy(_addresses(src, src_off), _addresses(dst, dst_off), block_bytes)
    for i in range(n):
        a, b = src_off[i], dst_off[i]
        assert np.array_equal(dst[b : b + block_bytes], src[a : a + block_bytes]), i
    # Nothing outside the blocks was written.
    assert not dst[n * block_bytes + shift :].any()
    assert not dst[:shift].any()


def test_address_arrays_must_agree() -> None:
    kernel = streaming_kernel()
    with pytest.raises(ValueError, match="int64 address arrays"):
        kernel.copy(np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.int64), 64)


def test_without_a_compiler_or_a_built_kernel_it_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler-mpcache")
    with pytest.raises(blockcopy.KernelUnavailable, match="no-such-compiler-mpcache"):
        blockcopy.load()


def test_it_is_built_once_then_loads_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As in the image: built at build time, the compiler removed after."""
    streaming_kernel()  # a compiler is here
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = blockcopy.load()
    assert first.path.parent == blockcopy.kernel_dir()
    built = first.path.stat().st_mtime_ns
    monkeypatch.setenv("CC", "no-such-compiler-mpcache")
    again = blockcopy.load()
    assert again.path == first.path and again.path.stat().st_mtime_ns == built
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, size=4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.array([2048, 0], dtype=np.int64)
    again.copy(_addresses(src, offsets), _addresses(dst, offsets[::-1].copy()), 2048)
    assert np.array_equal(dst[:2048], src[2048:]) and np.array_equal(dst[2048:], src[:2048])
