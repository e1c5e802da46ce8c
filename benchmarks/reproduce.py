"""Reproduction harness: the comparisons of the five seed papers on offline data, with ≥ 3 seeds, written up in
docs/results.md (tables in the papers' format, PNG curves, line-search steps, and one paragraph per paper that
compares the observed ordering with the paper's claims, agreement and disagreement alike).

    python benchmarks/reproduce.py                       # everything (hours on 2 CPU cores; resumable)
    python benchmarks/reproduce.py --only "000/*"        # one paper; patterns match run ids (see --list)
    python benchmarks/reproduce.py --rounds 0.25         # a quarter of every setup's rounds
    python benchmarks/reproduce.py --report-only         # rewrite docs/results.md from the cached runs
    python benchmarks/reproduce.py --studies --report-only   # run the sensitivity studies (benchmarks/studies/)

Run ids are ``<paper>/<setup>/<algorithm>/seed<k>``. Every finished run is cached as JSON under ``--results``
(default ``benchmarks/results``); a re-run skips runs whose cached arguments match, so an interrupted
reproduction continues where it stopped, and changing a config file or the round scale re-runs only what changed.
What is run is data in ``benchmarks/reproduction/experiments.py``; ``runner.py`` runs and caches, ``report.py``
writes the page.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _path in (ROOT, BENCH):  # fedlightning, the reproduction package and toy_fig1
    if _path not in sys.path:
        sys.path.insert(0, _path)

from reproduction.experiments import TOY_ID  # noqa: E402
from reproduction.report import portable_command, write_report  # noqa: E402
from reproduction.runner import DEFAULT_RESULTS, all_specs, execute, quiet, selected  # noqa: E402
from reproduction.studies import run_studies  # noqa: E402


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for o in parser._option_string_actions if o.startswith("--")]


def _parse_setup_scales(items: Sequence[str] | None) -> dict[str, float]:
    """``--setup-rounds`` values ``PATTERN=SCALE`` as ``{pattern: scale}``; a clear error for any other form."""
    out: dict[str, float] = {}
    for item in items or []:
        pattern, sep, value = item.partition("=")
        try:
            scale = float(value)
        except ValueError:
            scale = float("nan")
        if not sep or not pattern or not (scale > 0 and math.isfinite(scale)):
            raise SystemExit(f"--setup-rounds expects PATTERN=SCALE with a positive scale, got {item!r}")
        out[pattern] = scale
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", metavar="PATTERN", help="run ids to run (fnmatch; a prefix selects all below)")
    p.add_argument(
        "--rounds", type=float, default=1.0, metavar="SCALE", help="multiply every setup's rounds (default 1)"
    )
    p.add_argument(
        "--setup-rounds",
        nargs="+",
        metavar="PATTERN=SCALE",
        help="round scale for the setups matching PATTERN (fnmatch over <paper>/<setup>, e.g. "
        "'000/shakespeare-lstm=0.25'); overrides --rounds for them",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per run (default 3)")
    p.add_argument("--results", default=DEFAULT_RESULTS, help="cache of finished runs (JSON)")
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="where results.md and figures/ are written")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--list", action="store_true", help="list the selected run ids and exit")
    p.add_argument("--report-only", action="store_true", help="write the report from cached runs, run nothing")
    p.add_argument("--no-toy", action="store_true", help="skip the Fig. 1 toy (seed 000)")
    p.add_argument("--toy-rounds", type=int, default=50)
    p.add_argument(
        "--studies",
        action="store_true",
        help="also run (or resume) the sensitivity studies of benchmarks/studies/ with the sweep runner",
    )
    ns = p.parse_args(argv)
    if not (ns.rounds > 0 and math.isfinite(ns.rounds)):
        p.error(f"--rounds must be a positive scale, got {ns.rounds}")
    if ns.seeds < 1:
        p.error(f"--seeds must be >= 1, got {ns.seeds}")
    if ns.threads < 1:
        p.error(f"--threads must be >= 1, got {ns.threads}")
    quiet()
    import torch

    torch.set_num_threads(ns.threads)
    setup_scales = _parse_setup_scales(ns.setup_rounds)
    specs = [s for s in all_specs(ns.seeds, ns.rounds, setup_scales) if selected(s.run_id, ns.only)]
    if ns.only and not specs and not selected(TOY_ID, ns.only):
        p.error(f"--only {ns.only} selects no run; see --list")
    if ns.list:
        for s in specs:
            print(s.run_id + (f"   not run (missing {s.missing})" if s.missing else ""))
        if not ns.no_toy and selected(TOY_ID, ns.only):
            print(TOY_ID)
        return 0
    for s in specs:
        if s.missing:
            print(f"{s.run_id}: not run (missing {s.missing})")
    counts: dict[str, int] = {}
    if not ns.report_only:
        counts = execute(specs, ns.results)
        print(f"runs: {counts}")
    if ns.studies:
        codes = run_studies(ns.results)
        print(f"studies: {codes}")
    toy = not ns.no_toy and selected(TOY_ID, ns.only)
    args_text = portable_command(list(argv if argv is not None else sys.argv[1:]), _long_options(p))
    path = write_report(specs, ns.results, ns.docs, args_text.strip(), counts, ns.seeds, ns.rounds, toy, ns.toy_rounds)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
