# Two commands for a newcomer: `make demo` and `make test`. Each builds .venv on first use.
# The tests run the real simulators: `bash .ci/install-system` installs the system packages they need.
PYTHON ?= python3
VENV   ?= .venv
# CPU build from local disk here; CUDA users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-fullsize bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@# system packages the real simulators need (EGL, lavapipe Vulkan): installed where apt runs as root
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then bash .ci/install-system; \
	 else echo "note: run 'sudo bash .ci/install-system' for LIBERO/ManiSkill rendering (EGL, Vulkan)"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev,embodied,ray,vla,demos,lerobot,wandb]'
	# LeRobot's dataset code, for tests/test_lerobot_interop.py; --no-deps: [lerobot] has what it imports,
	# and its own pins would take transformers, huggingface-hub and numpy back (pyproject.toml says which)
	$(PY) -m pip install -q --no-deps lerobot-dataset==0.4.4
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ebrl train

# Half the suite's wall time is waiting (fresh interpreters, simulator resets, worker start-up),
# so two pytest workers halve it even on 2 cores. --dist loadfile keeps each file on one worker:
# its module fixtures (a LIBERO env, a tiny VLA) are built once. More cores: TEST_WORKERS=8.
# A test past its timeout (pytest-timeout's thread method) takes its worker down. Under --dist
# loadfile, xdist 3.8 hands the crashed test's file, that test included, to the replacement worker,
# which runs it again until the restart limit, and can then wait for ever or stop with an
# INTERNALERROR: --max-worker-restart=0 ends the run at the first such crash, naming the test.
# Tests marked slow are left out: `make test-slow`.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 -m "not slow"

# the tests marked slow (the LIBERO camera regression, RL that learns on reaches it was not tuned
# on: tests/test_learning_reach.py, test_pi0.py's); none selected is a pass (pytest exits 5)
test-slow: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 -m "slow and not fullsize" || [ $$? = 5 ]

# published-size models on the CPU (tests/test_lerobot_pi0.py's π0.5: ~10 minutes, up to 16 GiB), one at a time
test-fullsize: $(STAMP)
	$(PY) -m pytest -q -s -m fullsize

# every suite into docs/benchmarks/, then the README's tables regenerated from that JSON;
# `make bench SUITES="longtail overhead"` re-runs some and re-renders from all the JSON there
SUITES ?= overhead step-cost longtail longtail-user startup-mock heterogeneous mujoco-state startup mujoco-pixels vector-gpu embodied libero controller convergence lag policies scaling gpu-split soak embodied-learning vla sft-rl sample-efficiency paper-regime
BENCH_DIR ?= docs/benchmarks
bench: $(STAMP)
	set -e; for s in $(SUITES); do \
	  $(VENV)/bin/ebrl bench $$s --out $(BENCH_DIR) $$( [ $$s = heterogeneous ] && echo --trace ); done
	$(PY) -m ebrl.benchmark.docs $(BENCH_DIR)

clean:
	rm -rf $(VENV) runs bench_out
