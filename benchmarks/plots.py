"""One PNG per results JSON: every GB/s or TFLOP/s column of its rows against the shape.

    python -m benchmarks.plots [RESULTS_DIR]      (default benchmarks/results; `vllm-moe-fixes
                                                   bench` runs it after the benchmarks)

Each JSON whose "rows" or "results" is a list of dicts (or a dict of dicts keyed by operation)
gives one figure beside it; sweeps (`*_sweep.json`) are skipped. Series whose name holds one of
ANCHOR_WORDS (copy ceiling, torch, DeepGEMM, published figures) are anchors, drawn dashed beside
our kernels' solid lines. Every file's series are printed, so the selection shows without
matplotlib too; drawing needs it. Exit status 0 (also when there is nothing to plot).

eplb_sim.json (bench_eplb_sim) has a figure of its own (``draw_eplb_sim``): max/mean rank load
against redundant experts, one panel per scenario and EP size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ANCHOR_WORDS = ("copy", "torch", "deepgemm", "figure", "scaled_mm", "bf16", "vllm", "deepep")
SHAPE_KEYS = ("backend", "op", "groups", "rows", "M", "tokens", "topk", "N", "K")
UNITS = (("GB/s", ("gb/s", "gbps")), ("TFLOP/s", ("tflop",)))


def series(payload: dict) -> tuple[list[str], dict[str, list[float]], str] | None:
    """(x labels, {series name: values}, y-axis label) of one results JSON, or None when it holds
    no rows with a GB/s or TFLOP/s column."""
    rows = payload.get("rows") or payload.get("results")
    if isinstance(rows, dict):
        rows = [{"op": name, **row} for name, row in rows.items() if isinstance(row, dict)]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return None
    for unit, keys in UNITS:
        names = [k for k in rows[0] if any(s in k.lower() for s in keys)]
        if names:
            break
    else:
        return None
    shape_keys = [k for k in SHAPE_KEYS if isinstance(rows[0].get(k), (int, str))]
    labels = ["x".join(str(r.get(k)) for k in shape_keys) or str(i) for i, r in enumerate(rows)]
    values = {k: [r.get(k) if isinstance(r.get(k), (int, float)) else float("nan") for r in rows]
              for k in names}
    return labels, values, f"{unit} (shape {'x'.join(shape_keys)})"


def draw(path: Path, labels: list[str], values: dict[str, list[float]], ylabel: str) -> Path:
    """The figure of one JSON, written beside it as PNG; returns the file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, ys in values.items():
        anchor = any(word in name.lower() for word in ANCHOR_WORDS)
        ax.plot(range(len(labels)), ys, marker="o", label=name, linestyle="--" if anchor else "-")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(path.stem)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# bench_eplb_sim's planners: name, label, line style, marker (None: drawn as a level).
EPLB_PLANNERS = (("none", "no EPLB", ":", None), ("baseline", "hierarchical baseline", "-", "o"),
                 ("ours", "ours", "-", "s"))
EPLB_TICKS = (1, 1.5, 2, 4, 8, 16, 32)


def _eplb_panel(ax, sel: list[dict], reds: list[int]) -> None:
    """One (scenario, EP size) panel: a line per planner and, in the corner, the baseline's and
    ours' values at the largest R (the differences near 1 that a log axis flattens)."""
    for name, label, style, marker in EPLB_PLANNERS:
        if marker is None:  # no redundant slots: one value whatever R
            xs, ys = [reds[0], reds[-1]], [sel[0]["measured"][name]] * 2
        else:
            xs, ys = [r["redundant"] for r in sel], [r["measured"][name] for r in sel]
        ax.plot(xs, ys, linestyle=style, marker=marker, label=label)
    last = sel[-1]
    ax.text(0.97, 0.95, f"R {last['redundant']}: baseline {last['measured']['baseline']:.2f}, "
            f"ours {last['measured']['ours']:.2f}", transform=ax.transAxes, ha="right",
            va="top", fontsize="small", bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.set_yscale("log")
    ax.set_ylim(0.9, 4 * max(r["measured"]["none"] for r in sel))
    ax.set_xticks(reds)
    ax.grid(alpha=0.3)


def draw_eplb_sim(rows: list[dict], path: Path) -> Path:
    """eplb_sim.json's figure, written to `path`: the measured max/mean rank load against the
    redundant experts R, one panel per (scenario, EP size), one line per planner (no EPLB has
    no redundant slots: its one value spans the panel). Returns the file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    eps = sorted({r["ep"] for r in rows})
    reds = sorted({r["redundant"] for r in rows})
    fig, axes = plt.subplots(len(scenarios), len(eps), sharex=True, squeeze=False,
                             figsize=(3.4 * len(eps), 2.7 * len(scenarios)))
    for i, scenario in enumerate(scenarios):
        for j, ep in enumerate(eps):
            ax = axes[i][j]
            _eplb_panel(ax, sorted((r for r in rows if r["scenario"] == scenario
                                    and r["ep"] == ep), key=lambda r: r["redundant"]), reds)
            ax.yaxis.set_major_locator(FixedLocator(EPLB_TICKS))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
            ax.set_title(f"{scenario}, EP {ep}", fontsize="medium")
        axes[i][0].set_ylabel("max / mean rank load")
    for ax in axes[-1]:
        ax.set_xlabel("redundant experts R")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle("DeepSeek-V3/R1 routing: busiest rank's load over the mean rank's, measured on "
                 "steps after the plan (a point for each R where E + R divides by EP)",
                 y=0.995, fontsize="medium")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.97),
               ncol=len(EPLB_PLANNERS), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Results files with a figure of their own: stem -> (draw(rows, png path), what it shows).
OWN_FIGURES = {"eplb_sim": (draw_eplb_sim, "max/mean rank load against redundant experts, per "
                                           "scenario and EP size (draw_eplb_sim)")}


def plot(results_dir: Path) -> list[Path]:
    """Print each JSON's series and draw its figure where matplotlib is installed; returns the
    files written."""
    try:
        import matplotlib  # noqa: F401
        can_draw = True
    except ImportError:
        can_draw = False
        print("matplotlib is not installed: no plots (pip install matplotlib, or "
              "pip install 'vllm-moe-fixes[plot]')")
    written = []
    for path in sorted(results_dir.glob("*.json")):
        if path.stem.endswith("_sweep"):
            continue
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            payload = {}
        if path.stem in OWN_FIGURES and "rows" in payload:
            print(f"  {path.name}: {OWN_FIGURES[path.stem][1]}")
            if can_draw:
                written.append(OWN_FIGURES[path.stem][0](payload["rows"], path.with_suffix(".png")))
                print(f"  wrote {written[-1]}")
            continue
        parsed = series(payload)
        if parsed is None:
            print(f"  {path.name}: nothing to plot")
            continue
        labels, values, ylabel = parsed
        print(f"  {path.name}: {', '.join(values)} in {ylabel} at {', '.join(labels)}")
        if can_draw:
            written.append(draw(path, labels, values, ylabel))
            print(f"  wrote {written[-1]}")
    return written


def main(argv: list[str]) -> int:
    results_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results"
    if results_dir.is_dir():
        plot(results_dir)
    else:
        print(f"  no results directory at {results_dir}: nothing to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
