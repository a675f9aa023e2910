"""`--config FILE` on every command that takes --set: a YAML or JSON partial config over the preset, then --set; its
mistakes in one line naming the file; and the data mixture's per-source draws, with the refusal of a run that
repeats a source too often before any server starts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import hlat.commands.preflight
import hlat.temporary_server
from hlat.cli import _dispatch, build_parser, command_overrides, main, read_config_file
from hlat.core.config import ConfigError, flatten_config
from hlat.core.presets import load_config

ROOT = Path(__file__).resolve().parents[2]
MIX_EXAMPLE = ROOT / "deployments" / "mix-example.yaml"
SOURCES = [
    {"name": "web", "source": "HuggingFaceFW/fineweb", "weight": 0.6, "max_epochs": 1, "tokens": 10_000_000},
    {"name": "books", "source": "/data/books", "weight": 0.3, "tokens": 20_000_000},
    {"name": "code", "source": "s3://b/code/", "weight": 0.1, "max_epochs": 4, "tokens": 5_000_000},
]
MIX = {"data": {"sources": SOURCES, "curation": {"minhash": True}}, "training": {"max_steps": 10}}


def write(path: Path, body: Any) -> Path:
    path.write_text(json.dumps(body) if path.suffix == ".json" else yaml.safe_dump(body, sort_keys=False))
    return path


def config_of(*argv: str) -> tuple[str, dict[str, Any]]:
    """(preset, overrides) of `hlat config ARGV`, as every command resolves them."""
    args = build_parser().parse_args(["config", *argv])
    overrides = command_overrides(args)
    return args.preset, overrides


# --- the file -------------------------------------------------------------------------------------------------------


def test_a_nested_config_becomes_dotted_paths_with_lists_and_mappings_as_one_field() -> None:
    flat = flatten_config(
        {
            "data": {"sources": SOURCES, "curation": {"minhash": True}},
            "burn_in": {"thresholds": {"x": 1}},
            "run_id": "r",
        }
    )
    assert flat == {
        "data.sources": SOURCES,
        "data.curation.minhash": True,
        "burn_in.thresholds": {"x": 1},
        "run_id": "r",
    }
    # An unknown key stays a path, for apply_overrides to name; a section given a scalar is one field, for the
    # config's validation to refuse.
    assert flatten_config({"trainig": {"max_steps": 1}, "data": 3}) == {"trainig": {"max_steps": 1}, "data": 3}


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_yaml_and_json_files_give_the_same_overrides_over_the_preset(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path / f"mix{suffix}", MIX)
    assert read_config_file(str(path)) == (
        None,
        {"data.sources": SOURCES, "data.curation.minhash": True, "training.max_steps": 10},
    )
    preset, overrides = config_of("--config", str(path))
    config = load_config(preset, overrides)
    assert preset == "tiny" and [s.resolved_name for s in config.data.mixture] == ["web", "books", "code"]
    assert config.data.curation.minhash and config.training.max_steps == 10
    assert config.data.sources[1].max_epochs == 4.0  # a field the file leaves out keeps its default
    # --set applies after the file; the same list given to --set as JSON is the same config.
    preset, overrides = config_of("--config", str(path), "--set", "training.max_steps=7")
    assert load_config(preset, overrides).training.max_steps == 7
    as_set = config_of("--set", f"data.sources={json.dumps(SOURCES)}", "--set", "data.curation.minhash=true",
                       "--set", "training.max_steps=10")  # fmt: skip
    assert load_config(*as_set) == config


def test_the_files_preset_applies_only_when_no_preset_is_given(tmp_path: Path) -> None:
    path = write(tmp_path / "mix.yaml", {"preset": "hlat-7b", **MIX})
    assert config_of("--config", str(path))[0] == "hlat-7b"
    assert config_of("--config", str(path), "--preset", "tiny")[0] == "tiny"  # given, even as the default's name
    assert config_of()[0] == "tiny"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# every line commented out\n")
    assert config_of("--config", str(empty)) == ("tiny", {})


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "data:\n  sources: [\n", r"bad\.yaml: not valid YAML at line 3, column 1: "),
        ("bad.json", '{"data":\n  {"max_documents": 1,,}}', r"bad\.json: not valid JSON: .* at line 2, column 23$"),
        ("list.yaml", "- training\n", r"list\.yaml: the top level must be a mapping .* not a list$"),
        ("typo.yaml", "trainig:\n  max_steps: 3\n", r"typo\.yaml: trainig: unknown field 'trainig' in the config; "
         r"did you mean training\?"),
        ("typo.json", '{"data": {"sources": [], "sourcez": "x"}}', r"typo\.json: data\.sourcez: unknown field "
         r"'sourcez' in data; did you mean data\.sources\?"),
        ("preset.yaml", "preset: hlat7b\n", r"preset\.yaml: preset: unknown preset 'hlat7b'; did you mean 'hlat-7b'"),
        ("inf.yaml", "data:\n  sources: [{source: a, weight: .inf}]\n", r"inf\.yaml: data\.sources: values must be "
         r"finite$"),
        ("mix.toml", "[training]\n", r"mix\.toml: a config file is YAML \(\.yaml, \.yml\) or JSON"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, expected: str
) -> None:
    (tmp_path / name).write_text(text)
    assert main(["config", "--config", str(tmp_path / name)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hlat: error: {tmp_path / name}: ")
    assert re.search(expected, line), line


def test_a_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"hlat: error: {tmp_path / 'nope.yaml'}: no such config file\n"


def test_the_printed_config_is_the_file_over_the_preset_then_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "mix.json", {"preset": "hlat-7b", **MIX})
    assert main(["config", "--config", str(path), "--set", "training.lr=0.001"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["preset"] == "hlat-7b" and shown["training"]["lr"] == 0.001 and shown["training"]["max_steps"] == 10
    assert [s["name"] for s in shown["data"]["sources"]] == ["web", "books", "code"]


# --- the dry run and the refusal before anything starts -------------------------------------------------------------


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records (and stops) any start of a Prefect server or of the checks that come just before one."""
    started: list[str] = []

    def record(what: str) -> Any:
        def called(*args: Any, **kwargs: Any) -> None:
            started.append(what)
            raise AssertionError(f"{what} was called")

        return called

    monkeypatch.setattr(hlat.temporary_server, "start_temporary_server", record("start_temporary_server"))
    monkeypatch.setattr(hlat.commands.preflight, "check_before_start", record("check_before_start"))
    return started


