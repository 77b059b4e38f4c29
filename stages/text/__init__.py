"""Text in and out: the tokenizer read from the GGUF's tokenizer keys, sampling, and the
grammar masks of structured output. Imports gguf/ and arch/ only."""
