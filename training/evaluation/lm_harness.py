"""lm-eval-harness 0.4 on an exported Hugging Face folder, plus two offline tasks made from held-out text.

`write_offline_tasks` makes two offline tasks, so the harness runs with no network.
- `hlat_cloze`: predict a passage's last word, after LAMBADA (`perplexity` is per word).
- `hlat_choice`: pick the true continuation among four, after HellaSwag.
Unknown task names are refused before a model loads.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

CLOZE_TASK = "hlat_cloze"
CHOICE_TASK = "hlat_choice"
OFFLINE_TASKS = (CLOZE_TASK, CHOICE_TASK)

CONTEXT_CHARS = 400
"""Most characters of context before the point to predict."""
MIN_CONTEXT_CHARS = 100
"""Fewest characters of document before that point."""
CONTINUATION_CHARS = 100
"""Length of a `hlat_choice` continuation, before cutting to a word."""
MIN_DOCUMENT_CHARS = MIN_CONTEXT_CHARS + CONTINUATION_CHARS + 50
"""Shorter documents (ignoring surrounding whitespace) make no examples."""
SEGMENT_CHARS = CONTEXT_CHARS + CONTINUATION_CHARS
"""At most one example per task per segment of this many characters, so examples spread out."""
CHOICES = 4
DISTRACTOR_ATTEMPTS = 20
"""Random draws tried per distractor before dropping the example."""
DEFAULT_BOOTSTRAP_ITERS = 1000
"""Bootstrap resamples for `perplexity`'s standard error (lm-eval's 100,000 take minutes)."""
DATASETS_CACHE_DIR = "datasets-cache"
"""Where `datasets` keeps its Arrow copy of the JSONL files."""

# A word is a run of at least 3 letters, digits or underscores right after a single space that follows text, so
# the context ends on a non-space character and the target is exactly " " + word, as in LAMBADA.
_CLOZE_WORD = re.compile(r"(?<=\S) (\w{3,})")
# A point to continue from: a single space between two non-space characters (the space goes to the choice).
_CHOICE_SPLIT = re.compile(r"(?<=\S) (?=\S)")
_WORD_START = re.compile(r"(?<=\s)\S")
_SPACE_RUN = re.compile(r"\s+")

# Every variable through which huggingface_hub, transformers and datasets decide to stay off the network.
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")

# -- offline tasks ----------------------------------------------------------------------------------------------


def _passage_start(text: str, end: int) -> int:
    """Start of the context ending at `end`: at most CONTEXT_CHARS back, at a word start."""
    start = end - CONTEXT_CHARS
    if start <= 0:
        return 0
    space = _SPACE_RUN.search(text, start, end)
    return space.end() if space is not None else start


def _cut_at_word(text: str, start: int, length: int) -> str:
    """Up to `length` characters from `start`, cut back to a word boundary where sensible."""
    piece = text[start : start + length]
    if start + length < len(text) and not text[start + length].isspace():
        cut = next((i for i in range(len(piece) - 1, length // 2, -1) if piece[i].isspace()), None)
        if cut is not None:
            piece = piece[:cut]
    return piece.rstrip()


def _draw_positions(
    texts: list[str], pattern: re.Pattern[str], usable: Callable[[str, int], bool], rng: random.Random, most: int
) -> list[tuple[int, int]]:
    """Up to `most` (document, position) pairs, in document order, drawn from random segments."""
    segments = [(doc, start) for doc, text in enumerate(texts) for start in range(0, len(text), SEGMENT_CHARS)]
    rng.shuffle(segments)
    drawn: list[tuple[int, int]] = []
    for doc, start in segments:
        if len(drawn) == most:
            break
        text, candidates = texts[doc], []
        for match in pattern.finditer(text, start):  # lookbehinds still see the text before `start`
            if match.start() >= start + SEGMENT_CHARS:
                break
            if usable(text, match.start()):
                candidates.append(match.start())
        if candidates:
            drawn.append((doc, rng.choice(candidates)))
    return sorted(drawn)


def _cloze_examples(texts: list[str], rng: random.Random, most: int) -> list[dict[str, Any]]:
    def usable(text: str, space: int) -> bool:
        return space >= MIN_CONTEXT_CHARS

    examples = []
    for doc, space in _draw_positions(texts, _CLOZE_WORD, usable, rng, most):
        text = texts[doc]
        word = _CLOZE_WORD.match(text, space)
        assert word is not None  # the position came from the same pattern
        context = text[_passage_start(text, space) : space]
        examples.append({"context": context, "target": " " + word.group(1), "doc": doc, "offset": space})
    return examples


def _distractor(texts: list[str], doc: int, length: int, rng: random.Random, taken: list[str]) -> str | None:
    """A continuation of about `length` characters from a document other than `doc`."""
    for _ in range(DISTRACTOR_ATTEMPTS):
        other = rng.randrange(len(texts) - 1)
        if other >= doc:  # any document but `doc`
            other += 1
        text = texts[other]
        start = _WORD_START.search(text, rng.randrange(max(1, len(text) - length)))
        if start is None:
            continue
        piece = _cut_at_word(text, start.start(), length)
        if len(piece) >= length // 2 and piece not in taken:
            return piece
    return None


def _choice_examples(texts: list[str], rng: random.Random, most: int) -> list[dict[str, Any]]:
    if len(texts) < 2:
        return []

    def usable(text: str, space: int) -> bool:
        return space >= MIN_CONTEXT_CHARS and space + 1 + CONTINUATION_CHARS <= len(text)

    examples = []
    for doc, space in _draw_positions(texts, _CHOICE_SPLIT, usable, rng, most):
        text = texts[doc]
        true = _cut_at_word(text, space + 1, CONTINUATION_CHARS)
        choices = [true]
        while len(choices) < CHOICES:
            piece = _distractor(texts, doc, len(true), rng, choices)
            if piece is None:
                break
            choices.append(piece)
        if len(choices) < CHOICES:
            continue
        gold = rng.randrange(CHOICES)
        distractors = choices[1:]
        choices = [*distractors[:gold], true, *distractors[gold:]]
        context = text[_passage_start(text, space) : space]
        examples.append({"context": context, "choices": choices, "gold": gold, "doc": doc, "offset": space})
    return examples


def _task_yaml(name: str, data_file: str, cache_dir: str) -> dict[str, Any]:
    """The lm-eval task config of one offline task."""
    config: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        # cache_dir keeps datasets' Arrow copy with the tasks (and out of ~/.cache), so it goes away with them.
        "dataset_kwargs": {"data_files": {"test": data_file}, "cache_dir": cache_dir},
        "test_split": "test",
        "doc_to_text": "context",
    }
    if name == CLOZE_TASK:
        config.update(
            {
                "output_type": "loglikelihood",
                "doc_to_target": "target",
                # The target carries its own leading space; the default " " would double it in few-shot prompts.
                "target_delimiter": "",
                "metric_list": [
                    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                    {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                ],
            }
        )
    else:
        config.update(
            {
                "output_type": "multiple_choice",
                "doc_to_target": "gold",
                "doc_to_choice": "choices",
                "metric_list": [
                    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
                ],
            }
        )
    config["metadata"] = {"version": 1.0}
    return config


def write_offline_tasks(texts: list[str], out_dir: str, seed: int = 0, max_examples: int = 500) -> list[str]:
    """Write `hlat_cloze` and `hlat_choice` made from `texts` into `out_dir`; return their names.

    `out_dir` becomes `run_harness`'s `include_path`. Same texts and seed, same files.
    ValueError when a task gets no example. `texts[doc][offset]` is the space after an example's context.
    """
    import yaml

    if max_examples < 1:
        raise ValueError(f"max_examples must be at least 1, got {max_examples}")
    kept = [i for i, text in enumerate(texts) if len(text.strip()) >= MIN_DOCUMENT_CHARS]
    documents = [texts[i] for i in kept]
    if not documents:
        raise ValueError(
            f"no offline lm-eval examples could be made: none of the {len(texts)} held-out documents has "
            f"{MIN_DOCUMENT_CHARS} or more characters; give longer held-out text"
        )
    # String seeds are hashed with SHA-512, not hash(): the same in every process, whatever PYTHONHASHSEED.
    made = {
        CLOZE_TASK: _cloze_examples(documents, random.Random(f"{seed}:{CLOZE_TASK}"), max_examples),
        CHOICE_TASK: _choice_examples(documents, random.Random(f"{seed}:{CHOICE_TASK}"), max_examples),
    }
    if not made[CLOZE_TASK]:
        raise ValueError(
            f"no {CLOZE_TASK} example could be made from {len(documents)} documents: none has a word of 3 or more "
            f"letters/digits after a space at least {MIN_CONTEXT_CHARS} characters in"
        )
    if not made[CHOICE_TASK]:
        raise ValueError(
            f"no {CHOICE_TASK} example could be made from {len(documents)} usable document(s): it needs at least "
            f"2 documents of {MIN_DOCUMENT_CHARS}+ characters (distractors come from other documents)"
        )
    out = os.path.abspath(out_dir)
    os.makedirs(out, exist_ok=True)
    cache_dir = os.path.join(out, DATASETS_CACHE_DIR)
    shutil.rmtree(cache_dir, ignore_errors=True)  # never serve a previous call's examples
    for name, examples in made.items():
        data_file = os.path.join(out, f"{name}.jsonl")
        with open(data_file, "w", encoding="utf-8") as fh:
            for example in examples:
                example["doc"] = kept[example["doc"]]  # the index in `texts`, blank ones counted
                fh.write(json.dumps(example, ensure_ascii=False) + "\n")
        with open(os.path.join(out, f"{name}.yaml"), "w", encoding="utf-8") as fh:
            yaml.safe_dump(_task_yaml(name, data_file, cache_dir), fh, sort_keys=False, allow_unicode=True)
    return list(made)


# -- task names -------------------------------------------------------------------------------------------------


def _task_manager(include_path: str | None, include_defaults: bool = True, **kwargs: Any) -> TaskManager:
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise ValueError(f"lm-eval include_path {include_path} is not a folder")
    return TaskManager(include_path=include_path, include_defaults=include_defaults, **kwargs)


@functools.lru_cache(maxsize=1)
def _builtin_task_names() -> frozenset[str]:
    """Names lm-eval ships (indexing its YAML files takes seconds)."""
    return frozenset(_task_manager(None).all_tasks)


def _included_task_names(include_path: str | None) -> set[str]:
    if include_path is None:
        return set()
    return set(_task_manager(include_path, include_defaults=False).all_tasks)


def known_tasks(include_path: str | None) -> set[str]:
    """Every task, group and tag lm-eval can run, `include_path`'s included."""
    return set(_builtin_task_names()) | _included_task_names(include_path)


