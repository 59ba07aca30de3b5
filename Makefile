# Two commands on a fresh machine (Python 3.10+ with venv):
#   make demo   sets up .venvs/demo (the demo extra) and runs tensor-exchange demo
#   make test   sets up .venvs/test (test, interop, demo and ray extras) and runs the CPU job:
#               pytest tests/cpu tests/gpu, then the same on the pure-Python path
# Each environment is made when missing and refreshed when pyproject.toml, setup.py or
# ci/constraints.txt change. Other targets: gpu-check (ci/gpu-check.sh, on a GPU
# machine), clean (removes both environments and the built helper).
PYTHON ?= python3
VENVS := .venvs
PIP_FLAGS := -q -c ci/constraints.txt
DEPS := pyproject.toml setup.py ci/constraints.txt

.PHONY: demo test gpu-check clean

demo: $(VENVS)/demo/.installed
	$(VENVS)/demo/bin/tensor-exchange demo $(ARGS)

test: $(VENVS)/test/.installed
	VENV=$(VENVS)/test bash ci/cpu.sh

gpu-check:
	bash ci/gpu-check.sh

$(VENVS)/demo/.installed: $(DEPS)
	$(PYTHON) -m venv $(VENVS)/demo
	$(VENVS)/demo/bin/pip install $(PIP_FLAGS) -e ".[demo]"
	touch $@

$(VENVS)/test/.installed: $(DEPS)
	$(PYTHON) -m venv $(VENVS)/test
	$(VENVS)/test/bin/pip install $(PIP_FLAGS) -e ".[test,interop,demo,ray]"
	touch $@

clean:
	rm -rf $(VENVS) build exchange/_native*.so
