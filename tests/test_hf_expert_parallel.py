"""Expert parallelism for a Hugging Face MoE (parallel/hf_expert_parallel.py): a tiny Qwen3-MoE (tests/hf_tiny.py, saved
by save_pretrained) from its weights, with the balancing loss on. ep=2 against one process in the default suite; under
-m slow, Mixtral and DeepSeek-V3, LoRA on attention, ep=2 x dp_shard=2 (4 processes), DDP and FSDP2, what rank 0's checkpoint part holds, resuming an ep=2
checkpoint on one process and the other way round, and a rank whose experts get no tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hf_tiny
from helpers import check, launch_env, run, warm_cmd
from test_expert_parallel import train_records
from test_moe import RUN, assert_same

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]

HUB = ("model.name=hf", "model.hf_path={folder}", "data.tokenizer=byte", "model.block_size=16", "model.moe_aux_loss_coef=0.1")
LAUNCHES = {
    "ref": (1, ()),
    "ep2": (2, ("train.batch_size=2", "parallel.ep=2")),
    "ddp": (2, ("train.batch_size=2",)),
    "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2")),
    "ep2_edp2": (4, ("train.batch_size=1", "parallel.ep=2", "parallel.dp_shard=4")),
    "ep2_to_1": (1, ("resume={ep2}/checkpoints/step_0000003",)),
    "1_to_ep2": (2, ("train.batch_size=2", "parallel.ep=2", "resume={ref}/checkpoints/step_0000003")),
    # from the config alone: each rank initialises its own experts' slices (keyed by name, as FSDP2's)
    "lora": (1, ("model.lora_rank=4", "model.lora_targets=[q_proj,v_proj]")),
    "lora_ep2": (2, ("model.lora_rank=4", "model.lora_targets=[q_proj,v_proj]", "train.batch_size=2", "parallel.ep=2")),
    "scratch": (1, ("model.hf_pretrained=false",)),
    "scratch_ep2": (2, ("model.hf_pretrained=false", "train.batch_size=2", "parallel.ep=2")),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(family, name) -> its output folder, each launch run once per module."""
    outs: dict[tuple[str, str], object] = {}
    folders: dict[str, object] = {}

    def get(family: str, name: str):
        if (family, name) not in outs:
            if family not in folders:
                folders[family] = hf_tiny.save_model(hf_tiny.MOE_CONFIGS[family](), tmp_path_factory.mktemp(family))
            n, extra = LAUNCHES[name]
            runs = {k: get(family, k) for k in ("ep2", "ref") if any("{" + k + "}" in e for e in extra)}
            out = tmp_path_factory.mktemp(f"{family}_{name}")
            keys = [k.format(folder=folders[family], **runs) for k in (*RUN, *HUB, *extra)]
            check(run(warm_cmd(n, *keys, f"output_dir={out / 'out'}"), env=launch_env(out)))
            outs[family, name] = out / "out"
        return outs[family, name]

    return get


