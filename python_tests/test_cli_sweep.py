"""An outside tester's sweep of the ``specdec`` command line (README "Command line", each command's --help):
README's command lines, every option of every --help, bad values and options that combine badly, the output
formats against generate(), signals, a closed pipe and the environment (SPECDEC_CPU_ISA, NO_COLOR, another
working directory).

Conventions asserted (README): bad input is one line on stderr naming the command, the option and the problem,
status 2 for a usage error and 1 for other bad input; Ctrl-C exits with 130 (serve drains and exits 0); a closed
pipe ends quietly with 141; never a Python traceback. The sweep found 17 defects, each fixed with its test here (their
docstrings say "Was a defect"); a Ctrl-C while the command is still importing torch (its first second) still prints
torch's traceback: the package's import runs before any handler of the command's can."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from specdec_ext import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
ENV.pop("SPECDEC_TRACEBACK", None)
TOKENIZER_DIR = os.path.join(ROOT, "specdec_ext", "default_pair", "tokenizer")

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


def main(argv, stdin=None):
    """cli.main(argv) in this process -> (status, stdout, stderr, warning messages); a SystemExit with a message
    is status 1 with the message on stderr, as Python prints it."""
    out, err = io.StringIO(), io.StringIO()
    saved_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                code = cli.main(list(argv))
            except SystemExit as exit_:
                code = exit_.code
                if isinstance(code, str):
                    err.write(code + "\n")
                    code = 1
                code = 0 if code is None else code
    finally:
        sys.stdin = saved_stdin
    return code, out.getvalue(), err.getvalue(), [str(w.message) for w in caught]


def specdec(args, *, timeout=120, **kw):
    """``python -m specdec_ext ARGS`` in a subprocess -> CompletedProcess (text)."""
    kw.setdefault("cwd", ROOT)
    kw.setdefault("env", ENV)
    return subprocess.run([sys.executable, "-m", "specdec_ext", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specdec {command}: "), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------- README and --help
def _subparsers():
    return cli.build_parser()._subparsers._group_actions[0].choices


def _bench_options():
    from specdec_ext.bench import compare
    return re.findall(r'add_argument\("(--[\w-]+)"', inspect.getsource(compare.parse_args))


@pytest.mark.parametrize("command", ["generate", "audit", "demo", "serve", "train-eagle", "bench"])
def test_every_subcommand_help_exits_0_on_stdout_and_names_every_option_it_parses(command):
    code, out, err, _ = main([command, "--help"])
    assert code == 0 and err == "" and out.startswith(f"usage: specdec {command}"), err
    if command == "bench":
        options = _bench_options()
        assert len(options) > 15
    else:
        options = [s for a in _subparsers()[command]._actions for s in a.option_strings]
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", out), f"specdec {command} --help: {option}"


def _readme_command_lines():
    """Every `specdec ...` command line of README.md's bash blocks and its command table, and the torchrun line."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("specdec "):
                lines.append(line)
            elif " -m specdec_ext " in line:
                lines.append("specdec " + line.split(" -m specdec_ext ", 1)[1])
    lines += re.findall(r"^\| `(specdec [^`]*)` \|", text, flags=re.M)
    return lines


def test_every_command_line_the_readme_shows_parses_with_its_documented_flags():
    lines = _readme_command_lines()
    commands = {shlex.split(line)[1] for line in lines}
    assert commands == {"generate", "demo", "audit", "serve", "bench", "train-eagle"}, commands
    assert len(lines) >= 14, lines
    from specdec_ext.bench.compare import parse_args
    for line in lines:
        argv = shlex.split(line)[1:]
        if argv[0] == "bench":
            parse_args(argv[1:])
        else:
            args = cli.build_parser().parse_args(argv)
            assert args.command == argv[0], line


