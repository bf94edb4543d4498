"""A model's parts by name: the units a pipeline cuts between and the blocks FSDP2 wraps one by one.

Both read the same contract (models/__init__.py): a child that is a ModuleDict / ModuleList / Sequential is a row
of blocks (`blocks.0`, `blocks.1`, ...), every other child one unit; a model whose parts sit deeper (a Hugging Face
model) lists them itself (`pipeline_units()`, `decoder_layers()`), and `_no_split_modules` names the block class.
"""

from __future__ import annotations

from torch import nn

from parallel_train.errors import UserError

CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def model_units(model: nn.Module) -> dict[str, nn.Module]:
    """The splittable units of `model`, in forward order: name -> module."""
    if hasattr(model, "pipeline_units"):
        return dict(model.pipeline_units())
    if any(True for _ in model.parameters(recurse=False)):
        raise UserError(
            f"{type(model).__name__} has parameters of its own, outside its named parts; "
            "move them into a submodule so the pipeline splitter can place them"
        )
    units: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            units.update({f"{name}.{sub}": block for sub, block in child.named_children()})
        elif child is not None:
            units[name] = child
    return units


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` wraps one by one, before the root. The model names them, as for accelerate:
    `decoder_layers()` (model.name=hf: its decoder layers, wherever they sit), else every instance of the classes
    in `_no_split_modules` (GPT: "Block"); a model naming neither gets one unit per block of each of its rows of
    blocks (ModuleDict / ModuleList / Sequential children). A pipeline stage's view lists only the units it holds."""
    if hasattr(model, "decoder_layers"):
        return list(model.decoder_layers())
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if classes:
        return [m for m in model.modules() if m is not model and type(m).__name__ in classes]
    return [block for child in model.children() if isinstance(child, CONTAINERS) for block in child.children()]


def counted_units(model: nn.Module) -> dict[str, nn.Module]:
    """The parts the memory estimator counts a model's activations and gradients by, in forward order: the pipeline's
    units (`model_units`), or, for a model no pipeline splits (a transformers head of another task: its
    `splits_into_stages` is False), the model itself for what runs outside its blocks, then its FSDP units by name."""
    if getattr(model, "splits_into_stages", True):
        return model_units(model)
    names = {id(m): name for name, m in model.named_modules()}
    return {"model": model, **{names[id(m)]: m for m in fsdp_units(model)}}