def test_the_dry_run_prints_each_sources_tokens_and_epochs(
    capsys: pytest.CaptureFixture[str], nothing_starts: list[str]
) -> None:
    assert main(["pretrain", "--preset", "hlat-7b", "--dry-run", "--config", str(MIX_EXAMPLE)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index("  source       share  tokens drawn       source tokens      epochs")
    assert out[head - 1].startswith("data: 429,000 steps x 4,194,304 tokens drawn from 3 source(s)")
    rows = {line.split()[0]: line.split() for line in out[head + 1 : head + 4]}
    assert list(rows) == ["fineweb-edu", "code", "math"]
    # The schedule's step 386,100 moves weight to code and math: shares are the steps' weights averaged.
    steps, per_step = 429_000, 4_194_304
    drawn = {
        "fineweb-edu": 0.75 * 386_100 + 0.6 * 42_900, "code": 0.2 * 386_100 + 0.25 * 42_900,
        "math": 0.05 * 386_100 + 0.15 * 42_900,
    }  # fmt: skip
    declared = {"fineweb-edu": 1_300_000_000_000, "code": 250_000_000_000, "math": 55_000_000_000}
    limits = {"fineweb-edu": 2, "code": 4, "math": 4}
    for name, row in rows.items():
        tokens = round(drawn[name] * per_step)
        assert row[1] == f"{drawn[name] / steps:.1%}" and row[2] == f"{tokens:,}" and row[3] == f"{declared[name]:,}"
        assert row[4:] == [f"{tokens / declared[name]:.2f}", "(max", f"{limits[name]})"]
    assert nothing_starts == []


def over_repeating(tmp_path: Path) -> Path:
    """The mixture example with its math source declared small: 1.96 epochs of 55B tokens become 5.4 of 20B."""
    body = yaml.safe_load(MIX_EXAMPLE.read_text())
    body["data"]["sources"][2]["tokens"] = 20_000_000_000
    return write(tmp_path / "over.yaml", body)


def test_a_dry_run_that_over_repeats_a_source_is_refused_with_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nothing_starts: list[str]
) -> None:
    assert main(["pretrain", "--preset", "hlat-7b", "--dry-run", "--config", str(over_repeating(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert "math" in captured.out and "5.40 (max 4)" in captured.out and "CreateTrainingJob" not in captured.out
    assert captured.err.startswith(
        "hlat: error: data.sources[math]: the run draws 107,961,384,960 tokens from it = 5.40 epochs of its "
        "20,000,000,000 tokens, more than its max_epochs=4\n"
    )
    assert nothing_starts == []


@pytest.mark.parametrize("argv", [["pretrain"], ["run", "prepare-data"], ["run", "train"]])
def test_a_run_that_over_repeats_a_source_is_refused_before_a_server_starts(
    tmp_path: Path, nothing_starts: list[str], argv: list[str]
) -> None:
    args = build_parser().parse_args([*argv, "--config", str(over_repeating(tmp_path)), "--storage", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^data\.sources\[math\]: .* 5\.40 epochs .* max_epochs=4"):
        _dispatch(args)
    assert nothing_starts == [] and not (tmp_path / "runs").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["over.yaml"]  # no run folder either
