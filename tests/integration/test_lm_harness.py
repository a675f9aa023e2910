"""lm-eval-harness through its Python API on a tiny exported model, with the offline tasks made from stdlib source."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may come from the hub
os.environ["HF_DATASETS_OFFLINE"] = "1"

import argparse
import collections
import dataclasses
import functools
import inspect
import json
import math
import re
import socket
import string
import textwrap
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hlat.core.config import ModelConfig, TokenizerConfig
from hlat.infra.inputs.tokenizer import export_hf_tokenizer, train_sentencepiece, training_lines
from hlat.training.checkpoint.hf_export import export_hf
from hlat.training.evaluation import lm_harness
from hlat.training.evaluation.lm_harness import (
    CHOICE_TASK,
    CHOICES,
    CLOZE_TASK,
    CONTINUATION_CHARS,
    check_tasks,
    known_tasks,
    run_harness,
    write_offline_tasks,
)
from hlat.training.model import Transformer

TEXTS = [inspect.getsource(m) for m in (argparse, textwrap, collections, typing, dataclasses, functools, string, json)]
STANDARD_TASKS = {
    "hellaswag",
    "arc_easy",
    "arc_challenge",
    "mmlu",
    "gsm8k",
    "nq_open",
    "triviaqa",
    "winogrande",
    "piqa",
    "boolq",
    "openbookqa",
}
MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, vocab_size=512, max_seq_len=512)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Llama with a sentencepiece tokenizer trained on TEXTS, as an HF folder."""
    root = tmp_path_factory.mktemp("lm-harness")
    cfg = TokenizerConfig(sample_bytes=200_000, threads=1)
    lines = training_lines(iter(TEXTS), cfg.sample_bytes, cfg.max_sentence_length)
    tokenizer_model = train_sentencepiece(lines, MODEL.vocab_size, cfg, str(root / "tokenizer"))
    export_hf_tokenizer(tokenizer_model, str(root / "tokenizer"), MODEL.max_seq_len)
    torch.manual_seed(0)
    model = Transformer(MODEL)
    model.init_weights()
    return export_hf(model, MODEL, root / "hf", tokenizer_dir=str(root / "tokenizer"))


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every IP connection attempt fails and is recorded; the hub's offline switches start off."""
    import datasets.config
    import huggingface_hub.constants

    attempts: list[Any] = []
    real_connect = socket.socket.connect

    def guarded(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"test: network access to {address} attempted")
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    yield attempts


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# -- offline tasks ----------------------------------------------------------------------------------------------


def test_offline_tasks_are_deterministic_and_well_formed(tmp_path: Path) -> None:
    texts = ["", "   \n ", "too short", *TEXTS]
    names = write_offline_tasks(texts, str(tmp_path / "a"), seed=3, max_examples=60)
    assert names == [CLOZE_TASK, CHOICE_TASK]
    write_offline_tasks(texts, str(tmp_path / "b"), seed=3, max_examples=60)
    write_offline_tasks(texts, str(tmp_path / "c"), seed=4, max_examples=60)
    for name in names:
        data = (tmp_path / "a" / f"{name}.jsonl").read_bytes()
        assert data == (tmp_path / "b" / f"{name}.jsonl").read_bytes()
        assert data != (tmp_path / "c" / f"{name}.jsonl").read_bytes()

        config = yaml.safe_load((tmp_path / "a" / f"{name}.yaml").read_text())
        data_file = config["dataset_kwargs"]["data_files"]["test"]
        assert config["task"] == name and config["dataset_path"] == "json" and config["test_split"] == "test"
        assert os.path.isabs(data_file) and Path(data_file) == tmp_path / "a" / f"{name}.jsonl"
        assert config["metadata"] == {"version": 1.0} and config["doc_to_text"] == "context"
    cloze = yaml.safe_load((tmp_path / "a" / f"{CLOZE_TASK}.yaml").read_text())
    choice = yaml.safe_load((tmp_path / "a" / f"{CHOICE_TASK}.yaml").read_text())
    assert cloze["output_type"] == "loglikelihood" and [m["metric"] for m in cloze["metric_list"]] == [
        "acc",
        "perplexity",
    ]
    assert choice["output_type"] == "multiple_choice" and choice["doc_to_choice"] == "choices"
    assert [m["metric"] for m in choice["metric_list"]] == ["acc", "acc_norm"]

    examples = read_jsonl(tmp_path / "a" / f"{CLOZE_TASK}.jsonl")
    assert len(examples) == 60 and len({e["doc"] for e in examples}) > len(TEXTS) // 2  # spread over the documents
    for e in examples:
        assert re.fullmatch(r" \w{3,}", e["target"]) and e["context"] and not e["context"][-1].isspace()
        text, offset = texts[e["doc"]], e["offset"]  # doc indexes `texts`, the skipped ones included
        assert text[offset - len(e["context"]) : offset + len(e["target"])] == e["context"] + e["target"]
        assert not re.match(r"\w", text[offset + len(e["target"]) :])  # the whole word

    examples = read_jsonl(tmp_path / "a" / f"{CHOICE_TASK}.jsonl")
    assert len(examples) == 60
    assert len({e["gold"] for e in examples}) == CHOICES  # the answer is not always in the same place
    for e in examples:
        text, offset, choices = texts[e["doc"]], e["offset"], e["choices"]
        assert len(choices) == len(set(choices)) == CHOICES and all(choices)
        assert text[offset - len(e["context"]) : offset] == e["context"] and text[offset] == " "
        assert text[offset + 1 :].startswith(choices[e["gold"]]) and len(choices[e["gold"]]) <= CONTINUATION_CHARS
        for i, choice_text in enumerate(choices):
            in_other = any(choice_text in t for d, t in enumerate(texts) if d != e["doc"])
            assert in_other or i == e["gold"]


