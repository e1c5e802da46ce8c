"""benchmarks/reproduce.py's command line: per-setup round scales and their bad values; the command it writes."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", os.path.join(ROOT, "benchmarks", "reproduce.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def test_setup_rounds_override_only_the_matching_setups(reproduce):
    scales = reproduce._parse_setup_scales(["000/shakespeare-lstm=0.25"])
    base = {s.run_id: s for s in reproduce.all_specs(1, 0.5)}
    mixed = {s.run_id: s for s in reproduce.all_specs(1, 0.5, scales)}
    assert base.keys() == mixed.keys()
    changed = {rid for rid in base if base[rid].rounds != mixed[rid].rounds}
    assert changed and all(rid.startswith("000/shakespeare-lstm/") for rid in changed)
    for rid in changed:  # the setup's own default rounds times 0.25 instead of 0.5
        assert mixed[rid].rounds == max(1, int(round(mixed[rid].setup.rounds * 0.25)))
        assert mixed[rid].key != base[rid].key  # a different cache key: the run is redone, never mixed up


@pytest.mark.parametrize("item", ["000/shakespeare-lstm", "000/x=0", "000/x=-1", "000/x=abc", "=0.5", "000/x=nan"])
def test_bad_setup_rounds_are_named(reproduce, item):
    with pytest.raises(SystemExit, match="PATTERN=SCALE"):
        reproduce._parse_setup_scales([item])


def _no_absolute_path(command: str, *dirs: str) -> None:
    import shlex

    tokens = shlex.split(command)
    values = [t.partition("=")[2] if t.startswith("--") else t for t in tokens]
    assert not [v for v in values if os.path.isabs(v) or v.startswith("~")], command
    for d in dirs:
        assert d not in command, command


@pytest.mark.parametrize(
    "argv, expected",
    [
        # absolute paths inside the repository, the space-separated and the "=" forms, an abbreviated option
        (["--results", "{root}/runs/reproduce", "--docs={root}/docs"], "--results runs/reproduce --docs=docs"),
        (["--report-only", "--do", "{root}/docs/", "--res", "{root}/runs/r"], "--report-only --do docs --res runs/r"),
        # relative to the current directory (a subfolder of the repository), and the root itself
        (["--results", "../runs/x", "--docs", "."], "--results runs/x --docs benchmarks"),
        (["--docs", "{root}"], "--docs ."),
        # outside the repository: a placeholder, never the machine's path
        (["--results", "{out}/cache", "--docs={out}/d"], "--results RESULTS_DIR --docs=DOCS_DIR"),
        # other arguments untouched (quoted where the shell needs it)
        (["--only", "000/*", "--rounds", "0.5"], "--only '000/*' --rounds 0.5"),
    ],
)
def test_written_command_is_repository_relative(reproduce, tmp_path, monkeypatch, argv, expected):
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    out = tmp_path / "elsewhere"
    monkeypatch.chdir(root / "benchmarks")
    argv = [a.format(root=root, out=out) for a in argv]
    options = ["--results", "--docs", "--report-only", "--rounds", "--only", "--seeds"]
    command = reproduce.portable_command(argv, options, root=str(root))
    assert command == "python benchmarks/reproduce.py " + expected
    _no_absolute_path(command, str(tmp_path))


def test_report_written_by_main_names_no_absolute_path(reproduce, tmp_path):
    """End to end: main() with absolute --results / --docs (outside the repository) writes results.md whose
    command line has placeholders instead; the same run with the repository's own docs path would print `docs`."""
    docs, results = tmp_path / "docs", tmp_path / "results"
    assert (
        reproduce.main(
            [
                "--report-only",
                "--no-toy",
                "--seeds",
                "1",
                "--only",
                "001/*",
                "--results",
                str(results),
                f"--docs={docs}",
            ]
        )
        == 0
    )
    text = (docs / "results.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Written by"))
    command = line.split("Command: `", 1)[1].rsplit("`", 1)[0]
    assert command == (
        "python benchmarks/reproduce.py --report-only --no-toy --seeds 1 --only '001/*' "
        "--results RESULTS_DIR --docs=DOCS_DIR"
    )
    _no_absolute_path(command, str(tmp_path))
    assert (
        reproduce.portable_command(["--docs", os.path.join(ROOT, "docs")])
        == "python benchmarks/reproduce.py --docs docs"
    )


def test_committed_report_command_is_repository_relative():
    """docs/results.md as committed: its command line names no path of the machine that wrote it."""
    with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
        line = next(ln for ln in f if ln.startswith("Written by"))
    command = line.split("Command: `", 1)[1].rsplit("`", 1)[0]
    assert command.startswith("python benchmarks/reproduce.py ")
    _no_absolute_path(command)
