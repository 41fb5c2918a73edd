"""Figures (specdec_ext/plots.py) from short runs of a tiny pair, the message when matplotlib is missing,
and the progress bars (specdec_ext/progress.py): on stderr only, off when it is not a terminal or quiet."""
from __future__ import annotations

import builtins
import io
import struct
import sys

import pytest

import specdec_ext
from specdec_ext import plots
from specdec_ext.bench.compare import REFERENCE, Measure, PlotPlace, bench_panel
from specdec_ext.plots import BenchPanel, BenchPoint, PlotDependencyError
from specdec_ext.progress import progress_bar, progress_wanted
from test_generate_utils import noisy_copy, tiny_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_PALETTE = 3
PROMPT = [1, 4, 2, 6, 3]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=64, hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3)


def png_size(path) -> tuple:
    """(width, height) from a PNG's IHDR chunk; fails unless the file is a PNG by its magic bytes."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC, head[:8]
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


@pytest.fixture
def missing_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as where the plot extra is not installed."""
    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)


# ------------------------------------------------------------------------------------- figures
@pytest.mark.parametrize("k", [3, "auto"])
def test_generation_stats_plot(pair, tmp_path, k):
    target, draft = pair
    sampling = {}
    if k == "auto":  # adaptive k that drafts something: exploring every step while speculation does not pay
        k = specdec_ext.AdaptiveK(8, explore_every=1)  # (on the tiny pair, plain chains can beat every k)
        sampling = dict(temperature=1.0, seed=3)  # (greedy rows explore by looks, which verify no drafts)
    stats = specdec_ext.generate([PROMPT], target, draft, max_new_tokens=30, k=k, eos_token_id=False,
                                 **sampling).stats
    path = tmp_path / "generation.png"
    assert stats.plot(str(path), label="tiny pair") == str(path)
    assert png_size(path) == plots.figure_pixels(1) == (1200, 450)
    assert path.read_bytes()[25] == PNG_PALETTE  # IHDR's colour type: the small palette PNG


def test_generation_stats_plot_needs_drafted_tokens(pair, tmp_path):
    stats = specdec_ext.plain_generate([PROMPT], pair[0], max_new_tokens=4, eos_token_id=False).stats
    with pytest.raises(ValueError, match="no draft token was verified"):
        stats.plot(str(tmp_path / "plain.png"))
    assert not (tmp_path / "plain.png").exists()


def test_bench_figure_has_a_row_per_workload(tmp_path):
    def measure(tokens, passes, mean_k=None):  # one repeat of one second
        m = Measure(times=[1.0], tokens=[tokens], passes=[passes])
        if mean_k is not None:
            m.stats = [type("Stats", (), {"adaptive": {"mean_row_k": mean_k}})()]
        return m

    results = {"HF plain greedy": measure(100, 100), "ours k=2": measure(180, 90), "ours k=4": measure(200, 80),
               "ours k=auto": measure(190, 95, mean_k=3.5)}
    places = {"HF plain greedy": REFERENCE, "ours k=2": PlotPlace("ours draft model", 2),
              "ours k=4": PlotPlace("ours draft model", 4), "ours k=auto": PlotPlace("ours draft model k=auto")}
    panel = bench_panel("code", results, places)
    assert panel.references == {"HF plain greedy": BenchPoint(None, 100.0, 1.0)}
    assert panel.curves["ours draft model"] == [BenchPoint(2, 180.0, 2.0), BenchPoint(4, 200.0, 2.5)]
    assert panel.curves["ours draft model k=auto"] == [BenchPoint(3.5, 190.0, 2.0)]
    path = tmp_path / "bench.png"
    plots.plot_bench([panel, BenchPanel("edit", panel.curves, panel.references)], str(path), pair="tiny")
    assert png_size(path) == plots.figure_pixels(2) == (1200, 900)
    with pytest.raises(ValueError, match="no workload"):
        plots.plot_bench([], str(path), pair="tiny")


def test_plot_path_is_checked_before_drawing(tmp_path):
    with pytest.raises(ValueError, match="image format"):
        plots.check_plot_path(str(tmp_path / "figure.xyz"))
    with pytest.raises(ValueError, match="does not exist"):
        plots.check_plot_path(str(tmp_path / "missing" / "figure.png"))
    plots.check_plot_path(str(tmp_path / "figure.png"))


def test_labels_name_the_models_and_the_machine(pair):
    target, draft = pair
    assert plots.pair_label(target, draft) == "target / draft: LlamaForCausalLM (48K) / LlamaForCausalLM (48K)"
    target_, draft_, _ = specdec_ext.load_default_pair()
    assert plots.pair_label(target_, draft_) == "target / draft: bundled target (26.5M) / bundled draft (2.6M)"
    assert "1 torch thread)" in plots.machine_label()


def test_missing_matplotlib_names_the_install_command(pair, tmp_path, missing_matplotlib):
    target, draft = pair
    stats = specdec_ext.generate([PROMPT], target, draft, max_new_tokens=8, k=2, eos_token_id=False).stats
    with pytest.raises(PlotDependencyError, match=r'pip install "\.\[plot\]" in the specdec_ext checkout'):
        stats.plot(str(tmp_path / "generation.png"))
    with pytest.raises(ImportError, match=r'pip install "matplotlib>=3\.7"'):
        plots.check_plot_path(str(tmp_path / "generation.png"))
    assert not (tmp_path / "generation.png").exists()


# ------------------------------------------------------------------------------------- progress
def test_progress_is_off_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress_wanted()
    with progress_bar(5, "counting") as bar:
        bar.update(5)
    assert sys.stderr.getvalue() == "" and capsys.readouterr().out == ""


def test_progress_is_on_for_a_terminal_unless_quiet(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert progress_wanted() and not progress_wanted(quiet=True)
    with progress_bar(5, "counting", unit="step") as bar:
        bar.update(5)
    assert "counting" in terminal.getvalue() and "5/5" in terminal.getvalue()
    assert capsys.readouterr().out == ""  # never on stdout
    before = len(terminal.getvalue())
    with progress_bar(5, "quietly", show=progress_wanted(quiet=True)) as bar:
        bar.update(5)
    assert len(terminal.getvalue()) == before
