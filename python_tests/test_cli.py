"""The ``specdec`` command line: --help of every command, generate (streamed and not), audit, bench."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from specdec_ext import cli, plots
from test_generate_utils import CHAR_VOCAB, char_tokenizer, noisy_copy, tiny_model
from test_plots import FakeTerminal, missing_matplotlib, png_size  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tokenizer = char_tokenizer()
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    draft = noisy_copy(target, noise=0.3)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def test_python_dash_m_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "specdec_ext", "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("generate", "audit", "bench", "demo"):
        assert command in out.stdout


@pytest.mark.parametrize("command,flags", [
    ("generate", ["--target", "--draft", "--draft-tokenizer", "--max-new-tokens", "--k", "--temperature", "--top-k",
                  "--top-p", "--seed", "--eos-token-id", "--no-eos", "--stop", "--no-stream", "--json", "--threads", "--runner",
                  "--prompt-file", "--plot", "--quiet"]),
    ("audit", ["--draft-tokenizer", "--positions", "--samples", "--ks", "--bench-tokens", "--alpha", "--max-prompts", "--no-break-even",
               "--temperature", "--top-p", "--plot", "--quiet"]),
    ("demo", ["--files", "--lines", "--max-new-tokens", "--k", "--dtype"]),
    ("bench", ["--ks", "--prompts", "--lines", "--max-new-tokens", "--repeats", "--threads", "--dtype", "--no-hf",
               "--plot", "--quiet"]),
])
def test_help_explains_every_flag(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out, flag
    # every option line carries an explanation
    parser = cli.build_parser() if command != "bench" else None
    if parser is not None:
        sub = parser._subparsers._group_actions[0].choices[command]
        for action in sub._actions:
            assert action.help, action.option_strings


def test_generate_streams_text_and_prints_stats(pair_dirs, capsys):
    target, draft = pair_dirs
    assert cli.main(["generate", "def f(x):", "import ", "--target", target, "--draft", draft,
                     "--max-new-tokens", "12", "-k", "3", "--no-eos"]) == 0
    captured = capsys.readouterr()
    assert "--- [0]" in captured.out and "--- [1]" in captured.out
    assert "tokens per pass" in captured.err and "acceptance" in captured.err
    assert cli.main(["generate", "x = ", "--target", target, "--draft", draft, "--max-new-tokens", "6",
                     "--no-stream", "--json", "--temperature", "0.8", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)  # (--json: stdout is one JSON document)
    assert stats["new_tokens"] <= 6 and stats["k"] == 4
    assert stats["prompts"] == ["x = "] and len(stats["token_ids"][0]) == stats["new_tokens"]
    assert isinstance(stats["text"][0], str)


def test_generate_needs_both_models(pair_dirs):
    with pytest.raises(SystemExit, match="--target and --draft together"):
        cli.main(["generate", "x", "--target", pair_dirs[0]])


def test_audit_command(pair_dirs, capsys):
    target, draft = pair_dirs
    code = cli.main(["audit", "abc", "--target", target, "--draft", draft, "--samples", "200", "--positions", "2",
                     "--ks", "1,2", "--bench-tokens", "6", "--max-prompts", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "verdict: PASS" in out and "break-even" in out


def test_bench_command_runs_on_a_tiny_pair(pair_dirs, tmp_path, capsys):
    target, draft = pair_dirs
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):\n    return ")
    # fp32: every method then reproduces HF greedy exactly (in bf16 our lean target computes attention
    # in fp32 on the CPU, and multi-token passes round differently: near-ties may flip)
    figure = tmp_path / "bench.png"
    assert cli.main(["bench", "--target", target, "--draft", draft, "--prompt-file", str(prompt), "--ks", "2,3",
                     "--max-new-tokens", "10", "--repeats", "2", "--dtype", "float32", "--plot", str(figure)]) == 0
    assert png_size(figure) == plots.figure_pixels(1)  # one workload: the prompt file
    out = capsys.readouterr().out
    for name in ("HF plain greedy", "HF assisted (draft)", "HF prompt lookup", "ours plain (k=0)", "ours k=2",
                 "ours k=3", "cost model", "targets:"):
        assert name in out, name
    rows = [line for line in out.splitlines() if line.startswith(("HF ", "ours "))]
    assert all(line.split()[-1] == "yes" for line in rows)  # every method reproduces plain greedy


def test_demo_completes_heldout_prompts_with_the_bundled_pair(capsys):
    prompts = cli.heldout_prompts(2, 5)
    assert len(prompts) == 2 and all(name.startswith("stdlib/") for name, _ in prompts)
    assert cli.main(["demo", "--files", "1", "--lines", "5", "--max-new-tokens", "6", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "tokens per target pass" in out and "identical to plain greedy" in out
    assert out.startswith("models in bfloat16, 1 thread(s); target runner lean: ") and "the CPU kernels" in out


def test_demo_in_float32_leaves_the_cached_bundled_pair_as_loaded(capsys):
    from specdec_ext.models import load_pair
    target, draft, _ = load_pair()
    dtypes = (target.dtype, draft.dtype)
    for dtype in ("float32", "bfloat16"):
        assert cli.main(["demo", "--files", "1", "--lines", "3", "--max-new-tokens", "4", "--dtype", dtype]) == 0
        assert capsys.readouterr().out.startswith(f"models in {dtype}")
    assert (target.dtype, draft.dtype) == dtypes and load_pair()[0] is target


def test_generate_with_the_bundled_heads_and_a_tree(capsys):
    assert cli.main(["generate", "--prompt", "def f(x):", "--draft", "heads", "--tree", "2,2,4", "--max-new-tokens", "6",
                     "--no-stream", "--no-eos", "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)
    assert stats["k"] == 4 and stats["new_tokens"] == 6 and len(stats["token_ids"][0]) == 6
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x", "--tree", "2,2"])


def test_generate_with_the_bundled_eagle_head(capsys):
    assert cli.main(["generate", "--prompt", "def f(x):", "--draft", "eagle", "-k", "3", "--max-new-tokens", "6",
                     "--no-stream", "--no-eos", "--json", "--explain"]) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)  # (--explain writes to stderr)
    assert stats["k"] == 3 and stats["new_tokens"] == 6 and "hidden taps" in captured.err


def test_demo_with_the_bundled_heads(capsys):
    assert cli.main(["demo", "--draft", "heads", "--files", "1", "--lines", "5", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "8-node tree" in out and "identical to plain greedy" in out


def test_generate_with_a_heads_directory_for_another_target(pair_dirs, tmp_path, capsys):
    from specdec_ext.heads import MedusaHeads
    target_dir, _ = pair_dirs
    MedusaHeads(48, 2, CHAR_VOCAB).save(str(tmp_path / "heads"))
    assert cli.main(["generate", "--prompt", "abc", "--target", target_dir, "--draft", str(tmp_path / "heads"),
                     "--tree", "2,2,3", "--max-new-tokens", "5", "--no-stream", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["k"] == 3
    with pytest.raises(SystemExit, match="needs the --target"):
        cli.main(["generate", "--prompt", "abc", "--draft", str(tmp_path / "heads")])


# ------------------------------------------------------------------------------------- --plot, progress, --quiet
AUDIT_FAST = ["--samples", "300", "--positions", "2", "--ks", "1,2", "--bench-tokens", "6", "--max-prompts", "1"]


def test_audit_plot_and_progress_on_a_terminal(pair_dirs, tmp_path, monkeypatch, capsys):
    target, draft = pair_dirs
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    figure = tmp_path / "audit.png"
    assert cli.main(["audit", "abc", "--target", target, "--draft", draft, *AUDIT_FAST, "--plot", str(figure)]) == 0
    assert png_size(figure) == plots.figure_pixels(1)
    bars = terminal.getvalue()
    assert "audit sampling" in bars and "600/600" in bars and "audit break-even" in bars
    assert "Loading weights" in bars  # transformers' own bars, which --quiet hides too
    assert f"wrote {figure}" in bars
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "audit sampling" not in out  # the report on stdout, no bar there


def test_audit_quiet_draws_no_progress(pair_dirs, tmp_path, monkeypatch):
    target, draft = pair_dirs
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    figure = tmp_path / "audit.png"
    assert cli.main(["audit", "abc", "--target", target, "--draft", draft, *AUDIT_FAST, "--no-break-even",
                     "--quiet", "--plot", str(figure)]) == 0
    assert png_size(figure) == plots.figure_pixels(1)  # the break-even panel says it was not run
    assert "audit sampling" not in terminal.getvalue() and "Loading weights" not in terminal.getvalue()


def test_no_bar_of_any_kind_where_stderr_is_not_a_terminal(pair_dirs, capsys):
    target, draft = pair_dirs  # (capsys: stderr is a file, as in a log or a CI job)
    assert cli.main(["generate", "x", "--target", target, "--draft", draft, "--max-new-tokens", "2", "-k", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokens per pass" in err and "Loading weights" not in err and "%|" not in err


def test_generate_progress_bar_and_plot(pair_dirs, tmp_path, monkeypatch, capsys):
    target, draft = pair_dirs
    monkeypatch.setattr(cli, "GENERATE_PROGRESS_DELAY_S", 0.0)  # the tiny pair is done long before 3 s
    run = ["generate", "def f(x):", "--target", target, "--draft", draft, "--max-new-tokens", "12", "-k", "3",
           "--no-eos", "--no-stream"]
    # stderr not a terminal (captured): no bar
    assert cli.main(run) == 0
    assert "generating" not in capsys.readouterr().err
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    figure = tmp_path / "generation.png"
    assert cli.main(run + ["--plot", str(figure)]) == 0
    assert "generating" in terminal.getvalue() and "tokens per pass" in terminal.getvalue()
    assert png_size(figure) == plots.figure_pixels(1)
    out = capsys.readouterr().out
    assert "--- [0]" in out and "generating" not in out
    terminal.seek(0)
    terminal.truncate()
    assert cli.main(run + ["--quiet"]) == 0
    assert "generating" not in terminal.getvalue() and "tokens per pass" in terminal.getvalue()


@pytest.mark.parametrize("command", ["generate", "audit", "bench"])
def test_plot_without_matplotlib_fails_before_the_work(command, tmp_path, monkeypatch, missing_matplotlib):
    def no_work(*args, **kwargs):
        raise AssertionError("the models were loaded before --plot was checked")

    # the modules, not the functions of the same names that specdec_ext exports
    monkeypatch.setattr(importlib.import_module("specdec_ext.generate"), "load_models", no_work)
    monkeypatch.setattr(importlib.import_module("specdec_ext.audit"), "load_pair", no_work)
    monkeypatch.setattr(importlib.import_module("specdec_ext.bench.compare"), "load", no_work)
    argv = {"generate": ["generate", "x"], "audit": ["audit"], "bench": ["bench"]}[command]
    message = rf'specdec {command} --plot: .*pip install "\.\[plot\]" in the specdec_ext checkout'
    with pytest.raises(SystemExit, match=message):
        cli.main(argv + ["--plot", str(tmp_path / "figure.png")])


def test_plot_to_a_missing_directory_fails_before_the_work(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        cli.main(["generate", "x", "--plot", str(tmp_path / "missing" / "figure.png")])


def test_a_loaded_models_tokenizer_is_read_from_disk_once_per_version_of_its_files(pair_dirs, tmp_path, monkeypatch):
    """plain_generate() / generate() with a loaded model find its tokenizer beside its weights on every call;
    it is loaded once (it took 16-40 ms a call for the bundled one) and again only when its files change."""
    import shutil
    import time

    import transformers

    from specdec_ext import plain_generate

    folder = tmp_path / "target"
    shutil.copytree(pair_dirs[0], folder)
    target = transformers.AutoModelForCausalLM.from_pretrained(folder)
    loads = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *args, **kw: loads.append(args[0]) or load(*args, **kw))
    first = plain_generate([[3, 4, 5]], target, max_new_tokens=3, eos_token_id=False).token_ids
    assert plain_generate([[3, 4, 5]], target, max_new_tokens=3, eos_token_id=False).token_ids == first
    assert len(loads) == 1
    config = next(path for path in folder.iterdir() if path.name.startswith("tokenizer"))
    later = time.time_ns() + 10 ** 9
    os.utime(config, ns=(later, later))
    assert plain_generate([[3, 4, 5]], target, max_new_tokens=3, eos_token_id=False).token_ids == first
    assert len(loads) == 2


def test_an_audit_with_too_few_samples_is_inconclusive_not_a_pass(pair_dirs, capsys):
    """With 5 samples every token is pooled into one category: no test ran, and it said PASS, "indistinguishable"."""
    target, draft = pair_dirs
    assert cli.main(["audit", "abc", "--target", target, "--draft", draft, "--samples", "5", "--positions", "2",
                     "--max-prompts", "1", "--no-break-even", "--quiet"]) == 1
    assert "verdict: INCONCLUSIVE" in capsys.readouterr().out


def test_bad_input_is_one_line_on_stderr_and_status_1_not_a_traceback(pair_dirs, capsys, monkeypatch):
    target, draft = pair_dirs
    base = ["generate", "abc", "--target", target, "--draft", draft, "--max-new-tokens", "4", "--quiet"]
    for flags, words in ((["--temperature", "nan"], "temperature"), (["--top-p", "2"], "top_p"),
                         (["--stop", ""], "stop"), (["--prompt-file", "/nonexistent.txt"], "nonexistent.txt")):
        assert cli.main(base + flags) == 1
        err = capsys.readouterr().err
        assert "specdec generate: error: " in err and words in err and "Traceback" not in err, err
    for argv in (["demo", "--files", "0"], ["audit", "--alpha", "2"], ["audit", "--max-prompts", "0"]):
        with pytest.raises(SystemExit) as refused:  # argparse: status 2 with the usage
            cli.main(argv)
        assert refused.value.code == 2


def test_an_interrupt_is_status_130_and_a_closed_pipe_is_quiet(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    def closed_pipe(args):
        raise BrokenPipeError

    monkeypatch.setitem(cli.COMMANDS, "demo", interrupted)
    assert cli.main(["demo"]) == 130 and "specdec demo: interrupted" in capsys.readouterr().err
    monkeypatch.setitem(cli.COMMANDS, "demo", closed_pipe)
    assert cli.main(["demo"]) == 141 and capsys.readouterr().err == ""  # (128 + SIGPIPE: test_cli_errors.py)


def test_version_and_strict_json_stats(pair_dirs, capsys):
    with pytest.raises(SystemExit) as shown:
        cli.main(["--version"])
    assert shown.value.code == 0 and capsys.readouterr().out.startswith("specdec_ext ")
    target, draft = pair_dirs
    assert cli.main(["generate", "x", "--target", target, "--draft", draft, "--max-new-tokens", "2", "-k", "8",
                     "--no-stream", "--json", "--quiet"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)  # (json.loads takes NaN; the text must not hold one)
    assert "NaN" not in out and None in stats["acceptance_by_position"]  # (positions 2 steps never reached)


@pytest.mark.parametrize("argv,option", [
    (["bench", "--prompts", "0"], "--prompts"), (["bench", "--lines", "0"], "--lines"),
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens"), (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--ks", "a"], "--ks"), (["bench", "--ks", "0,2"], "--ks"), (["bench", "--eagle-ks", ""], "--eagle-ks"),
    (["audit", "--ks", "3,x"], "--ks"), (["audit", "--bench-tokens", "0"], "--bench-tokens"),
])
def test_bench_and_audit_refuse_a_count_of_zero_or_a_bad_list_as_a_usage_error(argv, option, capsys, monkeypatch):
    """--prompts 0 meant all 13 prompts, --max-new-tokens 0 raised ZeroDivisionError, --lines 0 blamed `specdec
    demo`'s held-out files, --ks a raised a ValueError: argparse's usage error naming the option, before any work."""
    monkeypatch.setattr(importlib.import_module("specdec_ext.bench.compare"), "load",
                        lambda *a, **k: pytest.fail("the models were loaded"))
    with pytest.raises(SystemExit) as error:
        cli.main(argv)
    assert error.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_generate_refuses_a_logit_bias_that_is_no_json_object(capsys):
    assert cli.main(["generate", "x", "--logit-bias", "[1, 2]"]) == 1  # a line, no traceback (an AttributeError)
    assert "logit_bias must be a mapping of token id -> bias" in capsys.readouterr().err


def test_an_eagle_head_directory_alone_drafts_for_the_bundled_target(capsys):
    """specdec train-eagle --out DIR (no --target) trains for the bundled target; `--draft DIR` alone was refused
    ("give --target and --draft together")."""
    import specdec_ext

    head_dir = os.path.join(os.path.dirname(specdec_ext.__file__), "default_pair", "eagle")
    assert cli.main(["generate", "def f(x):", "--draft", head_dir, "--max-new-tokens", "6", "--json", "-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert cli.main(["generate", "def f(x):", "--draft", "eagle", "--max-new-tokens", "6", "--json", "-k", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]


def test_prompt_file_dash_reads_standard_input(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("def fib(n):\n"))
    assert cli.main(["generate", "--prompt-file", "-", "--draft", "ngram", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == ["def fib(n):\n"]


def test_a_warning_on_the_command_line_is_one_line_naming_the_command(monkeypatch):
    """(Python's format showed the library's file, line number and source line: train-eagle's resume warning.)
    Checked through warnings.formatwarning, which Python's showwarning prints (pytest records warnings instead)."""
    import warnings

    shown = []

    def warns(args):
        shown.append(warnings.formatwarning("resuming the run in runs/x: seed=1", UserWarning, "training.py", 230))
        return 0

    monkeypatch.setitem(cli.COMMANDS, "generate", warns)
    before = warnings.formatwarning
    assert cli.main(["generate", "x"]) == 0
    assert shown == ["specdec generate: warning: resuming the run in runs/x: seed=1\n"]
    assert warnings.formatwarning is before  # (restored: the library's callers keep Python's format)
