"""The compute kernels: quantised matrices and their backend (ggml, Triton, dequantise),
ggml loading and threads, exact repacks and huge-page host memory. Imports gguf/ only."""
