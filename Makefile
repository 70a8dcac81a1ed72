# Developer entry points. The README's first lines are the canonical commands.
PY ?= python3

.PHONY: install demo test test-fast proto bench bench-serve bench-pipeline doctor clean

install:
	$(PY) -m pip install "torch==2.13.0" -e ".[test]"

demo:
	$(PY) -m tensorwire demo

test:
	$(PY) -m pytest

test-fast:
	$(PY) -m pytest -m "not slow and not netns"

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
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
