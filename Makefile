# Developer entry points. The README's first lines are the canonical commands.
PY ?= python3

.PHONY: install demo test test-fast native native-test check lint typecheck docs-config proto bench bench-serve bench-pipeline doctor clean

install:
	$(PY) -m pip install "torch==2.13.0" -e ".[test]"

demo:
	$(PY) -m tensorwire demo

test:
	$(PY) -m pytest

test-fast:
	$(PY) -m pytest -m "not slow and not netns"

# The compiled hot path (tensorwire/native.py): a build of the package with its hot modules compiled by mypyc, in
# build/native, and the whole suite run against it (the tests are the same; CI runs both).
# The build is pip's, isolated as a user's install is (it fetches setuptools and mypy); where there is no
# package index, NATIVE_PIP=--no-build-isolation uses the installed ones (the test extras have mypy).
NATIVE = build/native
NATIVE_PIP ?=

native:
	rm -rf $(NATIVE) build/lib.* build/temp.* build/bdist.*  # (no compiled module of an earlier list)
	TENSORWIRE_NATIVE=1 $(PY) -m pip install -q --no-deps $(NATIVE_PIP) --target $(NATIVE) .

native-test: native
	cd $(NATIVE) && PYTHONPATH=$(CURDIR)/$(NATIVE) $(PY) -m pytest $(CURDIR)/tests -p no:cacheprovider

# Static checks (CI runs them before the tests): lint, formatting, types. Configured in pyproject.toml.
CHECKED = tensorwire tests examples

check: lint typecheck

lint:
	$(PY) -m ruff check $(CHECKED)
	$(PY) -m ruff format --check $(CHECKED)

typecheck:
	$(PY) -m mypy

# Regenerate docs/configuration.md from tensorwire.settings (tests/core/test_settings.py checks it).
docs-config:
	$(PY) -m tensorwire.configdoc > docs/configuration.md

# Regenerate the committed protobuf/gRPC stubs from proto/ (tests check they match).
proto:
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/tensorwire/v1/*.proto

bench:
	$(PY) -m tensorwire bench --check

bench-serve:
	$(PY) bench/bench_serve.py

bench-pipeline:
	$(PY) bench/bench_pipeline.py

doctor:
	$(PY) -m tensorwire doctor

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache
