"""llama.cpp itself (llama-cpp-python, optional) runs the tiny DeepSeek-V3, DeepSeek-V2 and GLM-4.5 files
moeray's writer lays out as its converter does, and gets transformers' logits: the independent
check that the tensor names, the kv_b_proj split, the MTP layer and the metadata are llama.cpp's.

Measured: 6.5e-4 (DeepSeek-V3) and 3.9e-4 (GLM-4.5) of the largest logit; llama.cpp keeps its
KV cache in float16, so the tolerance is 5e-3, not the exact backend's 1e-4."""
from __future__ import annotations

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from moeray.stages.gguf.writer import write_gguf  # noqa: E402
from tiny_models import VOCAB, tiny_deepseek2, tiny_deepseek3, tiny_glm4moe, token_ids  # noqa: E402


def _tokenizer():
    """The smallest byte-level BPE llama.cpp accepts: the tiny models' 300 ids and one merge."""
    from tokenizers import Tokenizer, models

    vocab = {"a": 0, "b": 1, "ab": 2, **{f"<t{i}>": i for i in range(3, VOCAB)}}
    return Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))


# DeepSeek-V2 with its q LoRA: llama.cpp takes a file without attention.q_lora_rank as a "lite"
# model only at 26 or 27 layers (deepseek2.cpp's is_lite), so the 2-layer V2-Lite cannot load there.
@pytest.mark.parametrize("build", [tiny_deepseek3, lambda: tiny_deepseek2(q_lora_rank=64), tiny_glm4moe],
                         ids=["deepseek-v3", "deepseek-v2", "glm4moe"])
def test_llama_cpp_runs_the_file_and_matches_transformers(build, tmp_path):
    model, ids = build(), token_ids(20)
    path = write_gguf(model, tmp_path / "m.gguf", "F32", tokenizer=_tokenizer())
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_threads=1, verbose=False)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)])
    assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()
