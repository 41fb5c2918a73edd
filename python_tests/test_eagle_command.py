"""``specdec train-eagle`` (specdec_ext/eagle/command.py; issue 27, item 4): it trains a head for a target
directory on text files with a progress bar, resumes, exports the shipped int8 layout, and refuses bad
input with a message naming it before any work."""
from __future__ import annotations

import json
import os
import re
import sys
import warnings

import pytest
import torch

from eagle_utils import tiny_target
from specdec_ext import cli
from specdec_ext.eagle import EagleMismatchError, load_eagle
from specdec_ext.eagle.texts import read_pieces, text_files
from test_generate_utils import CHAR_VOCAB, char_tokenizer
from test_plots import FakeTerminal

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = ["--pieces", "6", "--chars", "40", "--prompt-tokens", "8", "--new-tokens", "8", "--draft-vocab", "16",
        "--batch", "4", "--save-every", "3", "--warmup-steps", "2", "--layer-ids", "1,3,5", "--device", "cpu"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_cli")
    model = tiny_target("llama", vocab=CHAR_VOCAB, layers=6, hidden=64, seed=0, logit_scale=10.0)
    model.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    texts = root / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 8)
    (texts / "b.txt").write_text("for i in range(10):\n    print(i * i, end=' ')\n" * 8)
    return str(root / "target"), str(texts)


def test_train_eagle_trains_resumes_and_exports(target_dir, tmp_path, monkeypatch, capsys):
    target, texts = target_dir
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out, exported = str(tmp_path / "run"), str(tmp_path / "export")
    assert cli.main(["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "6", *FAST]) == 0
    assert "train-eagle" in terminal.getvalue() and "6/6" in terminal.getvalue()  # the progress bar, on stderr
    printed = capsys.readouterr().out
    assert "6 pieces, 6 steps" in printed and "trained steps 0..6" in printed

    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    head = load_eagle(out, model)
    assert head.config.layer_ids == (1, 3, 5) and head.config.draft_vocab_size == 16

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the same options: nothing to warn about)
        assert cli.main(["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "9", "--quiet",
                         "--export", exported, *FAST]) == 0
    assert "trained steps 6..9" in capsys.readouterr().out
    with pytest.warns(UserWarning, match=r"resuming the run in .*ignored: prompt_tokens=5 \(the run's: "):
        cli.main(["train-eagle", "--target", target, "--data", texts, "--out", out, "--steps", "9", "--quiet",
                  *FAST, "--prompt-tokens", "5"])
    summary = json.load(open(os.path.join(exported, "train_summary.json")))
    assert summary["steps"] == 9 and summary["layer_ids"] == [1, 3, 5] and summary["training_seconds"] >= 0
    assert summary["command"].startswith(f"specdec train-eagle --target {target} --data {texts} --out {out} --steps 9")
    resumed, shipped = load_eagle(out, model), load_eagle(exported, model)
    for name, tensor in resumed.state_dict().items():
        if name.endswith("weight") and tensor.dim() == 2 and not name.startswith("embed_tokens"):
            scale = tensor.abs().amax(dim=1, keepdim=True) / 127  # int8 with a scale per row
            assert torch.all((shipped.state_dict()[name] - tensor).abs() <= scale / 2 + 1e-6), name


@pytest.mark.parametrize("flags,message", [
    (["--data", "{texts}", "--layer-ids", "1,x"], "--layer-ids takes comma-separated integers, not '1,x'"),
    (["--data", "{texts}/missing.txt"], "is neither a file nor a directory"),
    ([], "--target needs --data"),
    (["--data", "{texts}", "--export", "{texts}/a.txt"], "a.txt is a file, not a directory"),
    # a directory that is not a train-eagle run is not overwritten (the target's own lost its weights)
    (["--data", "{texts}", "--out", "{target}"], "is not empty and holds no train-eagle run"),
    (["--data", "{texts}", "--export", "{target}"], "is not empty and holds no earlier export"),
    (["--data", "{texts}", "--export", "{out}"], "--export must be another directory than --out"),
    (["--target", "{texts}/nowhere", "--data", "{texts}"], "--target: no such directory: {texts}/nowhere"),
    (["--target", "{texts}/a.txt", "--data", "{texts}"], "--target: not a directory: {texts}/a.txt"),
    (["--target", "{texts}", "--data", "{texts}"], "--target {texts}: could not load a causal LM"),
    (["--target", "{texts}/nowhere", "--data", "{texts}", "--chars", "100000"],  # (found before the target loads)
     "--data: no file holds a piece of --chars 100000 characters"),
])
def test_train_eagle_refuses_bad_input_by_name(target_dir, tmp_path, flags, message):
    target, texts = target_dir
    out = str(tmp_path / "run")
    flags = [f.format(texts=texts, target=target, out=out) for f in flags]
    message = message.format(texts=texts)
    before = sorted(os.listdir(target))
    with pytest.raises(SystemExit) as error:
        cli.main(["train-eagle", "--target", target, "--out", out, "--quiet", *flags])
    assert message in str(error.value)
    assert not os.path.exists(tmp_path / "run")  # refused before any work
    assert sorted(os.listdir(target)) == before


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--pieces", "0"), ("--pieces", "-1"), ("--ttt-steps", "0"),
                                        ("--save-every", "0"), ("--prompt-tokens", "0"), ("--draft-vocab", "0"),
                                        ("--batch", "0"), ("--chars", "0"), ("--temperature", "-1"),
                                        ("--device", "cuda")])