# ------------------------------------------------------------------------------------- output formats
def test_streamed_text_equals_the_json_text_and_generate_s_for_the_same_arguments():
    import specdec_ext

    base = ["generate", "def fib(n):", "--max-new-tokens", "24", "--no-eos", "-k", "3", "--stop", "return"]
    code, streamed, err, _ = main(base)
    assert code == 0, err
    code, js, _, _ = main(base + ["--json"])
    assert code == 0
    document = json.loads(js)
    library = specdec_ext.generate("def fib(n):", max_new_tokens=24, eos_token_id=False, k=3, stop=["return"])
    assert document["text"] == library.text and document["token_ids"] == library.token_ids
    assert streamed == library.text[0] + "\n"
    assert "tokens per pass" in err and "k=3" in err  # the stats on stderr, nothing but the text on stdout


def test_json_stats_have_the_documented_fields_and_plausible_numbers():
    code, out, err, _ = main(["generate", "def f(x):", "import os\n", "--max-new-tokens", "12", "--no-eos", "-k", "3",
                              "--json"])
    assert code == 0 and err == "", err  # (--json: nothing but the document; no summary on stderr)
    d = json.loads(out)
    for field in ("k", "tree", "batch_size", "steps", "new_tokens", "tokens_per_pass", "acceptance_rate",
                  "acceptance_by_position", "tokens_per_s", "prompts", "text", "token_ids"):
        assert field in d, field
    assert d["k"] == 3 and d["tree"] is None and d["batch_size"] == 2 and d["prompts"] == ["def f(x):", "import os\n"]
    assert [len(t) for t in d["token_ids"]] == [12, 12] and d["new_tokens"] == 24
    assert 1.0 <= d["tokens_per_pass"] <= 3 + 1 and 0.0 <= d["acceptance_rate"] <= 1.0
    assert len(d["acceptance_by_position"]) == 3
    assert all(a is None or 0.0 <= a <= 1.0 for a in d["acceptance_by_position"])
    assert d["steps"] >= 1 and d["tokens_per_s"] > 0


def test_a_seeded_sample_is_reproduced_and_is_generate_s():
    import specdec_ext

    argv = ["generate", "import ", "--max-new-tokens", "10", "--no-eos", "--temperature", "0.8", "--top-p", "0.95",
            "--seed", "7", "--json"]
    first, second = (json.loads(main(argv)[1]) for _ in range(2))
    assert first["token_ids"] == second["token_ids"] and first["k"] == 4  # (README: seeded T > 0 drafts a fixed 4)
    library = specdec_ext.generate("import ", max_new_tokens=10, eos_token_id=False, temperature=0.8, top_p=0.95,
                                   seed=7)
    assert first["token_ids"] == library.token_ids


@pytest.mark.parametrize("kind", ["empty positional", "empty file", "huge file", "second stdin read"])
def test_a_prompt_that_cannot_run_is_one_line_status_1(kind, tmp_path):
    empty, huge = tmp_path / "empty.txt", tmp_path / "huge.txt"
    empty.write_text("")
    huge.write_text("x = 1\n" * 4000)
    argv, stdin = {"empty positional": ([""], None), "empty file": (["--prompt-file", str(empty)], None),
                   "huge file": (["--prompt-file", str(huge)], None),
                   "second stdin read": (["--prompt-file", "-", "--prompt-file", "-"], "def f():\n")}[kind]
    code, out, err, _ = main(["generate", *argv, "--draft", "ngram", "--max-new-tokens", "2"], stdin=stdin)
    line = one_error_line(err, "generate")
    assert code == 1 and out == "" and "prompt" in line, line


@pytest.mark.parametrize("flags,words", [
    (["--min-p", "2"], "min_p"), (["--presence-penalty", "5"], "presence_penalty"),
    (["--eos-token-id", "-1"], "eos_token_id"), (["--regex", "["], "regex"), (["--top-k", "-5"], "top_k"),
    (["--logit-bias", '{"99999999": 1}'], "logit_bias"), (["--regex", "a", "--json-schema", '{"type": "integer"}'],
                                                           "at most one of"),
])
def test_an_out_of_range_processing_value_is_one_line_status_1(flags, words):
    code, out, err, _ = main(["generate", "x", "--draft", "ngram", "--max-new-tokens", "2", *flags])
    line = one_error_line(err, "generate")
    assert code == 1 and words in line and line.startswith("specdec generate: error: "), line


