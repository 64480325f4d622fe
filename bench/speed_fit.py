"""Fit the planner's speed model on the published 910B table, and report its error on every row.

    python bench/speed_fit.py            # fit, print the three parameters and every row's error
    python bench/speed_fit.py --check    # no fit: the shipped profile's errors (what BENCHMARKS.md shows)

The three fitted numbers are the compute half of the speed model (mindscale/perf/planner/speed.py): a wide matmul's
fraction of the peak, the width at which a dimension halves it, the attention core's fraction. They are fitted on
the rows marked `fit: true` in bench/published_ascend.yaml (at most half of the predicted rows), minimising the
squared log of predicted over published; the collective half (links, latencies) is the profile's published or
stated figures, not fitted. The result is written into configs/hardware/ascend910b.yaml by hand, with the median
error (`speed_error`); tests/unit/test_planner.py checks that the profile's figures are this script's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from scipy.optimize import minimize

from mindscale.perf.planner import published

PARAMETERS = ("matmul_efficiency", "matmul_half_width", "attention_efficiency", "vector_ns_per_element")
START = (0.7, 200.0, 0.6, 0.01)


def _hardware(base, x):
    return dataclasses.replace(base, **dict(zip(PARAMETERS, x)))


def fit() -> tuple[dict, list]:
    """The parameters that minimise the fitting rows' squared log error, and every row's error with them."""
    base = published.row_config(published.predicted_rows()[0]["id"]).hardware
    fitting = [r["id"] for r in published.predicted_rows() if r.get("fit")]

    def loss(x):
        if not (0 < x[0] <= 1 and x[1] >= 0 and 0 < x[2] <= 1 and x[3] >= 0):
            return 1e9
        found = published.errors(_hardware(base, x), only=fitting)
        return sum(math.log1p(e) ** 2 for _, _, e in found)

    best = minimize(loss, START, method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-6, "maxiter": 400})
    x = (round(best.x[0], 3), round(best.x[1]), round(best.x[2], 3), round(best.x[3], 5))
    return dict(zip(PARAMETERS, x)), published.errors(_hardware(base, x))


def report(found: list) -> str:
    lines = [f"{'row':26s} fit  published  predicted  error"]
    for row, pred, err in found:
        lines.append(
            f"{row['id']:26s} {'yes' if row.get('fit') else '   '}  {row['tokens_per_s_per_card']:9,.0f}  "
            f"{pred:9,.0f}  {err:+6.1%}"
        )
    return "\n".join(lines + [json.dumps(published.summary(found))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="the shipped profile's errors, no fit")
    args = parser.parse_args(argv)
    if args.check:
        print(report(published.errors()))
        return 0
    params, found = fit()
    print(json.dumps(params))
    print(report(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