def assert_same_run(got, want) -> None:
    """Losses, aux losses and expert loads step by step, and the final weights, within 1e-5."""
    assert_same(train_records(got), train_records(want))
    a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "family, name",
    [("qwen3_moe", "ep2")]  # the layout's one default test
    + [pytest.param(f, n, marks=pytest.mark.slow) for f in ("qwen3_moe", "mixtral") for n in ("ddp", "fsdp2", "ep2_edp2")]
    + [pytest.param(f, "ep2", marks=pytest.mark.slow) for f in ("mixtral", "deepseek_v3")],
)
def test_a_hub_moe_under_ep_equals_one_process_with_the_balancing_loss_on(launched, family, name):
    ref = launched(family, "ref")
    records = train_records(ref)
    assert records[-1]["loss"] != records[0]["loss"] and all(0.9 < r["aux_loss"] < 4 for r in records)
    assert_same_run(launched(family, name), ref)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_ep2_rank_0_holds_half_the_experts(launched):
    """Rank r's checkpoint part holds experts 2r and 2r+1 of every layer's fused expert weights (4 experts)."""
    shards = launched("qwen3_moe", "ep2") / "checkpoints" / "step_0000003" / "shards"
    for rank in (0, 1):
        with safe_open(shards / f"rank0000{rank}-000.safetensors", "pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for layer in (0, 1):
                for weight in ("gate_up_proj", "down_proj"):
                    name = f"model/model.layers.{layer}.mlp.experts.{weight}"
                    assert f.get_slice(name).get_shape()[0] == 2 and offsets[name]["saved_offsets"][0] == 2 * rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_ep2_checkpoint_resumes_on_one_process_and_the_other_way_round(launched):
    ref = train_records(launched("qwen3_moe", "ref"))
    for name in ("ep2_to_1", "1_to_ep2"):  # a resume's log holds steps 4-6
        assert_same([r for r in ref if r["step"] <= 3] + train_records(launched("qwen3_moe", name)), ref)


def test_ep_refuses_experts_it_cannot_split(tmp_path):
    """In process: ep not dividing a Hub model's experts (or a model without any, or GPT-OSS's, whose experts carry
    2-d biases), in one line each."""
    from types import SimpleNamespace

    from parallel_train.errors import UserError
    from parallel_train.models.hf import HFConfig, HFModel
    from parallel_train.parallel.hf_expert_parallel import hub_experts, shard_hub_experts

    folder = hf_tiny.save_model(hf_tiny.MOE_CONFIGS["qwen3_moe"](), tmp_path / "moe")
    model = HFModel(HFConfig(name="hf", hf_path=str(folder), block_size=16, hf_pretrained=False), hf_tiny.VOCAB)
    assert [tuple(p.shape[:1]) for m in hub_experts(model.hf) for p in m.parameters()] == [(4,)] * 4
    with pytest.raises(UserError, match="parallel.ep=3: the Hugging Face model has 4 routed experts per layer"):
        shard_hub_experts(model, None, 3)
    with pytest.raises(UserError, match="has no routed experts"):
        shard_hub_experts(SimpleNamespace(hf=torch.nn.Linear(2, 2)), None, 2)
    oss = transformers.GptOssConfig(**hf_tiny.MOE_SIZES, num_key_value_heads=2, num_local_experts=4, head_dim=8)
    oss_folder = hf_tiny.save_model(oss, tmp_path / "oss")
    oss_cfg = HFConfig(name="hf", hf_path=str(oss_folder), block_size=16, hf_pretrained=False, attn_implementation="eager")
    oss_model = HFModel(oss_cfg, hf_tiny.VOCAB)
    with pytest.raises(UserError, match="experts are not the stacked 3-d weights expert parallelism cuts here"):
        shard_hub_experts(oss_model, None, 2)


@pytest.mark.parametrize("sizes", [{"parallel__tp": 2}, {"parallel__dp_replicate": 2}, {"parallel__pipeline_stages": 2}])
def test_a_hub_moe_ep_beside_tp_hsdp_or_stages_is_one_line(sizes):
    """The GPT's EP composes with tp, HSDP and pipeline stages; a Hub MoE's runs over the dp_shard ranks alone: the mesh
    refuses the rest in one line, from the config, before any collective."""
    from parallel_train.config.sections import Config
    from parallel_train.errors import UserError
    from parallel_train.parallel.mesh import resolve_layout

    cfg = Config()
    cfg.model.name, cfg.parallel.ep = "hf", 2
    for key, value in sizes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(
        UserError, match=r"parallel.ep=2 with a Hugging Face MoE and .*: its experts are split over the dp_shard ranks alone"
    ):
        resolve_layout(cfg, 4, env={})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hub_moe_from_its_config_under_ep2_equals_one_process(launched):
    assert_same_run(launched("qwen3_moe", "scratch_ep2"), launched("qwen3_moe", "scratch"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lora_on_attention_with_the_experts_frozen_and_split_under_ep2_equals_one_process(launched):
    """The adapters train alike; the exported hf/ (adapters merged) equals one process's."""
    got, want = launched("qwen3_moe", "lora_ep2"), launched("qwen3_moe", "lora")
    assert_same_run(got, want)
    a, b = load_file(got / "hf" / "model.safetensors"), load_file(want / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)


EMPTY_RANK = """
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from parallel_train.parallel.hf_expert_parallel import shard_hub_experts

dist.init_process_group("gloo")
torch.manual_seed(0)
holder = nn.Module()
holder.experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4))
nn.init.normal_(holder.experts.gate_up_proj), nn.init.normal_(holder.experts.down_proj)
held = shard_hub_experts(SimpleNamespace(hf=holder), init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), 2)
x = torch.randn(3, 8, requires_grad=True)
index = torch.tensor([[0, 1]] * 3)  # every token to experts 0 and 1: rank 1 (experts 2, 3) gets no rows
out = holder.experts(x, index, torch.full((3, 2), 0.5))
out.sum().backward()
assert x.grad.abs().sum() > 0 and all(p.grad is not None for p in held)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_whose_experts_get_no_tokens_runs_the_backward_with_its_peers(tmp_path):
    """Every token to experts 0 and 1 (rank 0's): rank 1 gets no rows, yet runs the all-to-all's backward and gets its
    experts' (zero) gradients, as rank 0 does: no rank left waiting in a collective."""
    import os
    import subprocess
    import sys

    script = tmp_path / "empty_rank.py"
    script.write_text(EMPTY_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
