"""Huge-page host buffers for streamed weights (stages/kernels/host_memory.py): aligned, writable,
returned to the system when the last view goes, and plain torch memory when turned off."""
from __future__ import annotations

import gc

import torch

from moeray.stages.kernels import host_memory, settings


def _rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20


def test_a_weight_buffer_is_aligned_to_a_huge_page_and_freed_with_its_last_view():
    before = _rss_mib()
    buf = host_memory.weight_buffer(256 << 20)
    assert buf.numel() == 256 << 20 and buf.dtype == torch.uint8
    assert buf.data_ptr() % host_memory.HUGE_PAGE == 0
    buf.fill_(7)
    rows = buf.view(256, 1 << 20)  # how a slot store views it
    assert int(rows[255, -1]) == 7 and _rss_mib() >= before + 200
    del buf
    assert int(rows[3, 3]) == 7  # a view keeps the memory
    del rows
    gc.collect()
    assert _rss_mib() < before + 100


def test_small_buffers_and_the_off_switch_take_plain_torch_memory(monkeypatch):
    small = host_memory.weight_buffer(1000)
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 1000
    settings.update(hugepages=False)  # the off switch (StageOptions.hugepages)
    plain = host_memory.weight_buffer(8 << 20)
    assert plain.numel() == 8 << 20 and plain.untyped_storage().nbytes() == 8 << 20
