# dflash-lab: two commands on a fresh machine with only Python 3.11+:
#   make report   build the CPU environment, execute every notebook with papermill, render HTML to reports/
#   make test     build the CPU environment and run the tests
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dflash-lab-installed
export TRITON_INTERPRET := 1

.PHONY: env test report lab pair records clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dflash-lab needs Python 3.11+ (pyproject.toml pins the cpu extra at versions with no 3.10 release); $(PY) is " + sys.version.split()[0] + ": make ... PY=python3.11")'
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[cpu]'
	touch $(STAMP)

env: $(STAMP)

# pytest exits 5 when it collects no test: that is a failure here, never a silent pass.
test: $(STAMP)
	@$(BIN)/python -m pytest -q; status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

report: $(STAMP)
	$(BIN)/python -m dflash_lab.report --out reports
	@echo "open reports/index.html"

lab: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[cpu,lab]'
	$(BIN)/jupyter lab notebooks/

# after editing a notebook or its Markdown twin (notebooks/NN_name.md) outside a JupyterLab that has jupytext: write
# the other from the one edited last (the tests fail while the two differ)
pair: $(STAMP)
	$(BIN)/jupytext --sync notebooks/[0-9][0-9]_*.ipynb

# regenerate the synthetic launch records in data/records (deterministic)
records: $(STAMP)
	$(BIN)/python -m dflash_lab make-records data/records

clean:
	rm -rf reports .pytest_cache
