"""What a newcomer reads at the end of a stage: figures labelled with what they are and rounded to what they mean."""

from __future__ import annotations

from hlat.infra.supervision.ledger import Attempt
from hlat.tasks.evaluate import evaluation_summary
from hlat.tasks.train import summary_line, summary_rows

SUMMARY = {
    "final_step": 600,
    "loss": 4.776812345,
    "val_loss": 4.80112345,
    "tokens_per_s": 4698.17,
    "startup_s": 37.6,
    "grad_norm": 0.4123456,
    "lr": 0.000123456,
    "mfu": None,
    "jobs": 1,
    "cost_usd": 0.0,
}


def test_the_training_line_and_report_round_every_figure_and_say_what_it_is() -> None:
    assert summary_line(SUMMARY) == "train: step 600, loss 4.7768, val_loss 4.8011, 1 job(s), $0.00"
    rows = {r["metric"]: r["value"] for r in summary_rows(SUMMARY)}
    assert rows["training loss, last logged step"] == "4.7768"
    assert rows["tokens/s, average from the first logged step to the last (the progress line's)"] == "4,698"
    assert rows["start-up before the first step (s)"] == "38"
    assert rows["learning rate, last logged step"] == "0.000123" and rows["cost"] == "$0.00"
    assert rows["MFU, last logged step"] == ""  # unknown, not "None"


def test_the_evaluation_line_rounds_its_scores() -> None:
    results = {
        "perplexity": {"perplexity": 266.55239442907276, "bits_per_byte": 2.6377719733898064},
        "lm_eval": {"tasks": {"hlat_choice": {"metrics": {"acc_norm": 0.26171875, "acc_norm_stderr": 0.01}}}},
    }
    assert evaluation_summary(results) == "perplexity 266.55, 2.638 bits/byte, hlat_choice acc_norm 0.262"


def test_an_attempt_still_training_shows_the_step_it_reached_not_only_its_checkpoints() -> None:
    attempt = Attempt(attempt=1, job_name="run-train-1", status="Training", start_step=0, last_logged_step=50)
    row = attempt.row()
    assert row["steps checkpointed"] == 0 and row["last step logged"] == 50
