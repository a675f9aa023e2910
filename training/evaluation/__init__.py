"""What the evaluation job measures: held-out perplexity and bits per byte (`perplexity`) and lm-eval-harness tasks on
the exported model (`lm_harness`)."""
