"""runtime/host_gather.py: Engram row gathers into reused staging buffers.

CPU: the rows equal index_select's for FP8 tables with e8m0 scales; the staging buffer is reused
for gathers up to its size and grows past it; a returned CPU tensor never aliases the buffer, so
an earlier result survives later gathers; empty gathers; a table already on the destination skips
staging. GPU (skipped without CUDA): the copy from pinned memory is asynchronous, and the buffer is
not rewritten while a copy is still in flight. Each of 20 gathers, with rows changing between them,
gives the rows of its own ids on the device.
"""
from __future__ import annotations

import pytest
import torch

from megagraph.kernels import formats
from megagraph.runtime.host_gather import HostStaging, host_rows


def _table(rows: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return formats.quantize_fp8_rows(torch.randn(rows, width, generator=g))  # e8m0 per 32


def test_rows_and_scales_equal_index_select():
    table, scale = _table(300, 64, 1)
    ids = torch.randint(0, 300, (37, 5), generator=torch.Generator().manual_seed(2))
    st = HostStaging()
    rows, sc, local = host_rows(table, scale, ids, torch.device("cpu"), st)
    flat = ids.reshape(-1)
    assert rows.dtype == table.dtype and rows.shape == (185, 64)
    assert torch.equal(rows.view(torch.uint8), table.index_select(0, flat).view(torch.uint8))
    assert torch.equal(sc.view(torch.uint8), scale.index_select(0, flat).view(torch.uint8))
    assert torch.equal(local, torch.arange(185).reshape(37, 5))


def test_buffer_reused_grown_and_never_aliased():
    table, _ = _table(500, 32, 3)
    st = HostStaging()
    g = torch.Generator().manual_seed(4)
    cpu = torch.device("cpu")
    first_ids = torch.randint(0, 500, (100,), generator=g)
    first = st.gather(table, first_ids, cpu)
    (slot,) = st.slots.values()
    ptr, cap = slot.buf.data_ptr(), slot.buf.shape[0]
    assert cap == 100
    # smaller and equal gathers reuse the buffer; the earlier result is not overwritten
    for n in (7, 100, 1):
        ids = torch.randint(0, 500, (n,), generator=g)
        got = st.gather(table, ids, cpu)
        assert torch.equal(got.view(torch.uint8), table[ids].view(torch.uint8))
        assert got.data_ptr() != ptr
        assert st.slots[next(iter(st.slots))].buf.data_ptr() == ptr
    assert torch.equal(first.view(torch.uint8), table[first_ids].view(torch.uint8))
    # a larger gather grows it (at least doubling, so a slowly growing n reallocates rarely)
    big = torch.randint(0, 500, (150,), generator=g)
    got = st.gather(table, big, cpu)
    assert torch.equal(got.view(torch.uint8), table[big].view(torch.uint8))
    assert st.slots[next(iter(st.slots))].buf.shape[0] == 200
    assert st.nbytes() == 200 * 32
    # empty gathers
    empty = st.gather(table, torch.zeros(0, dtype=torch.long), cpu)
    assert empty.shape == (0, 32)


def test_device_table_is_not_staged():
    """A table already where the rows go (or any non-host table) is gathered in place."""
    table, _ = _table(40, 32, 5)
    st = HostStaging()
    ids = torch.tensor([3, 1, 39])
    got = st.gather(table.to("meta"), ids.to("meta"), torch.device("meta"))
    assert got.shape == (3, 32) and st.slots == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory, async copy)")
def test_pinned_async_copies_land_before_reuse():
    table, scale = _table(100_000, 256, 6)
    st = HostStaging()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    outs = []
    for i in range(20):
        ids = torch.randint(0, 100_000, (4096 - 97 * i, 3), generator=g)
        rows, sc, _ = host_rows(table, scale, ids, dev, st)
        outs.append((ids, rows, sc))  # no synchronize between gathers
    torch.cuda.synchronize()
    for ids, rows, sc in outs:
        flat = ids.reshape(-1)
        assert torch.equal(rows.cpu().view(torch.uint8), table[flat].view(torch.uint8))
        assert torch.equal(sc.cpu().view(torch.uint8), scale[flat].view(torch.uint8))
    assert all(s.buf.is_pinned() for s in st.slots.values())
