"""Host buffers for the weights ggml streams through at every token: anonymous memory advised for
transparent huge pages.

A decode token reads its routed experts once, from scattered places (a few MiB per expert), so
the cost is DRAM bandwidth plus the TLB: with 4 KiB pages a 2.65 MiB expert is ~680 page walks,
with 2 MiB pages two. Linux's default THP mode ("madvise") gives huge pages only where a mapping
asks, and neither the file mapping (page cache) nor torch's allocator asks. `bench/hugepages.py`
measures it (docs/performance.md#decode-and-prefill, "Weight layout"): on the default model, every expert resident went 23.3 ->
19.6 ms a token, the host path 21.2 -> 20.7 (one thread, CPU time per token).

StageOptions.hugepages False (`--no-hugepages`, or the override MOERAY_HUGEPAGES=0) turns it off
(plain torch memory), e.g. where huge pages are scarce and the kernel's compaction at first touch
would slow the load.
"""
from __future__ import annotations

import mmap
import os

import torch

from moeray.stages.kernels import settings

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return settings.current().hugepages and hasattr(mmap, "MADV_HUGEPAGE")


def weight_buffer(n_bytes: int) -> torch.Tensor:
    """A uint8 tensor of `n_bytes` (contents undefined), 2 MiB aligned and advised for huge pages
    when it is at least one huge page (else, or when the OS refuses, plain torch memory). Freed
    when the last tensor viewing it goes."""
    if n_bytes < HUGE_PAGE or not enabled():
        return torch.empty(max(1, n_bytes), dtype=torch.uint8)
    try:
        # Private: a shared anonymous mapping is shmem, which THP's "madvise" mode leaves alone.
        m = mmap.mmap(-1, n_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(n_bytes, dtype=torch.uint8)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # keeps `m` alive as long as any view lives
    offset = -whole.data_ptr() % HUGE_PAGE
    return whole[offset:offset + n_bytes]


def process_rss_bytes() -> int:
    """This process's resident memory, in bytes (Linux /proc; 0 elsewhere): the one RSS reading
    (memory_report, the server's /v1/stages)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
