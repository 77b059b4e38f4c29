"""The compute kernels: quantised matrices (qmatmul) and their backend (backend: ggml, Triton,
dequantise), ggml's threads and graphs (threads, graphs), the stage's options (settings), ggml
loading, exact repacks and huge-page host memory. Imports gguf/ (and moeray's base modules) only."""
