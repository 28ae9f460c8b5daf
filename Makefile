# `make demo` and `make test` are the README's two commands; both set everything up first.
.PHONY: setup demo test lint

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	@.venv/bin/python -m pytest -q -p no:cacheprovider

lint: setup
	@.venv/bin/ruff check aphrodite_cli engine tests
