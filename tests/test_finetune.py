"""Fine-tuning as people do it (issue 17): LoRA through peft, chat data that learns only the answers, packing.

A tiny Llama with a ChatML tokenizer and chat template is made here (tests/hf_tiny.py), with Shakespeare's lines
as conversations. In process: the chat mask token by token, packed batches against padded ones and documents
that never see each other (GPT and the Llama, SDPA and flex attention), LoRA's meta-device start and its frozen
base, the base-model check of a resumed checkpoint, prepared samples equal to rows in memory. Real launches
(gloo): LoRA on 1 process as the reference, then 2 processes under DDP, FSDP2 and a 2-stage pipeline, each equal
to it step by step; a LoRA chat run killed and resumed; the exports (merged, and the adapters for peft).
"""

from __future__ import annotations

import json
import shutil
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hf_tiny
from helpers import PYTHON, check, launch_env, read_metrics, run, summary, train_losses, warm_cmd, warm_script
from parallel_train import faults
from parallel_train.data.packing import PackedSamples, PaddedSamples, SamplesInMemory, pack
from parallel_train.errors import UserError
from parallel_train.losses import IGNORE_INDEX, loss_sum, token_losses, valid_tokens
from parallel_train.models import document_mask
from parallel_train.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

T = 128


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """{"model": a tiny chat Llama folder, "rows": a jsonl of 60 one- or two-exchange conversations, "tmp"}."""
    return hf_tiny.chat_files(tmp_path_factory.mktemp("finetune"))


def lora_cfg(folder, **keys):
    from parallel_train.models.hf import HFConfig

    return HFConfig(name="hf", hf_path=str(folder), block_size=T, **{"lora_rank": 8, **keys})


# ---------------------------------------------------------------- chat data: exactly the assistant's tokens learn


def three_turns() -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Answer in verse."},
            {"role": "user", "content": "Who art thou?"},
            {"role": "assistant", "content": "A man, my lord."},
            {"role": "user", "content": "Whence comest thou?"},
            {"role": "assistant", "content": "From Padua."},
            {"role": "user", "content": "And whither?"},
            {"role": "assistant", "content": "To Verona, sir."},
        ]
    }


