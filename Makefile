# The two commands of the README. Each sets up .venv (idempotent) and then runs.
.PHONY: train test setup

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/tiertrain train --overwrite

test:
	bash scripts/setup.sh test,plot
	.venv/bin/python -m pytest -q
