"""Build the small tokenizer and dataset shipped in ``titan_dualpipe/titan/assets/``.

The debug configs must train with nothing downloaded, so the project ships its own data:
a generated corpus of short, regular English sentences (learnable enough that the loss
of a tiny model falls within a few steps) and a byte-level BPE trained on it with the
``tokenizers`` library. Its vocabulary fits llama3 ``debugmodel`` (``vocab_size=2048``).

    python -m titan_dualpipe.titan.make_assets      # rewrites the files (deterministic)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .data import DATASET_FILE, TOKENIZER_DIR

VOCAB_SIZE = 2000  # < 2048, the debugmodel's embedding rows
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
N_DOCUMENTS = 1500
SEED = 0

_NAMES = "Ada Ben Cleo Dev Eli Fay Gus Hana Ivo Jun Kai Lea Max Nia Oto Pia Rui Sol Tam Uma".split()
_ANIMALS = "cat dog fox owl bee crow deer frog goat hare lynx mole newt otter seal toad wolf yak".split()
_THINGS = "book lamp cup key coat map bell drum kite rope boat box pen hat ring seed".split()
_PLACES = "garden river market forest harbor valley library kitchen station village meadow bridge".split()
_COLOURS = "red blue green yellow white black brown grey orange purple".split()
_VERBS = (("finds", "found"), ("carries", "carried"), ("paints", "painted"), ("sells", "sold"),
          ("hides", "hid"), ("mends", "mended"), ("draws", "drew"), ("buys", "bought"))
_NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
            "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()


def _sentence(rng: random.Random) -> str:
    name, animal, thing, place = (rng.choice(x) for x in (_NAMES, _ANIMALS, _THINGS, _PLACES))
    colour, (verb, past) = rng.choice(_COLOURS), rng.choice(_VERBS)
    a, b = rng.randrange(11), rng.randrange(11)
    templates = (
        f"{name} {verb} a {colour} {thing} in the {place}.",
        f"Yesterday {name} {past} the {thing} near the {place}.",
        f"The {animal} sleeps by the {colour} {thing}.",
        f"In the {place} the {animal} watches {name}.",
        f"{_NUMBERS[a].capitalize()} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}.",
        f"{name} counts {', '.join(_NUMBERS[a:a + 4])}.",
        f"Every {animal} in the {place} likes the {colour} {thing}.",
        f"When {name} {verb} the {thing}, the {animal} runs to the {place}.",
    )
    return rng.choice(templates)


def corpus(n_documents: int = N_DOCUMENTS, seed: int = SEED) -> list[str]:
    """Deterministic documents of 3-8 sentences each."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) for _ in range(n_documents)]


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Byte-level BPE (llama3-style special tokens) as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_dataset(texts: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def main() -> None:
    texts = corpus()
    train_tokenizer(texts, TOKENIZER_DIR)
    write_dataset(texts, DATASET_FILE)
    print(f"wrote {TOKENIZER_DIR} and {DATASET_FILE}")


if __name__ == "__main__":
    main()
