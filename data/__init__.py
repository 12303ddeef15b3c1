"""Data: the embedded default corpus, a byte tokenizer, ArrayRecord preparation, grain pipelines."""
