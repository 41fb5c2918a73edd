"""Figures of the reports: ``specdec bench --plot``, ``specdec audit --plot`` (``AuditReport.plot``) and
``GenerationStats.plot``; one function per figure; and the commands' ``--plot`` option
(``check_plot_option``, ``write_plot``).

A leaf of the layer diagram: it draws what it is handed and imports only the cost model (and, to name
the bundled pair, default_pair), never the stats, the loop or the commands that call it.

matplotlib is an optional extra (``pip install ".[plot]"``). It is imported when a figure is
drawn, never when this module is, and only through its object-oriented API on the Agg canvas: pyplot's
global backend and figure list are left alone (a notebook's own plotting keeps working).

Every figure is WIDTH_IN wide and PANEL_HEIGHT_IN high per row of two panels at DPI dots per inch
(``figure_pixels``), titled with the pair, the machine and the date.
"""
from __future__ import annotations

import datetime
import io
import itertools
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .cost_model import expected_tokens_per_pass, predicted_speedup

INSTALL_HINT = 'pip install ".[plot]" in the specdec_ext checkout (or pip install "matplotlib>=3.7")'
WIDTH_IN = 12.0
PANEL_HEIGHT_IN = 4.5
LEGEND_COLUMNS = 5  # the bench figure's shared legend, under the panels
DPI = 100  # 1200 px wide: the 10 pt text stays readable at 100 % size
FONT_SIZE = 10
PNG_COLOURS = 256  # a palette PNG: a line plot looks the same in 256 colours, at a third of the RGBA file's size
COST_MODEL_MAX_K = 8  # the cost model's curve spans k = 0..8 at least, like the audit's break-even table
PROMPT_SHIFT = 0.12  # x offset between the audit's prompts at one position
# (colour, line style) of the reference methods' horizontal lines, apart from the drafters' colour cycle
REFERENCE_LOOKS = (("black", "--"), ("dimgray", ":"), ("darkgoldenrod", "-."), ("teal", (0, (5, 1, 1, 1))))


class PlotDependencyError(ImportError):
    """matplotlib is missing; the message says how to install it."""


@dataclass(frozen=True)
class BenchPoint:
    """One method of a benchmark: where it sits on the k axis (None for a reference line) and its rates."""

    k: Optional[float]  # draft tokens per step (a tree: its nodes; k="auto": the mean k it chose)
    tokens_per_s: float
    tokens_per_pass: float


@dataclass
class BenchPanel:
    """One workload of a benchmark: a curve per drafter, and the methods drawn as horizontal lines."""

    workload: str
    curves: Dict[str, List[BenchPoint]] = field(default_factory=dict)
    references: Dict[str, BenchPoint] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- set-up
