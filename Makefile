# The two commands a newcomer needs: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch; on a GPU machine run e.g. `make TORCH_SPEC=torch install`.
TORCH_SPEC ?= torch==2.13.0
TRAIN_CONFIG ?= recipes/configs/smollm2_lora_arithmetic.yaml
ACCELERATE_CONFIG ?= recipes/accelerate/cpu.yaml

.PHONY: install train test test-dist lint bench bench-memory clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/.installed

train: install
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/accelerate launch --config_file $(ACCELERATE_CONFIG) \
		recipes/grpo.py --config $(TRAIN_CONFIG)

test: install
	$(BIN)/ruff check grpo_hf recipes tests bench
	$(BIN)/pytest -q tests

# Our GRPO step against TRL's on this machine (bench/run.py); results in bench/results/latest.json.
bench: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/run.py

# Peak memory of a training step, ours and TRL's, at 256 to 4096 completion tokens (bench/memory.py);
# results in bench/results/memory.json. On a GPU machine pass e.g. BENCH_MEMORY_ARGS="--num-generations 8".
bench-memory: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/memory.py $(BENCH_MEMORY_ARGS)

lint: install
	$(BIN)/ruff check grpo_hf recipes tests bench
	$(BIN)/ruff format --check grpo_hf recipes tests bench

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
