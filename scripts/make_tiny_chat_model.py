#!/usr/bin/env python3
"""Make a tiny chat model and a chat dataset offline: to try fine-tuning (docs/guide.md section 4a) without a download.

    python scripts/make_tiny_chat_model.py models/tiny_chat data/chats.jsonl
    python scripts/make_tiny_chat_model.py models/small_chat data/chats.jsonl --layers 4 --width 256 --conversations 2000
    python scripts/make_tiny_chat_model.py models/tiny_moe data/chats.jsonl --experts 8     # a Qwen3-MoE instead

MODEL_DIR gets what a Hub model folder holds (`save_pretrained`): a Llama with random weights (config.json,
model.safetensors) and its tokenizer, a byte-level BPE trained on Tiny Shakespeare that knows ChatML's two special
tokens (<|im_start|>, <|im_end|>: the end of a turn, its end-of-sequence token) and carries the ChatML chat template
(tokenizer.json, tokenizer_config.json, chat_template.jinja). CHATS_FILE gets one conversation per line,
{"messages": [{"role": ..., "content": ...}, ...]}: a system line, then one to three exchanges of Shakespeare's
lines, so samples have mixed lengths. With --experts N the model is a Qwen3-MoE of N experts per layer (each token runs
4 of them) instead of the Llama, saved as save_pretrained saves a Hub MoE (each expert's tensors apart).
Needs requirements-hf.txt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # run from a clone, no install step
from parallel_train.errors import OneLineParser  # noqa: E402 (errors.py imports nothing of the template)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def parse() -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_dir", type=Path, help="the model folder to write (model.hf_path=MODEL_DIR)")
    p.add_argument("chats_file", type=Path, help="the jsonl of conversations to write (data.path=CHATS_FILE)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--width", type=int, default=64, help="hidden size (4 attention heads, 2 key/value heads)")
    p.add_argument("--vocab", type=int, default=512, help="token ids of the BPE (and rows of the embedding)")
    p.add_argument("--conversations", type=int, default=400, help="rows of the chat jsonl")
    p.add_argument("--experts", type=int, default=0, help="0: a Llama; N: a Qwen3-MoE with N routed experts per layer, top-4")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the conversations")
    args = p.parse_args()
    if args.experts < 0:
        p.error(f"--experts: must be >= 0, got {args.experts}")
    for name in ("layers", "width", "vocab", "conversations"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.width % 4 or args.vocab < 256 + len(SPECIALS):  # 4 attention heads; the BPE's byte alphabet and specials
        p.error(f"--width must be a multiple of 4 and --vocab at least {256 + len(SPECIALS)}, got {args.width} and {args.vocab}")
    check_destinations(p, args.model_dir, args.chats_file)
    return args


def check_destinations(p: argparse.ArgumentParser, model_dir: Path, chats_file: Path) -> None:
    """MODEL_DIR a folder and CHATS_FILE a file, two different paths, each where a folder can be made: before anything
    is trained or written."""
    if model_dir.resolve() == chats_file.resolve():
        p.error(f"MODEL_DIR and CHATS_FILE are the same path ({model_dir}); give a folder and a file")
    for path, kind in ((model_dir, "a folder"), (chats_file, "a file")):
        if path.exists() and path.is_dir() != (kind == "a folder"):
            p.error(f"{path}: exists and is not {kind}")
        above = next(a for a in path.resolve().parents if a.exists())
        if not above.is_dir():
            p.error(f"{path}: cannot be written under {above}, a file")


def tokenizer(vocab: int, lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False)
    core.train_from_iterator([lines[i : i + 500] for i in range(0, len(lines), 500)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[2], pad_token=SPECIALS[0], chat_template=CHATML
    )


def conversations(lines: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Answer in verse."}]
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": rng.choice(lines)}, {"role": "assistant", "content": rng.choice(lines)}]
        rows.append({"messages": messages})
    return rows


def main() -> None:
    args = parse()
    import torch
    import transformers

    lines = [line for line in (REPO / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8").splitlines() if len(line) > 20]
    torch.manual_seed(args.seed)
    kind = "Qwen3Moe" if args.experts else "Llama"
    mlp = dict(num_experts=args.experts, num_experts_per_tok=min(4, args.experts), moe_intermediate_size=args.width * 3 // 8)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=args.vocab,
        hidden_size=args.width,
        **(mlp if args.experts else dict(intermediate_size=2 * args.width)),
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.width // 4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    getattr(transformers, f"{kind}ForCausalLM")(config).save_pretrained(args.model_dir)
    tokenizer(args.vocab, lines).save_pretrained(args.model_dir)
    args.chats_file.parent.mkdir(parents=True, exist_ok=True)
    args.chats_file.write_text("".join(json.dumps(r) + "\n" for r in conversations(lines, args.conversations, args.seed)), encoding="utf-8")
    print(
        f"a {args.layers}-layer {'Qwen3-MoE' if args.experts else 'Llama'} ({args.width} wide, {args.vocab} ids) in {args.model_dir}; {args.conversations} conversations in {args.chats_file}"
    )


if __name__ == "__main__":
    main()
