"""Every decoder architecture of transformers' causal-LM mapping (python_tests/architectures.py builds
each tiny from its config class): greedy speculative decoding equals HF's greedy generate, or
generate() refuses the architecture before decoding with an error that names it; docs/architectures.md
and README's list (tools/architectures_table.py) say the same as these results. For a sample covering
every attention feature the paged runner implements (sliding windows, logit softcapping, attention
sinks, multi-query keys, MLA latents, ALiBi, learned absolute positions), the first tokens at T = 1
follow plain target sampling (chi-square)."""
from __future__ import annotations

import os
import re

import pytest
import transformers

import specdec_ext
from architectures import SKIPPED, causal_lm_types, check_architecture, noisy_copy, tiny_model
from sampling_stats import chi_square_p, exact_joint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| `([^`]+)` \| (\w+) \|", re.M)


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


def documented():
    """(transformers version of the table, {model type: status}) from docs/architectures.md."""
    with open(os.path.join(ROOT, "docs", "architectures.md"), encoding="utf-8") as f:
        text = f.read()
    version = re.search(r"^transformers: (\S+)$", text, re.M).group(1)
    return version, dict(ROW.findall(text))


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_architecture_is_supported_or_refused_by_name(model_type):
    if model_type in SKIPPED:
        pytest.skip(SKIPPED[model_type])
    status, detail = check_architecture(model_type)
    assert status in ("supported", "refused"), f"{model_type}: {status}: {detail}"
    if status == "refused":
        config = tiny_model(model_type).config
        names = {model_type, getattr(config.get_text_config(), "model_type", model_type)}
        assert any(f"{name}:" in detail for name in names), detail  # the error names the architecture
    version, table = documented()
    if model_type in table:
        assert table[model_type] == status, f"docs/architectures.md says {table[model_type]} (regenerate it)"
    else:
        assert version != transformers.__version__, f"{model_type} is missing from docs/architectures.md"


def test_the_tables_list_every_architecture_of_this_transformers():
    version, table = documented()
    if version != transformers.__version__:
        pytest.skip(f"docs/architectures.md was made with transformers {version}, this is {transformers.__version__}")
    assert set(table) == set(causal_lm_types())
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    listed = re.search(r"<!-- architectures:start -->(.*?)<!-- architectures:end -->", readme, re.S).group(1)
    assert set(re.findall(r"`([^`]+)`", listed)) == {t for t, s in table.items() if s == "supported"}


SAMPLED = ["gemma2", "gemma3_text", "mistral", "gpt_oss", "falcon", "deepseek_v3", "bloom", "gpt2"]
SAMPLE_VOCAB = 8
SAMPLE_PROMPT = [1, 4, 2, 6, 3, 5, 7, 0, 2, 4, 6, 1]  # longer than the windows (8 positions)
SAMPLES = 2000
PASS_P = 1e-4


@pytest.mark.parametrize("model_type", SAMPLED)
def test_first_tokens_follow_plain_target_sampling_at_t1(model_type):
    target = tiny_model(model_type, vocab=SAMPLE_VOCAB, logit_scale=2.0)
    draft = noisy_copy(target, noise=0.5)
    joint = exact_joint(target, SAMPLE_PROMPT)
    out = specdec_ext.generate([SAMPLE_PROMPT] * SAMPLES, target, draft, max_new_tokens=3, k=2, temperature=1.0,
                               seed=list(range(SAMPLES)), eos_token_id=False, cost_probe=False)
    assert out.plan.target_runner == "paged"
    assert 0.05 < out.stats.acceptance_rate < 0.97  # drafts were accepted and rejected
    assert chi_square_p(out.token_ids, joint) > PASS_P


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral", "gemma2", "gpt_oss", "falcon", "bloom"])
def test_trees_with_windows_softcapping_sinks_mqa_and_alibi_equal_hf_greedy(model_type):
    """Tree forwards, tree verification and the compaction of the accepted path stay exact where a
    layer's window is counted along the node's path (contexts longer than the 8-position windows)."""
    from architectures import NEW, PROMPTS, hf_greedy
    target = tiny_model(model_type)
    draft = noisy_copy(target)
    out = specdec_ext.generate(PROMPTS, target, draft, max_new_tokens=NEW, draft_tree=(2, 3, 6), eos_token_id=False,
                               cost_probe=False)
    assert out.token_ids == [hf_greedy(target, p) for p in PROMPTS]
    assert out.stats.tokens_per_pass > 1.0


def test_mpt_refuses_trees_but_runs_chains():
    target = tiny_model("mpt")
    with pytest.raises(ValueError, match="mpt: its ALiBi bias follows cache slots"):
        specdec_ext.generate([[1, 2, 3]], target, noisy_copy(target), max_new_tokens=4, draft_tree=(2, 2, 4))
    assert len(specdec_ext.generate([[1, 2, 3]], target, noisy_copy(target), max_new_tokens=4, k=2).token_ids[0]) == 4
