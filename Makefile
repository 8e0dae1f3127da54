# The two commands of the README: `make demo` and `make test`. Both install
# what they need first (torch pinned when none is present, the dev tools, the
# frameworks tests/frameworks runs (--no-deps: they never replace torch),
# then pydist itself, built in place against that torch: see the README's
# Install section and pyproject.toml), so they work on a fresh machine.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
STAMP := build/.pydist-installed
SOURCES := $(shell find csrc pydist -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml requirements-dev.txt \
	requirements-frameworks.txt

.PHONY: install test test-spawn test-mpi demo bench gpu-check gpu-bench clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_PIN)
	$(PYTHON) -m pip install -r requirements-dev.txt
	$(PYTHON) -m pip install --no-deps -r requirements-frameworks.txt
	$(PYTHON) -m pip install --no-build-isolation -e .
	@mkdir -p build && touch $@

# Everything: the spawned-process suite, then the suite launched by mpirun.
# Every rank of the mpirun suite runs pytest; a failing rank aborts the whole
# job (tests/mpi/conftest.py), so mpiexec exits non-zero instead of hanging.
MPIEXEC ?= mpiexec
MPI_RANKS ?= 2
MPI_TESTS = $(MPIEXEC) -n $(MPI_RANKS) $(PYTHON) -m mpi4py -m pytest tests/mpi -p no:cacheprovider -o timeout=120
# --durations: the slowest tests, so a CI log shows where its time goes.
test: install
	$(PYTHON) -m pytest tests --durations=15
	$(MPI_TESTS)

test-spawn: install
	$(PYTHON) -m pytest tests

test-mpi: install
	$(MPI_TESTS)

# The training job of examples/train.py on 2 CPU ranks under torchrun, then
# the same training under torch's DDP: losses, the largest parameter
# difference, replicas equal, samples/s, and pydist's overlap record.
demo: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=2 examples/train.py --device cpu \
		--epochs 3 --bucket-cap-mb 2 --compare-torch

bench: install
	$(PYTHON) benchmarks/bench_flatten.py
	$(PYTHON) benchmarks/bench_collectives.py
	$(PYTHON) benchmarks/bench_ddp.py

# On a machine with a GPU: what CI cannot run. Builds the CUDA kernels in
# place (PYDIST_CUDA=1: a missing toolkit is an error), then the CUDA-marked
# tests (ops, DDP on CUDA beside torch over gloo and NCCL, the example's AMP),
# the kernels' torch-free self-test and the flatten bandwidth on the device.
# The GPU machines' default g++ (/opt/gcc) has no shared libstdc++, which
# setup.py refuses: build there with the system's compiler.
GPU_BUILD_ENV ?= $(if $(wildcard /usr/bin/g++),CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared")

gpu-check:
	$(GPU_BUILD_ENV) PYDIST_CUDA=1 $(PYTHON) setup.py build_ext --inplace
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -m cuda tests -p no:cacheprovider
	cmake -S . -B build/cmake && cmake --build build/cmake --target flatten_selftest && ./build/cmake/flatten_selftest
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_flatten.py --device cuda

# On a GPU machine, after gpu-check built the kernels: the sharded wrapper
# beside torch FSDP2 (step and peak device memory, NCCL with one rank, then
# gloo with two ranks sharing the GPU) and what is alive at the memory peak.
gpu-bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_fsdp_cuda.py --rounds 3 --steps 10
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_fsdp_cuda.py --backend gloo --models linear,transformer --rounds 2 --steps 5
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/gpu_memory_trace.py ln400,transformer

clean:
	rm -rf build pydist/_C*.so *.egg-info
