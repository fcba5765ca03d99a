# The two commands a newcomer needs:  `make demo`  and  `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install demo test test-fast test-kmod bench clean

install:
	scripts/install-deps.sh
	$(PIP) --no-build-isolation -e '.[test,bench,rl,criu]' 2>&1 | grep -v "^WARNING: Running pip as" || true
	$(PY) -c "import bunshin._core; bunshin._core.init_path()"

demo: install
	$(PY) -m bunshin demo

test: install
	kmod/tests/run.sh
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

test-kmod:
	kmod/tests/run.sh

bench: install
	for b in bench/*.py; do case $$b in */_*) continue;; esac; $(PY) $$b --quick | tail -1; done

clean:
	rm -rf build bench/out .pytest_cache
