"""The memory estimator (scripts/estimate_memory.py) against published per-GPU memory, and the parts of it that
make the difference: selective activation checkpointing, FSDP2's bf16 policy, pipeline schedules.

The published figures: torchtitan's Llama 3.1 runs on H100s (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md,
torchtitan 9dec370, December 2024; bf16 FSDP2 policy, AdamW, max reserved memory per GPU). The Llama 3.1 shapes are
written here as config.json folders (no Hub, no weights: the estimator builds the model on the meta device).
docs/BENCHMARKS.md has the table, the commands and why the figures differ.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

from parallel_train.config.load import load_config
from parallel_train.data.sources import load_data
from parallel_train.parallel.memory_estimate import _precision, estimate
from parallel_train.parallel.mesh import resolve_layout
from parallel_train.parallel.pipeline.in_flight import in_flight_bytes

GIB = 2**30
# Llama 3.1's config.json values (meta-llama/Llama-3.1-{8B,70B,405B}): hidden, intermediate, layers, heads (kv heads: 8).
LLAMA = {"8b": (4096, 14336, 32, 32), "70b": (8192, 28672, 80, 64), "405b": (16384, 53248, 126, 128), "tiny": (512, 1024, 2, 8)}
COMMON = ["model.name=hf", "model.hf_pretrained=false", "model.vocab_size=128256", "data.path=synthetic", "train.mixed_precision=bf16"]
# row: (model, processes, torchtitan's GiB, keys). Local batch and sequence as torchtitan's table gives them.
ROWS = {
    "T1": (
        "8b",
        8,
        82.4,
        ["model.block_size=8192", "train.batch_size=2", "parallel.dp_shard=8", "model.activation_checkpointing=selective"],
    ),
    "T2": ("8b", 8, 83.9, ["model.block_size=32768", "train.batch_size=1", "parallel.dp_shard=8", "model.activation_checkpointing=full"]),
    "T4": (
        "70b",
        256,
        71.9,
        ["model.block_size=8192", "train.batch_size=16", "parallel.dp_shard=32", "parallel.tp=8", "model.activation_checkpointing=full"],
    ),
}
# T5 as torchtitan ran it: its table gives no pipeline_parallel_microbatches, so build_pipeline_schedule used
# n_microbatches = pipeline_parallel_degree = 8 (torchtitan 9dec370, torchtitan/parallelisms/pipelining_utils.py lines
# 79-81): local batch 32 in 8 micro-batches of 4, for both schedules. Its default split (generate_split_points, lines
# 18-57: 15, 16 x 6, 15 layers; interleaved 2 stages per rank: 7, 8 x 14, 7) is the one parallel.split=auto gives here.
PIPELINE = ["model.block_size=8192", "train.batch_size=32", "parallel.dp_shard=8", "parallel.tp=8", "parallel.pipeline_stages=8"]
PIPELINE += ["parallel.microbatches=8", "model.activation_checkpointing=full"]
ROWS["T5-1f1b"] = ("405b", 512, 82.5, [*PIPELINE, "parallel.schedule=1f1b"])
ROWS["T5-interleaved"] = ("405b", 512, 72.7, [*PIPELINE, "parallel.schedule=interleaved1f1b"])
# Table 6's first row (FSDP 8, CP 1): T5's layout and 1F1B schedule with 8 micro-batches of one 32,768-token sample, so
# every tensor a rank holds has T5 1F1B's size; torchtitan measured it 7.2 GiB below T5 1F1B.
ROWS["T6"] = ("405b", 512, 75.3, ["model.block_size=32768", "train.batch_size=8", *PIPELINE[2:], "parallel.schedule=1f1b"])


# Table 2's rows with context parallelism (FSDP2 over dp_shard x cp, local batch 1, full AC, compile + Float8 there):
# each rank holds 32,768 tokens of the sequence, as T2 does without CP. torchtitan's CP is ring attention on GPUs; the
# estimate's is the template's Ulysses all-to-all (parallel/context_parallel.py), whose q, k, v and output have the bytes
# of this rank's part for every head. The 262,144-token row's folder says 262,144 positions (Llama 3.1's config says
# 131,072; torchtitan's rope has no such limit).
for cp, tokens, gib in ((2, 65536, 84.2), (4, 131072, 84.0), (8, 262144, 84.5)):
    ROWS[f"T2-cp{cp}"] = (
        "8b",
        8,
        gib,
        [f"model.block_size={tokens}", "train.batch_size=1", f"parallel.dp_shard={8 // cp}", f"parallel.cp={cp}"],
    )
    ROWS[f"T2-cp{cp}"][3].append("model.activation_checkpointing=full")


def llama_folder(root, name: str, positions: int = 131072):
    hidden, intermediate, layers, heads = LLAMA[name]
    folder = root / f"llama-3.1-{name}-{positions}"
    folder.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@functools.cache
def estimated_gib(row: str) -> float:
    """The largest rank's estimate for a published row (once per session: the 405B rows take 20-25 s each)."""
    name, world, _, keys = ROWS[row]
    cfg, _ = load_config(keys)
    folder = llama_folder(Path(tempfile.mkdtemp()), name, max(131072, cfg.model.block_size))
    cfg, _ = load_config([*COMMON, f"model.hf_path={folder}", *keys])
    data = load_data(cfg)
    _, ranks = estimate(cfg, world, data.vocab_size, data.train_set[0])
    return max(r.total() for r in ranks) / GIB  # torchtitan reports the largest over all GPUs


