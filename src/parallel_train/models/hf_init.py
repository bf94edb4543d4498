"""transformers' own random initialisation of one module, as `AutoModelForCausalLM.from_config` gives it.

`from_config` initialises a model by walking its tree children first, calling the model's `_init_weights` on every
module (`PreTrainedModel.initialize_weights`). Most rules set a module's own tensors (a Linear: normal(0, 0.02),
zeros for its bias; a norm: ones), but a parent's rule may reach into its children: GPT-2's attention and MLP draw
their `c_proj.weight` again with std 0.02 / sqrt(2 x n_layer), after the Conv1D's own rule drew it with 0.02.

The meta-device start (parallel/model_init.py) initialises one module at a time, keyed by its name, so that every
layout starts alike. `InitTree.apply(name, module)` gives that module what the whole walk would: the rule of the
module itself, then the rule of each of its parents, nearest first, each run on a copy of the parent whose children
are meta copies (a rule's writes there cost nothing) except the one on the path, which leads to `module`. Each
rule is the `_init_weights` of the nearest PreTrainedModel at or above the module it is run on (as
`initialize_weights` dispatches it in composite models). Nothing here names a model: any transformers model whose
rules reach only into its descendants starts as `from_config` starts it.
"""

from __future__ import annotations

import copy

from torch import nn

from parallel_train.models.meta_copy import meta_copy


class InitTree:
    """A meta copy of a transformers model's tree, taken before the model is split or sharded."""

    def __init__(self, model: nn.Module):
        self.root = meta_copy(model, children=True)

    def _parents(self, parts: list[str]) -> list[nn.Module]:
        """The meta copies from the root down to the parent of the module named by `parts` ([] if the tree lacks it:
        a module added since, which then gets its own rule only)."""
        nodes = [self.root]
        for part in parts:
            child = nodes[-1]._modules.get(part)
            if child is None:
                return []
            nodes.append(child)
        return nodes[:-1]

    def apply(self, name: str, module: nn.Module) -> None:
        """Initialise `module` (module `name`, whole, on the CPU) as the walk from the root would."""
        from transformers import PreTrainedModel

        parts = name.split(".") if name else []
        # Copies of the parents, nearest first, each holding the one below it (at the bottom: `module`) as its child.
        chain, child = [], module
        for node, part in zip(reversed(self._parents(parts)), reversed(parts), strict=False):
            parent = copy.copy(node)
            parent.__dict__ = dict(node.__dict__)
            parent._modules = {**node._modules, part: child}
            chain.append(parent)
            child = parent
        targets = [module, *chain]  # from_config's order: a module before its parents
        owners, owner = [], self.root
        for target in reversed(targets):  # root first: the nearest PreTrainedModel at or above each
            owner = target if isinstance(target, PreTrainedModel) else owner
            owners.append(owner)
        for target, rule_of in zip(targets, reversed(owners), strict=True):
            rule_of._init_weights(target)
