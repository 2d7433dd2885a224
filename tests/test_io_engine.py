"""The native I/O engine: correct bytes, validation before I/O, errors with errno and tag."""
import errno
import os

import numpy as np
import pytest
import torch

from lean_qwenflash import io_engine
from lean_qwenflash.io_engine import AlignedBuffer, IoError, open_engine

ENGINES = ["uring", "pread"]
PAGE = 4096


def _need(kind):
    if kind == "uring" and not io_engine.uring_compiled():
        pytest.skip("this build has no liburing (io_uring engine not compiled)")


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, size=PAGE * 256, dtype=np.uint8)
    path = tmp_path / "data.bin"
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("kind", ENGINES)
def test_reads_land_in_buffer(kind, data_file):
    _need(kind)
    path, data = data_file
    eng = open_engine(path, kind, queue_depth=8)
    assert eng.kind == kind and eng.direct and eng.file_size == data.nbytes
    buf = AlignedBuffer(PAGE * 64)
    view = np.frombuffer(buf, dtype=np.uint8)
    rng = np.random.default_rng(2)
    for _ in range(20):
        pages = rng.integers(0, 256 - 4, size=16)
        ids = [eng.submit(buf, i * 4 * PAGE, int(p) * PAGE, 4 * PAGE, tag=i, urgent=bool(i % 2))
               for i, p in enumerate(pages)]
        eng.wait_all(ids)
        for i, p in enumerate(pages):
            np.testing.assert_array_equal(view[i * 4 * PAGE:(i + 1) * 4 * PAGE], data[p * PAGE:(p + 4) * PAGE])
    assert eng.num_reads == 20 * 16 and eng.bytes_read == 20 * 16 * 4 * PAGE
    eng.close()


def test_aligned_buffer_is_zero_copy():
    buf = AlignedBuffer(3 * PAGE)
    assert buf.address % PAGE == 0 and buf.nbytes == 3 * PAGE and len(buf) == 3 * PAGE
    t = torch.frombuffer(buf, dtype=torch.float32)
    a = np.frombuffer(buf, dtype=np.float32)
    assert torch.count_nonzero(t) == 0
    a[5] = 3.5
    assert t[5].item() == 3.5 and t.data_ptr() == buf.address



def _smaps_entry(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            fields[head.rstrip(":")] = line.split()[1]
    return fields


def test_large_buffers_ask_for_huge_pages():
    """From 2 MiB up a buffer is huge-page aligned and advised for transparent huge pages (the
    expert caches: fewer TLB misses in the expert products), zeroed like any other; a small one
    keeps the 4096-byte alignment only."""
    big = AlignedBuffer((8 << 20) + 12345)
    assert big.address % (2 << 20) == 0 and big.nbytes == (8 << 20) + 12345
    assert torch.count_nonzero(torch.frombuffer(big, dtype=torch.uint8)) == 0
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[madvise]" in mode or "[always]" in mode:
        # the kernel marks the advised range eligible (whether it found free huge pages is its business)
        assert _smaps_entry(big.address + (4 << 20)).get("THPeligible") == "1", mode
    small = AlignedBuffer(3 * PAGE)
    assert small.address % PAGE == 0

@pytest.mark.parametrize("kind", ENGINES)
def test_misaligned_and_out_of_bounds_fail_before_io(kind, data_file):
    _need(kind)
    path, _ = data_file
    eng = open_engine(path, kind)
    buf = AlignedBuffer(4 * PAGE)
    cases = [
        (dict(dest_offset=1, file_offset=0, length=PAGE), "misaligned"),
        (dict(dest_offset=0, file_offset=100, length=PAGE), "misaligned"),
        (dict(dest_offset=0, file_offset=0, length=1000), "misaligned"),
        (dict(dest_offset=2 * PAGE, file_offset=0, length=4 * PAGE), "outside"),
        (dict(dest_offset=0, file_offset=255 * PAGE, length=2 * PAGE), "past end"),
        (dict(dest_offset=0, file_offset=0, length=0), "0 bytes"),
    ]
    for kw, words in cases:
        with pytest.raises(IoError) as ei:
            eng.submit(buf, tag=77, **kw)
        assert ei.value.errno == errno.EINVAL and ei.value.tag == 77 and words in str(ei.value)
    assert eng.num_reads == 0 and not np.frombuffer(buf, dtype=np.uint8).any()
    eng.close()


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("new_size", [PAGE, PAGE + 2048])
def test_short_read_at_eof_is_an_error(kind, new_size, tmp_path):
    """A file truncated after open: the read comes back short and must fail, naming the tag."""
    _need(kind)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * PAGE))
    eng = open_engine(path, kind)
    os.truncate(path, new_size)
    buf = AlignedBuffer(2 * PAGE)
    rid = eng.submit(buf, 0, PAGE, 2 * PAGE, tag=5)
    with pytest.raises(IoError) as ei:
        eng.wait(rid)
    assert ei.value.errno == errno.ENODATA and ei.value.tag == 5 and "short read" in str(ei.value)
    eng.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_kernel_error_carries_errno_and_tag(kind, tmp_path):
    _need(kind)
    # A directory opens read-only but every read of it fails with EISDIR: a real kernel error.
    eng = open_engine(tmp_path, kind, direct=False)
    if eng.file_size < PAGE:
        pytest.skip(f"this filesystem reports directory size {eng.file_size}")
    buf = AlignedBuffer(PAGE)
    with pytest.raises(IoError) as ei:
        eng.read([(buf, 0, 0, PAGE, 9)])
    assert ei.value.errno == errno.EISDIR and ei.value.tag == 9
    eng.close()


