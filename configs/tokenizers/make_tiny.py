"""Train the tiny models' tokenizer: a byte-level BPE with 512 ids (the tiny vocab size).

Ids 0, 1, 2 are <|bos|>, <|eos|>, <|pad|> (the tiny configs' bos/eos/pad ids); 3..258 the 256
bytes; the rest BPE merges learned from the fixed text below (this repo's step convention and a
few lines of chat-like text). Run from the repo root; writes v4.1-flash-tiny.json and
v4-flash-tiny.json (the same tokenizer) next to this script.

    python configs/tokenizers/make_tiny.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
TEXT = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "One engine step is one graph. It processes new tokens belonging to requests.",
]


def main() -> None:
    text = TEXT + (HERE.parent.parent / "docs" / "step-convention.md").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() == 512, tok.get_vocab_size()
    for name in ("v4.1-flash-tiny", "v4-flash-tiny"):
        tok.save(str(HERE / f"{name}.json"))


if __name__ == "__main__":
    main()
