# The two commands a newcomer needs:  `make demo`  and  `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install demo test test-fast test-kmod lint bench clean

install:
	scripts/install-deps.sh
	$(PIP) --no-build-isolation -e '.[test,bench,rl,criu,cluster]' 2>&1 | grep -v "^WARNING: Running pip as" || true
	$(PY) -c "import bunshin._core; bunshin._core.init_path()"
	@# a private stock CRIU, then Bunshin's (criu/patches) built from Debian's source
	$(PY) -m bunshin criu provision --if-needed
	@# pip's output is filtered above, so a failed extra shows here, not as skipped cluster tests
	$(PY) -c "import ray.cluster_utils"

demo: install
	$(PY) -m bunshin demo

test: install
	kmod/tests/run.sh
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

test-kmod:
	kmod/tests/run.sh

# ruff and mypy come with the test extra (make install); their settings are in pyproject.toml.
# Both run before either fails, so that one pass shows every finding.
lint:
	$(PY) -m ruff check bunshin; ruff=$$?; $(PY) -m mypy bunshin && exit $$ruff

bench: install
	for b in bench/*.py; do case $$b in */_*) continue;; esac; $(PY) $$b --quick | tail -1; done

clean:
	rm -rf build bench/out .pytest_cache .ruff_cache .mypy_cache
