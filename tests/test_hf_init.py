"""model.name=hf with model.hf_pretrained=false starts as `AutoModelForCausalLM.from_config` starts: the meta-device
start (parallel/model_init.py, one module at a time, keyed by name) draws every parameter by the same rule as
transformers' own initialisation, including the rules a parent applies to its children (models/hf_init.py: GPT-2's
c_proj at 0.02 / sqrt(2 x n_layer)). Compared per parameter, in distribution: mean, std, and exact zeros and ones."""

from __future__ import annotations

import pytest
import torch

import hf_tiny
from parallel_train.models.hf import HFCausalLM, HFConfig
from parallel_train.parallel.model_init import start_model

transformers = pytest.importorskip("transformers")

# Wide enough for a tight std estimate (the smallest matrix has 128 x 128 values: the std within about 2%), 4 layers
# so that GPT-2's scaled c_proj (0.02 / sqrt(8) = 0.0071) is far from the plain 0.02.
WIDE = {
    "gpt2": lambda: hf_tiny.gpt2_config(n_embd=128, n_layer=4, n_head=4),
    "llama": lambda: hf_tiny.llama_config(hidden_size=128, intermediate_size=256, num_hidden_layers=4),
}


def stats(t: torch.Tensor) -> tuple[float, float]:
    t = t.detach().float()
    return t.mean().item(), t.std().item()


@pytest.mark.parametrize("family", sorted(WIDE))
def test_random_start_matches_from_config_parameter_by_parameter(family, tmp_path):
    config = WIDE[family]()
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    reference = dict(transformers.AutoModelForCausalLM.from_config(config).named_parameters())
    model, init = start_model(HFCausalLM, HFConfig(name="hf", hf_path=str(tmp_path), hf_pretrained=False), hf_tiny.VOCAB, seed=3)
    init.fill(model, torch.device("cpu"))
    ours = dict(model.named_parameters())
    assert ours.keys() == reference.keys()
    for name, ref in reference.items():
        mine = ours[name]
        if ref.std() == 0:  # a constant: zeros (biases) or ones (norms)
            assert torch.equal(mine, ref), name
            continue
        (m_ref, s_ref), (m, s) = stats(ref), stats(mine)
        assert abs(s - s_ref) < 0.06 * s_ref, f"{name}: std {s:.5f}, from_config {s_ref:.5f}"
        assert abs(m - m_ref) < 4 * s_ref / ref.numel() ** 0.5 + 1e-6, f"{name}: mean {m:.5f}, from_config {m_ref:.5f}"
    if family == "gpt2":  # the rule a parent applies: the residual projections drawn smaller than the other matrices
        expected = config.initializer_range / (2 * config.n_layer) ** 0.5
        assert abs(stats(ours["transformer.h.0.attn.c_proj.weight"])[1] - expected) < 0.06 * expected
        assert abs(stats(ours["transformer.h.3.mlp.c_proj.weight"])[1] - expected) < 0.06 * expected
