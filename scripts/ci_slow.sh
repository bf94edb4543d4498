#!/usr/bin/env bash
# The slow tests (pytest -m slow): the code paths that only they reach, listed in docs/contributing.md ("Tests"),
# and second launches of paths the default suite covers. Run it before a release, and after touching one of those
# paths. Second launches include tests/test_dict_batches.py's one layout per launch (the default suite composes them:
# FSDP2 x TP, DDP x the one-process pipeline) and its Hub decoder on padded dicts under DDP, FSDP2, TP and FSDP2 x TP,
# tests/test_recipes.py's seq2seq on 1 and 2 processes (its masked-LM twin runs that path by default), tests/test_hf_tasks.py's
# sequence classifier on 1 process, DDP and FSDP2 and its export (test_recipes.py's
# nlp_example runs that path by default), tests/test_host_sync.py's plain DDP (its padded and MoE launches run DDP by default).
# Paths only they reach include a Hub Llama in pipeline stages x tensor parallel (4 processes; tests/test_hf_models.py),
# and real `accelerate launch`es of an FSDP config and of one process trained to its end (tests/test_mesh.py, test_topologies.py).
# It takes the README's test set-up (.venv with requirements-dev.txt); extra arguments go to pytest.
#
#   bash scripts/ci_slow.sh                 every slow test
#   bash scripts/ci_slow.sh -k mesh -x      some of them
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" -m pytest -m slow "$@"
