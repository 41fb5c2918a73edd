"""The ``specdec`` command line's errors and the statements of its help: a usage error is one line naming the
command, the option and the problem (status 2); a model directory or a file that does not exist is said so
(status 1); a closed pipe ends quietly with 141; serve, audit and the tools say what is true of them."""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from specdec_ext import cli
from specdec_ext.arg_types import USAGE_ERROR_STATUS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every way a command loads models fails the test: the errors here come before any loading."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    for module, name in (("specdec_ext.models", "load_models"), ("specdec_ext.models", "load_pair"),
                         ("specdec_ext.generate", "load_models"), ("specdec_ext.audit", "load_pair"),
                         ("specdec_ext.audit", "load_models"), ("specdec_ext.bench.compare", "load")):
        monkeypatch.setattr(importlib.import_module(module), name, loaded)


# ------------------------------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize("argv,command,option", [
    (["generate", "--prompt", "x", "-k", "0"], "generate", "-k/--k"),
    (["generate", "--prompt", "x", "--tree", "1,2"], "generate", "--tree"),
    (["generate", "--prompt", "x", "--tree", "a,b,c"], "generate", "--tree"),
    (["generate", "--prompt", "x", "--seed", "abc"], "generate", "--seed"),
    (["generate", "--prompt", "x", "--threads", "0"], "generate", "--threads"),
    (["generate", "--prompt", "x", "--stop"], "generate", "--stop"),
    (["generate", "--prompt", "x", "--runner", "fast"], "generate", "--runner"),
    (["train-eagle", "--out", "d", "--steps", "0"], "train-eagle", "--steps"),
    (["train-eagle", "--steps", "3"], "train-eagle", "--out"),  # (required)
    (["audit", "--alpha", "2"], "audit", "--alpha"),
    (["demo", "--files", "0"], "demo", "--files"),
    (["serve", "--port", "x"], "serve", "--port"),
    (["serve", "--dtype", "float16"], "serve", "--dtype"),
    (["serve", "--port", "70000"], "serve", "--port"),
    (["serve", "-k", "0"], "serve", "-k/--k"),  # (these were refused once the models had loaded, by field name)
    (["serve", "--max-rows", "0"], "serve", "--max-rows"),
    (["serve", "--max-queue", "-1"], "serve", "--max-queue"),
    (["serve", "--prefill-chunk", "-1"], "serve", "--prefill-chunk"),
    (["serve", "--tpot-slo-ms", "0"], "serve", "--tpot-slo-ms"),
    (["serve", "--shutdown-grace", "-1"], "serve", "--shutdown-grace"),
    (["bench", "--ks", "a"], "bench", "--ks"),
    (["bench", "--repeats", "0"], "bench", "--repeats"),
])
def test_a_usage_error_is_one_line_naming_the_command_and_the_option_status_2(argv, command, option, capsys,
                                                                              no_model_loads):
    """argparse printed its usage block (a dozen lines) above the message; the README says one line."""
    with pytest.raises(SystemExit) as error:
        cli.main(argv)
    assert error.value.code == USAGE_ERROR_STATUS == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "usage:" not in captured.err and captured.out == "", captured.err
    assert lines[0].startswith(f"specdec {command}: error: ") and option in lines[0], lines[0]
    assert lines[0].endswith(f"(specdec {command} --help lists the options)"), lines[0]


@pytest.mark.parametrize("argv,command,words", [
    (["generate", "x", "--no-such-flag"], "generate", "unrecognized arguments: --no-such-flag"),
    (["serve", "--no-such-flag"], "serve", "unrecognized arguments: --no-such-flag"),
    (["bench", "--no-such-flag"], "bench", "unrecognized arguments: --no-such-flag"),
])
def test_an_unknown_option_is_the_commands_own_usage_error(argv, command, words, capsys, no_model_loads):
    """argparse's root parser said "specdec: error: unrecognized arguments", naming no command."""
    with pytest.raises(SystemExit) as error:
        cli.main(argv)
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specdec {command}: error: {words}"), err


@pytest.mark.parametrize("argv,words", [([], "the following arguments are required"), (["frobnicate"], "invalid choice")])
def test_no_or_an_unknown_command_is_one_line_too(argv, words, capsys):
    with pytest.raises(SystemExit) as error:
        cli.main(argv)
    err = capsys.readouterr().err
    assert error.value.code == 2 and err.count("\n") == 1 and words in err
    assert err.startswith("specdec: error: ") and err.endswith("(specdec --help lists the commands)\n"), err


