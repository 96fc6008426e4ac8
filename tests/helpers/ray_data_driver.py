"""The Ray Data night's driver: examples/ray/ray_data.py's pipeline with a model that errs.

    python tests/helpers/ray_data_driver.py RUN LINES --out DIR [--drop ID] [--raise ID]

$RAY_ADDRESS names the cluster. The model leaves out the result of item ``--drop``
(a batch whose results miss an id: failed(data) by the keyed check) and raises on a
batch holding item ``--raise``; every other batch is scored as the example does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "ray"))

import ray_data  # after the path above
from ray_data import Model, run

# Workers cannot import the example by name: its classes travel by value.
ray.cloudpickle.register_pickle_by_value(ray_data)  # type: ignore[no-untyped-call, unused-ignore]


def erring_model(drop: str, fail: str) -> type:
    """Returns the example's model, changed to drop one item's result and raise on another."""

    class Erring(Model):  # type: ignore[misc]  # the example is not on mypy's path
        def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
            ids = [str(i) for i in batch["id"]]
            if fail in ids:
                raise RuntimeError(f"the model failed on a batch with {fail}")
            out = super().__call__(batch)
            keep = [i != drop for i in ids]
            return {k: v[keep] for k, v in out.items()}

    return Erring


def main() -> int:
    """Runs the pipeline over the lines with the erring model."""
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("lines")
    parser.add_argument("--out", required=True)
    parser.add_argument("--drop", default="")
    parser.add_argument("--raise", dest="fail", default="")
    args = parser.parse_args()
    return int(run(args.run, args.lines, args.out, None, model=erring_model(args.drop, args.fail)))


if __name__ == "__main__":
    sys.exit(main())
