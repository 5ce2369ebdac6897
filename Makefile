# The two commands of the README, plus their parts.
.PHONY: run test setup check

# Set up everything (idempotent), then serve on http://127.0.0.1:8000 until Ctrl-C.
run: setup
	@.venv/bin/python manage.py migrate --noinput
	@.venv/bin/python manage.py ensure_demo_user
	@scripts/run

# Set up everything (idempotent), then lint and run the whole test suite.
test: setup check
	.venv/bin/python -m pytest $(PYTEST_ARGS)

setup:
	@scripts/setup

check:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	PYTHONPATH=platform:. .venv/bin/lint-imports
