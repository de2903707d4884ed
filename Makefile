# The two commands of the README: `make demo` and `make test`.
.PHONY: demo test lint typecheck pytest lock bench clean

demo:  ## install (runtime lock) and run the example on the embedded default
	@scripts/bootstrap.sh runtime
	@rm -f jobplane-demo.db*
	JOBPLANE_DATABASE_URL=sqlite:///jobplane-demo.db .venv/bin/jobplane dev \
	  --app examples.hello:app \
	  --trigger 'greet={"name": "Ada", "excited": true}' \
	  --trigger crunch \
	  --exit-when-done

test:  ## install (dev lock), check the servers, the browser and kubectl; lint, type-check, run every test
	@scripts/bootstrap.sh dev
	@scripts/services.sh
	@scripts/browser.sh
	@scripts/k8s-tools.sh
	$(MAKE) --no-print-directory lint typecheck pytest

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck:
	.venv/bin/mypy

# In parallel by default: three pytest-xdist workers on the two cores (much of a test's time is
# spent waiting on processes and leases; four made the timing-sensitive fault tests flaky on two
# cores); `--dist loadgroup` keeps each xdist_group on one worker.
# Serially: `make pytest PYTEST_ARGS=` (or `.venv/bin/pytest` directly). The 30 slowest tests are
# listed at the end, to keep an eye on the suite's time.
PYTEST_ARGS ?= -n 3 --dist loadgroup --durations=30

pytest:
	.venv/bin/pytest $(PYTEST_ARGS)

lock:  ## refresh the lock files after changing dependencies (needs uv)
	uv pip compile pyproject.toml requirements/build.in --python-version 3.11 \
	  --generate-hashes -o requirements/runtime.lock
	uv pip compile pyproject.toml requirements/build.in --extra dev --python-version 3.11 \
	  --generate-hashes -o requirements/dev.lock

clean:
	rm -rf .venv .mypy_cache .ruff_cache .pytest_cache jobplane-demo.db*
