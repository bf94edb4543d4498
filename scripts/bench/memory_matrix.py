#!/usr/bin/env python3
"""The memory estimator against measured runs on every layout a CPU runs: each rank's estimate beside its peak.

    python scripts/bench/memory_matrix.py                     every cell (about 20 launches of a big and a tiny model)
    python scripts/bench/memory_matrix.py --cells ddp2,tp2    some cells
    python scripts/bench/memory_matrix.py --update-docs       also put the table into docs/BENCHMARKS.md
    python scripts/bench/memory_matrix.py --measured LOG      no launch: the measurements of an earlier run (the
                                                              lines it printed), estimated again by this checkout

A cell is a layout (1 process, DDP, FSDP2, TP, DP x TP, pipelines under each schedule, each checkpointing mode, LoRA)
launched twice with torchrun through scripts/bench/rank_peak.py: once with the cell's model and once with a tiny
model of the same layout (the baseline: torch, the process group, the data, the code). Every rank reports its peak
resident memory over its second optimizer step, with freed memory handed back at once (rank_peak.py says how).
Measured = big peak - tiny peak (the runtime's fixed cost cancels), estimated = the estimator's total for the big
model - its total for the tiny one (scripts/estimate_memory.py's figure, parallel/memory_estimate.py), per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import BARE_RUN, REPO, TORCHRUN, free_port, load, run_env, update_docs

START, END = "<!-- memory_matrix:start -->", "<!-- memory_matrix:end -->"
SECTION = "## The memory estimator against measured runs"
MIB = 2**20
COMMON = ("data.path=synthetic", "train.max_steps=2", *BARE_RUN)
# The cells' model: states and activations of the same order, both well above the measurement's noise (a few MB).
GPT = ("model.n_layer=8", "model.n_embd=384", "model.n_head=6", "model.block_size=256", "train.batch_size=8", "model.vocab_size=256")
TINY_GPT = ("model.n_embd=16", "model.n_head=2")  # put after the model's keys: the same depth, heads and layout
PIPE = ("parallel.microbatches=4",)
MOE = ("model.n_experts=4", "model.experts_per_token=2")  # the GPT's MLPs as 4 experts, 2 per token
# A Hugging Face Llama of about the GPT's size, and a tiny one of the same depth, written with random weights into
# folders made at run time ({big} and {tiny} below; LoRA adapts pretrained weights, so it reads them).
LLAMA = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2)
TINY_LLAMA = dict(hidden_size=24, intermediate_size=32, num_attention_heads=6, num_key_value_heads=2)
HF = ("model.name=hf", "model.hf_path={big}", "model.block_size=256", "train.batch_size=8", "model.vocab_size=256")
LORA = ("model.lora_rank=8", "model.lora_targets=[all-linear]")
# A transformers head of another task on dict batches (input_ids, attention_mask, token_type_ids, labels): a BERT
# sentence-pair classifier as configs/nlp_example.yaml trains it, every pair padded to the block.
BERT = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6)
TINY_BERT = dict(hidden_size=24, intermediate_size=32, num_attention_heads=6)
# A Hub mixture of experts from its config alone (random start): Qwen3-MoE, 4 experts of 512, 2 per token.
QWEN_MOE = dict(hidden_size=384, intermediate_size=1024, moe_intermediate_size=512, num_attention_heads=6, head_dim=64)
TINY_QWEN_MOE = dict(hidden_size=24, intermediate_size=32, moe_intermediate_size=32, num_attention_heads=6, head_dim=4)
HF_MOE = ("model.name=hf", "model.hf_path={moe}", "model.hf_pretrained=false", "model.block_size=256", "train.batch_size=8")
HF_MOE += ("model.vocab_size=256",)
CLASSIFIER = ("model.name=hf", "model.task=sequence-classification", "model.hf_path={bert}", "model.hf_pretrained=false")
CLASSIFIER += ("model.block_size=256", "train.batch_size=8", "data.path={pairs}")


@dataclass(frozen=True)
class Cell:
    nproc: int
    keys: tuple[str, ...]
    model: tuple[str, ...] = GPT
    tiny: tuple[str, ...] = TINY_GPT


def _cells() -> dict[str, Cell]:
    """Cell id -> cell; the table names each by its id (one- a single process, pp pipeline stages, tp tensor parallel)."""
    cells = {
        "one": Cell(1, ()),
        "one-full": Cell(1, ("model.activation_checkpointing=full",)),
        "one-op": Cell(1, ("model.activation_checkpointing=selective",)),
        "one-every2": Cell(1, ("model.activation_checkpointing=selective", "model.selective_ac=2")),
        "ddp2": Cell(2, ()),
        "fsdp2": Cell(2, ("parallel.dp_shard=2",)),
        "fsdp4": Cell(4, ("parallel.dp_shard=4",)),
        "fsdp2-full": Cell(2, ("parallel.dp_shard=2", "model.activation_checkpointing=full")),
        "tp2": Cell(2, ("parallel.tp=2",)),
        "dp2xtp2": Cell(4, ("parallel.dp_shard=2", "parallel.tp=2")),
    }
    for stages in (2, 4):
        for schedule in ("gpipe", "1f1b", "interleaved1f1b"):
            cells[f"pp{stages}-{schedule}"] = Cell(stages, (f"parallel.pipeline_stages={stages}", f"parallel.schedule={schedule}", *PIPE))
    cells["pp2-1f1b-op"] = Cell(2, (*cells["pp2-1f1b"].keys, "model.activation_checkpointing=selective"))
    # tensor parallel inside pipeline stages: sequence parallel between them, loss parallel on the last
    cells["pp2xtp2-1f1b"] = Cell(4, (*cells["pp2-1f1b"].keys, "parallel.tp=2"))
    # bf16 through the layers: FSDP2's policy over one data-parallel rank (parallel/sharding.py, fsdp_wraps)
    cells["tp2-bf16"] = Cell(2, (*cells["tp2"].keys, "train.mixed_precision=bf16"))
    cells["pp2-1f1b-bf16"] = Cell(2, (*cells["pp2-1f1b"].keys, "train.mixed_precision=bf16"))
    hf = {"model": HF, "tiny": ("model.hf_path={tiny}",)}
    cells["hf-one"] = Cell(1, (), **hf)
    cells["lora-one"] = Cell(1, LORA, **hf)
    cells["lora-fsdp2"] = Cell(2, (*LORA, "parallel.dp_shard=2"), **hf)
    cells["lora-pp2-1f1b"] = Cell(2, (*LORA, *cells["pp2-1f1b"].keys), **hf)
    cells["hf-pp2xtp2-1f1b"] = Cell(4, cells["pp2xtp2-1f1b"].keys, **hf)
    # context parallel (each rank T/cp of every sequence; FSDP2 over dp_shard x cp), and the GPT's experts over ep ranks
    cells["cp2"] = Cell(2, ("parallel.cp=2",))
    cells["cp2xfsdp2"] = Cell(4, ("parallel.cp=2", "parallel.dp_shard=2"))
    moe = {"model": (*GPT, *MOE), "tiny": TINY_GPT}
    cells["moe-one"] = Cell(1, (), **moe)
    cells["ep2"] = Cell(2, ("parallel.ep=2",), **moe)
    cells["ep2xfsdp2"] = Cell(4, ("parallel.ep=2", "parallel.dp_shard=4"), **moe)
    cells["ep2xfsdp2-full"] = Cell(4, (*cells["ep2xfsdp2"].keys, "model.activation_checkpointing=full"), **moe)
    cells["cp2-full"] = Cell(2, ("parallel.cp=2", "model.activation_checkpointing=full"))
    hf_moe = {"model": HF_MOE, "tiny": ("model.hf_path={moe_tiny}",)}
    cells["hf-moe-one"] = Cell(1, (), **hf_moe)
    cells["hf-moe-fsdp2"] = Cell(2, ("parallel.dp_shard=2",), **hf_moe)
    cells["hf-moe-ep2"] = Cell(2, ("parallel.dp_shard=2", "parallel.ep=2"), **hf_moe)
    bert = {"model": CLASSIFIER, "tiny": ("model.hf_path={bert_tiny}",)}
    cells["bert-cls-one"] = Cell(1, (), **bert)
    cells["bert-cls-fsdp2"] = Cell(2, ("parallel.dp_shard=2",), **bert)
    return cells


CELLS = _cells()


def write_folders(root: Path, names) -> dict[str, str]:
    """The folders the cells `names` read (the Hugging Face cells': see write_models), written only where one needs them."""
    return write_models(root) if any(CELLS[n].model != GPT for n in names) else {}


def write_models(root: Path) -> dict[str, str]:
    """The Hugging Face cells' folders: two Llamas (save_pretrained, random weights) {"big", "tiny"}, two Qwen3-MoE
    configs {"moe", "moe_tiny"} and two BERT classifiers (config and tokenizer) {"bert", "bert_tiny"}, which start from
    random weights, and the classifier's sentence pairs {"pairs"}."""
    import torch
    from datasets import Dataset
    from transformers import BertConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folders = {}
    for name, shape in (("big", LLAMA), ("tiny", TINY_LLAMA)):
        config = LlamaConfig(vocab_size=256, num_hidden_layers=8, max_position_embeddings=512, tie_word_embeddings=False, **shape)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(root / name)
        folders[name] = str(root / name)
    from transformers import Qwen3MoeConfig

    for name, shape in (("moe", QWEN_MOE), ("moe_tiny", TINY_QWEN_MOE)):
        Qwen3MoeConfig(
            vocab_size=256, num_hidden_layers=8, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **shape
        ).save_pretrained(root / name)
        folders[name] = str(root / name)
    words = [f"w{i}" for i in range(200)]
    special = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    for name, shape in (("bert", BERT), ("bert_tiny", TINY_BERT)):
        BertConfig(vocab_size=256, num_hidden_layers=8, max_position_embeddings=512, **shape).save_pretrained(root / name)
        PreTrainedTokenizerFast(tokenizer_object=_bert_tokenizer(words), **special).save_pretrained(root / name)
        folders[name] = str(root / name)
    pairs = Dataset.from_list(
        [
            # the second sentence longer than the block: every pair is cut to 256 tokens, every batch as wide as that
            {"sentence1": " ".join(words[i % 50 : i % 50 + 8]), "sentence2": " ".join((words * 2)[i % 90 : i % 90 + 250]), "label": i % 2}
            for i in range(64)
        ]
    )
    for split in ("train", "validation"):
        pairs.to_json(str(root / "pairs" / f"{split}.jsonl"))  # JSON lines
    folders["pairs"] = str(root / "pairs")
    return folders


def _bert_tokenizer(words: list[str]):
    """A word-level tokenizer with BERT's special tokens and pair template ([CLS] a [SEP] b [SEP], type ids 0 then 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


def arguments(cell: Cell, tiny: bool, folders: dict[str, str]) -> list[str]:
    """train.py's keys for the cell's model (`tiny`: the baseline's), the Llama folders filled in."""
    return [k.format(**folders) for k in (*COMMON, *cell.model, *(cell.tiny if tiny else ()), *cell.keys)]


def measure(cell: Cell, tiny: bool, out: Path, folders: dict[str, str], launcher=None) -> list[dict]:
    """Each rank's {"peak", "start"} bytes over its second step (rank_peak.py). `launcher(nproc, script, args, env)`: how to start
    it (torchrun by default; the test forks warm ranks)."""
    args = [*arguments(cell, tiny, folders), f"output_dir={out / 'run'}"]
    env = run_env(out, RANK_PEAK_DIR=str(out / "peaks"), HF_HUB_OFFLINE="1")
    if launcher is not None:
        launcher(cell.nproc, "scripts/bench/rank_peak.py", args, env)
    else:
        script = str(REPO / "scripts" / "bench" / "rank_peak.py")
        torchrun = [TORCHRUN, "--nproc-per-node", str(cell.nproc), "--master-port", str(free_port())]
        cmd = [*([sys.executable] if cell.nproc == 1 else torchrun), script, *args]
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return [json.loads((out / "peaks" / f"rank{r}.json").read_text()) for r in range(cell.nproc)]


def estimated(cell: Cell, tiny: bool, folders: dict[str, str]) -> list[tuple[int, int]]:
    """The estimator's (total, step) for every global rank (each rank's pipeline rank: its row); step: the total less
    what stands before a step (weights and optimizer state), rank_peak.py's peak - start."""
    from parallel_train.config.load import load_config
    from parallel_train.parallel.memory_estimate import estimate_config

    cfg, _ = load_config(arguments(cell, tiny, folders))
    layout, ranks, _ = estimate_config(cfg, cell.nproc)
    rows = [ranks[layout.coordinate(r)["pp"]] for r in range(cell.nproc)]
    return [(m.total(), m.total() - m.params - m.optimizer) for m in rows]


def run_cell(cell: Cell, tmp: Path, folders: dict[str, str], launcher=None) -> list[dict]:
    """Per rank: estimated and measured bytes above the tiny model of the same layout, and the same for what the step
    added at its peak above what stood before it (`step`, `step_estimated`: activations, scratch, gathered weights)."""
    big, tiny = (measure(cell, t, tmp / ("tiny" if t else "big"), folders, launcher) for t in (False, True))
    return compare(cell, big, tiny, folders)


def compare(cell: Cell, big: list[dict], tiny: list[dict], folders: dict[str, str]) -> list[dict]:
    est_big, est_tiny = estimated(cell, False, folders), estimated(cell, True, folders)
    step = lambda m: m["peak"] - m["start"]  # noqa: E731
    return [
        {
            "rank": r,
            "estimated": est_big[r][0] - est_tiny[r][0],
            "measured": big[r]["peak"] - tiny[r]["peak"],
            "step_estimated": est_big[r][1] - est_tiny[r][1],
            "step": step(big[r]) - step(tiny[r]),
        }
        for r in range(cell.nproc)
    ]


def reestimate(log: Path, update: bool) -> None:
    """The estimates again for the measurements an earlier run printed (`ID [{"rank", "estimated", "measured"}, ...]`
    per cell, and its load line): for a change to the estimator alone, without launching anything."""
    results, loads = {}, ""
    with tempfile.TemporaryDirectory() as tmp:
        lines = log.read_text().splitlines()
        ids = [line.split(" ", 1)[0] for line in lines if line.split(" ", 1)[0] in CELLS and line.split(" ", 1)[-1].startswith("[")]
        folders = write_folders(Path(tmp), ids)
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in CELLS and rest.startswith("["):
                cell, measured = CELLS[name], json.loads(rest)
                big, tiny = estimated(cell, False, folders), estimated(cell, True, folders)
                results[name] = [
                    {**r, "estimated": big[r["rank"]][0] - tiny[r["rank"]][0], "step_estimated": big[r["rank"]][1] - tiny[r["rank"]][1]}
                    for r in measured
                ]
            elif line.startswith("Load"):
                loads = line
    text = table(results) + f"\n\n{loads}"
    print(text)
    if update:
        update_docs(text, START, END, SECTION)


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| layout | rank | estimated | measured | estimate / measured |", "|---|---:|---:|---:|---:|"]
    for name, ranks in results.items():
        for r in ranks:
            ratio = r["estimated"] / r["measured"] if r["measured"] > 0 else float("nan")
            lines.append(f"| {name} | {r['rank']} | {r['estimated'] / MIB:,.1f} MiB | {r['measured'] / MIB:,.1f} MiB | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="", help="comma-separated cell ids (default: all): " + ",".join(CELLS))
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--measured", type=Path, help="an earlier run's output: its measurements, estimated again")
    a = parser.parse_args()
    if a.measured:
        return reestimate(a.measured, a.update_docs)
    names = [n.strip() for n in a.cells.split(",")] if a.cells else list(CELLS)
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        sys.exit(f"error: unknown cells {unknown}; known: {', '.join(CELLS)}")
    results, loads = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_folders(Path(tmp), names)
        for i, name in enumerate(names):
            loads.append(load())
            results[name] = run_cell(CELLS[name], Path(tmp) / str(i), folders)
            print(name, json.dumps(results[name]), flush=True)
    text = table(results) + f"\n\nLoad (1-minute average) at each cell's start: {min(loads):.1f}-{max(loads):.1f}."
    print(text)
    if a.update_docs:
        update_docs(text, START, END, SECTION)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
