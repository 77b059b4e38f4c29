"""The reference a pipeline's greedy tokens are held to: the whole model in this process, one
prompt at a time, no engine."""
from __future__ import annotations


def one_process_greedy(model, prompts: list[list[int]], n_new: int, max_len: int) -> list[list[int]]:
    import torch

    out = []
    for prompt in prompts:
        kv = model.new_kv_cache(1, max_len)
        toks, feed = [], prompt
        for _ in range(n_new):
            toks.append(int(torch.argmax(model.step([feed], [0], kv)[0])))
            feed = [toks[-1]]
        out.append(toks)
    return out
