# `make demo` and `make test` are the README's two commands; both set everything up first.
.PHONY: setup setup-vllm demo test test-fast lint fuzz

# APHRODITE_VLLM=1 make setup also builds vLLM's environment (.venv-vllm, for --engine vllm)
setup:
	@bash scripts/bootstrap.sh
	@if [ "$${APHRODITE_VLLM:-0}" != 0 ]; then bash scripts/vllm_env.sh; fi

# vLLM's own environment for `serve --engine vllm` (~3.5 GB once, outside the repository;
# a second run takes milliseconds): scripts/vllm_env.sh
setup-vllm:
	@bash scripts/vllm_env.sh

demo: setup
	@bash scripts/demo.sh

# The --engine vllm tests need .venv-vllm: a failed build is reported by those tests (and
# fails them under CI=true), so the rest of the suite still runs.
test: setup
	@bash scripts/vllm_env.sh || echo "make test: .venv-vllm could not be built (see .venv-vllm.error)"
	@bash scripts/test_suite.sh

# The unit tier alone (tests/unit: no model, no server, no media): about 10 seconds
test-fast: setup
	@.venv/bin/python -m pytest -q -p no:cacheprovider tests/unit

lint: setup
	@.venv/bin/ruff check aphrodite_cli engine tests
	@.venv/bin/lint-imports --no-cache --no-logo

# Property tests with fresh random seeds for FUZZ_SECONDS (default 300); `make test` never
# draws new examples, so it is green or red for the code, not for the seed.
fuzz: setup
	@bash scripts/fuzz.sh
