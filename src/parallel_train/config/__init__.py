"""The run's config: `sections.py` (every key, typed, with a default, a range and a help line) and `load.py` (defaults
<- YAML files <- `key=value` overrides, validated; `--help`). How a key is declared and the keys every model has live
on the ground floor (core/fields.py, core/model_config.py): models build their keys from them.

May import: core, errors, models (the registry, to parse `model.*` keys), data, tasks.
"""
