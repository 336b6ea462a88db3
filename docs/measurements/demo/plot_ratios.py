"""Draw a demo results file's ratio plot: what ``lilicorr demo`` draws beside its acceptance curves, from its JSON.

    python docs/measurements/demo/plot_ratios.py RESULTS.json OUT.png

For a results file kept without its plots (the ones committed under docs/measurements/demo/, or a run from before the
demo drew it): every arm's τ and tokens/s against DFlash's and its tokens/s against plain decoding's, each with the
paired-bootstrap interval the file records (:func:`lilicorr_pl.demo.run.plot_ratios`). It never writes over a file
``lilicorr demo`` did not draw.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lilicorr_pl.demo.run import plot_ratios
from lilicorr_pl.files import png_written_by_lilicorr, refuse_foreign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results file `lilicorr demo` wrote")
    parser.add_argument("output", help="the PNG to write")
    args = parser.parse_args()
    out = Path(args.output)
    try:
        refuse_foreign(out, "OUT.png", "a plot", "demo", png_written_by_lilicorr(out, "demo"),
                       "choose another OUT.png")
    except ValueError as err:
        raise SystemExit(f"plot_ratios: {err}") from None
    try:
        data = json.loads(Path(args.results).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"plot_ratios: {args.results} cannot be read as JSON ({err}); pass the results.json a demo "
                         "wrote") from None
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and {"benchmark", "temperature", "arm"} <= r.keys() for r in rows):
        raise SystemExit(f"plot_ratios: {args.results} holds no demo results (a list of rows, each with a benchmark, "
                         "temperature and arm); pass the results.json a demo wrote")
    print(plot_ratios(rows, out, {"results": Path(args.results).name}))


if __name__ == "__main__":
    main()