def _unknown_tasks(tasks: list[str], included: set[str]) -> ValueError | None:
    unknown = [t for t in tasks if t not in included and t not in _builtin_task_names()]
    if not unknown:
        return None
    names = sorted(_builtin_task_names() | included)
    problems = []
    for task in unknown:
        close = difflib.get_close_matches(task, names, n=3)
        if task in OFFLINE_TASKS:
            hint = "it is made by write_offline_tasks: pass the folder it wrote as include_path"
        elif close:
            hint = f"did you mean {' or '.join(repr(c) for c in close)}?"
        else:
            hint = "see `lm-eval ls tasks`"
        problems.append(f"unknown lm-eval task {task!r} ({hint})")
    return ValueError("evaluation.tasks: " + "; ".join(problems))


def check_tasks(tasks: list[str], include_path: str | None) -> None:
    """Raise ValueError naming every unknown task, with the closest known names."""
    error = _unknown_tasks(tasks, _included_task_names(include_path))
    if error is not None:
        raise error


# -- running the harness ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """These environment variables set for the duration (process-wide), then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """No request to the Hugging Face hub for the duration; module constants are switched too."""
    import datasets.config
    import huggingface_hub.constants

    flags = [
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
    ]
    saved = [(module, name, getattr(module, name)) for module, name in flags]
    with _environment(dict.fromkeys(_OFFLINE_ENV, "1")):
        for module, name in flags:
            setattr(module, name, True)
        try:
            yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)