def _matplotlib():
    """(Figure, FigureCanvasAgg), or PlotDependencyError naming the install command."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotDependencyError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}") from error
    return Figure, FigureCanvasAgg


def check_plot_path(path: str) -> None:
    """Fail now, before a long run, when the figure could not be written: matplotlib missing
    (PlotDependencyError), an image format matplotlib does not know or a missing directory (ValueError)."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(path)[1].lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension not in formats:
        raise ValueError(f"cannot tell the image format of {path!r}: end it with one of "
                         + ", ".join("." + f for f in sorted(formats)) + " (e.g. .png)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"the directory of {path!r} does not exist: {directory}")


def check_plot_option(command: str, path: Optional[str]) -> None:
    """``specdec <command> --plot FILE``: fail before the work when the figure could not be drawn or written."""
    if path is None:
        return
    try:
        check_plot_path(path)
    except (PlotDependencyError, ValueError) as error:
        raise SystemExit(f"specdec {command} --plot: {error}") from None


def write_plot(command: str, draw: Callable[[], str]) -> None:
    """Call ``draw()`` (it writes a figure and returns its path) and say where the figure went, on stderr."""
    try:
        path = draw()
    except ValueError as error:
        raise SystemExit(f"specdec {command} --plot: {error}") from None
    print(f"specdec {command}: wrote {path}", file=sys.stderr)


def figure_pixels(rows: int) -> Tuple[int, int]:
    """(width, height) in pixels of a figure with ``rows`` rows of panels."""
    return round(WIDTH_IN * DPI), round(rows * PANEL_HEIGHT_IN * DPI)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_label() -> str:
    """The CPU (cores, torch threads) and the GPU when there is one."""
    import torch

    threads = torch.get_num_threads()
    label = f"{_cpu_name()} ({os.cpu_count()} cores, {threads} torch thread{'s' if threads != 1 else ''})"
    if torch.cuda.is_available():
        label += f", {torch.cuda.get_device_name()}"
    return label


def model_label(model) -> str:
    """A model's directory or id and its size, e.g. "bundled target (26.5M)"."""
    from .default_pair import PAIR_DIR, target_dir_path

    name = getattr(model, "name_or_path", "") or type(model).__name__
    base = os.path.basename(os.path.normpath(name)) if os.path.isdir(name) else name
    if os.path.isdir(name) and os.path.realpath(name) == os.path.realpath(target_dir_path()):
        base = "bundled target"  # (its weights unpacked in the user's cache: default_pair/packing.py)
    elif os.path.isdir(name) and os.path.abspath(name).startswith(PAIR_DIR + os.sep):
        base = "bundled " + base
    params = sum(p.numel() for p in model.parameters())
    return f"{base} ({params / 1e6:.1f}M)" if params >= 1e5 else f"{base} ({params / 1e3:.0f}K)"


def pair_label(target, draft) -> str:
    """ "target / draft: <target's label> / <draft's label>" """
    return f"target / draft: {model_label(target)} / {model_label(draft)}"


def _new_figure(rows: int, subject: str):
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(figsize=(WIDTH_IN, rows * PANEL_HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{subject}\n{machine_label()}, {datetime.date.today().isoformat()}", fontsize=FONT_SIZE + 1)
    axes = figure.subplots(rows, 2, squeeze=False)
    for ax in axes.flat:
        ax.tick_params(labelsize=FONT_SIZE)
        ax.grid(True, alpha=0.3)
    return figure, axes


def _save(figure, path: str) -> str:
    check_plot_path(path)
    if os.path.splitext(path)[1].lower() != ".png":
        figure.savefig(path, dpi=DPI)
        return path
    from PIL import Image  # a requirement of matplotlib's

    rgba = io.BytesIO()
    figure.savefig(rgba, format="png", dpi=DPI)
    rgba.seek(0)
    with Image.open(rgba) as image:
        image.convert("RGB").quantize(PNG_COLOURS).save(path, optimize=True)
    return path


# ------------------------------------------------------------------------------------- bench
def plot_bench(panels: Sequence[BenchPanel], path: str, *, pair: str, details: str = "") -> str:
    """``specdec bench --plot``: per workload (a row), tokens/s and tokens per target pass against k for
    each drafter, the reference methods (HF plain, assisted, prompt lookup, ours plain) as horizontal lines."""
    if not panels:
        raise ValueError("plot_bench: no workload to draw")
    figure, axes = _new_figure(len(panels), f"specdec bench: {pair}" + (f"; {details}" if details else ""))
    # one colour per drafter and one look per reference method in every panel, so that one legend serves all
    curve_colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(n for p in panels for n in p.curves))}
    reference_looks = {name: look for name, look in zip(
        dict.fromkeys(n for p in panels for n in p.references), itertools.cycle(REFERENCE_LOOKS))}
    for row, panel in enumerate(panels):
        for column, (value, unit) in enumerate((("tokens_per_s", "tokens/s (median over repeats)"),
                                                ("tokens_per_pass", "tokens per target pass"))):
            ax = axes[row][column]
            for name, point in panel.references.items():
                colour, style = reference_looks[name]
                ax.axhline(getattr(point, value), color=colour, linestyle=style, linewidth=1.3, label=name)
            for name, points in panel.curves.items():
                points = sorted(points, key=lambda p: p.k)
                ax.plot([p.k for p in points], [getattr(p, value) for p in points], marker="o", linewidth=1.6,
                        color=curve_colours[name], label=name)
            ax.set_xlabel("draft tokens per step k (tree: nodes N; k=auto: mean k chosen)", fontsize=FONT_SIZE)
            ax.set_ylabel(unit, fontsize=FONT_SIZE)
            ax.set_title(f"workload {panel.workload}: {unit.split(' (')[0]}", fontsize=FONT_SIZE + 1)
            ax.set_ylim(bottom=0)
    legend = {}
    for ax in axes.flat:
        legend.update((label, handle) for handle, label in zip(*ax.get_legend_handles_labels()))
    figure.legend(legend.values(), legend.keys(), loc="outside lower center", ncols=LEGEND_COLUMNS,
                  fontsize=FONT_SIZE - 1)
    return _save(figure, path)


# ------------------------------------------------------------------------------------- audit
def plot_audit(report, path: str) -> str:
    """``specdec audit --plot``: the total variation per generated position next to its noise floor (left),
    the predicted and measured decode speedup for each k of the break-even report (right)."""
    s = report.sampling
    figure, axes = _new_figure(1, f"specdec audit: {report.pair or 'a (target, draft) pair'}; "
                                  f"T={s.temperature:g} top_k={s.top_k} top_p={s.top_p:g}")
    _draw_total_variation(axes[0][0], report)
    _draw_break_even(axes[0][1], report)
    return _save(figure, path)


def _draw_total_variation(ax, report) -> None:
    positions = list(dict.fromkeys(t.position for t in report.tests))  # "1", "2", ..., "joint"
    x = {p: i for i, p in enumerate(positions)}
    prompts = sorted({t.prompt for t in report.tests})
    for n, prompt in enumerate(prompts):
        tests = [t for t in report.tests if t.prompt == prompt]
        shift = (n - (len(prompts) - 1) / 2) * PROMPT_SHIFT  # prompts side by side at each position
        xs = [x[t.position] + shift for t in tests]
        # markers only: positions are categories (the joint is not the next position)
        dots, = ax.plot(xs, [t.tv for t in tests], marker="o", markersize=7, linestyle="none",
                        label=f"prompt {prompt + 1}: TV(speculative, plain)")
        ax.plot(xs, [t.tv_noise for t in tests], marker="_", markersize=16, markeredgewidth=2.5, linestyle="none",
                color=dots.get_color(), alpha=0.6, label=f"prompt {prompt + 1}: noise floor (TV of a random split)")
    ax.set_xticks(range(len(positions)), positions)
    ax.set_xlabel("generated position (joint: all positions together)", fontsize=FONT_SIZE)
    ax.set_ylabel("total variation distance (0 to 1)", fontsize=FONT_SIZE)
    ax.set_ylim(bottom=0)
    worst = min(t.p_value for t in report.tests)
    ax.set_title(f"losslessness: {report.verdict} (smallest p {worst:.3g}, threshold {report.threshold:.2g})",
                 fontsize=FONT_SIZE + 1)
    ax.legend(fontsize=FONT_SIZE - 1)


def _draw_break_even(ax, report) -> None:
    rows = report.break_even
    if not rows:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "break-even report not run (--no-break-even)", ha="center", va="center",
                fontsize=FONT_SIZE + 1, transform=ax.transAxes)
        return
    ks = [r.k for r in rows]
    mean_draft_cost = sum(r.draft_cost for r in rows) / len(rows)
    ax.plot(ks, [r.measured_speedup for r in rows], marker="o", linewidth=1.8, label="measured")
    ax.plot(ks, [r.predicted_speedup for r in rows], marker="s", linestyle="--",
            label="cost model E / (v + k c), a, c, v measured at each k")
    ax.plot(ks, [predicted_speedup(report.acceptance, k, mean_draft_cost, 1.0) for k in ks], linestyle=":",
            label=f"E / (1 + k c), pooled a = {report.acceptance:.2f}, mean c = {mean_draft_cost:.3f}")
    ax.axhline(1.0, color="0.35", linewidth=1.0, label="break-even (plain decoding)")
    ax.set_xticks(ks)
    ax.set_xlabel("draft length k (tokens per step)", fontsize=FONT_SIZE)
    ax.set_ylabel("decode speedup over plain decoding (x)", fontsize=FONT_SIZE)
    ax.set_ylim(bottom=0)
    ax.set_title(f"break-even (plain target step {report.target_step_time * 1e3:.2f} ms)", fontsize=FONT_SIZE + 1)
    ax.legend(fontsize=FONT_SIZE - 1)


