"""Accepting drafted tokens: the target's verdict on a speculative row.

A verify row feeds the target the sequence's last token and k drafted ones, d_1..d_k, as one
multi-token row; its logits at the k+1 positions are the target's distributions p_0..p_k, where
p_j is the next-token distribution after d_1..d_j. The row yields the drafted tokens the target
accepts and then one token of its own (the correction at the first rejection, or a bonus token
after the last draft), so every verify step gains at least the one token a plain decode gains.

Greedy: the longest prefix of the draft that equals the target's argmax at each position, then
the argmax after it: exactly the tokens a plain greedy decode would produce.

Sampling: the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023). Every
drafter here is deterministic (n-gram lookup, a greedy draft model), so its proposal q_j is a
point mass on d_j: d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j), and a
rejection draws from the residual norm(max(0, p_j - q_j)), which is p_j with d_j taken out. Each
emitted token is then distributed exactly as p_j: accepted with P = p_j(d_j), or else drawn from
p_j restricted to the other tokens with the remaining mass. p_j is the distribution plain sampling
would draw from at that position: temperature, top-k, top-p and the grammar's mask all applied.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from moeray.stages.text.sampling import (SamplingParams, TokenHistory, adjust_logits, argmax_rows, draw,
                                         filtered_probs)


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    """logits [k+1, vocab] (masked where a grammar forbids): the accepted drafts and the next token."""
    choice = argmax_rows(logits)
    out = []
    for j, d in enumerate(draft):
        if choice[j] != d:
            out.append(int(choice[j]))
            return out
        out.append(int(d))
    out.append(int(choice[len(draft)]))
    return out


def accept_sampled(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
                   generator: Optional[torch.Generator]) -> list[int]:
    """The rejection rule over logits [k+1, vocab] (masked where a grammar forbids), with the
    sequence's own generator: the accepted drafts, then a token drawn from the residual at the
    first rejection or from p_k after the last draft."""
    out = []
    for j, d in enumerate(draft):
        p = filtered_probs(logits[j].cpu(), params)
        if float(torch.rand(1, generator=generator)) < float(p[d]):
            out.append(int(d))
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(draw(residual, generator))
        return out
    p = filtered_probs(logits[len(draft)].cpu(), params)
    out.append(draw(p, generator))
    return out


def verify_row(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
               generator: Optional[torch.Generator],
               masks: Optional[Sequence[Optional[torch.Tensor]]] = None,
               history: Optional[TokenHistory] = None) -> list[int]:
    """One verify row's tokens: accepted drafts + one. The target's logits at each position get
    what plain sampling applies there (stages/text/sampling.py process_logits, in its order): the
    grammar's mask (`masks[j]`, bool [vocab]: the tokens it allows at position j; None: no grammar
    there), then logit_bias and the penalties, position j counting the drafted tokens before it as
    generated (`history`: what the sequence held before the row)."""
    if masks is not None and any(m is not None for m in masks):
        logits = logits.to(torch.float32, copy=True)
        for j, m in enumerate(masks):
            if m is not None:
                logits[j].masked_fill_(~m.to(logits.device), float("-inf"))
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, history, draft)
    if params.greedy:
        return accept_greedy(logits, draft)
    return accept_sampled(logits, draft, params, generator)