def test_offline_tasks_refuse_unusable_text(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="none of the 0 held-out documents"):
        write_offline_tasks([], str(tmp_path))
    with pytest.raises(ValueError, match="none of the 3 held-out documents has 250 or more characters"):
        write_offline_tasks(["", "  \n\t ", "a short note"], str(tmp_path))
    with pytest.raises(ValueError, match=r"hlat_choice.*at least 2 documents"):
        write_offline_tasks(TEXTS[:1], str(tmp_path))
    with pytest.raises(ValueError, match=r"hlat_cloze.*word"):
        write_offline_tasks([". " * 300, "? " * 300], str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing is written when a task cannot be made


# -- task names -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_known_tasks_include_the_standard_suite_and_the_offline_tasks(tmp_path: Path) -> None:
    started = time.perf_counter()
    builtin = known_tasks(None)
    print(f"lm-eval task index: {time.perf_counter() - started:.1f}s, {len(builtin)} names")
    assert builtin >= STANDARD_TASKS and CLOZE_TASK not in builtin
    write_offline_tasks(TEXTS, str(tmp_path), max_examples=5)
    assert known_tasks(str(tmp_path)) == builtin | {CLOZE_TASK, CHOICE_TASK}
    check_tasks(["hellaswag", CLOZE_TASK], str(tmp_path))
    with pytest.raises(ValueError, match=r"include_path .* is not a folder"):
        known_tasks(str(tmp_path / "missing"))


@pytest.mark.slow
def test_unknown_task_fails_before_the_model_is_loaded(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"^evaluation\.tasks: unknown lm-eval task 'helaswag' \(did you mean 'hellaswag'"
    ):
        check_tasks(["helaswag", "arc_easy"], None)
    with pytest.raises(ValueError) as caught:
        check_tasks(["arc_esay", "hlat_cloze", "zzqqxx-nothing-like-it"], None)
    message = str(caught.value)
    assert "'arc_esay' (did you mean 'arc_easy'" in message
    assert "'hlat_cloze' (it is made by write_offline_tasks: pass the folder it wrote as include_path)" in message
    assert "'zzqqxx-nothing-like-it' (see `lm-eval ls tasks`)" in message
    # No model folder at all: the name check comes first.
    with pytest.raises(ValueError, match="did you mean 'hellaswag'"):
        run_harness(str(tmp_path / "no-model"), ["helaswag"], None, limit=1, batch_size=1)


# -- the harness on a real (tiny) model -------------------------------------------------------------------------


@pytest.mark.slow
def test_run_harness_on_the_offline_tasks(exported: Path, tmp_path: Path, no_network: list[Any]) -> None:
    import datasets.config
    import huggingface_hub.constants

    include_path = str(tmp_path / "tasks")
    tasks = write_offline_tasks(TEXTS, include_path, seed=0, max_examples=40)
    started = time.perf_counter()
    results = run_harness(str(exported), tasks, include_path, limit=10, batch_size=8, seed=0)
    print(f"run_harness: {time.perf_counter() - started:.1f}s")

    assert no_network == []
    # The offline switches were on for the call only.
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False
    assert "HF_HUB_OFFLINE" not in os.environ and "DISABLE_MULTIPROC" not in os.environ
    json.dumps(results, allow_nan=False)  # plain JSON values only
    assert results["limit"] == 10 and results["num_fewshot"] is None and results["offline"] is True
    assert results["lm_eval_version"].startswith("0.4")
    assert set(results["tasks"]) == {CLOZE_TASK, CHOICE_TASK}

    cloze, choice = results["tasks"][CLOZE_TASK], results["tasks"][CHOICE_TASK]
    assert cloze["n_samples"] == choice["n_samples"] == 10
    assert cloze["num_fewshot"] == choice["num_fewshot"] == 0
    assert set(cloze["metrics"]) == {"acc", "acc_stderr", "perplexity", "perplexity_stderr"}
    assert set(choice["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    for metric in ("acc", "acc_norm"):
        assert 0 <= choice["metrics"][metric] <= 1
    assert 0 <= cloze["metrics"]["acc"] <= 1
    # An untrained model of 512 pieces: a word of a few pieces is far from certain, but finite.
    assert math.isfinite(cloze["metrics"]["perplexity"]) and cloze["metrics"]["perplexity"] > 1
    assert cloze["higher_is_better"] == {"acc": True, "perplexity": False}
    assert choice["higher_is_better"] == {"acc": True, "acc_norm": True}

    # The same call gives the same numbers.
    again = run_harness(str(exported), [CHOICE_TASK], include_path, limit=10, batch_size=3, seed=0)
    assert again["tasks"][CHOICE_TASK]["metrics"] == pytest.approx(choice["metrics"])


def test_hub_is_unreachable_inside_the_offline_guard(no_network: list[Any]) -> None:
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import get_session

    with lm_harness._hub_offline(), pytest.raises(OfflineModeIsEnabled):
        get_session().get("https://huggingface.co/api/models/gpt2")
    assert no_network == []
