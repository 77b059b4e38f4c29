"""Checkpoints of a hybrid model's recurrent state: the engine's ledger of which checkpoint slot
holds the state of which prompt prefix, so that a conversation's next turn prefills only what is new.

Cached KV blocks restore attention's past but not a DeltaNet layer's, which is one state per
sequence as it stood after its last token. A checkpoint is that state copied, after the step that
ended exactly at a block boundary, into a slot of its own (stages/blocks/deltanet.DeltaState: the
stages hold `max_seqs` sequence slots, then `n` checkpoint slots, `base` .. `base + n - 1`). It
is named, like the block it completes, by the hash of the token prefix up to that boundary
(cluster/kv_blocks.py, `prefix_hashes`), so it can only ever be found by a prompt with that exact
prefix: a checkpoint is never used past a point where the conversation differs. A later prompt
whose first b full blocks are cached AND which has a checkpoint at block b resumes there: the
checkpoint is copied into its sequence slot before its first step (`StepBatch.state_before`) and
only the rest is prefilled.

Which boundaries (cluster/scheduler.py), as llama-server's context checkpoints choose theirs:
  * the prompt's last full block before its final token (the chunk is cut there): the same prompt
    sent again, a regenerated answer, a turn whose template rewrote the previous answer;
  * the prompt's end, where it falls on a block boundary, and while decoding each block boundary
    the sequence crosses, in one slot the sequence keeps
    (overwritten every 16 tokens): when it finishes, the state at its last full block of prompt +
    answer, which the next turn's prompt begins with.
Unreferenced checkpoints are evicted least recently used first. How many slots the stages hold is
the planner's decision (planner/kv.py `trade_checkpoints`: each costs one sequence's state on
every recurrent layer's card, against KV blocks and expert slots).

The same copy (slot to slot, on every stage, before or after a step) is what a verify step of
speculative decoding needs: a hybrid sequence's slot is snapshotted into a spare slot before the
step and copied back after a rejection (cluster/scheduler.py, docs/speculative.md). Spares are
borrowed from these slots (`borrow`: a free one, else the least recently used checkpoint is
evicted for it) and go back unnamed, so they never cost a checkpoint slot of their own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class CheckpointStats:
    saved: int = 0  # checkpoints written (prompt ends and decode boundaries)
    restored: int = 0  # prompts resumed from one
    restored_tokens: int = 0  # prompt tokens those skipped
    evicted: int = 0
    borrowed: int = 0  # spare slots lent to verify steps (speculative decoding on a hybrid model)


class CheckpointLedger:
    def __init__(self, n: int, base: int):
        self.n, self.base = n, base
        self.free: list[int] = list(range(base + n - 1, base - 1, -1))  # popped from the end: lowest first
        self.ref: dict[int, int] = {}  # slot -> holders (a running sequence's rolling slot, a pending restore)
        self.hash_of: dict[int, int] = {}  # slot -> the prefix hash it holds the state of
        self.slot_of: dict[int, int] = {}  # prefix hash -> slot
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced named slots, oldest first
        self.stats = CheckpointStats()

    # ---------------------------------------------------------------- finding

    def find(self, hashes: list[int]) -> tuple[int, int | None]:
        """(b, slot): the longest prefix of b blocks (of the prompt's first len(hashes) full
        blocks, those whose KV is cached) whose state a checkpoint holds; (0, None) if none."""
        for b in range(len(hashes), 0, -1):
            slot = self.slot_of.get(hashes[b - 1])
            if slot is not None:
                return b, slot
        return 0, None

    # ---------------------------------------------------------------- holding

    def take(self, slot: int) -> None:
        """Hold `slot` (it will be read: not evicted, not overwritten) until `release`."""
        if self.ref.get(slot, 0) == 0:
            self.cached.pop(slot, None)
        self.ref[slot] = self.ref.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        self.ref[slot] -= 1
        if self.ref[slot] == 0:
            del self.ref[slot]
            if slot in self.hash_of:
                self.cached[slot] = None  # most recently used last
            else:
                self.free.append(slot)

    def borrow(self, avoid=()) -> int | None:
        """A slot to snapshot a speculating sequence's state into (speculative decoding's spare),
        held until `release`; it holds no prefix's state, so it goes back to the free slots.
        `avoid`: slots this step writes after it runs (checkpoints just saved), which a snapshot
        taken before the step must not share. None: every slot is held."""
        slot = self._allocate(avoid)
        if slot is not None:
            self.take(slot)
            self.stats.borrowed += 1
        return slot

    # ---------------------------------------------------------------- saving

    def save(self, h: int, own: int | None = None) -> int | None:
        """A slot to save the state of prefix `h` into, named `h` from now (the step that writes
        it is being handed out: every later step may read it). `own`: the caller's held slot,
        overwritten when no one else holds it; else a free or evicted one, held for the caller
        when `own` is given (a sequence's rolling slot), else left unreferenced (cached). None:
        every slot is held, nothing saved."""
        old = self.slot_of.get(h)
        if old is not None and old != own:  # already checkpointed (another sequence, same prefix)
            return None
        if own is not None and self.ref.get(own) == 1:
            slot = own
            self._forget(slot)
        else:
            slot = self._allocate()
            if slot is None:
                return None
            if own is not None:
                self.release(own)
                self.take(slot)
        self.hash_of[slot], self.slot_of[h] = h, slot
        if self.ref.get(slot, 0) == 0:
            self.cached[slot] = None
        self.stats.saved += 1
        return slot

    def _allocate(self, avoid=()) -> int | None:
        if self.free:
            return self.free.pop()
        slot = next((s for s in self.cached if s not in avoid), None)  # the least recently used
        if slot is None:
            return None
        del self.cached[slot]
        self._forget(slot)
        self.stats.evicted += 1
        return slot

    def _forget(self, slot: int) -> None:
        h = self.hash_of.pop(slot, None)
        if h is not None:
            del self.slot_of[h]

    def forget_all(self) -> None:
        """The stages lost their state (a restart): no checkpoint holds anything."""
        self.__init__(self.n, self.base)

    @property
    def n_held(self) -> int:
        return len(self.hash_of)
