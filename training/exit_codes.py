"""Exit codes by which a training job tells its launcher what happened (read by infra/ without importing torch)."""

EXIT_NAN = 3
"""The loss became NaN or inf with training.nan_policy=exit: relaunch from the last checkpoint (HLAT)."""

EXIT_BURN_IN_FAILED = 4
"""The burn-in program (`training.burn_in`) found a rank below its instance type's floors or computing wrong results;
its report (burn-in/report.json) and the failure reason (`BurnInFailed: ...`) name the ranks."""

EXIT_UNHEALTHY = 5
"""A periodic health check inside training (burn_in.health_check_every) found the all-reduce wrong or below its
bandwidth floor (`UnhealthyCollective: ...`): relaunch, on other nodes if it repeats, from the last checkpoint."""

EXIT_DATA_INVALID = 6
"""The prepare-data job (`training.prepare_data`) met data its policy refuses (data.validation.policy=fail, an empty
source, too many duplicates...): not worth relaunching; the failure reason (`DataValidationError: ...`) says where."""
