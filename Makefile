# The README's two commands: `make demo` (a real 2-rank DDP training) and `make test`.
# Each creates .venv/ if missing and installs what it needs; a second run reuses it.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.distkit-installed
# Open MPI refuses to run as root without these (CI and dev machines run as root).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Bytecode is written when a module is first imported, not by pip at install time (--no-compile below): pip
# compiles every file of every package (torch, DeepSpeed, mlflow, ...), 60 of the 82 s the installs took on a
# fresh clone, where the runs import a fraction of them. A PYTHONDONTWRITEBYTECODE from the caller's environment
# would then make every process compile what it imports, every time: it is dropped here.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check bench bench-check install horovod slurm pdsh

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned here, not in install_requires: 2.13.0 is the CPU wheel on these machines.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[mpi,deepspeed,ft,plot,trackers,lightning,hf,speechbrain,returnn,dev]'
	$(PY) scripts/torchaudio_python_only.py
	touch $@

demo: $(STAMP)
	$(VENV)/bin/distkit train configs/demo.py --nprocs 2

# Real Horovod 0.28.1 (source only, patched to C++17 for torch 2.x): built once (~3 min on
# 2 cores), cached as a wheel under ~/.cache/distkit/wheels/, reinstalled from there in
# seconds; does nothing when horovod already imports. tests/test_horovod_backend.py needs it.
horovod: $(STAMP)
	scripts/build_horovod.sh $(VENV)

# A real SLURM (slurmctld, slurmd, munge from apt; ~15 s) for tests/test_slurm.py, which starts its own
# daemons with a test-owned config; does nothing when it is installed.
slurm:
	scripts/install_slurm.sh

# pdsh and sshd (apt; ~10 s) for DeepSpeed's default launcher (pdsh over ssh) in tests/test_multihost.py,
# which starts its own sshd inside each test host; nothing is started here. Does nothing when installed.
pdsh:
	scripts/install_pdsh.sh

# $(call pytest,WHAT,ARGS): pytest on tests/ with ARGS; its exit 5 (no tests collected) is a failure here, never a
# silent pass. Leaves the status in rc.
pytest = $(VENV)/bin/pytest -q -p no:cacheprovider $(2) tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "$(1): no tests ran" >&2; exit 1; fi

# Everything, in one run on five workers (pytest-xdist, --dist loadgroup): two take the tests marked serial one at a
# time, from the start: one those that build hosts or SLURM daemons (machine-wide names) and the serial tests of
# two files that balance the lanes (tests/conftest.py MACHINE_LANE_TOO), the other the rest (a lighthouse, kill
# trials, timeouts, asserted durations: they time what they observe); the three others take the
# rest file by file (tests/conftest.py groups them). The serial tests mostly wait (for a timeout, a stalled rank, a
# daemon): beside them the machine's two cores stay busy (with four workers they were 12 % idle: 175 % CPU of a
# whole run, 155-175 % for the 12 minutes the serial lanes spent waiting). Exit 5 (no tests ran) is a failure. --max-worker-restart 0: a worker that dies ends the run
# at once naming its test (pytest-xdist 3.8 replaces a crashed worker under loadgroup/loadfile and can then wait
# forever for work it lost: pytest-xdist issues 1323, 1378); tests/conftest.py makes the worker say who ended it.
test: $(STAMP) horovod slurm pdsh
	$(call pytest,make test,--durations=25 -n 5 --dist loadgroup --max-worker-restart 0); exit $$rc

# The fast tier for the edit-test loop (tests/tiers.py): every test that starts no process, one real 2-rank parity
# run of every engine x mode, the conformance suite's core rows, config, bad-input, checkpoint and CLI tests. It leaves
# out what starts network-namespace hosts, SLURM daemons, a torchft lighthouse, kill trials or stall and fault runs.
# Two workers (pytest-xdist), one test file each at a time: its 2-rank runs leave a core idle while they start and
# wait (none of its tests times what it observes; those are serial in `make test`).
check: $(STAMP) horovod
	$(call pytest,make check,--durations=10 -n 2 --dist loadfile --max-worker-restart 0 -m "not full"); exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The overhead guard (issues 37, 61): every engine (fsdp too) and path against its hand-written loop, failing when a
# ratio's 95 % interval lies above 1.03; its last line is the verdict. About 33 minutes on the quiet 2-core machine
# (engines about 28, the four bridges about 5: benchmarks/bench_check.py's PAIRS); an
# engine's own change: `make bench-check BENCH_CHECK="--engines fsdp --quick"`. Not part of `make test` (timing
# never goes into a test); run it on a quiet machine.
bench-check: $(STAMP) horovod
	$(PY) benchmarks/bench_check.py $(BENCH_CHECK)