# ------------------------------------------------------------------------------------- defects: generate
def test_several_streamed_prompts_each_print_one_header_then_their_whole_text():
    """Was a defect, fixed: with two prompts the stream interleaves the rows' pieces step by step, printing a "--- [i]" header
    before every piece (a dozen headers per prompt), so neither text can be read or cut out of stdout."""
    base = ["generate", "def f(x):", "import os", "--max-new-tokens", "24", "--no-eos", "-k", "3"]
    code, out, _, _ = main(base)
    assert code == 0
    texts = json.loads(main(base + ["--json"])[1])["text"]
    assert out.count("--- [0]") == 1 and out.count("--- [1]") == 1, out
    assert texts[0] in out and texts[1] in out, out


def test_a_tree_summary_names_the_nodes_it_drafts_not_the_budget_asked_for():
    """Was a defect, fixed: --tree 2,2,1000 drafts at most 2 + 4 = 6 nodes (JSON "k": 6, six positions), but the summary line
    says "tree 2x2, 1000 nodes"."""
    argv = ["generate", "def f(x):", "--tree", "2,2,1000", "--max-new-tokens", "4", "--no-eos"]
    code, _, err, _ = main(argv)
    js = json.loads(main(argv + ["--json"])[1])
    assert code == 0 and js["k"] == 6 and len(js["acceptance_by_position"]) == 6
    assert "1000 nodes" not in err and "6 nodes" in err, err


def test_a_negative_max_new_tokens_is_a_usage_error_as_in_demo_and_bench():
    """Was a defect, fixed: demo and bench refuse --max-new-tokens 0 as a usage error naming the option (status 2); generate's
    --max-new-tokens -1 passes the parser and fails later with status 1 as "max_new_tokens must be ..."."""
    code, _, err, _ = main(["generate", "x", "--draft", "ngram", "--max-new-tokens", "-1"])
    line = one_error_line(err, "generate")
    assert code == 2 and "--max-new-tokens" in line, (code, line)


@pytest.mark.parametrize("draft", ["heads", "eagle"])
def test_a_bundled_drafter_for_another_target_is_explained_in_command_line_terms(draft, tmp_path):
    """Was a defect, fixed: `--target DIR --draft heads` answers with Python: "pass draft=specdec_ext.heads.load_heads(<dir>)"
    / "draft=EagleDrafterSpec('path/to/head')"; the command takes --draft DIR (a heads or EAGLE-3 directory)."""
    from test_generate_utils import CHAR_VOCAB, char_tokenizer, tiny_model

    target = tmp_path / "target"
    tiny_model("llama", vocab=CHAR_VOCAB, hidden=32, layers=1).save_pretrained(target)
    char_tokenizer().save_pretrained(target)
    code, _, err, _ = main(["generate", "abc", "--target", str(target), "--draft", draft, "--max-new-tokens", "2"])
    line = one_error_line(err, "generate")
    assert code == 1 and "--draft" in line and "draft=" not in line, line


# an option the command then ignores: it should be refused (or at least warned about), naming the option
IGNORED = [
    (["generate", "x", "--draft", "ngram", "--draft-tokenizer", TOKENIZER_DIR, "--max-new-tokens", "2"],
     "--draft-tokenizer"),
    (["generate", "x", "--draft", "heads", "--draft-tokenizer", TOKENIZER_DIR, "--max-new-tokens", "2"],
     "--draft-tokenizer"),
    (["generate", "x", "--draft", "ngram", "--no-eos", "--eos-token-id", "5", "--max-new-tokens", "2"],
     "--eos-token-id"),
    (["generate", "x", "--draft", "ngram", "--tp-check", "verify", "--max-new-tokens", "2"], "--tp-check"),
    (["serve", "--draft", "none", "-k", "3"], "-k"),
    (["serve", "--draft", "none", "--draft-tokenizer", TOKENIZER_DIR], "--draft-tokenizer"),
    (["serve", "--draft", "ngram", "--draft-tokenizer", TOKENIZER_DIR], "--draft-tokenizer"),
]