# T4 and T5 1F1B miss (0.83 and 0.81 of torchtitan's reserved figures; docs/BENCHMARKS.md says why): strict, so that a
# change which brings them inside shows here.
MISSES = pytest.mark.xfail(
    strict=True, reason="live tensors below torchtitan's reserved memory: docs/BENCHMARKS.md, Why the figures differ"
)


@pytest.mark.parametrize(
    "row",
    [
        "T1",  # by default one published row, the rest slow: 3-25 s each here
        pytest.param("T2", marks=pytest.mark.slow),
        pytest.param("T4", marks=[pytest.mark.slow, MISSES]),
        pytest.param("T5-1f1b", marks=[pytest.mark.slow, MISSES]),
        pytest.param("T5-interleaved", marks=pytest.mark.slow),
        pytest.param("T6", marks=pytest.mark.slow),
        "T2-cp2",
        pytest.param("T2-cp4", marks=pytest.mark.slow),
        pytest.param("T2-cp8", marks=pytest.mark.slow),
    ],
)
def test_estimate_is_within_15_percent_of_torchtitan(row):
    got, published = estimated_gib(row), ROWS[row][2]
    assert abs(got / published - 1) <= 0.15, f"{row}: estimated {got:.1f} GiB, torchtitan {published} GiB"


@pytest.mark.slow
def test_interleaved_and_1f1b_differ_as_torch_orders_them():
    """The two schedules give different figures, from torch's own order (docs/BENCHMARKS.md): with 8 micro-batches
    interleaved 1F1B holds 128 layer inputs in flight on ranks 1-3 where 1F1B's largest rank holds 112 (rank 1), and
    twice the receive buffers (two stages per rank), so it is estimated about 4% above 1F1B; torchtitan measured it
    12% below, which nothing in its table explains."""
    one, interleaved = estimated_gib("T5-1f1b"), estimated_gib("T5-interleaved")
    assert 1.02 < interleaved / one < 1.08, (one, interleaved)


@pytest.mark.slow
def test_t5_1f1b_and_table_6s_first_row_hold_tensors_of_one_size():
    """8 micro-batches of 4 x 8,192 tokens (T5) or of 1 x 32,768 (T6, CP 1) on one layout and schedule: every layer
    input, receive buffer, recomputation and logits slice has the same bytes, so the estimates agree within 0.5 GiB;
    torchtitan measured 82.5 and 75.3 GiB, 7.2 GiB apart, which no tensor's size accounts for (the allocator's
    reserved memory, docs/BENCHMARKS.md)."""
    assert abs(estimated_gib("T5-1f1b") - estimated_gib("T6")) < 0.5


