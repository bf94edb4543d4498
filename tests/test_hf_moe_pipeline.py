"""A Hub mixture of experts in pipeline stages (models/hf_layouts.py's MoE layouts, parallel/pipeline/balance.py over a
transformers model's routers): a tiny Qwen3-MoE in 2 stages on 2 processes equals one process that runs the same
micro-batches as gradient accumulation, with the router's balancing loss on (loss, aux loss, expert load, final
weights). With -m slow: the same for Mixtral and for 2 stages x FSDP2 over 2 ranks (4 processes), and the 2 stages'
step-3 checkpoint resumed on one process. In process: the in-process pipeline refuses a Hub MoE in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import check, launch_env, read_metrics, run, warm_cmd
from test_moe import HUB, RUN, assert_same, save_tiny_qwen3_moe

transformers = pytest.importorskip("transformers")

# The pipeline's micro-batches (gpipe, 1 per accumulation step: 2 of 4 per optimizer step) are the reference's
# accumulation micro-steps (train.batch_size=4, train.gradient_accumulation_steps=2 in test_moe.RUN).
STAGES = ("parallel.pipeline_stages=2", "parallel.schedule=gpipe", "parallel.microbatches=1")
LAUNCHES = {
    "ref": (1, "qwen3_moe", ()),
    "pp2": (2, "qwen3_moe", STAGES),
    "pp2_to_1": (1, "qwen3_moe", ("resume={pp2}/checkpoints/step_0000003",)),
    # FSDP2 over the 2 ranks of each stage: 2 samples per rank, the same micro-batches of 4
    "pp2_fsdp2": (4, "qwen3_moe", (*STAGES, "parallel.dp_shard=2", "train.batch_size=2")),
    "mixtral_ref": (1, "mixtral", ()),
    "mixtral_pp2": (2, "mixtral", STAGES),
}


def save_mixtral(folder) -> str:
    hf_tiny.mixtral_config(num_attention_heads=2, num_key_value_heads=1, router_aux_loss_coef=0.1).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> its output folder, each launch run once per module (the model from its config, one folder per family
    that every launch of it reads: a resumed run's model.hf_path is its checkpoint's)."""
    outs: dict[str, object] = {}
    root = tmp_path_factory.mktemp("hub")
    hubs = {"qwen3_moe": save_tiny_qwen3_moe(root / "qwen3_moe"), "mixtral": save_mixtral(root / "mixtral")}

    def get(name: str):
        if name not in outs:
            n, family, extra = LAUNCHES[name]
            folders = {k: get(k) for k in LAUNCHES if any("{" + k + "}" in e for e in extra)}
            out = tmp_path_factory.mktemp(name)
            hub = hubs[family]
            keys = [k.format(hub=hub) for k in (*RUN, *HUB)] + [e.format(**folders) for e in extra]
            check(run(warm_cmd(n, *keys, f"output_dir={out / 'out'}"), env=launch_env(out)))
            outs[name] = out / "out"
        return outs[name]

    return get


def train_records(folder) -> list[dict]:
    return [r for r in read_metrics(folder) if r["kind"] == "train"]


def assert_same_weights(got, ref) -> None:
    """The final weights, within 1e-5."""
    want, have = load_file(ref / "model.safetensors"), load_file(got / "model.safetensors")
    assert sorted(have) == sorted(want)
    for key in want:
        torch.testing.assert_close(have[key], want[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("pp2", "ref"),
        pytest.param("mixtral_pp2", "mixtral_ref", marks=pytest.mark.slow),
        pytest.param("pp2_fsdp2", "ref", marks=pytest.mark.slow),
    ],
)
def test_a_hub_moe_in_two_stages_equals_one_process_accumulating_its_micro_batches(launched, name, ref):
    """Each stage's routers (one decoder layer each) count their tokens and tie their balancing term to the stage's
    output: the first stage's router trains as in one process, and the loss averages over both stages' layers."""
    records = train_records(launched(ref))
    assert all(len(r["expert_load"]) == 2 and r["aux_loss"] > 0.9 for r in records) and records[-1]["loss"] != records[0]["loss"]
    assert_same(train_records(launched(name)), records)
    assert_same_weights(launched(name), launched(ref))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_saved_in_two_stages_resumes_on_one_process(launched):
    ref = train_records(launched("ref"))  # the resumed run's log holds steps 4-6
    assert_same([r for r in ref if r["step"] <= 3] + train_records(launched("pp2_to_1")), ref)
    assert_same_weights(launched("pp2_to_1"), launched("ref"))


@pytest.mark.multiprocess
def test_the_in_process_pipeline_refuses_a_hub_moe(tmp_path):
    """Its stages would keep only the last micro-batch's routing statistics: refused in one line, before any weight."""
    keys = [k.format(hub=save_tiny_qwen3_moe(tmp_path / "qwen3_moe")) for k in (*RUN, *HUB)]
    result = run(
        warm_cmd(1, *keys, *STAGES, "parallel.stage_devices=[cpu,cpu]", f"output_dir={tmp_path / 'out'}"), env=launch_env(tmp_path)
    )
    assert result.returncode == 2 and "the in-process pipeline does not carry the router's balancing loss" in result.output
    assert "Traceback" not in result.output
