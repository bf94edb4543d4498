"""Tied weights on every layout (src/parallel_train/models/ties.py, parallel/pipeline/tied.py): a tiny GPT whose output layer is its
token embedding (model.tie_embeddings=true, as GPT-2 does).

In process: the tie is found, stored once under its owner's name with the alias recorded, loaded back into every
name a part holds (a pipeline stage holding only the output layer included), filled from the owner's rule after a
meta-device start, kept in exports; tensor parallelism and an in-process split over two devices refuse it in one
line. Real launches: one process checkpoints and resumes bit-identically; DDP and a 2-stage pipeline (the tied
weight on both ranks, gradients summed over their group) equal the unsplit run; sample.py loads the export. With
-m slow: ZB-V (both ends on rank 0: one tensor), FSDP2 and the one-process executor equal it too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import TINY, check, launch_env, run, summary, train_losses, warm_cmd, warm_script
from parallel_train.checkpoint import checkpointer, storage
from parallel_train.checkpoint.export import INDEX, export, load_weights, read_weights
from parallel_train.checkpoint.manifest import SHARD_DIR
from parallel_train.checkpoint.named_state import RankState, load_into, merge_meta, rank_tensors, templates
from parallel_train.errors import UserError
from parallel_train.models.gpt import GPT, GPTConfig
from parallel_train.models.ties import TIED_KEY, find_ties
from parallel_train.parallel.mesh import MeshLayout
from parallel_train.parallel.model_init import start_model
from parallel_train.parallel.pipeline.inprocess import refuse_ties_across_devices
from parallel_train.parallel.pipeline.split import plan_stages, stage_module
from parallel_train.parallel.pipeline.tied import TiedAcrossStages
from parallel_train.parallel.sharding import refuse_cut_ties

TIED = {"head.weight": "tok_emb.weight"}
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, tie_embeddings=True)


def tied_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG, 65)


def save(folder, rank: RankState):
    """A checkpoint's tensors and optimizer.json, as one process writes them (checkpoint/checkpointer.py, without the rest)."""
    tensors, meta = rank_tensors(rank)
    storage.write(folder / SHARD_DIR, tensors)
    (folder / "optimizer.json").write_text(json.dumps(merge_meta([meta])))
    return folder


