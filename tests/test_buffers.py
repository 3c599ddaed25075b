"""The buffer pool: a buffer is handed out again only once nothing refers to it."""

from __future__ import annotations

import gc

import pytest

from diloco.runtime.buffers import BufferPool


def test_a_buffer_comes_back_only_when_no_tensor_or_view_holds_it():
    pool = BufferPool(keep=2)
    first = pool.tensor(1000)
    first.fill_(1.0)
    address = first.data_ptr()
    view = first[10:20]  # a view of a tensor: the same storage
    del first
    second = pool.tensor(1000)
    assert second.data_ptr() != address and pool.reused == 0  # the view still holds it
    second.fill_(2.0)
    assert float(view.sum()) == 10.0  # untouched
    del view
    gc.collect()
    third = pool.tensor(1000)
    assert third.data_ptr() == address and pool.reused == 1


def test_a_smaller_request_reuses_a_larger_idle_buffer_and_keep_bounds_what_is_kept():
    pool = BufferPool(keep=1)
    big = pool.tensor(1000)
    address = big.data_ptr()
    del big
    small = pool.tensor(10)
    assert small.data_ptr() == address and small.numel() == 10
    other = pool.tensor(10)  # the kept one is in use: a new one, not kept
    assert other.data_ptr() != address
    assert pool.kept_bytes() == 4000
    del small, other
    assert BufferPool(keep=0).tensor(5).numel() == 5
    assert BufferPool(keep=0).kept_bytes() == 0


def test_a_numpy_array_handed_out_holds_its_buffer_too():
    pool = BufferPool(keep=1)
    arr = pool.array(100)
    torch_view = pool.tensor(100)  # arr is in use: not the same memory
    assert torch_view.data_ptr() != arr.ctypes.data
    del torch_view
    arr2 = pool.array(100)
    assert arr2.ctypes.data != arr.ctypes.data
    del arr, arr2
    assert pool.array(100) is not None and pool.reused == 1


def test_keep_must_not_be_negative():
    with pytest.raises(ValueError):
        BufferPool(keep=-1)