def test_pipeline_schedules_hold_what_torch_orders():
    """Micro-batches in flight, read from torch's own schedule order: GPipe all M, 1F1B S - rank, interleaved 1F1B a
    longer warm-up of smaller chunks (so the two differ on one model), the zero-bubble V a full V's worth."""
    one = {0: 1}
    assert in_flight_bytes("gpipe", 4, 1, 8, 0, one) == 8
    assert [in_flight_bytes("1f1b", 4, 1, 8, r, {r: 1}) for r in range(4)] == [4, 3, 2, 1]
    # 126 layers on 8 ranks, 32 micro-batches: 1F1B holds 8 micro-batches of 15 layers; interleaved, with stages of 7
    # and 8 layers, a warm-up of 22 chunks and one more: 15 of its first stage and 8 of its second
    assert in_flight_bytes("1f1b", 8, 1, 32, 0, {0: 15}) == 8 * 15
    assert in_flight_bytes("interleaved1f1b", 8, 2, 32, 0, {0: 7, 8: 8}) == 15 * 7 + 8 * 8
    # torchtitan's T5 (8 micro-batches): interleaved holds all 8 of each of its two stages on ranks 0-3 (rank 1: 8 + 8
    # layers each), 1F1B 8 on rank 0 and 7 on rank 1
    assert in_flight_bytes("interleaved1f1b", 8, 2, 8, 1, {1: 8, 9: 8}) == 8 * 8 + 8 * 8
    assert [in_flight_bytes("1f1b", 8, 1, 8, r, {r: 16}) for r in (0, 1)] == [8 * 16, 7 * 16]


def test_gradients_stand_beside_the_micro_batches_only_from_the_first_backward():
    """A step starts without gradients (set to None): GPipe's peak is all M micro-batches alone, or M - 1 beside the
    gradients, whichever is larger (adding both overstated 2-stage GPipe by 8-9% against the measured peak);
    1F1B reaches its warm-up's count again after its first backward, so the gradients always add."""
    assert in_flight_bytes("gpipe", 2, 1, 4, 0, {0: 10}, grads=5) == 40
    assert in_flight_bytes("gpipe", 2, 1, 4, 0, {0: 10}, grads=25) == 25 + 30
    assert in_flight_bytes("1f1b", 2, 1, 4, 0, {0: 10}, grads=5) == 20 + 5


GPT = ["model.n_layer=4", "model.n_embd=64", "model.n_head=2", "model.block_size=64", "train.batch_size=4", "data.path=synthetic"]


def estimated(world: int, *keys: str):
    cfg, _ = load_config([*GPT, *keys])
    data = load_data(cfg)
    return estimate(cfg, world, data.vocab_size, data.train_set[0])[1][0]


def test_a_pipelines_last_stage_holds_each_micro_batchs_logits_until_its_backward():
    """torch's PipelineStage keeps a stage's output per micro-batch (its fwd_cache) until that micro-batch's backward:
    on the last stage, the logits, which one process frees once the loss has its log-probabilities."""
    cfg, _ = load_config([*GPT, "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b"])
    data = load_data(cfg)
    last = estimate(cfg, 2, data.vocab_size, data.train_set[0])[1][-1]
    assert last.breakdown["head"] == 2 * 64 * data.vocab_size * 4  # a micro-batch of 2 x 64 tokens, fp32 logits
    assert estimated(1).breakdown["head"] == 0


def test_each_checkpointing_mode_keeps_what_it_says():
    """What model.activation_checkpointing keeps is measured, not assumed: full keeps each block's input only, the op
    policy the matmul and attention outputs it saves, selective_ac=2 every other block whole, none everything."""
    kept = {
        mode: estimated(1, *keys).breakdown
        for mode, keys in {
            "none": [],
            "full": ["model.activation_checkpointing=full"],
            "op": ["model.activation_checkpointing=selective"],
            "2": ["model.activation_checkpointing=selective", "model.selective_ac=2"],
        }.items()
    }
    block = {mode: kept[mode]["blocks.1"] for mode in kept}
    assert block["full"] < block["op"] < block["none"], block
    assert block["full"] == 4 * 64 * 64 * 4  # its input: batch x context x width, fp32
    assert kept["2"]["blocks.0"] == block["full"] and kept["2"]["blocks.1"] == block["none"]  # layers 0, 2 checkpointed


