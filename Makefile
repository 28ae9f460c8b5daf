# `make demo` and `make test` are the README's two commands; both set everything up first.
.PHONY: setup demo test lint fuzz

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	@.venv/bin/python -m pytest -q -p no:cacheprovider

lint: setup
	@.venv/bin/ruff check aphrodite_cli engine tests
	@.venv/bin/lint-imports --no-cache --no-logo

# Property tests with fresh random seeds for FUZZ_SECONDS (default 300); `make test` never
# draws new examples, so it is green or red for the code, not for the seed.
fuzz: setup
	@bash scripts/fuzz.sh
