"""The one way the template writes JSON files: metrics.jsonl, summary.json, trainer_state.json, optimizer.json,
manifest.json, prepared.json, the export's index, the benchmarks' records.

JSON has no NaN or Infinity (RFC 8259). Python's `json.dumps` writes them anyway, as bare `NaN` and `Infinity`
tokens that strict readers refuse (JavaScript's JSON.parse, jq, Go, Rust's serde, most dashboards), so a file holding
one is not JSON. A number that is not finite here always means "not measured": a validation loss over batches with
no token to learn (eval_metrics.py), a train loss of a step with nothing to learn (step.py), a speed before any
was taken. `json_text` writes such a number as `null`, which every reader takes, and each writer says why the
field can be null where it documents the field (docs/reliability.md, "Nothing to learn"). `allow_nan=False` is the
last guard: a non-finite number that reaches json.dumps some other way (a type this module does not walk) raises
instead of being written.

On the ground floor (tests/test_structure.py): data/, checkpoint/, observe/, the trainer and the scripts all use it.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (nan, inf, -inf) inside dicts, lists and tuples replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def json_text(value: Any, **kwargs: Any) -> str:
    """json.dumps(value, **kwargs) with non-finite floats written as null; never writes NaN or Infinity."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
