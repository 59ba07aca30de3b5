# Targets (what each costs on a 2-core machine: README.md, "Set-up"):
#   make demo   .venvs/demo (the demo and ray extras), then tensor-exchange demo $(ARGS);
#               make demo ARGS=--ray runs it on Ray actors
#               make demo ARGS=--publish: a trainer publishes its weights as a tensor set to two reader processes
#   make test   .venvs/test (the test, interop, demo, ray, metrics, plot and top extras), then ci/cpu.sh: the suite
#               against the built wheel in a new environment, then on the pure-Python path
#   make dist   dist/: the sdist, and from it a wheel with the compiled core per CPython 3.10-3.13
#               found here (ci/dist.sh; what the build tools print goes to build/dist*.log)
#   make gpu-check  ci/gpu-check.sh, on a GPU machine;  make clean  removes what these made
# An environment is made when missing and refreshed when pyproject.toml, setup.py,
# ci/constraints.txt or this Makefile change. No command line is echoed and pip writes to
# stderr, so stdout holds the program's output alone:
#   make demo ARGS="--report json" | python3 -m json.tool
PYTHON ?= python3
VENVS := .venvs
PIP_FLAGS := -c ci/constraints.txt
DEPS := pyproject.toml setup.py ci/constraints.txt Makefile
# No "Entering directory" lines (make prints them on stdout when run by another make).
MAKEFLAGS += --no-print-directory

.PHONY: demo test dist gpu-check clean

demo: $(VENVS)/demo/.installed
	@$(VENVS)/demo/bin/tensor-exchange demo $(ARGS)

test: $(VENVS)/test/.installed
	@VENV=$(VENVS)/test bash ci/cpu.sh

dist:
	@bash ci/dist.sh

gpu-check:
	@bash ci/gpu-check.sh

$(VENVS)/demo/.installed: $(DEPS)
	@echo "make: setting up $(VENVS)/demo: the demo and ray extras (PyTorch, JAX, ONNX Runtime, scikit-learn, Ray): about 2 min on 2 cores with pip's cache warm, more to download them; pip's progress follows" >&2
	@$(PYTHON) -m venv $(VENVS)/demo >&2
	@$(VENVS)/demo/bin/python -m pip install $(PIP_FLAGS) -e ".[demo,ray]" >&2
	@touch $@

$(VENVS)/test/.installed: $(DEPS)
	@echo "make: setting up $(VENVS)/test: the test, interop, demo, ray, metrics, plot and top extras: 1.1 to 1.9 min on 2 cores with pip's cache warm, more to download them; pip's progress follows" >&2
	@$(PYTHON) -m venv $(VENVS)/test >&2
	@$(VENVS)/test/bin/python -m pip install $(PIP_FLAGS) -e ".[test,interop,demo,ray,metrics,plot,top]" >&2
	@touch $@

clean:
	@rm -rf $(VENVS) build dist exchange/_native*.so exchange/_native_not_built.json