def expected_mask(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """The template's rendering, tokenized, and each token's side: inside an assistant turn's content and its
    `<|im_end|>\\n` (found in the text, not by the code under test), or not."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, at = [], 0
    for m in messages:
        turn = f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        at = text.index(turn, at)
        if m["role"] == "assistant":
            start = at + len(f"<|im_start|>{m['role']}\n")
            spans.append((start, at + len(turn)))
        at += len(turn)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [any(lo <= s < hi for lo, hi in spans) for s, _ in enc["offset_mapping"]]


@pytest.mark.parametrize("generation_tags", [False, True], ids=["prefix", "generation_tags"])
def test_chat_mask_marks_exactly_the_assistant_tokens(chat, generation_tags, tmp_path):
    """A 3-turn conversation: its ids are the template's rendering, and exactly the assistant's tokens (content and
    end of turn) carry targets, token by token; the same with a template that marks them with {% generation %}."""
    from parallel_train.data.chat_format import load_format
    from parallel_train.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(str(chat["model"]))
    template = ""
    if generation_tags:
        template = str(tmp_path / "marked.jinja")
        assert hf_tiny.CHAT_TEMPLATE_MARKED != hf_tiny.CHAT_TEMPLATE
        (tmp_path / "marked.jinja").write_text(hf_tiny.CHAT_TEMPLATE_MARKED)
    fmt = load_format("chat", str(chat["model"]), tokenizer.tokenizer, tokenizer, template, ("messages",))
    assert fmt.marks_answers == generation_tags
    row = three_turns()
    ids, mask = fmt.render(row, "row 1")
    want_ids, want_mask = expected_mask(fmt.tokenizer, row["messages"])
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    learned = tokenizer.decode([i for i, m in zip(ids.tolist(), mask.tolist(), strict=True) if m])
    assert learned == "A man, my lord.<|im_end|>\nFrom Padua.<|im_end|>\nTo Verona, sir.<|im_end|>\n"
    from parallel_train.data.packing import training_row

    x, y = training_row(ids, mask)  # what a batch holds: a target wherever the next token is the assistant's
    assert (y != IGNORE_INDEX).tolist() == mask[1:].tolist() and y[mask[1:]].tolist() == ids[1:][mask[1:]].tolist()


def test_instruction_rows_and_no_template(chat, tmp_path):
    """Instruction rows go through the template as a user and an assistant turn; with a tokenizer that has no
    template (data.tokenizer=byte) they are prompt + completion + end of text, the last two learned."""
    from parallel_train.data.chat_format import load_format
    from parallel_train.data.tokenizers import ByteVocab, load_tokenizer

    tokenizer = load_tokenizer(str(chat["model"]))
    fmt = load_format("instruction", str(chat["model"]), tokenizer.tokenizer, tokenizer, "", ("prompt", "completion"))
    ids, mask = fmt.render({"prompt": "Say hi.", "completion": "Hi."}, "row 1")
    assert tokenizer.decode(ids.tolist()).startswith("<|im_start|>user\nSay hi.")
    assert tokenizer.decode(ids[mask].tolist()) == "Hi.<|im_end|>\n"
    plain = load_format("instruction", "byte", None, ByteVocab(), "", ("prompt", "completion"))
    ids, mask = plain.render({"prompt": "Q: 1+1?", "completion": " 2"}, "row 1")
    assert bytes(ids.tolist()) == b"Q: 1+1? 2\n" and bytes(ids[mask].tolist()) == b" 2\n"


# ---------------------------------------------------------------- packing: equal to padded, documents apart


def random_samples(seed: int, vocab: int, n: int = 12) -> SamplesInMemory:
    g = np.random.default_rng(seed)
    ids = [g.integers(0, vocab, int(g.integers(4, 30))) for _ in range(n)]
    return SamplesInMemory(ids, [g.random(len(i)) > 0.3 for i in ids])


def gpt_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64), 50).eval()


def llama_model(chat) -> torch.nn.Module:
    from parallel_train.models.hf import HFCausalLM, HFConfig

    return HFCausalLM(HFConfig(name="hf", hf_path=str(chat["model"]), block_size=64), 300).eval()


def test_the_memory_estimator_reads_chat_rows_padded_and_packed(chat):
    """scripts/estimate_memory.py on chat data (its datasets batch themselves): padded rows at the widest batch's width,
    packed rows with their positions, which make transformers keep the documents apart with a (B, 1, T, T) mask that
    a run holds and the estimate counts (4 x 128 x 128 bytes here, at the same width as the padded rows)."""
    from parallel_train.config.load import load_config
    from parallel_train.parallel.memory_estimate import estimate_config

    keys = ["model.name=hf", f"model.hf_path={chat['model']}", f"data.path={chat['rows']}", "data.format=chat", "data.truncate=true"]
    keys += [f"model.block_size={T}", "train.batch_size=4"]
    padded, packed = (estimate_config(load_config([*keys, f"data.packing={p}"])[0], 1)[1][0] for p in ("false", "true"))
    assert packed.activations - padded.activations >= 4 * T * T


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_packed_batch_loss_equals_the_same_samples_padded(chat, name):
    """The per-token loss of packed rows equals the same samples one per row, padded, within 1e-5; so does every
    sample's own loss."""
    model = gpt_model() if name == "gpt" else llama_model(chat)
    samples = random_samples(0, 50)
    packed, padded = PackedSamples(samples, 64, 0), PaddedSamples(samples, 64, 0, fixed=False)
    assert len(packed) < len(samples) and 0 < packed.padding_share() < 0.5
    x, y, positions = packed.__getitems__(list(range(len(packed))))
    x2, y2 = padded.__getitems__(list(range(len(samples))))
    with torch.no_grad():
        a, b = token_losses(model(x, positions=positions), y), token_losses(model(x2), y2)
    assert valid_tokens(y) == valid_tokens(y2)
    assert (a.sum() / valid_tokens(y)).item() == pytest.approx((b.sum() / valid_tokens(y2)).item(), rel=1e-5)
    for p, row in enumerate(packed.rows):  # each sample's own token losses, where packing put it
        at = 0
        for i in row:
            n = int(samples.lengths[i]) - 1
            torch.testing.assert_close(a[p, at : at + n], b[i, :n], rtol=1e-5, atol=1e-5)
            at += n


@pytest.mark.parametrize("name, flex", [("gpt", False), ("gpt", True), ("llama", False)], ids=["gpt_sdpa", "gpt_flex", "llama_sdpa"])
def test_a_document_never_attends_to_another(chat, name, flex, monkeypatch):
    """Changing every token of one packed document leaves the other documents' logits unchanged. flex: the CUDA
    path (flex attention with a block mask), run eagerly on the CPU."""
    if flex:
        monkeypatch.setattr(document_mask, "for_positions", lambda p, flex=None, f=document_mask.for_positions: f(p, flex=True))
    model = gpt_model() if name == "gpt" else llama_model(chat)
    samples = random_samples(1, 50, n=3)
    row = PackedSamples(samples, 64, 0)
    assert len(row.rows) == 1 and len(row.rows[0]) == 3
    x, y, positions = row.__getitems__([0])
    first = int(samples.lengths[row.rows[0][0]]) - 1
    changed = x.clone()
    changed[0, :first] = (changed[0, :first] + 7) % 50
    with torch.no_grad():
        before, after = model(x, positions=positions), model(changed, positions=positions)
    assert not torch.allclose(before[0, :first], after[0, :first])
    torch.testing.assert_close(after[0, first:], before[0, first:], rtol=0, atol=1e-6)


def test_pack_is_best_fit_decreasing_and_keeps_every_sample_once():
    sizes = np.array([60, 10, 30, 35, 5, 64, 20, 3])
    rows = pack(sizes, 64)
    assert sorted(i for r in rows for i in r) == list(range(len(sizes)))
    assert all(sum(sizes[r]) <= 64 for r in rows) and len(rows) == 4  # 64 | 60+3 | 35+20+5 | 30+10 (best fit)
    assert rows == pack(sizes, 64)  # deterministic


# ---------------------------------------------------------------- LoRA in process


def test_lora_starts_from_the_base_trains_only_adapters_and_leaves_the_base_bit_identical(chat):
    """Built on the meta device and filled as a run does: the adapters have peft's own initialisation (B zero, so the
    model is its base), keyed by name (the same on every layout). A few AdamW steps with weight decay: the optimizer
    holds only the adapters, the base weights stay bit-identical to the folder's, the state dict holds adapters only."""
    from parallel_train.config.sections import TrainConfig
    from parallel_train.models.hf import HFCausalLM, HFConfig
    from parallel_train.optim import build_optimizer
    from parallel_train.parallel.model_init import start_model

    model, init = start_model(HFCausalLM, lora_cfg(chat["model"]), 300, seed=3)
    init.fill(model, torch.device("cpu"))
    again, init2 = start_model(HFCausalLM, lora_cfg(chat["model"]), 300, seed=3)
    init2.fill(again, torch.device("cpu"))
    base = HFCausalLM(HFConfig(name="hf", hf_path=str(chat["model"]), block_size=T), 300)
    x = torch.randint(0, 300, (2, 32))
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    a = model.model.layers[0].self_attn.q_proj.lora_A.default.weight
    assert a.abs().max() > 0 and torch.equal(a, again.model.layers[0].self_attn.q_proj.lora_A.default.weight)
    assert not model.model.layers[0].self_attn.q_proj.lora_B.default.weight.any()

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    optimizer = build_optimizer(model, TrainConfig(learning_rate=1e-2, weight_decay=0.1))
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for n, p in model.named_parameters() if n in trainable}
    for _ in range(3):
        loss_sum(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
    files = load_file(str(chat["model"] / "model.safetensors"))
    for name, p in model.named_parameters():
        if name not in trainable:
            assert torch.equal(p, files[name.replace(".base_layer.", ".")]), name
    assert set(model.state_dict()) == trainable
    assert not torch.allclose(model(x), base(x))
    from parallel_train.parallel.pipeline.split import stage_module

    embedding_only = stage_module(model, ["model.embed_tokens"])  # a pipeline stage holding no adapter
    assert embedding_only(x).requires_grad  # still sends a tensor with a gradient, which pipelining's backward needs


def test_lora_export_writes_merged_and_adapter_folders_with_the_run_template(chat, tmp_path):
    """What the run's end writes, in process: hf/ (merged) loads with the model's logits, adapter/ loads with peft,
    and the chat template the run trained with (data.chat_template) replaces the model folder's in hf/."""
    from parallel_train.data.tokenizers import load_tokenizer
    from parallel_train.models.hf import HFCausalLM

    cfg = lora_cfg(chat["model"])
    model = HFCausalLM(cfg, 300)
    with torch.no_grad():  # stands for training: adapters unlike their start
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    line = HFCausalLM.export(
        cfg, model.state_dict(), tmp_path / "hf", load_tokenizer(str(chat["model"])), chat_files={"chat_template.jinja": "X"}
    )
    assert "LoRA adapters merged" in line and str(tmp_path / "adapter") in line
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(x).logits
        adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(chat["model"]), tmp_path / "adapter")
        torch.testing.assert_close(merged, model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(input_ids=x).logits, model(x), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == "X"


def test_lora_refusals_and_the_base_model_check(chat, tmp_path):
    from parallel_train.models.hf import HFCausalLM
    from parallel_train.models.hf_lora import base_identity, check_same_base

    model = HFCausalLM(lora_cfg(chat["model"]), 300)
    with pytest.raises(UserError, match=r"^parallel.tp=2: tensor parallelism does not cut peft's LoRA layers .*parallel.dp_shard\)$"):
        model.tensor_parallel_plan(2)
    with pytest.raises(UserError, match=r"^model.lora_targets: Target modules \{'nothing'\} not found .*Linear layers are .*q_proj"):
        HFCausalLM(lora_cfg(chat["model"], lora_targets=["nothing"]), 300)
    mine = base_identity(str(chat["model"]))
    other = hf_tiny.save_model(hf_tiny.llama_config(num_hidden_layers=3), tmp_path / "other")
    assert check_same_base(mine, mine, tmp_path) is None and check_same_base(None, None, tmp_path) is None
    with pytest.raises(
        UserError, match=r"holds LoRA adapters of base model .*, not of model.hf_path=.*other.*; resume with model.hf_path="
    ):
        check_same_base(mine, base_identity(str(other)), tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_bytes((chat["model"] / "config.json").read_bytes())
    assert "has the same config.json" in check_same_base(mine, base_identity(str(moved)), tmp_path)
    with pytest.raises(UserError, match="holds the whole model"):
        check_same_base(None, mine, tmp_path)
    from parallel_train.run.resume_config import check_same_files

    (tmp_path / "chat_template.jinja").write_text("A")  # the chat template a checkpoint's run trained with
    check_same_files(tmp_path, {"chat_template.jinja": "A"})
    check_same_files(tmp_path, {})  # text data: nothing to compare
    with pytest.raises(UserError, match=r"^data.chat_template: the resumed run trained with another chat template"):
        check_same_files(tmp_path, {"chat_template.jinja": "B"})


# ---------------------------------------------------------------- real launches

LORA = (
    "model.name=hf",
    f"model.block_size={T}",
    "model.lora_rank=8",
    "data.format=chat",
    "data.packing=true",
    "data.truncate=true",
    "train.batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=1",
    "train.lr_decay_steps=6",
    "train.optimizer=sgd",  # SGD: Adam would blow float noise in the adapters' tiny first gradients up into full steps
    "train.learning_rate=2.0",
    "train.log_interval=1",
    "eval.interval=3",
    "eval.iters=2",
    "eval.batch_size=4",
    "checkpoint.interval=3",
    "tracker=none",
)


@pytest.fixture(scope="module")
def launches(chat):
    """launches(name) -> (output_dir, log), each launch once per module: the 1-process reference, then DDP, FSDP2
    and a 2-stage pipeline on 2 processes, each with the global batch of 4."""
    tmp, done = chat["tmp"], {}
    setups = {
        "ref": (1, ()),
        "ddp": (2, ("train.batch_size=2",)),
        "fsdp2": (2, ("train.batch_size=2", "parallel.dp_shard=2")),
        "pipeline": (2, ("parallel.pipeline_stages=2", "parallel.microbatches=2")),
    }

    def launch(name: str):
        if name not in done:
            nproc, extra = setups[name]
            args = (*LORA, f"model.hf_path={chat['model']}", f"data.path={chat['rows']}", *extra, f"output_dir={tmp / name}")
            cmd = warm_cmd(nproc, *args)
            done[name] = (tmp / name, check(run(cmd, env=launch_env(tmp), timeout=420)).output)
        return done[name]

    return launch


def assert_same_steps(out, ref, rel=1e-5):
    got, want = train_losses(out), train_losses(ref)
    assert got.keys() == want.keys() == set(range(1, 7)), (got, want)
    assert all(got[s] == pytest.approx(want[s], rel=rel) for s in want), (got, want)
    w, r = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert w.keys() == r.keys() and all(".lora_" in k for k in w)
    for key in r:
        torch.testing.assert_close(w[key], r[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_lora_ddp_on_two_processes_trains_the_adapters_and_exports_both_ways(chat, launches):
    """Under 5% of the parameters train, the loss falls, DDP equals one process step by step; the checkpoint holds
    the adapters and names the base; output_dir/hf (merged) gives the in-template model's logits within 1e-5 and
    output_dir/adapter loads with peft onto the untouched base with the same logits; sample.py --chat answers."""
    from parallel_train.observe.generation import chat_answer, load_trained

    out, log = launches("ddp")
    ref, _ = launches("ref")
    s = summary(out)
    assert s["world_size"] == 2 and 0 < s["trainable_params"] < 0.05 * s["total_params"], s
    assert "trainable: 3,584 of 116,032 parameters (3.09%)" in log and "packed into" in log
    losses = train_losses(out)
    evals = [r["val_loss"] for r in read_metrics(out) if r["kind"] == "eval"]
    assert losses[6] < losses[1] and evals[-1] < evals[0], (losses, evals)
    assert_same_steps(out, ref)
    state = json.loads((out / "checkpoints" / "step_0000006" / "trainer_state.json").read_text())
    assert state["base_model"]["hf_path"] == str(chat["model"]) and len(state["base_model"]["config_sha256"]) == 64
    trained = load_trained(out)  # the in-template model: the base from the folder, the run's adapters
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ours = trained.model(x)
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")(x).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(chat["model"])
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter")(input_ids=x).logits
    torch.testing.assert_close(merged, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adapted, ours, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(chat["model"])
    assert transformers.AutoTokenizer.from_pretrained(out / "hf").chat_template == hf_tiny.CHAT_TEMPLATE
    answer = chat_answer(trained, out, "Who art thou?", 12, generator=torch.Generator().manual_seed(0))
    assert isinstance(answer, str) and "<|im_start|>" not in answer


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fsdp2", "pipeline"])
def test_lora_under_fsdp2_and_a_pipeline_equals_one_process(launches, name):
    out, log = launches(name)
    assert ("device mesh (FSDP2" if name == "fsdp2" else "multi-process pipeline") in log
    assert_same_steps(out, launches("ref")[0])


@pytest.mark.multiprocess
def test_lora_chat_run_killed_then_resumed_equals_the_uninterrupted_run(chat, launches):
    """SIGKILL after step 4 (checkpoint at 3): resumed, the losses and adapters are the uninterrupted run's, bit
    for bit. Then another base model is refused in one line before anything loads: under another model.hf_path by
    the config comparison (run/resume_config.py), and under the same path, its folder replaced by another model, by
    the hash of the base's config.json that the checkpoint records (models/hf_lora.py)."""
    ref, _ = launches("ref")
    out, base = chat["tmp"] / "killed", chat["tmp"] / "base_copy"
    shutil.copytree(chat["model"], base)
    args = (*LORA, f"model.hf_path={base}", f"data.path={chat['rows']}", f"output_dir={out}")
    killed = run(warm_cmd(1, *args), env=launch_env(chat["tmp"], **{faults.ENV: "kill@4"}), timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.output[-2000:]
    resumed = check(run(warm_cmd(1, *args), env=launch_env(chat["tmp"]), timeout=300))
    assert "resumed from" in resumed.output and "step_0000003" in resumed.output
    assert train_losses(out) == train_losses(ref)
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    other = hf_tiny.save_model(hf_tiny.llama_config(num_hidden_layers=3), chat["tmp"] / "other_base", hf_tiny.chat_tokenizer())
    moved = [a if not a.startswith("model.hf_path=") else f"model.hf_path={other}" for a in args] + ["train.max_steps=8"]
    refused = run(warm_cmd(1, *moved), env=launch_env(chat["tmp"]), timeout=300)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1 and "model.hf_path" in errors[0] and "cannot change" in errors[0], refused.output
    shutil.rmtree(base)
    shutil.copytree(other, base)  # the same path, another model
    refused = run(warm_cmd(1, *args, "train.max_steps=8"), env=launch_env(chat["tmp"]), timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds LoRA adapters of base model" in errors[0], refused.output[-2000:]


def test_prepared_samples_train_like_rows_in_memory(chat, tmp_path):
    """prepare_data.py --format chat writes the rows' samples with their masks; read back they are the same ids,
    masks and batches (packed and padded) as the rows read into memory."""
    from parallel_train.config.load import load_config
    from parallel_train.data.sources import load_data

    folder = tmp_path / "prepared"
    args = ("--format", "chat", "--input", str(chat["rows"]), "--output", str(folder), "--tokenizer", str(chat["model"]))
    check(run(warm_script("scripts/prepare_data.py", *args, "--shard_tokens", "2000", "--num_proc", "1"), env=launch_env(tmp_path)))
    meta = json.loads((folder / "prepared.json").read_text())
    assert meta["samples"]["format"] == "chat" and len(meta["splits"]["train"]["shards"]) > 1
    assert (folder / "chat_template.jinja").read_text() == hf_tiny.CHAT_TEMPLATE
    for packing in ("false", "true"):
        keys = ["model.name=hf", f"model.hf_path={chat['model']}", f"model.block_size={T}", "data.format=chat", "data.truncate=true"]
        memory = load_data(load_config([*keys, f"data.path={chat['rows']}", f"data.packing={packing}"])[0])
        prepared = load_data(load_config([*keys, f"data.path={folder}", f"data.packing={packing}"])[0])
        assert len(memory.train_set) == len(prepared.train_set) and len(memory.val_set) == len(prepared.val_set)
        for a, b in zip(memory.train_set.__getitems__([0, 5, 17]), prepared.train_set.__getitems__([0, 5, 17]), strict=True):
            assert torch.equal(a, b)
        assert prepared.files == memory.files and "chat_template.jinja" in prepared.files
    with pytest.raises(UserError, match=r"data.format=text, but .* was prepared with --format chat; set data.format=chat"):
        load_data(load_config(["model.name=hf", f"model.hf_path={chat['model']}", f"data.path={folder}"])[0])


def test_the_default_job_imports_neither_peft_nor_transformers(tmp_path):
    """`python train.py` (here 1 step of the default job) never imports the optional extra."""
    code = (
        "import sys; sys.path.insert(0, 'src'); from parallel_train.cli import main; "
        f"main(['train.max_steps=1', 'eval.iters=1', 'tracker=none', 'output_dir={tmp_path / 'run'}']); "
        "bad = sorted(m for m in ('peft', 'transformers') if m in sys.modules); assert not bad, bad; print('clean')"
    )
    result = check(run([PYTHON, "-c", code], env=launch_env(tmp_path), timeout=300))
    assert "clean" in result.stdout and (tmp_path / "run" / "model.safetensors").is_file()
