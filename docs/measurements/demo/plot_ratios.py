"""Draw a demo results file's ratio plot: what ``lilicorr demo`` draws beside its acceptance curves, from its JSON.

    python docs/measurements/demo/plot_ratios.py RESULTS.json [RESULTS.json ...] OUT.png

For a results file kept without its plots (the ones committed under docs/measurements/demo/, or a run from before the
demo drew it): every arm's τ and tokens/s against DFlash's and its tokens/s against plain decoding's, each with the
paired-bootstrap interval the file records (:func:`lilicorr_pl.demo.run.plot_ratios`). Also the files
``more_prompts.py`` writes (their ``rows``), several in one figure: one row of panels per benchmark and temperature.
It never writes over a file ``lilicorr demo`` did not draw.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lilicorr_pl.demo.run import plot_ratios
from lilicorr_pl.files import png_written_by_lilicorr, refuse_foreign


def read_rows(path: str) -> list[dict[str, Any]]:
    """A results file's rows (a demo's ``results``, ``more_prompts.py``'s ``rows``), or one line naming the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"plot_ratios: {path} cannot be read as JSON ({err}); pass the results.json a demo "
                         "wrote") from None
    rows = (data.get("results", data.get("rows"))) if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and {"benchmark", "temperature", "arm"} <= r.keys() for r in rows):
        raise SystemExit(f"plot_ratios: {path} holds no demo results (a list of rows, each with a benchmark, "
                         "temperature and arm); pass the results.json a demo wrote")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results files `lilicorr demo` (or more_prompts.py) wrote")
    parser.add_argument("output", help="the PNG to write")
    args = parser.parse_args()
    out = Path(args.output)
    try:
        refuse_foreign(out, "OUT.png", "a plot", "demo", png_written_by_lilicorr(out, "demo"),
                       "choose another OUT.png")
    except ValueError as err:
        raise SystemExit(f"plot_ratios: {err}") from None
    rows = [row for path in args.results for row in read_rows(path)]
    groups = [(r["benchmark"], r["temperature"], r["arm"]) for r in rows]
    if len(set(groups)) != len(groups):
        raise SystemExit("plot_ratios: these files hold the same benchmark, temperature and arm more than once; pass "
                         "files of different benchmarks (e.g. more_prompts.py's humaneval and stdlib-heldout)")
    print(plot_ratios(rows, out, {"results": ", ".join(Path(p).name for p in args.results)}))


if __name__ == "__main__":
    main()
