#!/usr/bin/env python3
"""Tokenize a corpus once into memory-mapped token shards that `train.py data.path=OUTPUT` reads.

    python scripts/prepare_data.py --input data/tinyshakespeare.txt --output data/shakespeare_bpe1024 --tokenizer bpe:1024
    python scripts/prepare_data.py --input 'corpus/*.jsonl' --input extra.parquet --output data/mine --tokenizer byte --num_proc 8
    python scripts/prepare_data.py --input ORG/NAME --text_column content --output data/hub --tokenizer gpt2   # needs the Hub
    python scripts/prepare_data.py --format chat --input chats.jsonl --output data/chats --tokenizer MODEL_FOLDER

Inputs: .txt/.jsonl/.json/.csv/.parquet files, globs, a folder laid out like a Hub dataset (its train files),
or a Hub dataset name (online only). Tokenizers: char, byte, bpe:N (a byte-level BPE of N ids trained on the
inputs), word (one id per whitespace-separated word of the inputs, <eos> at line ends), a tokenizer.json or a
folder holding one, or a Hub tokenizer name (online only). A second run with
the same inputs and options does nothing. The format: src/parallel_train/data/prepared.py; docs/data.md.
--format chat|instruction prepares rows of conversations (or prompts and completions) rendered by the tokenizer's
chat template, with the mask of the assistant's tokens stored beside the tokens (data/prepared_samples.py);
train with data.format=chat|instruction.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a clone, no install step

from parallel_train.errors import UserError, run_cli  # noqa: E402


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like train.py (argparse prints usage too)
        raise UserError(f"{message} (see --help)")


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", action="append", required=True, help="a file, a glob, a dataset folder or a Hub dataset; repeat for more")
    p.add_argument("--output", type=Path, required=True, help="folder to write (train.py data.path=OUTPUT)")
    p.add_argument("--tokenizer", required=True, help="char, byte, bpe:N, word, a tokenizer.json or folder, or a Hub tokenizer name")
    p.add_argument("--text_column", default="text", help="column holding the text in json/csv/parquet/Hub data")
    p.add_argument("--val_fraction", type=float, default=0.1, help="share of the tokens (the last ones) held out for validation")
    p.add_argument("--num_proc", type=int, default=min(8, os.cpu_count() or 1), help="tokenizing processes")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--overwrite", action="store_true", help="replace data prepared from other inputs in --output")
    p.add_argument("--format", choices=("text", "chat", "instruction"), default="text", help="text, or rows of samples (data.format)")
    p.add_argument("--chat_template", default="", help="chat/instruction: a jinja chat template file instead of the tokenizer's own")
    p.add_argument("--messages_column", default="messages", help="--format chat: the column of each row's messages")
    p.add_argument("--prompt_column", default="prompt", help="--format instruction: the column of each row's prompt")
    p.add_argument("--completion_column", default="completion", help="--format instruction: the column of each row's completion")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val_fraction: must be in (0, 1), got {args.val_fraction}")
    if args.num_proc < 1:
        raise UserError(f"--num_proc: must be >= 1, got {args.num_proc}")
    if args.shard_tokens < 1:
        raise UserError(f"--shard_tokens: must be >= 1, got {args.shard_tokens}")
    return args


def main() -> int:
    args = parse(sys.argv[1:])
    from parallel_train.data.prepare import Options, prepare
    from parallel_train.data.tokenizers import check_spec
    from parallel_train.observe.messages import quiet_third_party

    check_spec(args.tokenizer, key="--tokenizer")
    quiet_third_party()
    opts = Options(
        args.input,
        args.output,
        args.tokenizer,
        args.text_column,
        args.val_fraction,
        args.num_proc,
        args.shard_tokens,
        args.overwrite,
        args.format,
        args.chat_template,
        args.messages_column,
        args.prompt_column,
        args.completion_column,
    )
    prepare(opts)
    return 0


if __name__ == "__main__":
    run_cli(main)
