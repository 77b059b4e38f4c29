"""A draft model on the first stage: a small GGUF of the target's vocabulary that proposes tokens
(speculative decoding's `--draft MODEL.gguf`).

It runs in the first stage's process, beside the target's first layers, on the same device: its
weights and its KV pool are charged to that stage like trunk. Its KV pool has the target's block
count and is addressed by the same block tables, so the engine's one ledger covers both: a
rejected draft's positions go back with the target's, and a position the draft model wrote is
overwritten before it is read again, as the target's is.

Every step, the draft model mirrors the rows its sequences feed the target (prompt chunks, decode
tokens, verify rows of other drafters), so its KV holds what the target's holds; a row that asks
for k drafted tokens (StepBatch.draft_k) then gets them greedily, one position at a time, all such
rows together. A greedy draft is a point mass, which the target's acceptance rule assumes
(stages/text/verify.py). The last drafted token has no KV yet; when the target accepts every draft,
the next step's row starts just after it, and the draft model feeds it first (`owed`).
"""
from __future__ import annotations

import torch

from moeray.errors import MoerayError

MIRROR, NO_MIRROR = 0, -1  # draft_k values: mirror the row only; leave the row alone


def check_draft(path: str, target_config) -> None:
    """One clear line before anything starts: the file is a GGUF of the model's vocabulary."""
    from moeray.stages.gguf.reader import read_gguf_header

    cfg = read_gguf_header(path).config  # GGUFError names a missing or broken file
    if cfg.vocab_size != target_config.vocab_size:
        raise MoerayError(f"--draft {path}: its vocabulary has {cfg.vocab_size} tokens, the model's "
                          f"{target_config.vocab_size}; a draft model must share the model's tokenizer")


def draft_bytes(path: str, n_blocks: int, itemsize: int = 4) -> int:
    """What a draft model will hold on the first stage's device, from its header: its trunk (every
    layer, the embedding and the head: the planner prices it as that stage's trunk) and a KV pool
    of the target's block count."""
    from moeray.stages.blocks.kv_cache import kv_block_bytes
    from moeray.stages.gguf.reader import read_gguf_header
    from moeray.stages.runtime.model import stage_trunk_bytes

    header = read_gguf_header(path)
    cfg = header.config
    return stage_trunk_bytes(header, 0, cfg.n_layers) + n_blocks * kv_block_bytes(cfg, range(cfg.n_layers), itemsize)


class DraftModel:
    def __init__(self, path: str, device, n_blocks: int, target_config):
        from moeray.stages.gguf.reader import GGUFFile
        from moeray.stages.runtime.model import StageModel

        gguf = GGUFFile(path)
        cfg = gguf.config
        if cfg.vocab_size != target_config.vocab_size:
            raise MoerayError(f"--draft {path}: its vocabulary has {cfg.vocab_size} tokens, the model's "
                              f"{target_config.vocab_size}; a draft model must share the model's tokenizer")
        if cfg.deltanet is not None:
            raise MoerayError(f"--draft {path}: a draft model with recurrent (DeltaNet) layers is not supported; "
                              "give a transformer of the model's vocabulary")
        self.path = path
        self.model = StageModel(gguf, 0, cfg.n_layers, device)
        self.kv = self.model.new_kv_pool(n_blocks)
        self.owed: dict[int, tuple[int, int]] = {}  # slot -> (position, token): the last draft, no KV yet

    def token_ms(self, reps: int = 5) -> float:
        """Median ms of one drafted token (one position of one row): what each drafted token costs
        the step beside the target's work. Timed in block 0 of its pool (no sequence is running
        yet; whoever gets the block later writes its rows before reading them)."""
        import time

        times = []
        for _ in range(reps):
            t = time.perf_counter()
            self._run([([1], 0, [0])], [True])
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]

    def nbytes(self) -> int:
        """What it holds on its device: its trunk and its KV pool."""
        return self.model.trunk_bytes() + self.kv.nbytes()

    @torch.inference_mode()
    def draft(self, slots, starts, tokens, tables, fresh, draft_k) -> list[list[int]]:
        """Mirror the step's rows and draft for those that ask: per row, `draft_k[i]` tokens (0:
        mirror only; -1: not this model's sequence). `tokens[i]` is the row's tokens as the target
        gets them, its first one its last token (a model-drafted row: that token alone)."""
        feed, at, drafting = [], [], []
        for i, (slot, start, toks, new, k) in enumerate(zip(slots, starts, tokens, fresh, draft_k)):
            if new:
                self.owed.pop(slot, None)
            if k < 0:
                continue
            row = list(toks[:1]) if k > 0 else list(toks)
            owed = self.owed.pop(slot, None)
            begin = start
            if owed is not None and owed[0] == start - 1:  # every draft was accepted: its last first
                row, begin = [owed[1]] + row, start - 1
            feed.append((i, row, begin))
            if k > 0:
                drafting.append(i)
        out: list[list[int]] = [[] for _ in slots]
        if not feed:
            return out
        nxt = self._run([(row, begin, tables[i]) for i, row, begin in feed], [i in drafting for i, _, _ in feed])
        for (i, row, begin), tok in zip([f for f in feed if f[0] in drafting], nxt):
            out[i].append(tok)
        pos = {i: begin + len(row) for i, row, begin in feed}  # where each drafting row's next token goes
        while True:
            more = [i for i in drafting if len(out[i]) < draft_k[i]]
            if not more:
                break
            nxt = self._run([([out[i][-1]], pos[i], tables[i]) for i in more], [True] * len(more))
            for i, tok in zip(more, nxt):
                pos[i] += 1
                out[i].append(tok)
        for i in drafting:
            self.owed[slots[i]] = (pos[i], out[i][-1])
        return out

    def _run(self, rows, want) -> list[int]:
        """One step of the draft model over rows (tokens, start, table); the greedy next token of
        each row whose `want` is set."""
        m = self.model
        n_new = [len(t) for t, _, _ in rows]
        starts = [s for _, s, _ in rows]
        tables = [list(t) for _, _, t in rows]
        meta = m.table_meta(n_new, starts, tables, self.kv)
        idx = [j for j, w in enumerate(want) if w]
        # the last layer's FFN only for the rows the head reads (one, at least, where none is)
        x = m.run_layers(m.embed([t for t, _, _ in rows]), meta, self.kv, meta.last_index[idx or [-1]])
        if not idx:
            return []
        return m.head(x).argmax(-1).tolist()