def trained_state(model: GPT) -> tuple[RankState, torch.optim.Optimizer]:
    """The whole model's RankState after two AdamW steps (moments and step counts to save)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 65, (2, 16))).square().mean().backward()
        optimizer.step()
    return RankState(model.state_dict(), model, optimizer, find_ties(model)), optimizer


# ---------------------------------------------------------------- in process


def test_a_tied_weight_is_stored_once_and_loads_into_every_name_a_part_holds(tmp_path):
    model = tied_gpt()
    assert model.head.weight is model.tok_emb.weight and find_ties(model) == TIED
    rank, _ = trained_state(model)
    tensors, meta = rank_tensors(rank)
    assert "model/tok_emb.weight" in tensors and not any(k.startswith(("model/head.", "optimizer/head.")) for k in tensors)
    assert meta["tied"] == TIED and "head.weight" not in meta["param_groups"][0]["params"]
    folder = save(tmp_path, rank)

    fresh = tied_gpt(seed=1)  # other weights, same tie: one process resuming
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpointer.load_rank_state(folder, RankState(fresh.state_dict(), fresh, fresh_opt, TIED))
    assert fresh.head.weight is fresh.tok_emb.weight  # loading copies into the tensor: the tie stays
    for (name, p), q in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(fresh_opt.state[fresh.tok_emb.weight]["exp_avg"], rank.optimizer.state[model.tok_emb.weight]["exp_avg"])

    # A pipeline rank holding the last stage only: its `head.weight` is read from `model/tok_emb.weight`, its optimizer
    # state from `optimizer/tok_emb.weight/...`, and it writes the weight back under that name.
    whole = tied_gpt(seed=2)
    last = stage_module(whole, plan_stages(whole, 2)[1])
    last_opt = torch.optim.AdamW(last.parameters(), lr=1e-2)
    stage = RankState(last.state_dict(), last, last_opt, TIED)
    assert "head.weight" in stage.model and "tok_emb.weight" not in stage.model
    saved = storage.saved_tensors(folder / SHARD_DIR)
    tensors = templates(stage, saved, set(whole.state_dict()))  # what load_rank_state does, with every rank's names
    storage.read(folder / SHARD_DIR, tensors)
    load_into(stage, tensors, json.loads((folder / "optimizer.json").read_text()))
    assert torch.equal(last.head.weight, model.tok_emb.weight)
    assert torch.equal(last_opt.state[last.head.weight]["exp_avg_sq"], rank.optimizer.state[model.tok_emb.weight]["exp_avg_sq"])
    written, _ = rank_tensors(RankState(last.state_dict(), last, last_opt, TIED))
    assert {"model/tok_emb.weight", "optimizer/tok_emb.weight/exp_avg"} <= written.keys() and "model/head.weight" not in written


def test_a_meta_start_fills_a_tied_weight_from_its_owner_wherever_it_is_held():
    """The unsplit model and a pipeline stage that holds only the output layer start from the same weight (the
    embedding's rule and seed); filling and releasing parts (parallel.split=time's probe) keeps the tie."""
    whole, init = start_model(GPT, CFG, 65, seed=0)
    assert whole.head.weight is whole.tok_emb.weight and whole.head.weight.is_meta and init.ties == TIED
    init.fill(whole, torch.device("cpu"))
    assert whole.head.weight is whole.tok_emb.weight  # torch's to_empty would have given each name its own tensor
    model, init = start_model(GPT, CFG, 65, seed=0)
    last = stage_module(model, plan_stages(model, 2)[1])
    init.fill(last, torch.device("cpu"))
    assert torch.equal(last.head.weight, whole.tok_emb.weight)
    init.release(last)
    assert model.head.weight is model.tok_emb.weight and model.tok_emb.weight.is_meta


def test_exports_keep_the_alias_and_loading_them_restores_it(tmp_path):
    rank, _ = trained_state(tied_gpt())
    folder = save(tmp_path / "ckpt", rank)
    (single,) = export(folder, tmp_path / "one")
    assert "head.weight" not in load_file(str(single))  # stored once, as safetensors and transformers want it
    with safe_open(str(single), framework="pt") as f:
        assert json.loads(f.metadata()[TIED_KEY]) == TIED
    for weights in (read_weights(single), load_weights(tmp_path / "one"), load_weights(folder)):
        assert torch.equal(weights["head.weight"], rank.model["tok_emb.weight"]) and weights.keys() == rank.model.keys()
    fresh = tied_gpt(seed=1)
    fresh.load_state_dict(read_weights(single))  # strict: the alias is not missing (scripts/sample.py loads this way)
    assert fresh.head.weight is fresh.tok_emb.weight
    export(folder, tmp_path / "sharded", max_file_bytes=20_000)
    assert json.loads((tmp_path / "sharded" / INDEX).read_text())["metadata"][TIED_KEY] == TIED


def test_layouts_that_cannot_keep_the_tie_refuse_it_in_one_line():
    model = tied_gpt()
    with pytest.raises(UserError, match=r"parallel.tp=2: head.weight is tok_emb.weight \(tied weights\), and tensor parallelism would cut"):
        refuse_cut_ties(model, TIED, 2)
    refuse_cut_ties(model, TIED, 1)
    stages = plan_stages(model, 2)
    with pytest.raises(UserError, match=r"parallel.stage_devices: head.weight is tok_emb.weight .*run on cpu, cuda:1"):
        refuse_ties_across_devices(TIED, stages, [torch.device("cpu"), torch.device("cuda", 1)])
    refuse_ties_across_devices(TIED, stages, [torch.device("cpu"), torch.device("cpu")])  # one device: one tensor


def test_the_tie_group_joins_the_stage_ranks_of_each_replica():
    """DP x PP (2 replicas x 2 stages): ranks 0,1 and 2,3 each sum their copies; the norm counts the first's only."""
    assert TiedAcrossStages._lines(MeshLayout(dp_replicate=2, pp=2), [0, 1]) == [[0, 1], [2, 3]]
    assert TiedAcrossStages._lines(MeshLayout(pp=2, tp=2), [0, 1]) == [[0, 2], [1, 3]]


