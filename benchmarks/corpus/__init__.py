"""An architecture corpus of our own: every architecture transformers can build from its config,
shrunk generically to a tiny size, plus hand-written model styles; ``benchmarks/run_corpus.py``
runs the whole suite on each (docs/corpus.md)."""
