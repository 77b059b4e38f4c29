"""Block accounting of the KV cache: the engine's one ledger of which block holds what.

Every stage has a pool of the same `n_blocks` blocks (stages/blocks/kv_cache.py); the engine decides
which blocks each sequence uses and sends the block tables with every step, so the stages hold
no bookkeeping of their own. A block is

  * free        in the free set, holding nothing;
  * in use      by one or more sequences (`ref` counts them);
  * cached      in use by none, but holding a full block of some prompt, findable by the hash
                of its token prefix (or a tail, below): a later prompt with the same prefix reuses it instead of
                computing it again (prefix reuse). Cached blocks are handed out again, least
                recently used first, when the free list is empty.

A full block of a prompt is named by the hash of (the previous block's hash, its 16 tokens),
so one hash names the whole prefix up to the block's end, as vLLM does. Shared blocks are
read-only: a sequence reuses only full blocks that precede its first computed token, and
writes only blocks of its own.

Past the last full block a prompt usually goes on for a few tokens into a block that holds
other tokens after them (another answer, or a finished sequence's partly filled last block: a
*tail*, kept too). Every named block and tail is also listed under the prefix it follows, with
its tokens, so `match_tail` finds the one that begins with the most of the prompt's next tokens:
the sequence takes a block of its own and the stages copy those rows into it before its first
step (`StepBatch.copies`), instead of computing them again. A chat client that sends the same
question twice, or a conversation's next turn, then computes one token, as llama-server's slot
cache does (docs/architecture.md, "The KV cache").

A cached block evicted for another prefix can go to the host tier (`HostTier`, when the stages
keep one): the step that next runs carries a save of its rows into a host slot named by the same
prefix hash (`StepBatch.kv_save`), before any step writes the block again, and a later prompt
whose prefix goes on past its blocks on the device into blocks the tier holds takes fresh blocks
and has them copied back (`StepBatch.kv_load`, with its first chunk) instead of prefilled. The
tier keeps its copy (a block evicted again costs no second save) and gives its least recently
used slot to the next save when full: it never grows past its slots. A tail evicted from the pool
goes to the tier too, under its prefix and its tokens, and comes back into a block of the prompt's
own the same way (`match_host_tail`): a returning conversation then computes its new tokens only,
not the last up to 15 tokens of its previous turn as well (llama-server's --cache-ram keeps them).

A prompt's full blocks are named when it is admitted, before its prefill has run: they are
*pending* until the step that writes them is handed to the pipeline. A request whose prefix
continues into a pending block waits for it (one prefill of a shared system prompt, not 16 at
once); since every stage runs steps in the order they were handed out, a block is readable by
any step handed out after the one that writes it.

Where blocks go: a sequence whose blocks are consecutive has its keys read by attention as one
view of the pool; any other table is gathered, every layer, every step (stages/blocks/kv_cache.py),
which at a few thousand tokens of context costs more than the step's attention itself. So a new
block is the one right after the sequence's last where that one is free (`allocate(after=)`),
else the lowest free one; a returning prompt whose tail block (a finished sequence's partly
filled last block) sits right after its shared prefix, held by no one, takes that block itself
rather than a copy of its rows (`steal`): a conversation's next turn then goes on in the same
consecutive run. A full block is never taken so: its name is a prefix other prompts still find
(the same question sent again finds all of it, not only the part it shares with the last one).
A prompt whose shared prefix cannot go on in place (the blocks after it are another prefix's, or
in use) takes a free stretch of its own instead, and the stages copy the prefix's rows into it
before its first chunk (`free_run`, cluster/scheduler.py): one copy of the prefix, where a gather
costs one every step.
The prefix's names move with its rows (`rename`): the conversation's next turn finds them in one
run again, and the old blocks are free once no one holds them.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from moeray.stages.blocks.kv_cache import BLOCK_SIZE


def consecutive(blocks: list[int]) -> bool:
    """The blocks follow one another: attention reads them as one view of the pool."""
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def common_prefix(a, b) -> int:
    """How many leading tokens two token sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class KVStats:
    """What the ledger has seen: prefix lookups in prompt tokens, and preemptions (counted by the scheduler)."""
    prompt_tokens: int = 0  # tokens of prompts looked up for a cached prefix
    cached_tokens: int = 0  # of those, found cached (their prefill skipped), the host tier's included
    preemptions: int = 0


