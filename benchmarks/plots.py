"""One PNG per results JSON: every GB/s or TFLOP/s column of its rows against the shape.

    python -m benchmarks.plots [RESULTS_DIR]      (default benchmarks/results; `vllm-moe-fixes
                                                   bench` runs it after the benchmarks)

Each JSON whose "rows" or "results" is a list of dicts (or a dict of dicts keyed by operation)
gives one figure beside it; sweeps (`*_sweep.json`) are skipped. Series whose name holds one of
ANCHOR_WORDS (copy ceiling, torch, DeepGEMM, published figures) are anchors, drawn dashed beside
our kernels' solid lines. Every file's series are printed, so the selection shows without
matplotlib too; drawing needs it. Exit status 0 (also when there is nothing to plot).
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
            parsed = series(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            parsed = None
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