def test_help_still_prints_the_usage_and_exits_0(capsys):
    with pytest.raises(SystemExit) as shown:
        cli.main(["generate", "--help"])
    assert shown.value.code == 0 and capsys.readouterr().out.startswith("usage: specdec generate")


def test_a_usage_error_of_the_installed_command_is_one_line_and_status_2():
    """The process itself (python -m specdec_ext): its stderr and exit status."""
    out = subprocess.run([sys.executable, "-m", "specdec_ext", "generate", "--prompt", "x", "-k", "0"],
                         capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("specdec generate: error: argument -k/--k: expected 'auto' or an int >= 1, got '0' "
                          "(specdec generate --help lists the options)\n")


# ---------------------------------------------------------------------------------- missing models and files
@pytest.mark.parametrize("argv,expected", [
    (["generate", "--target", "/nonexistent", "--draft", "/nonexistent", "--prompt", "x"],
     "specdec generate: error: --target: no such directory: /nonexistent"),
    (["generate", "--target", "{existing}", "--draft", "./no/such/draft", "--prompt", "x"],
     "specdec generate: error: --draft: no such directory: ./no/such/draft"),
    (["generate", "x", "--draft", "~/no-such-draft"], "specdec generate: error: --draft: no such directory: ~/no-such-draft"),
    (["generate", "x", "--draft-tokenizer", "/no/such/tokenizer"],
     "specdec generate: error: --draft-tokenizer: no such directory: /no/such/tokenizer"),
    (["generate", "x", "--target", "{file}", "--draft", "{existing}"], "specdec generate: error: --target: not a directory: {file}"),
    (["audit", "--target", "/nonexistent/t", "--draft", "/nonexistent/d"],
     "specdec audit: error: --target: no such directory: /nonexistent/t"),
    (["audit", "--draft-tokenizer", "/nonexistent"], "specdec audit: error: --draft-tokenizer: no such directory: /nonexistent"),
    (["demo", "--target", "{existing}", "--draft", "/nonexistent"], "specdec demo: error: --draft: no such directory: /nonexistent"),
    (["serve", "--target", "/nonexistent"], "specdec serve: error: --target: no such directory: /nonexistent"),
    (["bench", "--target", "/nonexistent", "--draft", "/nonexistent"],
     "specdec bench: error: --target: no such directory: /nonexistent"),
])
def test_a_model_directory_that_does_not_exist_is_named(argv, expected, tmp_path, capsys, no_model_loads):
    """It said "could not load the target model from '/nonexistent' (offline, local files only): Repo id must use
    alphanumeric chars ..." and never that the directory does not exist."""
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    fill = dict(existing=str(tmp_path), file=str(afile))
    argv = [a.format(**fill) for a in argv]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == expected.format(**fill) + "\n"


def test_a_model_id_is_looked_up_in_the_hub_cache(tmp_path, monkeypatch, capsys):
    """A value that could be a Hub model id and is no directory here is loaded from the Hugging Face cache
    (offline): it passes where the cache holds it, and is named as neither otherwise."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("TRANSFORMERS_CACHE", raising=False)
    (tmp_path / "models--someorg--cached-model").mkdir()
    ran = []
    monkeypatch.setitem(cli.COMMANDS, "generate", lambda args: ran.append((args.target, args.draft)) or 0)
    assert cli.main(["generate", "x", "--target", "someorg/cached-model", "--draft", "someorg/cached-model"]) == 0
    assert ran == [("someorg/cached-model", "someorg/cached-model")]
    assert cli.main(["generate", "x", "--target", "someorg/cached-model", "--draft", "uncached-model"]) == 1
    assert capsys.readouterr().err == ("specdec generate: error: --draft: no such directory: uncached-model (nor a "
                                       "model id in the Hugging Face cache: models load offline)\n")


@pytest.mark.parametrize("command,draft", [("generate", "ngram"), ("generate", "heads"), ("generate", "eagle"),
                                           ("serve", "none"), ("audit", "eagle")])
def test_the_draft_keywords_are_no_paths(command, draft, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, command, lambda args: 0)
    assert cli.main([command, "--draft", draft]) == 0


@pytest.mark.parametrize("flags,expected", [
    (["--json-schema", "/nonexistent.json"], "--json-schema: no such file: /nonexistent.json"),
    (["--json-schema", "schemas/user"], "--json-schema: no such file: schemas/user"),
    (["--json-schema", "user.json"], "--json-schema: no such file: user.json"),
    (["--json-schema", "{{not json"], "--json-schema is not valid JSON: "),
    (["--json-schema", "integer"], "--json-schema is neither a file nor valid JSON: "),
    (["--json-schema", "{tmp}/bad.json"], "--json-schema: the file {tmp}/bad.json is not valid JSON: "),
    (["--grammar", "/nonexistent.lark"], "--grammar: no such file: /nonexistent.lark"),
    (["--grammar", "{tmp}"], "--grammar: {tmp} is a directory, not a file"),
    (["--prompt-file", "/nonexistent.txt"], "--prompt-file: no such file: /nonexistent.txt"),
    (["--prompt-file", "{tmp}/latin1.txt"], "--prompt-file: {tmp}/latin1.txt is not UTF-8 text"),
])
def test_a_file_option_names_a_missing_or_unreadable_file(flags, expected, tmp_path, capsys, no_model_loads):
    """--json-schema /nonexistent.json said "is not valid JSON: Expecting value"; --grammar and --prompt-file gave
    Python's "[Errno 2] No such file or directory", naming no option."""
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    flags = [f.format(tmp=tmp_path) for f in flags]
    try:
        code = cli.main(["generate", "x", *flags])
    except SystemExit as exit_:  # (JSON errors exit with their message)
        code, err = 1, str(exit_)
    else:
        err = capsys.readouterr().err
    assert code == 1 and err.startswith("specdec generate: error: " + expected.format(tmp=tmp_path)), err
    assert err.count("\n") <= 1 and "Traceback" not in err


def test_a_schema_given_as_a_file_or_as_text_is_read(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "integer"}')
    parse = cli.build_parser().parse_args
    for value in (str(schema), '{"type": "integer"}', ' {"type": "integer"}'):
        assert cli._processing_kwargs(parse(["generate", "x", "--json-schema", value])) == {
            "json_schema": {"type": "integer"}}
    assert cli._processing_kwargs(parse(["generate", "x", "--json-schema", "true"])) == {"json_schema": True}


# ------------------------------------------------------------------------------------------------- closed pipe
CLOSED_PIPE_SCRIPT = """
import sys
from specdec_ext import cli

def floods(args):
    for i in range(10 ** 7):
        print(f"line {i} " + "x" * 60)
    return 0

cli.COMMANDS["demo"] = floods
sys.exit(cli.main(["demo"]))
"""


def test_a_closed_pipe_ends_quietly_with_status_141():
    """`specdec generate ... | head -1`: quiet, as documented, but it exited with status 1 (an error's)."""
    process = subprocess.Popen([sys.executable, "-c", CLOSED_PIPE_SCRIPT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=ROOT, env=ENV)
    assert process.stdout.readline().startswith(b"line 0 ")
    process.stdout.close()  # (the reader goes away, as head does)
    process.wait(timeout=120)
    err = process.stderr.read().decode()
    assert process.returncode == cli.CLOSED_PIPE_STATUS == 141 and err == "", err


# ------------------------------------------------------------------------------------------------- serve, audit
def test_serve_refuses_heads_before_loading_naming_what_it_serves(capsys, no_model_loads, tmp_path):
    """It said "specdec serve: specdec serve runs chain drafters (a draft model or ngram) or none ..." once the
    models had loaded: the prefix twice, and neither eagle nor a draft with another tokenizer, which it serves."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "heads.safetensors").write_bytes(b"")
    for draft in ("heads", str(heads)):
        with pytest.raises(SystemExit) as refused:
            cli.main(["serve", "--draft", draft])
        message = str(refused.value)
        assert message.startswith(f"specdec serve: error: --draft {draft}: ") and message.count("specdec serve") == 1
        for served in ("'eagle'", "'ngram'", "'none'", "--draft-tokenizer", "draft model"):
            assert served in message, served


def test_a_library_message_that_names_the_command_is_not_prefixed_twice():
    assert cli._prefixed("specdec serve", ValueError("specdec serve runs chains")) == "specdec serve runs chains"
    assert cli._prefixed("specdec serve", ValueError("device gpu0: no\nsuch")) == "specdec serve: device gpu0: no such"


def test_an_error_line_does_not_repeat_the_command(monkeypatch, capsys):
    """audit() says "audit: temperature must be > 0": the line said "specdec audit: error: audit: ..."."""
    def refuses(args):
        raise ValueError("audit: temperature must be > 0\n(greedy decoding is checked token for token instead)")

    monkeypatch.setitem(cli.COMMANDS, "audit", refuses)
    assert cli.main(["audit"]) == 1
    assert capsys.readouterr().err == ("specdec audit: error: temperature must be > 0 (greedy decoding is checked "
                                       "token for token instead)\n")


@pytest.mark.parametrize("draft", ["ngram", "heads"])
def test_audit_refuses_lookup_drafting_and_heads_by_name(draft, no_model_loads):
    """--draft ngram said "pass both target= and draft= (or neither ...): target is missing"."""
    with pytest.raises(SystemExit, match=f"specdec audit: error: --draft {draft}: the audit runs a draft model or an "
                       "EAGLE-3 head"):
        cli.main(["audit", "--draft", draft])


def test_the_serve_banner_names_a_draft_runner_only_where_there_is_one():
    """--draft ngram and --draft eagle printed "(draft runner None)"."""
    from eagle_utils import random_head, tiny_target
    from serve_utils import tiny_pair
    from specdec_ext.models import Models
    from specdec_ext.serve.build import EngineOptions, build_engine

    options = EngineOptions(max_rows=2, max_seq_len=128)
    target, draft, tokenizer = tiny_pair()
    with_model = build_engine(Models(target, "model", draft=draft, tokenizer=tokenizer), options).description
    assert re.search(r"drafter model \(draft runner \w+\);", with_model), with_model
    ngram = build_engine(Models(target, "ngram", tokenizer=tokenizer), options).description
    llama = tiny_target("llama")
    eagle = build_engine(Models(llama, "eagle", draft=random_head(llama, draft_vocab=48)), options).description
    plain = build_engine(Models(target, "none", tokenizer=tokenizer), options).description
    for description, drafter in ((ngram, "ngram"), (eagle, "eagle"), (plain, "none")):
        assert f"drafter {drafter};" in description and "None" not in description, description


def test_the_serve_banner_on_port_0_names_no_port_0(monkeypatch, capsys):
    """--port 0 binds a free port: the banner said "on http://127.0.0.1:0/v1"."""
    pytest.importorskip("uvicorn")
    server = importlib.import_module("specdec_ext.serve.server")
    monkeypatch.setattr(server, "run_server", lambda app, engine, **kw: kw["port"])
    assert cli.main(["serve", "--draft", "none", "--device", "cpu", "--no-calibrate", "--port", "0"]) == 0
    banner = capsys.readouterr().err
    assert "on http://127.0.0.1:PORT/v1, a free port the system chooses" in banner and ":0/" not in banner
    assert "drafter none;" in banner and "draft runner" not in banner, banner


def test_an_inconclusive_audit_line_names_no_threshold():
    """The INCONCLUSIVE line said "(every p-value must exceed 0.00013 = alpha 0.001 / 2 tests); ... nothing was
    tested"."""
    from specdec_ext.audit import AuditReport, DistributionTest
    from specdec_ext.sampling import SamplingParams

    untested = [DistributionTest(0, str(p), 3, 3, 1, 0.0, 0, 1.0, 1.0, 1.0) for p in (1, 2)]
    text = AuditReport(SamplingParams(1.0), untested, 1e-3).text()
    verdict = next(line for line in text.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: INCONCLUSIVE: nothing was tested: no test (2 in all) had two "
                              "categories") and "p-value" not in verdict, verdict
    tested = [DistributionTest(0, "1", 500, 500, 4, 2.0, 3, 0.5, 0.01, 0.02)]
    verdict = AuditReport(SamplingParams(1.0), tested, 1e-3).text().splitlines()[-1]
    assert verdict.startswith("verdict: PASS (every p-value must exceed 0.001 = alpha 0.001 / 1 tests)"), verdict


# ----------------------------------------------------------------------------------------------- what help says
def _subparsers():
    return cli.build_parser()._subparsers._group_actions[0].choices


@pytest.mark.parametrize("command", ["generate", "audit", "demo", "serve", "train-eagle"])
def test_every_option_a_commands_help_names_is_its_own(command):
    """The --draft-tokenizer help of serve and audit said "(--explain names the mode)": neither has --explain."""
    parser = _subparsers()[command]
    own = {s for action in parser._actions for s in action.option_strings}
    outside = {"--nproc_per_node"}  # (torchrun's, in --tp's help)
    for action in parser._actions:
        for named in re.findall(r"(?<![\w-])--[a-z][a-z_-]*", action.help or ""):
            assert named in own | outside, f"specdec {command} {action.option_strings}: {named}"


def test_the_draft_tokenizer_help_says_where_each_command_names_its_mode():
    helps = {c: next(a.help for a in _subparsers()[c]._actions if "--draft-tokenizer" in a.option_strings)
             for c in ("generate", "audit", "serve")}
    assert "--explain names the mode" in helps["generate"]
    assert "--explain" not in helps["audit"] and "--explain" not in helps["serve"]


def test_audit_help_offers_no_greedy_temperature_nor_lookup_drafts():
    actions = {a.dest: a.help for a in _subparsers()["audit"]._actions}
    assert "0 is greedy" not in actions["temperature"] and "> 0" in actions["temperature"]
    assert "'ngram' for" not in actions["draft"] and "'heads' for" not in actions["draft"]


def test_the_repetition_penalty_help_states_the_range_the_validator_takes():
    """It said "> 0" where the rule is [1e-30, 1e30] (0.5e-30 is refused)."""
    from specdec_ext.processing import REPETITION_PENALTY_RANGE, Processing

    text = next(a.help for a in _subparsers()["generate"]._actions if "--repetition-penalty" in a.option_strings)
    low, high = REPETITION_PENALTY_RANGE
    assert f"[{low:g}, {high:g}]" in text and "> 0" not in text
    for value, valid in ((low, True), (high, True), (low / 2, False), (high * 2, False)):
        try:
            Processing.of(repetition_penalty=value).validate()
        except ValueError:
            assert not valid, value
        else:
            assert valid, value


def test_no_documented_example_moves_the_shared_bundled_pair():
    """docs/profiling.md called load_pair() (the process's shared pair) and then .to(...), which changed it for
    every later generate() of the process: examples take load_default_pair(), a fresh copy."""
    for folder, names in ((ROOT, ["README.md"]), (os.path.join(ROOT, "docs"), os.listdir(os.path.join(ROOT, "docs")))):
        for name in names:
            if name.endswith(".md"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        assert not re.search(r"load_pair\(\)\s*(#.*)?$", line) or "load_default_pair" in line, \
                            f"{name}:{number}: {line.strip()}"


# ------------------------------------------------------------------------------------ tools/architectures_table.py
def _architectures_tool():
    spec = importlib.util.spec_from_file_location("architectures_table", os.path.join(ROOT, "tools",
                                                                                      "architectures_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architectures_table_help_prints_and_writes_nothing():
    """--help was ignored: the tool started regenerating README.md and docs/architectures.md in place."""
    before = {p: os.stat(p).st_mtime_ns for p in (os.path.join(ROOT, "README.md"),
                                                  os.path.join(ROOT, "docs", "architectures.md"))}
    out = subprocess.run([sys.executable, os.path.join("tools", "architectures_table.py"), "--help"],
                         capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: ") and "--check" in out.stdout, out.stderr
    assert {p: os.stat(p).st_mtime_ns for p in before} == before


def test_architectures_table_check_compares_and_writes_nothing(tmp_path, monkeypatch, capsys):
    tool = _architectures_tool()
    architectures = importlib.import_module("architectures")
    monkeypatch.setattr(architectures, "causal_lm_types", lambda: ["llama", "gpt2"])
    monkeypatch.setattr(architectures, "check_architecture",
                        lambda t: ("supported", "lean") if t == "llama" else ("refused", "no | rotary"))
    readme, doc = tmp_path / "README.md", tmp_path / "architectures.md"
    readme.write_text("intro\n<!-- architectures:start -->\nold\n<!-- architectures:end -->\nrest\n")
    doc.write_text("old\n")
    monkeypatch.setattr(tool, "README", str(readme))
    monkeypatch.setattr(tool, "DOC", str(doc))
    assert tool.main(["--check"]) == 1
    assert "docs/architectures.md differs" in capsys.readouterr().err
    assert doc.read_text() == "old\n" and "\nold\n" in readme.read_text()  # (nothing written)
    assert tool.main([]) == 0
    assert "| `gpt2` | refused | no / rotary |" in doc.read_text() and "1 of 2" in readme.read_text()
    assert tool.main(["--check"]) == 0
