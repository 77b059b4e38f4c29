"""Block accounting of the KV cache: the engine's one ledger of which block holds what.

Every stage has a pool of the same `n_blocks` blocks (stages/kv_cache.py); the engine decides
which blocks each sequence uses and sends the block tables with every step, so the stages hold
no bookkeeping of their own. A block is

  * free        on the free list, holding nothing;
  * in use      by one or more sequences (`ref` counts them);
  * cached      in use by none, but holding a full block of some prompt, findable by the hash
                of its token prefix: a later prompt with the same prefix reuses it instead of
                computing it again (prefix reuse). Cached blocks are handed out again, least
                recently used first, when the free list is empty.

A full block of a prompt is named by the hash of (the previous block's hash, its 16 tokens),
so one hash names the whole prefix up to the block's end, as vLLM does. Shared blocks are
read-only: a sequence reuses only full blocks that precede its first computed token, and
writes only blocks of its own.

A prompt's full blocks are named when it is admitted, before its prefill has run: they are
*pending* until the step that writes them is handed to the pipeline. A request whose prefix
continues into a pending block waits for it (one prefill of a shared system prompt, not 16 at
once); since every stage runs steps in the order they were handed out, a block is readable by
any step handed out after the one that writes it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from moeray.stages.kv_cache import BLOCK_SIZE


@dataclass
class KVStats:
    """What the ledger has seen: prefix lookups in prompt tokens, and preemptions (counted by the scheduler)."""
    prompt_tokens: int = 0  # tokens of prompts looked up for a cached prefix
    cached_tokens: int = 0  # of those, found cached (their prefill skipped)
    preemptions: int = 0


class BlockManager:
    def __init__(self, n_blocks: int, prefix_reuse: bool = True):
        self.n_blocks, self.block_size = n_blocks, BLOCK_SIZE
        self.prefix_reuse = prefix_reuse
        self.free: deque[int] = deque(range(n_blocks))
        self.ref = [0] * n_blocks
        self.hash_of: dict[int, int] = {}  # block -> the hash of the prefix it completes
        self.block_of: dict[int, int] = {}  # hash -> block
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self.pending: set[int] = set()  # hashes whose block no step has written yet
        self.stats = KVStats()

    # ---------------------------------------------------------------- counts

    @property
    def n_available(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones (evicted on use)."""
        return len(self.free) + len(self.cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_available

    @property
    def n_cached(self) -> int:
        return len(self.cached)

    @property
    def hit_rate(self) -> float:
        s = self.stats
        return s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0

    # ---------------------------------------------------------------- prefix reuse

    @staticmethod
    def prefix_hashes(tokens: list[int], n_blocks: int) -> list[int]:
        out, h = [], 0
        for i in range(n_blocks):
            h = hash((h, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
            out.append(h)
        return out

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], bool]:
        """(blocks, wait): the known blocks that hold the longest full-block prefix of `tokens`,
        leaving at least one token to compute (its logits give the next token); wait is True when
        the prefix goes on into a block still being computed (better to wait for it than to
        compute it twice). Takes nothing."""
        if not self.prefix_reuse:
            return [], False
        found = []
        for h in self.prefix_hashes(tokens, (len(tokens) - 1) // BLOCK_SIZE):
            b = self.block_of.get(h)
            if b is None:
                break
            if h in self.pending:
                return found, True
            found.append(b)
        return found, False

    def register(self, table: list[int], tokens: list[int], n_full: int, start: int = 0,
                 pending: bool = False) -> None:
        """Blocks [start, n_full) of `table` hold (or, pending, will hold) full blocks of `tokens`:
        name them by their prefix hash so later prompts can find them (a hash already held by
        another block stays there)."""
        if not self.prefix_reuse or n_full <= start:
            return
        for i, h in enumerate(self.prefix_hashes(tokens, n_full)):
            if i < start:
                continue
            b = table[i]
            if h not in self.block_of and b not in self.hash_of:
                self.block_of[h], self.hash_of[b] = b, h
                if pending:
                    self.pending.add(h)

    def written(self, table: list[int], first: int, end: int) -> None:
        """Blocks [first, end) of `table` are written by a step just handed out: no longer pending."""
        if self.pending:
            for b in table[first:end]:
                self.pending.discard(self.hash_of.get(b))

    # ---------------------------------------------------------------- taking and giving back

    def take_shared(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.cached[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n blocks of our own, or None (nothing taken) when fewer are available."""
        if n > self.n_available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:  # evict the least recently used cached block: its prefix is forgotten
                b, _ = self.cached.popitem(last=False)
                del self.block_of[self.hash_of.pop(b)]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, table: list[int]) -> None:
        """A sequence is done with its blocks: unshared ones become free, or cached when they
        hold a named prefix (most recently used last, so evicted last)."""
        for b in reversed(table):  # a prefix's tail is evicted before its head
            self.ref[b] -= 1
            if self.ref[b] == 0:
                h = self.hash_of.get(b)
                if h in self.pending:  # never written (aborted, preempted mid-prompt): forget it
                    self.pending.discard(h)
                    del self.block_of[h], self.hash_of[b]
                if b in self.hash_of:
                    self.cached[b] = None
                else:
                    self.free.append(b)

    def forget_all(self) -> None:
        """The stages lost their KV (a restart): no block holds anything any more."""
        self.free = deque(range(self.n_blocks))
        self.ref = [0] * self.n_blocks
        self.hash_of.clear()
        self.block_of.clear()
        self.cached.clear()
        self.pending.clear()
