"""The run's config: `sections.py` (every key, typed, with a default, a range and a help line), `load.py` (defaults
<- YAML files <- `key=value` overrides, validated; `--help`), `fields.py` (how a key is declared and checked) and
`model.py` (`ModelConfig`, the keys every model has; each model adds its own beside it).

May import: errors, models (the registry, to parse `model.*` keys). fields.py and model.py import nothing of the
template but errors: models build their keys from them.
"""
