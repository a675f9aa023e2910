"""The test suite's data and run sizes, in a module of their own (no Prefect), so that test helpers run where
the suite's conftest cannot (a GPU machine without Prefect).
"""

# Small data and tokenizer that still exercise every stage: small corpus, small vocabulary.
SMALL_DATA = {
    "data.max_documents": 300,
    "model.vocab_size": 512,
    "tokenizer.sample_bytes": 400_000,
    "tokenizer.report_sample_bytes": 100_000,
}
# ... and a few training steps on it.
SMALL_RUN = {
    **SMALL_DATA,
    "training.max_steps": 12,
    "training.checkpoint_every": 5,
    "training.eval_every": 6,
    "training.eval_batches": 2,
}
