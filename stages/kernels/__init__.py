"""The compute kernels: quantised matrices and their backend (ggml, Triton, dequantise), the
stage's options (settings), ggml loading and threads, exact repacks and huge-page host memory.
Imports gguf/ (and moeray's base modules) only."""
