"""benchmarks/reproduce.py's command line: per-setup round scales and their bad values."""

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
