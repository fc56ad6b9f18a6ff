# make demo / make test each build .venv on first use (python3, a C compiler and make are all they need).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-compilers docs matrix rows bench experiments mutants clean

$(STAMP): pyproject.toml setup.py tapegrad/_ctape.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python experiments/demo.py

# Both cores (pytest-xdist), each test file on one worker so a file's compiled programs are built once;
# the build cache's per-key lock lets workers share it. The tests that compile with every C compiler on
# PATH or with nvcc (marker `compilers`) are make test-compilers: .ci/run runs both.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile -m "not compilers" tests tapegrad interop

test-compilers: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile -m compilers tests

# The documentation site (mkdocs.yml: the pages under docs/ and an API reference from the docstrings) into
# site/, warnings as errors. make test runs every code block of its pages (tests/test_docs.py).
DSTAMP  := $(VENV)/.installed-docs

$(DSTAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $(DSTAMP)

docs: $(DSTAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_docs.py -k api_reference   # needs griffe

# The native exactness tests under every compiler x target x BLAS kernel present (.ci/run runs it).
matrix: $(STAMP)
	tools/matrix.sh

# The interop and oracle tests under Python 3.12 and 3.13 with JAX 0.12, a venv each outside the tree
# (.ci/run runs it; JAX_ROWS="3.13:0.12" picks rows).
rows:
	tools/jax_rows.sh

# Mutation testing (docs/testing.md): mutmut per core module with its own tests, then hand-written C
# mutations. Not part of make test; under an hour on 2 cores. MUTANTS="tape optim" runs some modules only.
MSTAMP  := $(VENV)/.installed-mutants
MUTANTS ?=

$(MSTAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e ".[mutants]"
	touch $(MSTAMP)

mutants: $(MSTAMP)
	nice $(BIN)/python tools/mutants.py $(MUTANTS)
	nice $(BIN)/python tools/c_mutants.py
	$(BIN)/python tools/mutants.py --report

# This machine pins OpenBLAS to its Haswell kernels (OPENBLAS_CORETYPE) for old builds' sake; a
# current NumPy runs AVX-512 GEMMs without it. Benchmarks only: tests and CI keep the setting.
BENCH_ENV := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE

bench: $(STAMP)
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_eager.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_capture.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_models.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_linalg.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_interop.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_oracle.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_gemm.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/emit_logreg.py

# The research experiments (README "Experiments"): tables and plots into experiments/out/.
experiments: $(STAMP)
	$(BENCH_ENV) $(BIN)/python experiments/studies/transformer.py
	$(BENCH_ENV) $(BIN)/python experiments/studies/reproducibility.py
	$(BENCH_ENV) $(BIN)/python experiments/studies/fusion_study.py
	$(BENCH_ENV) $(BIN)/python experiments/studies/finetune_memory.py
	$(BENCH_ENV) $(BIN)/python experiments/studies/data_parallel.py
	$(BENCH_ENV) $(BIN)/python experiments/bench/bench_peers.py

clean:
	rm -rf $(VENV) site experiments/out/*.png experiments/out/*.md