def test_train_eagle_refuses_a_count_of_zero_or_a_device_it_lacks_as_a_usage_error(target_dir, tmp_path, capsys,
                                                                                   flag, value):
    """A count of 0 meant "all" (--pieces, --draft-vocab) or raised ZeroDivisionError inside the run (--ttt-steps,
    --save-every); --device cuda on a CPU torch an AssertionError: now argparse's usage error naming the option."""
    if flag == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is a device this process has")
    target, texts = target_dir
    with pytest.raises(SystemExit) as error:
        cli.main(["train-eagle", "--target", target, "--data", texts, "--out", str(tmp_path / "run"), "--quiet",
                  f"{flag}={value}"])
    assert error.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")


def test_a_resumed_run_keeps_its_options_and_leftover_data_for_other_options_are_made_again(target_dir, tmp_path):
    """trainer.pt records the run's options, not the ignored ones a resume asked for (the next resume, asking the
    run's own, was warned about them); data.pt left by a run that saved no step is made again for other options
    (it was reused silently)."""
    from specdec_ext.eagle.training import DATA, TRAINER_STATE

    target, texts = target_dir
    out = str(tmp_path / "run")
    base = ["train-eagle", "--target", target, "--data", texts, "--out", out, "--quiet", *FAST]
    assert cli.main([*base, "--steps", "3"]) == 0
    with pytest.warns(UserWarning, match=r"ignored: draft_vocab_size=12 \(the run's: 16\)"):
        assert cli.main([*base, "--steps", "4", "--draft-vocab", "12"]) == 0
    assert torch.load(os.path.join(out, TRAINER_STATE), weights_only=False)["config"]["draft_vocab_size"] == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run's own options again: nothing ignored
        assert cli.main([*base, "--steps", "5"]) == 0

    fresh = str(tmp_path / "fresh")
    assert cli.main([*base[:6], fresh, *base[7:], "--steps", "3"]) == 0
    os.remove(os.path.join(fresh, TRAINER_STATE))  # as a run stopped before its first save leaves it
    assert torch.load(os.path.join(fresh, DATA), weights_only=True)["draft_ids"].numel() == 16
    assert cli.main([*base[:6], fresh, *base[7:], "--steps", "3", "--draft-vocab", "12"]) == 0
    assert torch.load(os.path.join(fresh, DATA), weights_only=True)["draft_ids"].numel() == 12


def test_train_eagle_refuses_layers_the_target_does_not_have(target_dir, tmp_path, capsys, monkeypatch):
    target, texts = target_dir
    args = ["train-eagle", "--target", target, "--data", texts, "--out", str(tmp_path / "run"), "--quiet",
            "--steps", "2", *FAST[:-4], "--layer-ids", "1,3,9"]
    assert cli.main(args) == 1  # a line on stderr, no traceback
    assert re.search(r"specdec train-eagle: error: .*layers \[1, 3, 9\].*6", capsys.readouterr().err)
    monkeypatch.setenv("SPECDEC_TRACEBACK", "1")
    with pytest.raises(EagleMismatchError, match=r"layers \[1, 3, 9\].*6"):
        cli.main(args)


def test_pieces_come_from_the_files_in_a_seeded_order(target_dir):
    _, texts = target_dir
    files = text_files([texts])
    assert [os.path.basename(f) for f in files] == ["a.txt", "b.txt"]
    pieces = read_pieces(files, 5, 40, seed=0)
    assert len(pieces) == 5 and all(len(p) == 40 for p in pieces) and pieces == read_pieces(files, 5, 40, seed=0)
    assert any(p.startswith("def read") for p in pieces) and any(p.startswith("for i") for p in pieces)
