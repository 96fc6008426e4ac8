"""`report RUN --html`: one self-contained page, plain inline SVG drawn here, no script.

Nothing is fetched when the page is viewed (no script, no font, no image URL):
it opens offline, from a mail attachment, in any browser. Every figure is also
printed as text beside its chart, with an id (``#completion-rate``, ``#equation``,
...) so that tests and scripts read the numbers from the DOM.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any, Final

from shardledger_cli.output import by_state, equation, verify_failure_rows

__all__ = ["render_html"]

STATE_COLOURS: Final = {
    "verified": "#2e7d32",
    "failed": "#c62828",
    "verify_failed": "#ad1457",
    "missing": "#9e9e9e",
    "running": "#1565c0",
    "stale": "#ef6c00",
    "unverified": "#f9a825",
}
# A grid of more cells than this draws the first ones and says how many it left out.
GRID_CELLS: Final = 20_000
CSS: Final = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0; } h2 { font-size: 1.15em; margin-top: 2em; }
.sub { color: #666; margin-top: 0.2em; } .fig { font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; } tr:nth-child(even) { background: #f4f4f4; }
.legend span { display: inline-block; margin-right: 1em; }
.sw { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: -0.1em; margin-right: 0.3em; }
code { font-size: 0.92em; }
"""


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _fig(ident: str, text: str) -> str:
    return f'<span class="fig" id="{ident}">{escape(text)}</span>'


def _svg(width: int, height: int, body: str, label: str) -> str:
    return (
        f'<svg width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">'
        f"{body}</svg>"
    )


def _stacked_bar(parts: Sequence[tuple[str, int, str]], label: str, width: int = 900) -> str:
    total = sum(n for _, n, _ in parts) or 1
    x, body = 0.0, []
    for name, n, colour in parts:
        w = width * n / total
        if n:
            body.append(
                f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="28" fill="{colour}">'
                f"<title>{escape(name)}: {n}</title></rect>"
            )
        x += w
    legend = " ".join(
        f'<span><i class="sw" style="background:{c}"></i>{escape(name)} {n}</span>'
        for name, n, c in parts
    )
    return _svg(width, 28, "".join(body), label) + f'<div class="legend">{legend}</div>'


def _bars(rows: Sequence[tuple[str, float, str]], label: str, *, unit: str = "") -> str:
    """Returns a horizontal bar chart, one labelled bar per row (value printed at its end)."""
    if not rows:
        return "<p>none</p>"
    top = max(v for _, v, _ in rows) or 1
    height, body = 24 * len(rows), []
    for i, (name, value, text) in enumerate(rows):
        y = 24 * i
        w = 560 * value / top
        body.append(
            f'<text x="230" y="{y + 16}" text-anchor="end">{escape(name[:34])}</text>'
            f'<rect x="240" y="{y + 4}" width="{w:.2f}" height="16" fill="#5c6bc0">'
            f"<title>{escape(name)}: {escape(text)}</title></rect>"
            f'<text x="{246 + w:.2f}" y="{y + 16}">{escape(text)}{escape(unit)}</text>'
        )
    return _svg(900, height, "".join(body), label)