@pytest.mark.parametrize("argv,option", IGNORED, ids=[" ".join(a[:1] + a[2:4] + [o]) for a, o in IGNORED])
def test_an_option_the_command_would_ignore_is_refused_or_warned_about(argv, option, monkeypatch):
    """Was a defect, fixed: each of these runs to the end with status 0 and says nothing: the option does nothing (a draft
    tokenizer for lookup drafting or heads, an EOS id with --no-eos, --tp-check without --tp, a draft length or a
    draft tokenizer for plain decoding)."""
    if argv[0] == "serve":
        pytest.importorskip("uvicorn")
        server = importlib.import_module("specdec_ext.serve.server")
        monkeypatch.setattr(server, "run_server", lambda app, engine, **kw: 0)
        argv = argv + ["--no-calibrate", "--device", "cpu"]
    code, _, err, warned = main(argv)
    said = err + "\n".join(warned)
    assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", said), (code, said)


# ------------------------------------------------------------------------------------- defects: bench
BENCH_FAST = ["--no-hf", "--ks", "2", "--repeats", "1", "--max-new-tokens", "2", "--prompts", "1", "--lines", "2",
              "--workloads", "code", "--quiet"]


@pytest.mark.parametrize("flags", [["--drafters", "tree", "--trees", "2,3"], ["--drafters", "tree", "--trees", "a"],
                                   ["--drafters", "heads", "--heads-trees", "3"]],
                         ids=["trees 2,3", "trees a", "heads-trees 3"])
def test_bench_refuses_a_malformed_tree_as_a_usage_error_naming_the_option(flags):
    """Was a defect, fixed: --trees 2,3 and --heads-trees 3 crash with an IndexError traceback (bench/compare.py build_methods,
    tree[2]) once the models have loaded; --trees a says "invalid literal for int() with base 10: 'a'" (status 1),
    naming no option."""
    code, _, err, _ = main(["bench", *BENCH_FAST, *flags])
    line = one_error_line(err, "bench")
    assert code == 2 and flags[2] in line, (code, line)


def test_bench_refuses_an_unknown_drafter_as_a_usage_error_naming_the_option():
    """Was a defect, fixed: it loads both models, then exits 1 with "bench: unknown drafters ['foo']; ..." (no "specdec", no
    "error:", no option)."""
    code, _, err, _ = main(["bench", *BENCH_FAST, "--drafters", "foo"])
    line = one_error_line(err, "bench")
    assert code == 2 and line.startswith("specdec bench: error: ") and "--drafters" in line, (code, line)


@pytest.mark.parametrize("kind", ["missing", "not utf-8"])
def test_bench_prompt_file_errors_name_the_option(kind, tmp_path):
    """Was a defect, fixed: generate says "--prompt-file: no such file: ..." / "... is not UTF-8 text"; bench says Python's
    "[Errno 2] No such file or directory: '...'" / "'utf-8' codec can't decode byte ...", naming no option."""
    path = tmp_path / "prompt.txt"
    if kind == "not utf-8":
        path.write_bytes("café = 1\n".encode("latin-1"))
    code, _, err, _ = main(["bench", *BENCH_FAST, "--prompt-file", str(path)])
    line = one_error_line(err, "bench")
    assert code == 1 and "--prompt-file" in line, line


def test_bench_confidence_out_of_range_names_the_option():
    """Was a defect, fixed: --confidence -3 passes the parser (type=float) and fails after loading with "draft_confidence must be
    a number in [0, 1)", a keyword of generate() the command does not have."""
    code, _, err, _ = main(["bench", *BENCH_FAST, "--drafters", "model", "--confidence", "-3"])
    line = one_error_line(err, "bench")
    assert code in (1, 2) and "--confidence" in line, line