@pytest.mark.slow  # a regression guard of the formula every estimate runs (the 70B layout's test holds it too)
@pytest.mark.parametrize("world,keys", [(1, []), (2, ["parallel.dp_shard=2", "train.mixed_precision=bf16"])])
def test_a_run_checkpointing_fully_gets_one_number_for_full_checkpointing(world, keys):
    """The "with full checkpointing" column is measured with full checkpointing, through the same formula as the run's
    own mode: for a run whose mode is full, the two are one number (they differed when the column was derived from the
    un-checkpointed forward's block inputs: 61.78 against 62.78 GiB for the 70B layout), and for other modes the column
    is the full run's figure."""
    full = estimated(world, *keys, "model.activation_checkpointing=full")
    assert full.activations_ckpt == full.activations and full.total(True) == full.total()
    for mode in (["model.activation_checkpointing=none"], ["model.activation_checkpointing=selective"]):
        assert estimated(world, *keys, *mode).total(True) == full.total(), mode


def test_lora_trains_only_its_adapters(tmp_path):
    """model.lora_rank: frozen weights are held but have neither gradients nor optimizer state; the adapters have both."""
    folder = llama_folder(tmp_path, "tiny")
    small = ["model.name=hf", f"model.hf_path={folder}", "data.path=synthetic", "model.vocab_size=128256", "model.block_size=16"]
    whole = estimate_hf(small + ["model.hf_pretrained=false"])
    lora = estimate_hf(small + ["model.lora_rank=8"])
    adapters = lora.param_numel - whole.param_numel  # rank 8 on q_proj and v_proj (512 -> 512 each) of 2 layers
    assert adapters == 2 * 8 * ((512 + 512) + (512 + 512))
    assert (lora.grads, lora.optimizer) == (4 * adapters, 8 * adapters)
    assert (whole.grads, whole.optimizer) == (4 * whole.param_numel, 8 * whole.param_numel)