def _number(value: Any) -> float | int | None:
    """A JSON-safe metric value: finite numbers, else None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _compact(raw: dict[str, Any]) -> dict[str, Any]:
    """Per task: metrics (lm-eval's "none" filter suffix dropped), samples, shots, directions and version."""
    tasks: dict[str, Any] = {}
    for name, row in raw["results"].items():
        metrics: dict[str, float | int | None] = {}
        for key, value in row.items():
            metric, comma, filter_name = key.partition(",")
            if comma:  # the other entries (alias, name, sample_len) are not metrics
                metrics[metric if filter_name == "none" else key] = _number(value)
        counts = raw.get("n-samples", {}).get(name)
        n_samples = counts["effective"] if counts else row.get("sample_len")
        version = raw.get("versions", {}).get(name)
        tasks[name] = {
            "metrics": dict(sorted(metrics.items())),
            "n_samples": None if n_samples is None else int(n_samples),
            "num_fewshot": _number(raw.get("n-shot", {}).get(name)),
            "higher_is_better": {
                str(k): None if v is None else bool(v) for k, v in raw.get("higher_is_better", {}).get(name, {}).items()
            },
            "version": version if version is None or isinstance(version, str) else _number(version),
        }
    return tasks


def run_harness(
    model_dir: str,
    tasks: list[str],
    include_path: str | None,
    limit: int | None,
    batch_size: int,
    device: str = "cpu",
    num_fewshot: int | None = None,
    seed: int = 0,
    offline: bool | None = None,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
) -> dict[str, Any]:
    """Run lm-eval's `simple_evaluate` with its "hf" model on `model_dir`; return compact plain-JSON results.

    Task names are checked first. `offline` (None: when every task is local) keeps the call off the hub.
    """
    import lm_eval

    if not tasks:
        raise ValueError("evaluation.tasks is empty: name at least one lm-eval task")
    pretrained = os.path.abspath(model_dir)
    model_args = {"pretrained": pretrained, "dtype": "bfloat16" if device.startswith("cuda") else "float32"}
    local: TaskManager | None = None  # the tasks under include_path alone
    if include_path is not None:
        local = _task_manager(include_path, include_defaults=False, metadata=dict(model_args))
    error = _unknown_tasks(tasks, set(local.all_tasks) if local is not None else set())
    if error is not None:
        raise error
    if not os.path.isfile(os.path.join(pretrained, "config.json")):
        raise ValueError(f"{pretrained} is not a Hugging Face model folder (no config.json); export the model first")
    # Plain tasks defined under include_path need no index of lm-eval's own ~15k YAML files (seconds to build);
    # a group or tag there may name lm-eval's tasks, so it gets the full index.
    local_only = local is not None and all(task in local.all_subtasks for task in tasks)
    if offline is None:
        offline = local_only
    manager = local if local is not None and local_only else _task_manager(include_path, metadata=dict(model_args))
    # DISABLE_MULTIPROC: bootstrapped standard errors run in this process, not in a fork pool of every core.
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environment({"DISABLE_MULTIPROC": "1"}))
        if offline:
            stack.enter_context(_hub_offline())
        raw = lm_eval.simple_evaluate(
            model="hf",
            model_args=model_args,  # a dict: a string would be split at any comma in the path
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            device=device,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if raw is None:
        raise RuntimeError("lm-eval returned no results (it returns them on rank 0 only)")
    return {
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "offline": offline,
        "tasks": _compact(raw),
    }