def test_bench_with_no_workload_is_refused():
    """Was a defect, fixed: --workloads , selects no workload: the command prints the pair line, benchmarks nothing and exits 0."""
    code, out, err, _ = main(["bench", *BENCH_FAST[:-3], "--workloads", ",", "--quiet", "--drafters", "model"])
    assert code in (1, 2) and "--workloads" in err, (code, out, err)


def test_bench_error_does_not_contradict_the_max_new_tokens_given():
    """Was a defect, fixed: `bench --ks 5000 --max-new-tokens 2` fails (rightly) but says "with max_new_tokens=8" (the warm-up's
    length, not the user's) and advises "leave k to the plan (None or 'auto')", library terms; --ks is not named."""
    code, _, err, _ = main(["bench", *BENCH_FAST, "--drafters", "model", "--ks", "5000"])
    line = one_error_line(err, "bench")
    assert code in (1, 2) and "max_new_tokens=8" not in line and "--ks" in line, line


# ------------------------------------------------------------------------------------- defects: train-eagle
@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory):
    from eagle_utils import tiny_target
    from test_generate_utils import CHAR_VOCAB, char_tokenizer

    root = tmp_path_factory.mktemp("sweep_eagle")
    tiny_target("llama", vocab=CHAR_VOCAB, layers=6, hidden=64, seed=0).save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    (root / "texts").mkdir()
    (root / "texts" / "a.txt").write_text("def read(path):\n    return open(path).read()\n" * 8)
    return str(root / "target"), str(root / "texts")


@pytest.mark.parametrize("flag,value", [("--lr", "-1"), ("--lr", "nan"), ("--min-lr-ratio", "5"),
                                        ("--min-lr-ratio", "-1")])
def test_train_eagle_refuses_a_bad_learning_rate_as_a_usage_error(flag, value, eagle_target, tmp_path):
    """Was a defect, fixed: --lr -1 / nan pass the parser (type=float), the data are made, then torch's "Invalid learning rate:
    -1.0" (status 1, no option named); --min-lr-ratio 5 or -1 ("a fraction of --lr") train without a word."""
    target, texts = eagle_target
    code, _, err, _ = main(["train-eagle", "--target", target, "--data", texts, "--out", str(tmp_path / "run"),
                            "--pieces", "4", "--chars", "40", "--prompt-tokens", "8", "--new-tokens", "8",
                            "--draft-vocab", "16", "--batch", "4", "--warmup-steps", "0", "--layer-ids", "1,3,5",
                            "--device", "cpu", "--steps", "1", "--quiet", f"{flag}={value}"])
    assert code == 2 and f"argument {flag}" in err, (code, err)