def test_open_errors(tmp_path):
    with pytest.raises(IoError) as ei:
        open_engine(tmp_path / "missing.bin")
    assert ei.value.errno == errno.ENOENT and "missing.bin" in str(ei.value)
    with pytest.raises(ValueError, match="io_engine must be one of"):
        open_engine(tmp_path / "x", engine="libaio")
    (tmp_path / "x").write_bytes(b"\0" * PAGE)
    with pytest.raises(IoError, match="queue_depth"):
        open_engine(tmp_path / "x", queue_depth=0)


def test_auto_falls_back_to_pread_when_uring_unavailable(data_file):
    path, data = data_file
    io_engine._io._force_uring_failure(True)
    try:
        eng = open_engine(path, "auto")
        assert eng.kind == "pread" and "io_uring unavailable" in eng.fallback_reason
        with pytest.raises(IoError) as ei:
            open_engine(path, "uring")
        assert ei.value.errno == errno.ENOSYS
    finally:
        io_engine._io._force_uring_failure(False)
    buf = AlignedBuffer(8 * PAGE)
    eng.read([(buf, 0, 16 * PAGE, 8 * PAGE, 0)])
    np.testing.assert_array_equal(np.frombuffer(buf, dtype=np.uint8), data[16 * PAGE:24 * PAGE])
    eng.close()
    if io_engine.uring_compiled():
        assert open_engine(path, "auto").kind == "uring"


def test_crc32c():
    assert io_engine.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert io_engine.crc32c(b"") == 0
    data = os.urandom(100_003)
    # Chaining with a seed equals one pass.
    assert io_engine.crc32c(data[50_000:], io_engine.crc32c(data[:50_000])) == io_engine.crc32c(data)


@pytest.mark.parametrize("kind", ENGINES)
def test_read_probe_lands_whole_blocks_across_a_destination(kind, data_file):
    """measure_random_reads into a cache-sized destination: every slot it wrote holds one whole
    block of the file (block-aligned), slots all over the buffer were used, and none is torn."""
    _need(kind)
    path, data = data_file
    block = 4 * PAGE
    eng = open_engine(path, kind, queue_depth=4)
    dest = AlignedBuffer(block * 32)
    done, dt = io_engine.measure_random_reads(eng, block, 0.2, dest=dest)
    assert done > 32 and dt > 0
    view = np.frombuffer(dest, dtype=np.uint8).reshape(32, block)
    blocks = {data[i * block:(i + 1) * block].tobytes() for i in range(data.nbytes // block)}
    written = [s for s in range(32) if view[s].any()]
    assert len(written) >= 16          # random slots, not the first few again and again
    assert all(view[s].tobytes() in blocks for s in written)
    with pytest.raises(ValueError, match="at least the queue depth"):
        io_engine.measure_random_reads(eng, block, 0.1, dest=AlignedBuffer(block * 3))
    eng.close()