# ------------------------------------------------------------------------------------- generation
def plot_generation(stats, path: str, *, label: str = "") -> str:
    """``GenerationStats.plot``: acceptance by draft position next to the pooled acceptance (left), and
    tokens per target pass measured against the cost model E(k) = (1 - a^(k+1)) / (1 - a) (right)."""
    if stats.k == 0 or not any(stats.reached):
        raise ValueError("nothing to plot: no draft token was verified (plain decoding, or no decode step)")
    how = f"k=auto (k_max {stats.adaptive['k_max']})" if stats.adaptive else f"k={stats.k}"
    run = f"{how}, batch {stats.batch_size}, {stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s"
    figure, axes = _new_figure(1, f"specdec generate: {label}; {run}" if label else f"specdec generate: {run}")
    _draw_acceptance(axes[0][0], stats)
    _draw_tokens_per_pass(axes[0][1], stats)
    return _save(figure, path)


def _draw_acceptance(ax, stats) -> None:
    positions = [i + 1 for i, reached in enumerate(stats.reached) if reached]
    rates = [stats.acceptance_by_position[i - 1] for i in positions]
    bars = ax.bar(positions, rates, color="tab:blue", alpha=0.8, label="accepted / reached at this position")
    ax.bar_label(bars, labels=[f"n={stats.reached[i - 1]}" for i in positions], fontsize=FONT_SIZE - 2)
    ax.axhline(stats.acceptance_rate, color="tab:red", linestyle="--",
               label=f"pooled acceptance a = {stats.acceptance_rate:.3f} (the cost model's)")
    ax.set_xticks(range(1, stats.k + 1))
    ax.set_xlim(0.4, stats.k + 0.6)  # every position has its place, reached or not
    ax.set_xlabel("draft position (1 = first drafted token)", fontsize=FONT_SIZE)
    ax.set_ylabel("acceptance probability (0 to 1)", fontsize=FONT_SIZE)
    ax.set_ylim(0, 1.3)  # room for the legend above the bars
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_title("acceptance by draft position (n: times the position was reached)", fontsize=FONT_SIZE + 1)
    ax.legend(fontsize=FONT_SIZE - 1, loc="upper left")