# ------------------------------------------------------------------------------------- NO_COLOR
def test_no_color_turns_off_the_demo_highlight(monkeypatch):
    """Was a defect, fixed: on a terminal the demo wraps each completion in ANSI bold (ESC[1m ... ESC[0m) even with NO_COLOR set
    (https://no-color.org: a command that colours its output leaves it plain when NO_COLOR is set)."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("NO_COLOR", "1")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli.main(["demo", "--files", "1", "--lines", "3", "--max-new-tokens", "3"]) == 0
    assert "\033[" not in terminal.getvalue(), terminal.getvalue()[-200:]


# ------------------------------------------------------------------------------------- processes: signals, pipes, env
def _wait_for_output(process, deadline_s=90):
    start = time.monotonic()
    first = process.stdout.read(1)
    assert first, process.stderr.read()
    assert time.monotonic() - start < deadline_s
    return first


def test_ctrl_c_during_a_real_generation_exits_130_with_one_line():
    process = subprocess.Popen([sys.executable, "-m", "specdec_ext", "generate", "def f(x):", "--max-new-tokens",
                                "1500", "--no-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=ENV)
    try:
        _wait_for_output(process)
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    err = err.decode()
    assert process.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "specdec generate: interrupted", err


@pytest.mark.parametrize("closed", ["stdout", "stdin"])
def test_a_closed_standard_stream_is_no_traceback(closed):
    """Was a defect, fixed: `specdec generate x >&-` ends with AttributeError: 'NoneType' object has no attribute 'flush'
    (cli.main's sys.stdout.flush(); Python's sys.stdout is None there), and `specdec generate --prompt-file - <&-`
    with AttributeError: 'NoneType' object has no attribute 'read' (cmd_generate): tracebacks, where a closed
    stream is bad input (one line, status 1, naming --prompt-file for stdin)."""
    fd = 1 if closed == "stdout" else 0
    prompt = ["x"] if closed == "stdout" else ["--prompt-file", "-"]
    process = subprocess.run([sys.executable, "-m", "specdec_ext", "generate", *prompt, "--draft", "ngram",
                              "--max-new-tokens", "2"], stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                             timeout=120, preexec_fn=lambda: os.close(fd),
                             **({"stdin": subprocess.DEVNULL} if closed == "stdout" else {"stdout": subprocess.DEVNULL}))
    assert "Traceback" not in process.stderr and "AttributeError" not in process.stderr, process.stderr
    if closed == "stdin":
        line = one_error_line(process.stderr, "generate")
        assert process.returncode == 1 and "--prompt-file" in line, line


def test_cpu_isa_from_the_environment_from_another_directory(tmp_path):
    bogus = specdec(["generate", "x", "--draft", "ngram", "--max-new-tokens", "2"], cwd=str(tmp_path),
                    env={**ENV, "SPECDEC_CPU_ISA": "bogus"})
    line = one_error_line(bogus.stderr, "generate")
    assert bogus.returncode == 1 and "SPECDEC_CPU_ISA=bogus" in line and "avx2" in line, line
    isa = "avx2" if platform.machine() in ("x86_64", "AMD64") else "portable"
    forced = specdec(["generate", "def f(x):", "--max-new-tokens", "6", "--no-eos", "-k", "2", "--explain", "--json"],
                     cwd=str(tmp_path), env={**ENV, "SPECDEC_CPU_ISA": isa})
    assert forced.returncode == 0, forced.stderr
    assert f"the {isa} path" in forced.stderr and "avx512" not in forced.stderr, forced.stderr
    document = json.loads(forced.stdout)
    assert len(document["token_ids"][0]) == 6 and document["k"] == 2


def test_serve_on_a_port_in_use_is_one_line_status_1():
    """Was a defect, fixed: the banner announces http://127.0.0.1:PORT/v1, then uvicorn's "ERROR:    [Errno 98] error while
    attempting to bind ...: address already in use" and exit status 3, which README's statuses (0, 1, 2, 130, 141)
    do not have; no "specdec serve: error:" line naming --port."""
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = specdec(["serve", "--draft", "none", "--no-calibrate", "--device", "cpu", "--port", str(port),
                       "--log-level", "warning"])
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert re.search(rf"specdec serve: error: .*{port}.*(in use|already)", out.stderr), out.stderr


def test_ctrl_c_stops_serve_gracefully_with_0():
    """README said "Ctrl-C exits with 130" for every command, and of serve only that SIGTERM drains and exits 0;
    `specdec serve` stopped with Ctrl-C drains the same way and exits 0, which README now says."""
    pytest.importorskip("uvicorn")
    process = subprocess.Popen([sys.executable, "-m", "specdec_ext", "serve", "--draft", "none", "--no-calibrate",
                                "--device", "cpu", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=ROOT, env=ENV, text=True)
    try:
        start = time.monotonic()
        seen = ""
        while "Uvicorn running" not in seen and time.monotonic() - start < 90:
            line = process.stderr.readline()
            if not line:
                break
            seen += line
        assert "Uvicorn running" in seen, seen
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "Traceback" not in err, err
    assert process.returncode == 0, (process.returncode, err)