# ---------------------------------------------------------------- real launches

# SGD at learning rate 1 and global batch 8 (4 x 2 accumulation steps): a gradient of the tied weight that is not the
# sum of both uses shows at once (without the group's sum the pipeline's losses differ from step 2 on by about 0.02).
SGD = (*TINY, "model.tie_embeddings=true", "train.gradient_accumulation_steps=2", "train.optimizer=sgd", "train.learning_rate=1.0")
SGD += ("eval.batch_size=8",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tied")
    env = launch_env(tmp)
    check(run(warm_cmd(1, *SGD, f"output_dir={tmp / 'ref'}"), env=env))
    return tmp, env


def assert_equal_training(out, ref, steps=range(1, 7), rel=1e-5):
    got, want = train_losses(out), train_losses(ref)
    assert all(got[s] == pytest.approx(want[s], rel=rel, abs=0 if rel == 0 else None) for s in steps), (got, want)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert w.keys() == r.keys() and "head.weight" not in w
    for k in r:
        torch.testing.assert_close(w[k], r[k], rtol=rel, atol=0 if rel == 0 else 1e-6, msg=k)


@pytest.mark.multiprocess
def test_one_process_resumes_a_tied_model_bit_identically(runs):
    tmp, env = runs
    out = tmp / "resumed"
    check(run(warm_cmd(1, *SGD, f"resume={tmp / 'ref' / 'checkpoints' / 'step_0000003'}", f"output_dir={out}"), env=env))
    assert_equal_training(out, tmp / "ref", steps=range(4, 7), rel=0)
    assert (out / "model.safetensors").read_bytes() == (tmp / "ref" / "model.safetensors").read_bytes()


@pytest.mark.multiprocess
def test_ddp_and_a_two_stage_pipeline_train_a_tied_model_like_one_process(runs):
    """DDP (batch 2 x 2 ranks x 2): one tensor per replica. A 2-stage pipeline: the embedding on rank 0, the output
    layer on rank 1, a copy each, their gradients summed; losses and weights equal the unsplit run within 1e-5, and
    the export holds the weight once, with the alias that sample.py restores."""
    tmp, env = runs
    ddp, pipe = tmp / "ddp", tmp / "pipeline"
    check(run(warm_cmd(2, *SGD, "train.batch_size=2", f"output_dir={ddp}"), env=env))
    assert_equal_training(ddp, tmp / "ref")
    stages = ("parallel.pipeline_stages=2", "parallel.microbatches=2", "parallel.schedule=1f1b", "parallel.split=auto")
    log = check(run(warm_cmd(2, *SGD, *stages, f"output_dir={pipe}"), env=env)).output
    assert "stage 0 on rank 0: tok_emb, pos_emb, drop" in log and "ln_f, head" in log
    assert_equal_training(pipe, tmp / "ref")
    assert summary(pipe)["final_val_loss"] == pytest.approx(summary(tmp / "ref")["final_val_loss"], rel=1e-5)
    weights = load_weights(pipe)
    assert torch.equal(weights["head.weight"], weights["tok_emb.weight"])
    sampled = check(run(warm_script("scripts/sample.py", "--run", str(pipe), "--max_new_tokens", "20", "--prompt", "ROMEO:"), env=env))
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout.rstrip("\n")) == len("ROMEO:") + 20


MORE = {  # name -> (processes, overrides); each equals the unsplit run
    # ZB-V puts the first and the last stage on rank 0: the tie is the tensor itself there, no group, no sum
    "zbv": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=4", "parallel.schedule=zbv")),
    # FSDP2: both names in the root's unit, one sharded tensor
    "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2")),
    # the one-process executor, both stages on the CPU: one tensor
    "inprocess": (1, ("parallel.pipeline_stages=2", "parallel.stage_devices=[cpu,cpu]", "parallel.microbatches=2")),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(MORE))
def test_tied_model_on_more_layouts(runs, name):
    tmp, env = runs
    out = tmp / name
    nproc, overrides = MORE[name]
    args = (*SGD, *overrides, f"output_dir={out}")
    check(run(warm_cmd(nproc, *args) if nproc > 1 else warm_cmd(1, *args), env=env))
    assert_equal_training(out, tmp / "ref")
