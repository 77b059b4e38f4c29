"""The GGUF format: reading a file's header and tensors, writing files, the quant block types,
and the embedded default model. Imports only arch/."""