def test_a_hub_decoder_keeps_no_attention_mask_unless_its_batch_is_packed(tmp_path):
    """An unpacked batch's causal mask is SDPA's own (no tensor) in a run; the estimate's fake forward must see the
    same: given 0..T-1 as position ids, transformers cannot read fake values to find there is no packing and built a
    (B, 1, T, T) mask a run never has (1 GiB per micro-batch for torchtitan's 70B row). A packed batch keeps its mask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallel_train.models.hf import HFCausalLM, HFConfig
    from parallel_train.models.hf_layouts import LayerInputs

    cfg = HFConfig(name="hf", hf_path=str(llama_folder(tmp_path, "tiny")), hf_pretrained=False, block_size=64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = HFCausalLM(cfg, 128256)
        args = (model.hf.model, model.layout, model.hf.config, torch.empty(2, 64, 512))
        cpu = torch.device("cpu")
        assert LayerInputs(*args).for_layer(0, cpu)["attention_mask"] is None
        packed = LayerInputs(*args, positions=torch.arange(64).repeat(2, 1))
        assert packed.for_layer(0, cpu)["attention_mask"].shape == (2, 1, 64, 64)


def test_a_pipeline_stage_counts_what_it_makes_before_its_first_layer(tmp_path):
    """A decoder stage makes its layers' masks and rotary tables before its first layer runs: they are that stage's
    (a packed batch's (B, 1, T, T) mask in every stage), not the previous stage's last layer's."""
    keys = ["model.name=hf", f"model.hf_path={llama_folder(tmp_path, 'tiny')}", "model.hf_pretrained=false", "data.path=synthetic"]
    keys += ["model.block_size=64", "train.batch_size=4", "parallel.pipeline_stages=2", "parallel.microbatches=2"]
    cfg, _ = load_config([*keys, "model.activation_checkpointing=full"])
    ids = torch.ones(64, dtype=torch.long)
    first, second = (r.breakdown for r in estimate(cfg, 2, 128256, (ids, ids, torch.arange(64) % 32))[1])  # 2 documents a row
    output = 2 * 64 * 512 * 4  # a layer's output, micro-batch 2 x 64 x 512 fp32: what the next layer keeps
    assert first["model.layers.0"] == output  # stage 0's last layer
    assert second["model.layers.1"] >= output + 2 * 64 * 64  # stage 1's first: with its stage's mask


def estimate_hf(keys: list[str]):
    cfg, _ = load_config(keys)
    data = load_data(cfg)
    return estimate(cfg, 1, data.vocab_size, data.train_set[0])[1][0]


def test_fsdp2_bf16_policy_keeps_bf16_activations_where_autocast_keeps_fp32_too():
    """train.mixed_precision=bf16: under FSDP2 the policy computes the blocks in bf16 (half of fp32's bytes); one process
    autocasts, keeping the fp32 residual stream beside bf16 copies (more)."""
    fp32 = estimated(1).breakdown["blocks.1"]
    assert estimated(2, "parallel.dp_shard=2", "train.mixed_precision=bf16").breakdown["blocks.1"] == pytest.approx(fp32 / 2, rel=0.01)
    assert estimated(1, "train.mixed_precision=bf16").breakdown["blocks.1"] > fp32 // 2


@pytest.mark.parametrize(
    "world,keys,policy",
    [
        (1, [], False),
        (2, [], False),
        (2, ["parallel.tp=2"], True),
        (2, ["parallel.pipeline_stages=2"], True),
        (4, ["parallel.dp_shard=2", "parallel.tp=2"], True),
        (2, ["parallel.pipeline_stages=2", "parallel.schedule=zbv", "parallel.stages_per_rank=2", "parallel.microbatches=4"], True),
    ],
)
def test_each_engine_is_estimated_in_its_own_bf16(world, keys, policy):
    """Under bf16 the estimate takes the precision each engine computes in: FSDP2's policy (bf16 activations, as the
    dp_shard case above measures) for the mesh engine and the pipeline, tensor parallel alone and stages without
    replicas included, zero-bubble schedules too (parallel/sharding.py fsdp_wraps); autocast for one process and DDP."""
    cfg, _ = load_config([*GPT, "train.mixed_precision=bf16", *keys])
    got_policy, autocast = _precision(cfg, resolve_layout(cfg, world, env={}))
    assert (got_policy is not None, autocast) == (policy, None if policy else torch.bfloat16)


@pytest.mark.slow
def test_the_70b_layout_in_performance_md_is_what_the_estimator_says(tmp_path):
    """docs/performance.md "70B and 405B": its estimate command, run as written at full world size (256 fake ranks) with
    a local Llama 3.1 70B config.json in place of the Hub name, prints the per-GPU figure its table gives, and fits."""
    import shlex
    import subprocess
    import sys

    from helpers import REPO, doc_section

    text = doc_section("performance", "70B and 405B")
    line = next(x for x in text.splitlines() if x.startswith("python scripts/estimate_memory.py"))
    args = [a.replace("meta-llama/Llama-3.1-70B", str(llama_folder(tmp_path, "70b"))) for a in shlex.split(line.split("  #")[0])[2:]]
    result = subprocess.run([sys.executable, "scripts/estimate_memory.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figure = next(cell for cell in text.split("| Llama 3.1 70B |")[1].split("\n")[0].split("|") if "GiB" in cell).strip()
    assert f": fits (largest rank {figure}" in result.stdout, (figure, result.stdout[-1500:])
    # its own mode is full: the "with full checkpointing" figure is the same number (it was 61.78 against 62.78)
    assert f"with model.activation_checkpointing=full: fits ({figure})" in result.stdout, (figure, result.stdout[-1500:])


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_a_pipeline_stage_under_tensor_parallel_receives_its_sequence_shard(tmp_path, model):
    """Sequence parallel inside pipeline stages (pp 2 x tp 2, 2 micro-batches of 2): what stage 1 receives, and so each
    of torch's receive buffers (one per micro-batch, for the input and for its gradient), is (B/M, T/tp, H), measured
    on the stages cut by the run's own code. GPT's plan handed on local shards before; the Hub Llama's now does too."""
    keys = ["train.batch_size=4", "parallel.tp=2", "parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b"]
    if model == "gpt":
        cfg, _ = load_config([*GPT, *keys])
        width, length = 64, 64
    else:
        folder = llama_folder(tmp_path, "tiny")
        cfg, _ = load_config(
            ["model.name=hf", "model.hf_pretrained=false", f"model.hf_path={folder}", "model.vocab_size=128256"]
            + ["data.path=synthetic", "model.block_size=16", *keys]
        )
        width, length = LLAMA["tiny"][0], 16
    data = load_data(cfg)
    _, ranks = estimate(cfg, 4, data.vocab_size, data.train_set[0])
    shard = 2 * (length // 2) * width * 4  # one micro-batch's (B/M, T/tp, H) in fp32
    assert [r.stage_buffers for r in ranks] == [2 * shard, 2 * shard], (ranks[0].stage_buffers, shard)