@dataclass
class HostStats:
    """The host tier's ledger: blocks saved into it, found in it (copied back), evicted from it."""
    saved: int = 0
    hits: int = 0  # blocks copied back to the stages instead of prefilled
    hit_tokens: int = 0
    evicted: int = 0


class HostTier:
    """Which host slot holds which prefix's block (every stage keeps its own copy of its layers'
    rows in the same slot: stages/blocks/host_kv.py), least recently used first. A tail's slot is
    named by a key of its prefix and its tokens (`tail_key`) and listed under its prefix."""

    def __init__(self, n: int):
        self.n = n
        self.free = list(range(n - 1, -1, -1))  # popped from the end: lowest first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # prefix hash -> slot, least recently used first
        self.hash_of: dict[int, int] = {}
        self.held: dict[int, int] = {}  # slot -> loads handed to requests not yet sent to the stages
        self.tails: dict[int, dict[int, tuple[int, ...]]] = {}  # prefix hash -> {slot: the tail's tokens}
        self.tail_parent: dict[int, int] = {}  # a tail's slot -> its prefix hash
        self.stats = HostStats()

    @staticmethod
    def tail_key(parent: int, tokens: tuple[int, ...]) -> int:
        """The name of a tail (a partly filled block after prefix `parent`) among the prefix hashes."""
        return hash(("tail", parent, tokens))

    def find(self, h: int) -> int | None:
        return self.slot_of.get(h)

    def find_tail(self, parent: int, want: list[int]) -> tuple[int | None, int]:
        """(slot, n): the tail after prefix `parent` whose first n tokens are the most of `want`;
        (None, 0) when none begins with them."""
        best, n = None, 0
        for slot, held in self.tails.get(parent, {}).items():
            k = common_prefix(want, held)
            if k > n:
                best, n = slot, k
        return best, n

    def touch(self, h: int) -> None:
        self.slot_of.move_to_end(h)

    def put(self, h: int, tail: tuple[int, tuple[int, ...]] | None = None) -> int | None:
        """A slot to save prefix `h`'s block into (None: it is there already, or every slot is held);
        tail: (its prefix hash, its tokens) where the block is a tail named by `tail_key`."""
        if h in self.slot_of:
            self.touch(h)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            old = next((k for k, s in self.slot_of.items() if s not in self.held), None)
            if old is None:
                return None
            slot = self.slot_of.pop(old)
            del self.hash_of[slot]
            self._untail(slot)
            self.stats.evicted += 1
        self.slot_of[h], self.hash_of[slot] = slot, h
        if tail is not None:
            parent, tokens = tail
            self.tails.setdefault(parent, {})[slot] = tokens
            self.tail_parent[slot] = parent
        self.stats.saved += 1
        return slot

    def _untail(self, slot: int) -> None:
        parent = self.tail_parent.pop(slot, None)
        if parent is not None:
            kids = self.tails[parent]
            del kids[slot]
            if not kids:
                del self.tails[parent]

    def take(self, slot: int) -> None:
        self.held[slot] = self.held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        self.held[slot] -= 1
        if not self.held[slot]:
            del self.held[slot]

    @property
    def n_held(self) -> int:
        return len(self.slot_of)

    def forget_all(self) -> None:
        self.__init__(self.n)


