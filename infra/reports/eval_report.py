"""Evaluation output for people: a markdown report and charts beside results.json, and a two-run comparison.

`compare_runs` finds where two runs' losses part, to check a resumed run or new kernel. Charts use a bare Agg `Figure`,
never pyplot, so no global backend changes.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hlat.core.layout import EVAL_DIR, EVAL_REPORT, METRICS_FILE, eval_path
from hlat.core.layout import EVAL_REPORT_FILE as REPORT_FILE
from hlat.core.layout import EVAL_RESULTS_FILE as RESULTS_FILE
from hlat.core.run import Run
from hlat.core.storage import Storage

log = logging.getLogger("hlat.eval_report")

BASELINES_FILE = Path(__file__).with_name("baselines.json")
COMPARE_FILE = "compare.md"
MISSING = "—"

# Metrics lm-eval reports as fractions in [0, 1]: shown ×100 to sit beside published percentages.
_FRACTION_METRICS = frozenset({"acc", "acc_norm", "exact_match", "em", "f1", "mc1", "mc2", "contains"})
_PREFERRED_METRICS = ("acc_norm", "acc", "exact_match")
_COMPARED_KEYS = ("loss", "grad_norm")
_COMPARE_TABLE_ROWS = 20


# -- metrics.jsonl -------------------------------------------------------------------------------------------


def read_metrics(run: Run) -> list[dict[str, Any]]:
    """The run's metrics records, one per step sorted by step; for a repeated step the later line wins per key.

    A non-JSON last line (a killed writer) is skipped with a warning; any other bad line is a ValueError."""
    uri = run.storage.uri(METRICS_FILE)
    if not run.storage.exists(METRICS_FILE):
        raise ValueError(f"{uri} does not exist: the run has recorded no step yet (or was trained with metrics off)")
    lines = run.storage.read_text(METRICS_FILE).splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                log.warning("%s: skipping its last line, cut short (%s)", uri, exc)
                continue
            raise ValueError(f"{uri} line {number} is not JSON ({exc}): {line[:80]!r}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{uri} line {number} is not an object with an integer 'step': {line[:80]!r}")
        by_step.setdefault(record["step"], {}).update(record)
    if not by_step:
        raise ValueError(f"{uri} is empty: the run has recorded no step yet")
    return [by_step[step] for step in sorted(by_step)]


def _number(value: Any) -> float | None:
    """A finite float, or None for missing, null (non-finite when recorded) and non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _points(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps: list[int] = []
    values: list[float] = []
    for record in records:
        value = _number(record.get(key))
        if value is not None:
            steps.append(int(record["step"]))
            values.append(value)
    return steps, values


# -- charts --------------------------------------------------------------------------------------------------


def plot_curves(
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    key: str,
    out_png: str | os.PathLike[str] | io.BytesIO | None,
    title: str,
    *,
    extra_keys: Sequence[str] = (),
    log_y: bool = False,
    mark_step: int | None = None,
) -> bytes:
    """Draw `key` against step, one line per labelled run; return the PNG bytes, also written to `out_png`.

    `extra_keys` (e.g. "val_loss") are dashed in the run's colour. `log_y` applies when all values are positive.
    `mark_step` draws a dotted vertical line at the evaluated checkpoint."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    keys = [key, *[k for k in extra_keys if k != key]]
    plotted: list[float] = []
    for index, (label, records) in enumerate(series.items()):
        colour = f"C{index % 10}"
        for key_index, name in enumerate(keys):
            steps, values = _points(records, name)
            if not steps:
                continue
            if len(series) == 1:
                line_label = name
            elif len(keys) == 1:
                line_label = label
            else:
                line_label = f"{label} {name}"
            axes.plot(
                steps,
                values,
                color=colour,
                linestyle="-" if key_index == 0 else "--",
                linewidth=1.2 if key_index == 0 else 1.5,
                marker="o" if len(steps) == 1 or key_index > 0 else None,
                markersize=3,
                label=line_label,
            )
            plotted.extend(values)
    if plotted:
        if log_y and min(plotted) > 0:
            axes.set_yscale("log")
            # Plain numbers ("3", "4", "6") rather than the default "6×10⁰" on a loss axis spanning a decade or two.
            axes.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        axes.legend(loc="best", fontsize="small")
    else:
        axes.text(0.5, 0.5, f"no {key} values", ha="center", va="center", transform=axes.transAxes)
    if mark_step is not None:
        axes.axvline(mark_step, color="grey", linestyle=":", linewidth=1)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(key)
    axes.grid(True, alpha=0.3)
    buffer = io.BytesIO()
    # No "Software" entry: the bytes then do not depend on the matplotlib version.
    figure.savefig(buffer, format="png", metadata={"Software": None})
    png = buffer.getvalue()
    if isinstance(out_png, io.BytesIO):
        out_png.write(png)
    elif out_png is not None:
        target = Path(out_png)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png)
    return png


# -- baselines -----------------------------------------------------------------------------------------------


def load_baselines(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Published baseline scores (`infra/reports/baselines.json` by default); empty when the file is absent."""
    source = Path(path) if path is not None else BASELINES_FILE
    if not source.exists():
        if path is not None:
            log.warning("no baselines file at %s: the report will show this run's scores alone", source)
        return {"note": "", "sources": {}, "models": []}
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON ({exc}): fix or remove it") from exc
    if not isinstance(data, dict) or not isinstance(data.get("models", []), list):
        raise ValueError(f"{source} must be an object with a 'models' list (and 'sources', 'note')")
    data.setdefault("note", "")
    data.setdefault("sources", {})
    data.setdefault("models", [])
    return data


def _task_key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


# -- the report ----------------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _fmt(value: Any, spec: str) -> str:
    number = _number(value)
    return MISSING if number is None else format(number, spec)


def _split_metric(name: str) -> tuple[str, str]:
    """lm-eval names metrics 'acc,none' (metric, filter); results may also hold the bare 'acc'."""
    base, _, filter_name = name.partition(",")
    return base, filter_name


def choose_metric(metrics: Mapping[str, Any]) -> str | None:
    """The metric a task is reported by: acc_norm, then acc, then exact_match, then the first non-stderr one."""
    numeric = [name for name, value in metrics.items() if _number(value) is not None]
    for preferred in _PREFERRED_METRICS:
        for name in numeric:
            if _split_metric(name)[0] == preferred:
                return name
    for name in numeric:
        if "stderr" not in _split_metric(name)[0]:
            return name
    return None


def _our_score(metrics: Mapping[str, Any], name: str) -> str:
    """This run's value (×100 for fraction metrics), with lm-eval's standard error when given."""
    base, filter_name = _split_metric(name)
    value = _number(metrics[name])
    stderr = _number(metrics.get(f"{base}_stderr" + (f",{filter_name}" if filter_name else "")))
    if value is None:
        return MISSING
    scale, spec = (100.0, ".1f") if base in _FRACTION_METRICS else (1.0, ".2f")
    text = format(scale * value, spec)
    return text if stderr is None else f"{text} ± {format(scale * stderr, spec)}"


def _baseline_cell(score: Any, our_metric: str, our_shots: Any) -> str:
    """A published value (a percentage), with its metric and shots where they differ from ours."""
    if isinstance(score, Mapping):
        value, metric, shots = score.get("value"), score.get("metric"), score.get("shots")
    else:
        value, metric, shots = score, None, None
    if _number(value) is None:
        return MISSING
    differs = []
    if metric and metric != our_metric:
        differs.append(str(metric))
    if shots is not None and shots != our_shots:
        differs.append(f"{shots}-shot")
    return f"{_number(value):.1f}" + (f" ({', '.join(differs)})" if differs else "")


def _citation(sources: Mapping[str, Any], key: str | None) -> str:
    source = sources.get(key) if key else None
    if not isinstance(source, Mapping):
        return f"source {key!r} is not described in the baselines file" if key else "no source given"
    parts = [f"*{source['title']}*" if source.get("title") else str(key)]
    if source.get("where"):
        parts.append(str(source["where"]))
    text = ", ".join(parts)
    if source.get("url"):
        text += f" — <{source['url']}>"
    if source.get("protocol"):
        text += f". Protocol: {source['protocol']}"
    return text


def _column_label(index: int) -> str:
    """A, B, ..., Z, AA...: a baseline model's column in the published-scores table."""
    label = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        label = chr(ord("A") + rest) + label
    return label


def _benchmark_section(results: Mapping[str, Any], baselines: Mapping[str, Any]) -> list[str]:
    lm_eval = results.get("lm_eval")
    lm_eval = lm_eval if isinstance(lm_eval, Mapping) else {}
    tasks = lm_eval.get("tasks") or {}
    models = [m for m in baselines.get("models", []) if isinstance(m, Mapping)]
    if not tasks and not models:
        return ["## Benchmarks", "", "_No lm-eval task was run for this evaluation._", ""]
    lines = ["## Benchmarks", ""]
    if lm_eval.get("skipped"):
        lines += [f"_lm-eval was skipped: {lm_eval['skipped']}_", ""]
    if tasks:
        limit = lm_eval.get("limit")
        scope = f"up to {limit} samples per task" if limit else "full task sets"
        lines += [f"lm-eval {lm_eval.get('lm_eval_version', '?')}, {scope}.", ""]
    else:
        lines += ["_No lm-eval task was run for this evaluation._", ""]

    model_scores = [{_task_key(t): s for t, s in (m.get("scores") or {}).items()} for m in models]
    ours = {_task_key(t) for t in tasks}
    # Two narrow tables, since the Prefect UI clips wide ones: this run's scores, then the baselines' with short
    # column labels and a legend. Tasks only the baselines report share one line rather than a row each.
    footnotes: dict[str, int] = {}
    for m in models:
        footnotes.setdefault(str(m.get("source") or ""), len(footnotes) + 1)
    rows: list[list[str]] = []
    compared: list[list[str]] = []
    for task, entry in sorted(tasks.items()):
        entry = entry if isinstance(entry, Mapping) else {}
        metrics = entry.get("metrics") or {}
        metric = choose_metric(metrics)
        shots = entry.get("num_fewshot", lm_eval.get("num_fewshot"))
        base = _split_metric(metric)[0] if metric else ""
        unit = " (%)" if base in _FRACTION_METRICS else ""
        ours_text = _our_score(metrics, metric) if metric else MISSING
        rows.append(
            [
                task,
                f"{base}{unit}" if metric else MISSING,
                MISSING if shots is None else str(shots),
                str(entry.get("n_samples", MISSING)),
                ours_text,
            ]
        )
        published = [scores.get(_task_key(task)) for scores in model_scores]
        if any(score is not None for score in published):
            cells = [MISSING if score is None else _baseline_cell(score, base, shots) for score in published]
            compared.append([task, ours_text, *cells])
    if rows:
        lines += _table(["Task", "Metric", "Shots", "N", "This run"], [":--", ":--", "--:", "--:", "--:"], rows)
        lines += ["", "Scores marked (%) are percentages; ± is one standard error of this run's score.", ""]
    if models:
        labels = [_column_label(i) for i in range(len(models))]
        if compared:
            lines += ["Published scores of the same tasks:", ""]
            lines += _table(["Task", "This run", *labels], [":--", "--:", *["--:"] * len(labels)], compared)
            lines.append("")
            lines.append(
                "Published numbers follow each paper's own protocol (prompt format, number of shots, metric, full "
                "test sets, model size), so they place this run on a scale rather than compare like for like; a "
                f"baseline's metric and shots are given in parentheses where they differ from ours. {MISSING}: no "
                "published value for that task."
            )
            lines.append("")
            lines += [
                f"- **{label}:** {m.get('model', '?')} [^{footnotes[str(m.get('source') or '')]}]"
                for label, m in zip(labels, models, strict=True)
            ]
            lines.append("")
        not_run = sorted({t for scores in model_scores for t in scores} - ours)
        if not_run:
            lines += [f"Not run here, with published baselines: {', '.join(not_run)}.", ""]
    note = baselines.get("note")
    if note and compared:
        lines += [f"> {note}", ""]
    if footnotes and compared:
        sources = baselines.get("sources") or {}
        lines += [f"[^{n}]: {_citation(sources, key or None)}" for key, n in footnotes.items()]
    lines.append("")
    return lines


def render_report(
    results: Mapping[str, Any],
    baselines: Mapping[str, Any],
    plots: Mapping[str, str],
    *,
    notes: Sequence[str] = (),
) -> str:
    """The markdown report of one evaluation: header, perplexity, lm-eval against baselines, then the charts.

    `plots` maps a caption to an image path relative to the report; `notes` go in the charts section."""
    run_id = results.get("run_id", "?")
    lines = [f"# Evaluation report: {run_id}", ""]
    model = results.get("model") if isinstance(results.get("model"), Mapping) else {}
    assert isinstance(model, Mapping)
    params = model.get("params")
    about = [
        ("Run", f"`{run_id}`"),
        ("Step", results.get("step", MISSING)),
        ("Checkpoint", f"`{results['checkpoint']}`" if results.get("checkpoint") else MISSING),
        ("Date", results.get("created", MISSING)),
        ("Model", f"{model.get('preset', '?')}, {params:,} parameters" if isinstance(params, int) else MISSING),
        ("Evaluation time", f"{results['duration_s']:.1f} s" if _number(results.get("duration_s")) else MISSING),
    ]
    lines += [f"- **{name}:** {value}" for name, value in about]
    lines.append("")

    lines += ["## Perplexity", ""]
    perplexity = results.get("perplexity")
    if isinstance(perplexity, Mapping):
        lines.append(f"On the held-out `{perplexity.get('split', '?')}` split.")
        lines.append("")
        tokens, documents = perplexity.get("tokens"), perplexity.get("documents")
        row = [
            f"{tokens:,}" if isinstance(tokens, int) else MISSING,
            f"{documents:,}" if isinstance(documents, int) else MISSING,
            _fmt(perplexity.get("perplexity"), ".2f"),
            _fmt(perplexity.get("nll_per_token"), ".4f"),
            _fmt(perplexity.get("bits_per_byte"), ".4f"),
        ]
        header = ["Tokens", "Documents", "Perplexity", "NLL per token (nats)", "Bits per byte"]
        lines += _table(header, ["--:"] * len(header), [row])
    else:
        lines.append("_No perplexity evaluation in this run._")
    lines.append("")

    lines += _benchmark_section(results, baselines)

    lines += ["## Training curves", ""]
    for caption, image in plots.items():
        lines += [f"![{caption}]({image})", ""]
    if not plots and not notes:
        lines += ["_No charts._", ""]
    for note in notes:
        lines += [f"_{note}_", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


UI_IMAGE_WIDTH = 640
"""Pixel width of the charts embedded in the Prefect artifact; report.md keeps the full-size files."""
_IMAGE_LINK = re.compile(r"!\[(?P<caption>[^\]]*)\]\((?P<target>[^)\s]+\.png)\)")


def embed_images(markdown: str, folder: Storage, width: int = UI_IMAGE_WIDTH) -> str:
    """`markdown` with relative image links inlined as data: URIs `width` pixels wide, for the Prefect UI."""
    import base64

    def inline(match: re.Match[str]) -> str:
        target = match.group("target")
        if "://" in target or target.startswith(("data:", "/")) or not folder.exists(target):
            if not target.startswith("data:"):
                log.warning("report image %s is not in %s: left as a link", target, folder.uri())
            return match.group(0)
        png = _shrink_png(folder.read_bytes(target), width)
        return f"![{match.group('caption')}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"

    return _IMAGE_LINK.sub(inline, markdown)


def _shrink_png(png: bytes, width: int) -> bytes:
    """The PNG scaled to at most `width` pixels as an 8-bit palette image; its data URI shrinks several times."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as opened:
        image = opened.convert("RGB")
    if image.width > width:
        image = image.resize((width, round(image.height * width / image.width)), Image.Resampling.LANCZOS)
    small = image.quantize(colors=64)
    buffer = io.BytesIO()
    small.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _has_values(records: Sequence[Mapping[str, Any]], *keys: str) -> bool:
    return any(_number(record.get(key)) is not None for record in records for key in keys)


def evaluation_history(run: Run) -> list[dict[str, Any]]:
    """One row per evaluated checkpoint, oldest first: step, perplexity, bits per byte and each task's main metric."""
    rows = []
    for name in sorted(run.storage.list(EVAL_DIR)) if run.storage.exists(EVAL_DIR) else []:
        rel = eval_path(name, RESULTS_FILE)
        if not name.startswith("step-") or not run.storage.exists(rel):
            continue
        results = run.storage.read_json(rel)
        ppl = results.get("perplexity") or {}
        row: dict[str, Any] = {
            "step": results.get("step"),
            "perplexity": ppl.get("perplexity"),
            "bits_per_byte": ppl.get("bits_per_byte"),
        }
        for task, entry in ((results.get("lm_eval") or {}).get("tasks") or {}).items():
            metrics = entry.get("metrics") or {}
            metric = choose_metric(metrics)
            if metric:
                row[f"{task} {_split_metric(metric)[0]}"] = metrics[metric]
        rows.append(row)
    return rows


def _history_section(history: Sequence[Mapping[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in history for key in row))
    rows = [
        [_fmt(row.get(c), ".4g") if isinstance(row.get(c), float) else row.get(c, MISSING) for c in columns]
        for row in history
    ]
    return ["## Checkpoints evaluated", "", *_table(columns, ["--:"] * len(columns), rows), ""]


def write_report(run: Run, results: Mapping[str, Any], baselines: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Write report.md and the two charts into the run's eval/; return {file name: URI}.

    results.json is the caller's. Without metrics.jsonl the report says so, and old charts are removed."""
    baselines = load_baselines() if baselines is None else baselines
    label = str(results.get("run_id") or "run")
    step = results.get("step") if isinstance(results.get("step"), int) else None
    notes: list[str] = []
    try:
        records = read_metrics(run)
    except ValueError as exc:
        records = []
        notes.append(f"No training curves: {exc}.")
    charts = {
        "loss.png": ("loss", ("val_loss",), True, "loss (training; validation dashed)"),
        "grad_norm.png": ("grad_norm", (), False, "gradient norm"),
    }
    files: dict[str, str] = {}
    plots: dict[str, str] = {}
    for name, (key, extra, log_y, caption) in charts.items():
        rel = eval_path(name)
        if not _has_values(records, key, *extra):
            run.storage.remove(rel)
            continue
        title = f"{label}: {caption}" + (f", evaluated at step {step}" if step is not None else "")
        png = plot_curves({label: records}, key, None, title, extra_keys=extra, log_y=log_y, mark_step=step)
        run.storage.write_bytes(rel, png)
        files[name] = run.storage.uri(rel)
        plots[caption] = name
    if records and not plots:
        notes.append(f"No training curves: {run.storage.uri(METRICS_FILE)} holds no loss or grad_norm values.")
    report = render_report(results, baselines, plots, notes=notes)
    history = evaluation_history(run)
    if len(history) > 1:  # intermediate checkpoints were evaluated too: show the trajectory
        report += "\n" + "\n".join(_history_section(history))
    run.storage.write_text(EVAL_REPORT, report)
    files[REPORT_FILE] = run.storage.uri(EVAL_REPORT)
    return files


# -- comparing two runs --------------------------------------------------------------------------------------


def _relative(a: float, b: float) -> float:
    """|a − b| relative to the larger magnitude: symmetric, and 0 when both are 0."""
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def _difference(
    a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]], steps: Sequence[int], key: str, rtol: float
) -> dict[str, Any]:
    abs_diffs: list[float] = []
    rel_diffs: list[float] = []
    divergence: int | None = None
    final: tuple[int, float, float] | None = None
    for step in steps:
        va, vb = _number(a[step].get(key)), _number(b[step].get(key))
        if va is None or vb is None:
            # Recorded in both but non-finite (null) in only one: that is where they part.
            if divergence is None and key in a[step] and key in b[step] and (va is None) != (vb is None):
                divergence = step
            continue
        abs_diffs.append(abs(va - vb))
        rel_diffs.append(_relative(va, vb))
        if divergence is None and rel_diffs[-1] > rtol:
            divergence = step
        final = (step, va, vb)
    return {
        "steps_compared": len(abs_diffs),
        "max_abs_diff": max(abs_diffs) if abs_diffs else None,
        "mean_abs_diff": sum(abs_diffs) / len(abs_diffs) if abs_diffs else None,
        "max_rel_diff": max(rel_diffs) if rel_diffs else None,
        "final_step": final[0] if final else None,
        "final_a": final[1] if final else None,
        "final_b": final[2] if final else None,
        "first_divergence_step": divergence,
    }


def _spread(count: int, most: int) -> list[int]:
    """Up to `most` evenly spaced indices into a sequence of `count`, first and last included."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def _compare_markdown(
    a: Storage, b: Storage, labels: tuple[str, str], summary: Mapping[str, Any], plots: Mapping[str, str], rtol: float
) -> str:
    la, lb = labels
    lines = [
        f"# Run comparison: {la} vs {lb}",
        "",
        f"- **{la}:** `{a.url}`",
        f"- **{lb}:** `{b.url}`",
        f"- **Common steps:** {summary['common_steps']} (only in {la}: {summary['steps_only_in_a']}, "
        f"only in {lb}: {summary['steps_only_in_b']})",
        "",
    ]
    stats = [summary[key] for key in _COMPARED_KEYS]
    rows = [
        ["Steps compared", *[str(s["steps_compared"]) for s in stats]],
        ["Max |difference|", *[_fmt(s["max_abs_diff"], ".6g") for s in stats]],
        ["Mean |difference|", *[_fmt(s["mean_abs_diff"], ".6g") for s in stats]],
        ["Max relative difference", *[_fmt(s["max_rel_diff"], ".3g") for s in stats]],
        ["Last common step", *[str(s["final_step"] if s["final_step"] is not None else MISSING) for s in stats]],
        [f"{la} there", *[_fmt(s["final_a"], ".6g") for s in stats]],
        [f"{lb} there", *[_fmt(s["final_b"], ".6g") for s in stats]],
        [
            f"First step with relative difference > {rtol:g}",
            *[str(s["first_divergence_step"]) if s["first_divergence_step"] is not None else "none" for s in stats],
        ],
    ]
    lines += _table(["", *_COMPARED_KEYS], [":--", *["--:"] * len(_COMPARED_KEYS)], rows)
    lines.append("")
    table = summary["table"]
    picked = _spread(len(table), _COMPARE_TABLE_ROWS)
    # The steps where the runs part are the ones a reader looks for: always in the table.
    index = {row["step"]: i for i, row in enumerate(table)}
    divergences = {summary[key]["first_divergence_step"] for key in _COMPARED_KEYS} - {None}
    picked = sorted(set(picked) | {index[step] for step in divergences})
    lines += [
        "## Step by step",
        "",
        f"{len(picked)} of {len(table)} common steps; differences are {lb} − {la}.",
        "",
    ]
    header = ["Step"]
    for key in _COMPARED_KEYS:
        header += [f"{key} {la}", f"{key} {lb}", f"Δ {key}"]
    body = [
        [str(table[i]["step"])]
        + [_fmt(table[i][f"{key}_{side}"], ".6g") for key in _COMPARED_KEYS for side in ("a", "b", "diff")]
        for i in picked
    ]
    lines += _table(header, ["--:"] * len(header), body)
    lines.append("")
    if plots:
        lines += ["## Charts", ""]
        for caption, image in plots.items():
            lines += [f"![{caption}]({image})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def compare_line(key: str, d: Mapping[str, Any]) -> str:
    """One compared series as `hlat compare` prints it, e.g. `loss: final 5.7768 vs 5.9185, max |diff| 0.1417, ...`."""
    first = d.get("first_divergence_step")
    return (
        f"{key}: final {_fmt(d.get('final_a'), '.4f')} vs {_fmt(d.get('final_b'), '.4f')}, max |diff| "
        f"{_fmt(d.get('max_abs_diff'), '.4g')}, max rel diff {_fmt(d.get('max_rel_diff'), '.2%')}, first divergence "
        f"(>1e-3 rel) at step {first if first is not None else 'none'}"
    )


def compare_runs(
    a: Run,
    b: Run,
    out: Storage | None = None,
    labels: tuple[str, str] = ("A", "B"),
    *,
    rtol: float = 1e-3,
) -> dict[str, Any]:
    """Compare two runs' loss and grad norm over their common steps.

    Relative difference: |a − b| / max(|a|, |b|). The first divergence is the first step past `rtol`, or where
    one value alone is finite. With `out`, writes the charts and compare.md there."""
    if labels[0] == labels[1]:
        raise ValueError(f"labels must differ to tell the runs apart in charts, got {labels!r}")
    records_a, records_b = read_metrics(a), read_metrics(b)
    by_step_a = {int(r["step"]): r for r in records_a}
    by_step_b = {int(r["step"]): r for r in records_b}
    common = sorted(by_step_a.keys() & by_step_b.keys())
    if not common:
        raise ValueError(
            f"{a.storage.uri(METRICS_FILE)} (steps {min(by_step_a)}..{max(by_step_a)}) and "
            f"{b.storage.uri(METRICS_FILE)} (steps {min(by_step_b)}..{max(by_step_b)}) share no step: "
            "nothing to compare"
        )
    summary: dict[str, Any] = {
        "common_steps": len(common),
        "steps_only_in_a": len(by_step_a.keys() - by_step_b.keys()),
        "steps_only_in_b": len(by_step_b.keys() - by_step_a.keys()),
    }
    for key in _COMPARED_KEYS:
        summary[key] = _difference(by_step_a, by_step_b, common, key, rtol)
    table: list[dict[str, Any]] = []
    for step in common:
        row: dict[str, Any] = {"step": step}
        for key in _COMPARED_KEYS:
            va, vb = _number(by_step_a[step].get(key)), _number(by_step_b[step].get(key))
            row[f"{key}_a"], row[f"{key}_b"] = va, vb
            row[f"{key}_diff"] = vb - va if va is not None and vb is not None else None
        table.append(row)
    summary["table"] = table

    files: dict[str, str] = {}
    if out is not None:
        series = {labels[0]: records_a, labels[1]: records_b}
        plots: dict[str, str] = {}
        for key in _COMPARED_KEYS:
            name = f"compare-{key}.png"
            extra = ("val_loss",) if key == "loss" else ()
            title = f"{key}: {labels[0]} vs {labels[1]}"
            out.write_bytes(name, plot_curves(series, key, None, title, extra_keys=extra, log_y=key == "loss"))
            files[name] = out.uri(name)
            plots[key] = name
        out.write_text(COMPARE_FILE, _compare_markdown(a.storage, b.storage, labels, summary, plots, rtol))
        files[COMPARE_FILE] = out.uri(COMPARE_FILE)
    summary["files"] = files
    return summary
