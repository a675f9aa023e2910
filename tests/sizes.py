"""The test suite's data and run sizes, in a module of their own (no Prefect), so that test helpers run where
the suite's conftest cannot (a GPU machine without Prefect).
"""

# Small data and tokenizer that still exercise every stage: small corpus, small vocabulary.
SMALL_DATA = {
    "data.max_documents": 300,
    "model.vocab_size": 512,
    "tokenizer.sample_bytes": 400_000,
    "tokenizer.report_sample_bytes": 100_000,
    # Deduplication and decontamination, not the quality rules (~3 s of every prepare-data on these large source
    # files): every rule runs in the tiny preset's own pipelines (README, e2e) and in tests/unit/test_curation.py.
    "data.curation.gopher_quality": False,
    "data.curation.gopher_repetition": False,
    "data.curation.c4_quality": False,
    "data.curation.fineweb_quality": False,
}
# ... and a few training steps on it.
SMALL_RUN = {
    **SMALL_DATA,
    "training.max_steps": 12,
    "training.checkpoint_every": 5,
    "training.eval_every": 6,
    "training.eval_batches": 2,
}
