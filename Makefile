# `make test` and `make demo` work from a fresh clone: they create .venv and install the Debian
# packages the tests drive for real (haproxy, prometheus + promtool, alertmanager + amtool, victoria-metrics:
# victoria-metrics, vmagent, vmalert, vmauth; etcd-server: etcd for the fleet registry; chromium: the tests open the
# HTML reports in it, headless, a few seconds in all).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEBS := haproxy prometheus prometheus-alertmanager victoria-metrics etcd-server chromium

.PHONY: test demo lint unit deps venv bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Install only what is missing; apt needs root (as on CI) or sudo.
deps:
	@missing=""; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v amtool >/dev/null 2>&1 || missing="$$missing prometheus-alertmanager"; \
	command -v vmalert >/dev/null 2>&1 || missing="$$missing victoria-metrics"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .

# Two processes: the pure modules beside the real-service ones, which run one at a time (tests/conftest.py).
test: deps $(STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

demo: deps $(STAMP)
	$(BIN)/grayguard demo $(DEMO_ARGS)

# The controller's cost at 1,000 and 10,000 nodes: decision time, HAProxy batches, and what the shipped rules and
# queries cost a real Prometheus (about 5 minutes on 2 cores; BENCH_ARGS=--no-prometheus skips that part).
bench: deps $(STAMP)
	$(BIN)/grayguard bench-controller $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache demo-report
