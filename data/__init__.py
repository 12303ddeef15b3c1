"""Data: the embedded default corpus, tokenizers, preparation into token files, the data order
(independent windows), grain pipelines."""