def _draw_tokens_per_pass(ax, stats) -> None:
    a = stats.acceptance_rate
    ks = list(range(0, max(stats.k, COST_MODEL_MAX_K) + 1))  # k = 0: plain decoding, one token per pass
    ax.plot(ks, [k + 1 for k in ks], color="0.5", linestyle=":", label="k + 1 (every draft accepted)")
    ax.plot(ks, [expected_tokens_per_pass(a, k) for k in ks], linestyle="--", marker=".",
            label=f"cost model (1 - a^(k+1)) / (1 - a), a = {a:.3f}")
    measured_k = stats.adaptive["mean_row_k"] if stats.adaptive else stats.k
    if not math.isnan(measured_k):
        ax.plot([measured_k], [stats.tokens_per_pass], marker="o", markersize=9, linestyle="none", color="tab:red",
                label=f"measured: {stats.tokens_per_pass:.2f} at k = {measured_k:.3g}"
                      + (" (mean k chosen)" if stats.adaptive else ""))
    ax.set_xticks(ks)
    ax.set_xlabel("draft length k (tokens per step)", fontsize=FONT_SIZE)
    ax.set_ylabel("tokens per target pass", fontsize=FONT_SIZE)
    ax.set_ylim(bottom=0)
    ax.set_title("tokens per target pass: measured and predicted", fontsize=FONT_SIZE + 1)
    ax.legend(fontsize=FONT_SIZE - 1, loc="upper left")
