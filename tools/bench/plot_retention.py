"""Draws the retention benchmark's year: the hot store's size by night, with and without archiving.

    python -m tools.bench.plot_retention [bench-results/retention.json] [-o docs/img/retention-year.png]

Pillow only (no plotting library): two lines on labelled axes, the figure
docs/performance.md shows ("Retention: a year of nights").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Final

WIDTH, HEIGHT = 900, 420
LEFT, RIGHT, TOP, BOTTOM = 80, 30, 40, 60
COLORS: Final = {"without_archive": (200, 60, 50), "with_archive": (40, 110, 200)}
LABELS: Final = {"without_archive": "without archiving", "with_archive": "archive after 7 nights"}


def plot(result: dict[str, Any], out: Path) -> None:
    """Writes the PNG."""
    from PIL import Image, ImageDraw

    series = {k: result[k]["used_bytes_by_night"] for k in COLORS}
    nights = max(len(v) for v in series.values())
    top_mb = max(max(v) for v in series.values()) / 1e6
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(night: int, used: float) -> tuple[float, float]:
        return LEFT + plot_w * night / max(1, nights - 1), TOP + plot_h * (1 - used / 1e6 / top_mb)

    draw.rectangle((LEFT, TOP, LEFT + plot_w, TOP + plot_h), outline="black")
    for i in range(5):
        mb = top_mb * i / 4
        y = TOP + plot_h * (1 - i / 4)
        draw.line((LEFT - 5, y, LEFT, y), fill="black")
        draw.text((8, y - 6), f"{mb:,.1f} MB", fill="black")
    for night in (1, 30, 90, 180, 270, 365):
        if night <= nights:
            x = xy(night - 1, 0)[0]
            draw.line((x, TOP + plot_h, x, TOP + plot_h + 5), fill="black")
            draw.text((x - 10, TOP + plot_h + 10), str(night), fill="black")
    draw.text((LEFT + plot_w / 2 - 20, HEIGHT - 25), "night", fill="black")
    title = (
        f"hot store (pages in use), {result['shards_per_night']} shards"
        f" / {result['events_per_night']} events a night"
    )
    draw.text((LEFT, 12), title, fill="black")
    for n, (name, values) in enumerate(series.items()):
        draw.line([xy(i, v) for i, v in enumerate(values)], fill=COLORS[name], width=3)
        legend_y = TOP + 12 + 18 * n
        draw.line((LEFT + 15, legend_y + 6, LEFT + 45, legend_y + 6), fill=COLORS[name], width=3)
        final = values[-1] / 1e6
        draw.text(
            (LEFT + 52, legend_y),
            f"{LABELS[name]}: {final:,.1f} MB at night {len(values)}",
            fill="black",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main(argv: list[str] | None = None) -> int:
    """Reads the benchmark's JSON and writes the plot."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.plot_retention", description=__doc__
    )
    parser.add_argument("result", nargs="?", default="bench-results/retention.json")
    parser.add_argument("-o", "--output", default="docs/img/retention-year.png")
    args = parser.parse_args(argv)
    plot(json.loads(Path(args.result).read_text()), Path(args.output))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
