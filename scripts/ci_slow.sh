#!/usr/bin/env bash
# The slow tests (pytest -m slow): the code paths that only they reach, listed in docs/contributing.md ("Tests"),
# and second launches of paths the default suite covers. Run it before a release, and after touching one of those
# paths. It takes the README's test set-up (.venv with requirements-dev.txt); extra arguments go to pytest.
#
#   bash scripts/ci_slow.sh                 every slow test
#   bash scripts/ci_slow.sh -k mesh -x      some of them
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" -m pytest -m slow "$@"