def _grid(views: Sequence[dict[str, Any]]) -> str:
    shown = views[:GRID_CELLS]
    per_row = 50 if len(shown) <= 2500 else 100
    size = 16 if per_row == 50 else 8
    body = []
    for i, v in enumerate(shown):
        x, y = (i % per_row) * (size + 2), (i // per_row) * (size + 2)
        colour = STATE_COLOURS.get(v["state"], "#000")
        tip = f"{v['shard_id']} #{v['plan_index']}: {v['state']} {v['detail'] or ''}".strip()
        body.append(
            f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{colour}"'
            f' data-state="{escape(v["state"])}"><title>{escape(tip)}</title></rect>'
        )
    rows = (len(shown) + per_row - 1) // per_row
    svg = _svg(per_row * (size + 2), max(rows, 1) * (size + 2), "".join(body), "shard states")
    counts: dict[str, int] = {}
    for v in views:
        counts[v["state"]] = counts.get(v["state"], 0) + 1
    legend = " ".join(
        f'<span><i class="sw" style="background:{STATE_COLOURS.get(s, "#000")}"></i>'
        f"{escape(s)} {n}</span>"
        for s, n in sorted(counts.items())
    )
    more = (
        f"<p>the first {GRID_CELLS} of {len(views)} shards, in plan order</p>"
        if len(views) > GRID_CELLS
        else ""
    )
    return f'<div id="shard-grid">{svg}</div><div class="legend">{legend}</div>{more}'


def _trend(points: Sequence[tuple[str, float, float]]) -> str:
    """Returns completion and silent error rates over runs as two polylines with labelled points."""
    if len(points) < 2:
        return "<p>no earlier runs to compare with</p>"
    w, h, left, top = 900, 220, 50, 10
    step = (w - left - 20) / (len(points) - 1)

    def y(v: float) -> float:
        return top + (1 - v) * (h - 60)

    body = [
        f'<line x1="{left}" y1="{y(t):.1f}" x2="{w - 10}" y2="{y(t):.1f}" stroke="#ddd"/>'
        f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{int(100 * t)} %</text>'
        for t in (0.0, 0.5, 1.0)
    ]
    for series, colour, name in ((1, "#2e7d32", "completion"), (2, "#ad1457", "silent errors")):
        values = [(run, c if series == 1 else s) for run, c, s in points]
        coords = " ".join(f"{left + i * step:.1f},{y(v):.1f}" for i, (_, v) in enumerate(values))
        body.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for i, (run, v) in enumerate(values):
            body.append(
                f'<circle cx="{left + i * step:.1f}" cy="{y(v):.1f}" r="3.5"'
                f' fill="{colour}"><title>{escape(run)} {name}: {_pct(v)}</title></circle>'
            )
    for i, p in enumerate(points):
        body.append(
            f'<text x="{left + i * step:.1f}" y="{h - 30}" text-anchor="middle"'
            f' font-size="11">{escape(p[0][-14:])}</text>'
        )
    rows = "".join(
        f"<tr><td>{escape(r)}</td><td>{_pct(c)}</td><td>{_pct(s)}</td></tr>" for r, c, s in points
    )
    legend = (
        '<div class="legend"><span><i class="sw" style="background:#2e7d32"></i>completion</span>'
        '<span><i class="sw" style="background:#ad1457"></i>silent errors</span></div>'
    )
    table = (
        '<table id="trend-table"><tr><th>run</th><th>completion</th><th>silent errors</th></tr>'
        f"{rows}</table>"
    )
    return _svg(w, h, "".join(body), "trend over recent runs") + legend + table


def _counts(title: str, counts: dict[str, int], ident: str) -> str:
    rows = [(k, float(n), str(n)) for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return f'<h3>{escape(title)}</h3><div id="{ident}">{_bars(rows, title)}</div>'


def _verify_failures(s: dict[str, Any]) -> str:
    """Returns the verification failures by reason, the first pass beside now, as a table."""
    rows = verify_failure_rows(s)
    title = "verification failures: shards by reason, first pass and now"
    if not rows:
        return f'<h3>{escape(title)}</h3><div id="verify-failures"><p>none</p></div>'
    cells = "".join(
        f"<tr><td>{escape(r)}</td><td>{first}</td><td>{now}</td></tr>" for r, first, now in rows
    )
    return (
        f'<h3>{escape(title)}</h3><div id="verify-failures"><table>'
        f"<tr><th>reason</th><th>first pass</th><th>now</th></tr>{cells}</table></div>"
    )


def render_html(
    report: dict[str, Any],
    views: Sequence[dict[str, Any]],
    *,
    history: Sequence[dict[str, Any]] = (),
) -> str:
    """Returns the whole page for one run.

    ``report`` is what `report RUN --json` prints (the server's figures), ``views``
    the run's shard views, ``history`` the summaries of earlier runs, oldest first.
    """
    s = report["summary"]
    run_id = report["run_id"]
    fp = s.get("first_pass") or {}
    costs = report["costs"]
    advice = report["checkpoint_advice"]
    labels = ", ".join(f"{k}={v}" for k, v in report["labels"].items()) or "no labels"
    parts = [(k, n, STATE_COLOURS[k]) for k, n in by_state(s).items()]
    first_vs_final = _bars(
        [
            (
                "completion, first pass",
                fp.get("completion_rate", 0.0),
                _pct(fp.get("completion_rate", 0.0)),
            ),
            ("completion, now", s["completion_rate"], _pct(s["completion_rate"])),
            (
                "silent errors, first pass",
                fp.get("silent_error_rate", 0.0),
                _pct(fp.get("silent_error_rate", 0.0)),
            ),
            ("silent errors, now", s["silent_error_rate"], _pct(s["silent_error_rate"])),
            (
                "reconciled at first attempt",
                fp.get("reconciliation_rate", 0.0),
                _pct(fp.get("reconciliation_rate", 0.0)),
            ),
        ],
        "first pass against now",
    )
    lost = costs["lost_gpu_s"]
    recomputed = _bars(
        [
            ("counted", costs["counted_gpu_s"], f"{costs['counted_gpu_s']:.1f}"),
            ("still running", costs["running_gpu_s"], f"{costs['running_gpu_s']:.1f}"),
            ("reruns after a failure", lost["reruns"], f"{lost['reruns']:.1f}"),
            ("failed verification", lost["silent"], f"{lost['silent']:.1f}"),
            ("duplicates", lost["duplicates"], f"{lost['duplicates']:.1f}"),
            ("zombies", lost["zombies"], f"{lost['zombies']:.1f}"),
            ("hung", lost["hung"], f"{lost['hung']:.1f}"),
        ],
        "GPU time by what became of it",
        unit=" GPU-s",
    )
    trend_points = [
        (str(r["run_id"]), r["completion_rate"], r["silent_error_rate"]) for r in [*history, s]
    ]
    if advice["interval_s"] is not None:
        steps = f" (about {advice['interval_steps']} steps)" if advice["interval_steps"] else ""
        advice_text = f"checkpoint every {advice['interval_s']:.3g} s{steps}"
    else:
        advice_text = f"no advice: {advice['reason']}"
    inputs = (
        f"T = {_opt(advice['shard_duration_s'], 's')},"
        f" w = {_opt(advice['checkpoint_write_s'], 's')},"
        f" p = {_opt(advice['reclaim_probability'], '')} over {advice['attempts']} attempts"
    )
    fingerprints = s.get("fingerprint_groups") or {}
    gpu_text = f"{costs['gpu_s']:.1f} GPU-s"
    recomputed_text = f"{costs['not_counted_gpu_s']:.1f} GPU-s"
    return "".join(
        [
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
            f"<title>shardledger report: {escape(run_id)}</title>",
            f"<style>{CSS}</style></head><body>",
            f'<h1>run <span id="run-id">{escape(run_id)}</span></h1>',
            f'<p class="sub">namespace {escape(s["namespace"])} · {escape(labels)} ·'
            f" {s.get('event_count', 0)} events</p>",
            "<h2>The run ledger</h2>",
            f"<p>{_fig('equation', equation(s))}</p>",
            _stacked_bar(parts, "submitted shards by state"),
            f"<p>completion rate {_fig('completion-rate', _pct(s['completion_rate']))}"
            " (verified / submitted) · silent error rate"
            f" {_fig('silent-error-rate', _pct(s['silent_error_rate']))}</p>",
            "<h2>First pass against now</h2>",
            f"<p>first-pass completion {_fig('first-pass-completion', _pct(fp.get('completion_rate', 0.0)))}"
            f" · first-pass reconciliation {_fig('reconciliation-rate', _pct(fp.get('reconciliation_rate', 0.0)))}</p>",
            first_vs_final,
            "<h2>Shards, in plan order</h2>",
            _grid(views),
            "<h2>Failures</h2>",
            _counts(
                "failure tags: shards in state failed, by their latest attempt",
                s.get("failure_tags") or {},
                "failure-tags",
            ),
            _counts(
                "failure tags: attempts (every failed attempt)",
                s.get("attempt_failure_tags") or {},
                "attempt-tags",
            ),
            _verify_failures(s),
            "<h2>Fingerprint groups</h2>",
            "<p>numbers compare strictly only inside one group: another driver, library or GPU may"
            " change the last bits (docs/metrics.md)</p>",
            _counts(
                "shards by the fingerprint of their latest attempt",
                {k[:16]: n for k, n in fingerprints.items()},
                "fingerprints",
            ),
            "<h2>Recomputed work: GPU time that did not count</h2>",
            f"<p>GPU time {_fig('gpu-s', gpu_text)}, did not count"
            f" {_fig('recomputed-gpu-s', recomputed_text)}, a share of"
            f" {_fig('not-counted-share', _pct(costs['not_counted_share']))}; hangs"
            f" {_fig('hangs', str(costs['hangs']))} ({costs['hang_lost_s']:.1f} s lost)</p>",
            recomputed,
            "<h2>Checkpoint interval: t* = sqrt(2·T·w/p)</h2>",
            f"<p>{_fig('checkpoint-advice', advice_text)}; {escape(inputs)}</p>",
            "<h2>Trend over recent runs</h2>",
            f'<div id="trend">{_trend(trend_points)}</div>',
            '<p class="sub">written by shardledger report --html; definitions in docs/metrics.md</p>',
            "</body></html>\n",
        ]
    )


def _opt(x: float | None, unit: str) -> str:
    return "unknown" if x is None else f"{x:.4g}{' ' + unit if unit else ''}"