class BlockManager:
    def __init__(self, n_blocks: int, prefix_reuse: bool = True, host_blocks: int = 0):
        self.n_blocks, self.block_size = n_blocks, BLOCK_SIZE
        self.prefix_reuse = prefix_reuse
        # the host tier (None: the stages keep none), and the saves into it no step carries yet
        self.host = HostTier(host_blocks) if host_blocks and prefix_reuse else None
        self.saves: list[tuple[int, int]] = []
        self.free: set[int] = set(range(n_blocks))
        self._lowest: list[int] = list(range(n_blocks))  # a heap of the free blocks (taken ones skipped)
        self.ref = [0] * n_blocks
        self.hash_of: dict[int, int] = {}  # block -> the hash of the prefix it completes
        self.block_of: dict[int, int] = {}  # hash -> block
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self.pending: set[int] = set()  # hashes whose block no step has written yet
        # prefix hash (0: the empty prefix) -> {block: the tokens it holds after that prefix}, for
        # the named blocks and the tails (match_tail); and each such block's prefix hash
        self.follows: dict[int, dict[int, tuple[int, ...]]] = {}
        self.parent_of: dict[int, int] = {}
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

    def match_host(self, tokens: list[int], n_blocks: int) -> list[int]:
        """The host slots holding the full blocks of `tokens` that follow its first n_blocks (those
        found on the device), as far as they go on, leaving at least one token to compute. Takes nothing."""
        if self.host is None:
            return []
        hashes = self.prefix_hashes(tokens, (len(tokens) - 1) // BLOCK_SIZE)
        found = []
        for h in hashes[n_blocks:]:
            slot = self.host.find(h)
            if slot is None:
                break
            found.append(slot)
        return found

    def match_host_tail(self, tokens: list[int], n_blocks: int) -> tuple[int | None, int]:
        """(host slot, n): the tail the host tier holds whose first n tokens are the most of the
        tokens after `tokens`' first n_blocks full blocks (found on the device or in the tier),
        leaving at least one token to compute; (None, 0) when it holds none. Takes nothing."""
        start = n_blocks * BLOCK_SIZE
        want = tokens[start:len(tokens) - 1]
        if self.host is None or not want:
            return None, 0
        parent = self.prefix_hashes(tokens, n_blocks)[-1] if n_blocks else 0
        slot, n = self.host.find_tail(parent, want)
        if slot is not None:
            self.host.touch(self.host.hash_of[slot])
        return slot, n

    def take_saves(self) -> list[tuple[int, int]]:
        """The (block, host slot) saves the next step handed out carries, before it writes anything."""
        out, self.saves = self.saves, []
        return out

    def register(self, table: list[int], tokens: list[int], n_full: int, start: int = 0,
                 pending: bool = False) -> None:
        """Blocks [start, n_full) of `table` hold (or, pending, will hold) full blocks of `tokens`:
        name them by their prefix hash so later prompts can find them (a hash already held by
        another block stays there)."""
        if not self.prefix_reuse or n_full <= start:
            return
        hashes = self.prefix_hashes(tokens, n_full)
        for i in range(start, n_full):
            b, h = table[i], hashes[i]
            if h not in self.block_of and b not in self.hash_of and b not in self.parent_of:
                self.block_of[h], self.hash_of[b] = b, h
                self._follow(b, hashes[i - 1] if i else 0, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
                if pending:
                    self.pending.add(h)

    def register_written(self, table: list[int], tokens: list[int], n_tokens: int) -> None:
        """A sequence done (or preempted) with the first `n_tokens` of `tokens` written in `table`:
        its full blocks are named, and its partly filled last block is kept as a tail."""
        if not self.prefix_reuse:
            return
        n_full, rest = divmod(n_tokens, BLOCK_SIZE)
        self.register(table, tokens, n_full)
        if rest and n_full < len(table) and table[n_full] not in self.parent_of:
            parent = self.prefix_hashes(tokens, n_full)[-1] if n_full else 0
            self._follow(table[n_full], parent, tokens[n_full * BLOCK_SIZE:n_tokens])

    def match_tail(self, tokens: list[int], n_blocks: int) -> tuple[int | None, int]:
        """(block, n): the written block whose first n tokens are the most of the tokens after
        `tokens`' first n_blocks full blocks (which the caller shares), leaving at least one token
        to compute; (None, 0) when none begins with them. Takes nothing."""
        start = n_blocks * BLOCK_SIZE
        want = tokens[start:len(tokens) - 1]
        if not self.prefix_reuse or not want:
            return None, 0
        parent = self.prefix_hashes(tokens, n_blocks)[-1] if n_blocks else 0
        best, n = None, 0
        for b, held in self.follows.get(parent, {}).items():
            if self.hash_of.get(b) in self.pending:
                continue  # named at admission, not written yet
            k = common_prefix(want, held)
            if k > n:
                best, n = b, k
        return best, n

    def _follow(self, b: int, parent: int, tokens: list[int]) -> None:
        self.parent_of[b] = parent
        self.follows.setdefault(parent, {})[b] = tuple(tokens)

    def _to_host(self, b: int) -> None:
        """Block b, about to be written by another sequence: its rows to the host tier when it holds
        a named, written block or a tail (a save the next step carries)."""
        if self.host is None:
            return
        h, tail = self.hash_of.get(b), None
        if h is None:  # a tail: named in the tier by its prefix and its tokens
            parent = self.parent_of.get(b)
            if parent is None:
                return
            tail = (parent, self.follows[parent][b])
            h = HostTier.tail_key(*tail)
        elif h in self.pending:
            return
        slot = self.host.put(h, tail)
        if slot is not None:
            self.saves.append((b, slot))

    def _forget(self, b: int) -> None:
        """Block b holds nothing findable any more."""
        h = self.hash_of.pop(b, None)
        if h is not None:
            del self.block_of[h]
            self.pending.discard(h)
        parent = self.parent_of.pop(b, None)
        if parent is not None:
            kids = self.follows[parent]
            del kids[b]
            if not kids:
                del self.follows[parent]

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

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """n blocks of our own, or None (nothing taken) when fewer are available. Each is the block
        right after the one before it (the first: after `after`, a sequence's last block) where
        that one is free, else the lowest free block: consecutive blocks are read as a view."""
        if n > self.n_available:
            return None
        out = []
        want = None if after is None else after + 1
        for _ in range(n):
            if want is not None and want in self.free:
                b = want
                self.free.discard(b)
            elif self.free:
                b = self._pop_lowest()
            else:  # evict the least recently used cached block: its prefix is forgotten (or kept on the host)
                b, _ = self.cached.popitem(last=False)
                self._to_host(b)
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
            want = b + 1
        return out

    def is_tail(self, b: int) -> bool:
        """Block b is kept as a tail (a finished sequence's partly filled last block), not named
        as a full block of a prefix."""
        return b not in self.hash_of and b in self.parent_of

    def steal(self, b: int) -> bool:
        """Take the cached block b, which no sequence holds, as a sequence's own: its first rows
        already hold what the sequence needs there (`match_tail`), so they stay in place instead
        of being copied into another block, and the rest are written over. It is no longer
        findable by its prefix. False (nothing taken) when a sequence holds it."""
        if self.ref[b] != 0 or b not in self.cached:
            return False
        after = self._followers(self.hash_of.get(b))
        del self.cached[b]
        self._forget(b)
        self.ref[b] = 1
        # The blocks that went on from it can no longer be found (a prefix is matched block by
        # block from the first): free, so the sequence's next blocks can be the ones after b.
        for d in after:
            if self.ref[d] == 0 and d in self.cached:
                del self.cached[d]
                self._forget(d)
                self._free(d)
        return True

    def _followers(self, h: int | None) -> list[int]:
        """Every block named or kept as a tail after the prefix that hash h names, and after those."""
        out, todo = [], [h] if h is not None else []
        while todo:
            for d in self.follows.get(todo.pop(), {}):
                out.append(d)
                if (hd := self.hash_of.get(d)) is not None:
                    todo.append(hd)
        return out

    def free_after(self, b: int, n: int) -> bool:
        """The n blocks right after block b are all free."""
        return all(b + 1 + i in self.free for i in range(n))

    def free_run(self, n: int, room: int) -> list[int] | None:
        """n consecutive free blocks, not taken: the first of the first free stretch of at least
        `room` blocks (a sequence's whole length, so it grows on in place), else of the longest
        stretch of at least n; None when no stretch is n long."""
        best, start, prev = None, None, None
        for b in sorted(self.free) + [None]:
            if b is not None and prev is not None and b == prev + 1:
                prev = b
                continue
            if start is not None:  # a stretch [start, prev] ended
                length = prev - start + 1
                if length >= room:
                    return list(range(start, start + n))
                if length >= n and (best is None or length > best[1]):
                    best = (start, length)
            start = prev = b
        return None if best is None else list(range(best[0], best[0] + n))

    def rename(self, moves: list[tuple[int, int, int]]) -> int:
        """Whole named blocks copied into other blocks (src, dst, BLOCK_SIZE rows): each name goes
        with its rows, pending until the step that copies them is handed out, so the next prompt
        with this prefix finds the copies, which follow one another; a source, no longer named,
        is free once no sequence holds it. Returns how many moved (the first of `moves`)."""
        n_moved = 0
        for src, dst, n in moves:
            if n != BLOCK_SIZE or src not in self.hash_of:
                break
            h = self.hash_of.pop(src)
            self.block_of[h], self.hash_of[dst] = dst, h
            self.pending.add(h)
            parent = self.parent_of.pop(src, None)
            if parent is not None:
                kids = self.follows[parent]
                kids[dst] = kids.pop(src)
                self.parent_of[dst] = parent
            n_moved += 1
        return n_moved

    def take(self, blocks: list[int]) -> None:
        """Free blocks (`free_run`'s) as a sequence's own."""
        for b in blocks:
            self.free.remove(b)
            self.ref[b] = 1

    def _pop_lowest(self) -> int:
        while True:
            b = heapq.heappop(self._lowest)
            if b in self.free:
                self.free.discard(b)
                return b

    def _free(self, b: int) -> None:
        self.free.add(b)
        heapq.heappush(self._lowest, b)
        if len(self._lowest) > 2 * self.n_blocks + 64:  # taken blocks' entries pile up: start afresh
            self._lowest = sorted(self.free)

    def release(self, table: list[int]) -> None:
        """A sequence is done with its blocks: unshared ones become free, or cached when they
        hold a named prefix (most recently used last, so evicted last)."""
        for b in reversed(table):  # a prefix's tail is evicted before its head
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of.get(b) in self.pending:  # never written (aborted, preempted mid-prompt)
                    self._forget(b)
                if b in self.parent_of:  # a named block or a tail
                    self.cached[b] = None
                else:
                    self._free(b)

    def forget(self, blocks: list[int]) -> None:
        """What these blocks hold is not to be trusted (a step that wrote them failed): each one no
        sequence holds now is no longer findable by its prefix, and free."""
        for b in blocks:
            if self.ref[b] == 0 and b in self.cached:
                del self.cached[b]
                self._forget(b)
                self._free(b)

    def forget_all(self) -> None:
        """The stages lost their KV (a restart): no block holds anything any more."""
        self.free = set(range(self.n_blocks))
        self._lowest = list(range(self.n_blocks))
        self.ref = [0] * self.n_blocks
        self.hash_of.clear()
        self.block_of.clear()
        self.cached.clear()
        self.pending.clear()
        self.follows.clear()
        self.parent_of.clear()
        self.saves = []
        if self.host is not None:  # a restarted stage's host tier is gone with its process
            self.host.forget_all()
