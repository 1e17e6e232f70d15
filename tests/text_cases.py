"""A few lines of text and a word-level tokenizer trained on them, for the tests of token data,
tokenizers and exports."""

LINES = ["the cat sat on the mat", "a dog ate the cat food", "the mat was red and the dog sat"]


def word_tokenizer(path):
    """A WordLevel tokenizer trained on LINES, saved as ``path`` (a tokenizer.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train_from_iterator(LINES, trainer)
    tokenizer.save(str(path))
    return path


def llama_config(folder, vocab_size: int, max_positions: int):
    """A 2-layer Llama's config.json saved in ``folder``, for runs that build it from a config;
    returns the config.json's path."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
    )
    config.save_pretrained(folder)
    return folder / "config.json"
