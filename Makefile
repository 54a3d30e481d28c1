# The few commands people run. `make demo` and `make test` set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
export SGLANG_PLATFORM ?= unicache_cpu

.PHONY: setup demo test lint format bench gpu-check gpu-targets quality selfcheck-study

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,scale]'
	# kvpress, for the peer tests only (tests/policy/test_kvpress_peer.py): its metadata asks
	# for transformers < 5.3, SGLang 0.5.23 for 5.x, so it goes in without its dependencies.
	$(VENV)/bin/pip install -q --no-deps kvpress==0.5.5 'cachetools>=5.5.2,<6' 'fire>=0.6,<0.7' \
		termcolor
	touch $@

demo: setup
	$(PY) -m examples.demo

# One process by default. TEST_WORKERS=2 runs two pytest-xdist workers, each one test file at a
# time in collection order (the engine tests first, the fast ones fill the end), their servers
# within one RAM budget (tests/support/budget.py); not the default (README says why).
TEST_WORKERS ?= 0
test: setup
	$(PY) -m pytest -q -p no:warnings --durations=25 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder

lint: setup
	$(VENV)/bin/ruff check sglang_unicache tests benchmarks examples tools

format: setup
	$(VENV)/bin/ruff format sglang_unicache tests benchmarks examples tools

# On a fresh clone setup takes 5 min and bench_policy.py 1 min. perf.py's default parts were
# timed one by one, not as a whole: the decode part 10 min, capacity over 400 images on two
# models 22 min, capacity with HiCache ~20 min, the workload on a larger model 8 min.
# serving_client.py (SGLang's own benchmark client against stock and each config, three
# rounds: the verdict is their median): its two image-dataset workloads ~37 min with --dtype
# float32, the multi-turn one ~15 min more; longer in bf16.
# Results: runs/perf.json, runs/serving-client.json, logs runs/perf-logs.
# Do not run it beside other jobs: see BENCHMARKS.md.
# On a CUDA machine (SGLANG_PLATFORM empty): per attention backend identity at keep 1.0,
# compression and reuse at 0.1, the Triton kernels against their references, decode time per
# token against stock; one JSON, runs/gpu-check.json. `make gpu-check DRY=--dry` runs it here.
gpu-check: setup
	$(PY) -m benchmarks.gpu_check $(DRY) --out runs/gpu-check.json

# On a CUDA machine (SGLANG_PLATFORM empty): the speed targets the CPU cannot decide, against
# stock in the same run (the compression's share of the prefill, SGLang's client pool free and
# bound, a recall's TTFT, the multi-turn chats on the 2B language model); one JSON with a verdict per
# target, runs/gpu-targets.json. STEPS="overhead,client" runs a part; DRY=--dry runs it here.
STEPS ?= overhead,client,recall,multi-turn
gpu-targets: setup
	$(PY) -m benchmarks.gpu_targets $(DRY) --steps "$(STEPS)" --out runs/gpu-targets.json

bench: setup
	$(PY) -m benchmarks.perf --out runs/perf.json
	$(PY) -m benchmarks.serving_client --rounds 3 --out runs/serving-client.json
	$(PY) -m benchmarks.bench_policy --reps 2 --dtype bf16

# Quality vs keep ratio: the transformers reference on 40 items per setting, then
# eval_serving.py for full + 7 methods x 5 keep ratios, reuse and long settings, and UniCache with
# a query-robustness blend (unicache-qw0.6, not the default); then the defaults as shipped (the
# self-check on: unicache-shipped, 4 more servers); 45 server starts, ~45 minutes on the quiet
# 2-core machine; then the tables, target checks and plots.
# Results: runs/quality.json, runs/quality-qw.json, runs/quality.md, docs/img/quality-*.png.
QUALITY_MODEL ?= assets/checkpoints/tiny-vqa-qwen2-vl
GRID_MODEL ?= assets/checkpoints/tiny-grid-qwen2-vl
quality: setup
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.quality.eval_serving --model $(QUALITY_MODEL) \
		--methods full,random,knorm,h2o,snapkv,pyramidkv,aircache,unicache \
		--ratios 0.01,0.05,0.1,0.25,0.5 --settings reuse,long --images 30 --transformers-check 40 \
		--out runs/quality.json
	$(PY) -m benchmarks.quality.eval_serving --model $(QUALITY_MODEL) --methods unicache \
		--ratios 0.01,0.05,0.1,0.25,0.5 --settings reuse,long --images 30 \
		--set query_weight=0.6 --set anchor_fraction=0.05 --label=-qw0.6 --out runs/quality-qw.json
	$(PY) -m benchmarks.quality.eval_serving --model $(QUALITY_MODEL) --methods unicache \
		--ratios 0.01,0.05,0.1,0.25 --settings reuse,long --images 30 --selfcheck on \
		--label=-shipped --out runs/quality-shipped.json
	$(PY) -m benchmarks.quality.report runs/quality.json runs/quality-qw.json \
		runs/quality-shipped.json --plot-dir docs/img --markdown runs/quality.md
	$(PY) -m benchmarks.quality.eval_serving --model $(GRID_MODEL) --methods full,unicache \
		--ratios 0.1 --settings reuse,long --images 16 --questions 4 --selfcheck on \
		--label=-shipped --out runs/grid-shipped.json

# What the self-check predicts (docs/selfcheck.md): every statistic recorded per image
# for every method at keep 5/10/25% in the reuse setting, against harm to later answers, then
# the grid model (the second task) at keep 10/20/40%. 29 server starts, ~55 minutes on the quiet
# 2-core machine.
selfcheck-study: setup
	$(PY) -m benchmarks.quality.eval_serving --model $(QUALITY_MODEL) \
		--methods full,unicache,aircache,snapkv,h2o,pyramidkv,knorm,random --ratios 0.05,0.1,0.25 \
		--settings reuse --images 30 --selfcheck record --out runs/selfcheck-study.json
	$(PY) -m benchmarks.quality.eval_serving --model $(GRID_MODEL) --methods full,unicache,snapkv \
		--ratios 0.1,0.2,0.4 --settings reuse --images 16 --questions 4 --selfcheck record \
		--out runs/selfcheck-study-grid.json
	$(PY) -m benchmarks.quality.selfcheck_study runs/selfcheck-study.json \
		runs/selfcheck-study-grid.json --markdown runs/selfcheck-study.md
