"""Exit codes by which a training job tells its launcher what happened (read by infra/ without importing torch)."""

EXIT_NAN = 3
"""The loss became NaN or inf with training.nan_policy=exit: relaunch from the last checkpoint (HLAT)."""
