"""The tiny gpt-oss GGUF the gpt-oss tests share: tests/tiny_models.py's random GptOssForCausalLM
written as llama.cpp's converter lays it out (MXFP4 experts, gate/up split from the interleaved
gate_up_proj, sinks, post_attention_norm), with a byte-level BPE vocabulary that has harmony's
special tokens and the harmony chat template (tests/data/openai-gpt-oss.jinja)."""
from __future__ import annotations

from pathlib import Path

HARMONY_SPECIAL = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>",
                   "<|call|>", "<|constrain|>"]
TEMPLATE = Path(__file__).parent / "data" / "openai-gpt-oss.jinja"


def harmony_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=HARMONY_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["You are ChatGPT, a large language model trained by OpenAI.",
                             "analysis commentary final. What is the capital of France? Paris."] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>")
    fast.chat_template = TEMPLATE.read_text()
    return fast


def write_gpt_oss(path: Path, file_type: str = "F32", n_layers: int = 3, seed: int = 4):
    """(path, the transformers model holding exactly the file's weights)."""
    from moeray.stages.gguf.writer import dequantized_state_dict, write_gguf
    from tiny_models import VOCAB, tiny_gpt_oss

    model = tiny_gpt_oss(seed, n_layers)
    write_gguf(model, path, file_type, tokenizer=harmony_tokenizer(VOCAB), name="tiny-gpt-oss",
               expert_type="MXFP4")
    model.load_state_dict(dequantized_state_dict(path, model))  # the MXFP4 (and Q8_0) rounding
    return path, model
