"""A character-level tokenizer over printable ASCII, saved as a standard HF tokenizer."""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII covers arithmetic and GSM8K-style text; anything else maps to <unk>.
CHARACTERS = tuple(chr(code) for code in range(32, 127))


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; prepends <bos>; pads on the left (for generation)."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )


def save_char_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(directory)
    return tokenizer
