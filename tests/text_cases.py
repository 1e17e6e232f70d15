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
