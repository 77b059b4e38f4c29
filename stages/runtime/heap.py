"""Python's garbage collector in a serving process: the heap that is there to stay, frozen.

A full (oldest-generation) collection walks every object the collector tracks. After a model is
loaded that is a few hundred thousand (the tokenizer's tables, the GGUF's metadata, each ggml
graph's ctypes placeholders): ~100 ms on this machine, taken on whichever thread happens to
allocate, mid-step. The collector starts one whenever the objects that outlived two collections
grew by a quarter, which a new ggml graph (a prompt of a new length) does often: a served request
then waited 100 ms for its first token beside a 12 ms step.

`gc.freeze()` moves every object alive now out of the collector's reach (reference counting
still frees each as usual): what the process holds after loading, and each graph once built,
then costs a collection nothing. vLLM's engine freezes its start-up heap for the same reason.
What is frozen and later becomes garbage in a reference cycle is not collected until the heap is
frozen anew at the next load (which first lets everything go back and collects once); a frozen
object that reference counting frees is freed as ever (tests/stages/test_heap.py).
"""
from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_heap(collect: bool = True) -> None:
    """Everything alive now out of the collector's reach. collect (where the caller can afford a
    full collection: loading, not mid-serving): first everything frozen before goes back and one
    full collection frees what became garbage since (a model loaded again drops the one before,
    which reference counting alone may not free), so only what is alive is frozen."""
    global _unfreeze_at_exit
    if collect:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:  # at exit the frozen objects go back, so they are freed before the
        _unfreeze_at_exit = True  # modules their finalisers call are torn down
        atexit.register(gc.unfreeze)


class FrozenAfterBuilds:
    """Freezes the heap after a step that built new graphs (their objects stay while the graph is
    cached), so later collections do not walk them again and again."""

    def __init__(self, built: int):
        self.seen = built

    def after_step(self, built: int) -> None:
        if built != self.seen:
            self.seen = built
            freeze_heap(collect=False)
