# Two commands for a fresh machine:
#   make demo   set up, then train a small GPT with ZeRO stage 3 + CPU optimizer offload on 2 ranks (the main job)
#   make test   set up, then run the test suite (what CI runs)
PYTHON ?= python3
# Installed only when no torch is present (pip's default torch is a large CUDA build; pass
# TORCH_SPEC="torch==X --index-url <your CPU wheel index>" for a CPU-only machine).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lint bench ops gpu-wheels gpu-check
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_SPEC)
	$(PYTHON) -m pip install --no-build-isolation -e ".[test]"

demo: setup
	-$(PYTHON) -m zero.ops build
	$(PYTHON) -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py

test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m zero.ops build
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) benchmarks/bench_adam.py
	$(PYTHON) benchmarks/bench_zero.py
	$(PYTHON) benchmarks/bench_offload.py
	$(PYTHON) -m pip install -q matplotlib
	$(PYTHON) benchmarks/report.py

ops: setup
	$(PYTHON) -m zero.ops build

lint:
	$(PYTHON) -m ruff check .

# The GPU machine (the `device` tool): `make gpu-wheels` here once, then one call per part,
# run(command="make gpu-check PART=tests", carry=[".whl"]); see .ci/gpu-check.
GPU_WHEELS ?= pydantic==$(shell $(PYTHON) -c "import pydantic; print(pydantic.VERSION)") \
	pydantic-core==$(shell $(PYTHON) -c "import pydantic_core; print(pydantic_core.__version__)") \
	annotated-types typing-inspection hjson
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

gpu-check:
	PART=$(PART) bash .ci/gpu-check
