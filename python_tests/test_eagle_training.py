"""Training an EAGLE-3 head by self-distillation (specdec_ext/eagle/training.py; issue 27, item 4), on a CPU:
a few steps lower the training-time-test loss, the run resumes from its checkpoint, the saved head loads
with load_eagle, the draft vocabulary is the most frequent tokens, and the trained head drafts tokens the
target accepts (fewer target passes than the untrained head on its training prompts)."""
from __future__ import annotations

import random

import pytest
import torch

from eagle_utils import eagle_generate, proposals, tiny_target
from specdec_ext.eagle import load_eagle
from specdec_ext.eagle.training import TrainConfig, choose_draft_vocab, train_eagle, ttt_losses
from test_generate_utils import CHARS, char_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = TrainConfig(prompt_tokens=8, new_tokens=24, batch_size=8, lr=3e-3, draft_vocab_size=32, save_every=20)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab=64, layers=6, hidden=64, seed=0, logit_scale=10.0)
    rng = random.Random(0)
    texts = [''.join(rng.choice(CHARS[:40]) for _ in range(20)) for _ in range(24)]
    return target, char_tokenizer(), texts


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    target, tokenizer, texts = setup
    out = tmp_path_factory.mktemp("eagle")
    return train_eagle(target, tokenizer, texts, str(out), 40, CONFIG), str(out)


def test_a_few_steps_lower_the_loss(trained):
    result, _ = trained
    assert result.start_step == 0 and len(result.losses) == 40
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-10:]) / 10
    assert last < 0.85 * first, (first, last)


def test_training_resumes_from_its_checkpoint(setup, trained):
    target, tokenizer, texts = setup
    result, out = trained
    assert load_eagle(out, target).state_dict().keys() == result.head.state_dict().keys()
    for name, tensor in load_eagle(out, target).state_dict().items():
        assert torch.equal(tensor, result.head.state_dict()[name]), name
    more = train_eagle(target, tokenizer, texts, out, 50, CONFIG)
    assert more.start_step == 40 and len(more.losses) == 50 and more.losses[:40] == result.losses


def test_the_trained_head_drafts_what_the_target_emits(setup, trained):
    target, tokenizer, texts = setup
    result, _ = trained
    prompts = [tokenizer.encode(t)[:8] for t in texts[:4]]
    untrained = train_eagle(target, tokenizer, texts, str(trained[1]) + "-fresh", 0, CONFIG).head
    steps = {name: len(proposals(target, head, prompts, 24, k=3)) for name, head in
             (("trained", result.head), ("untrained", untrained))}
    assert steps["trained"] < steps["untrained"], steps
    greedy = eagle_generate(target, result.head, prompts, 24, k=3)
    assert greedy == eagle_generate(target, untrained, prompts, 24, k=3)  # lossless either way


def test_draft_vocabulary_and_ttt_shapes(trained):
    tokens = torch.tensor([[3, 3, 3, 5, 5, 9], [1, 5, 3, 2, 2, 2]])
    # 3 (x4), 2 and 5 (x3), then 1 before 9 (ties: the lower id)
    assert choose_draft_vocab(tokens, 12, 4).tolist() == [1, 2, 3, 5]
    head = trained[0].head
    B, n = 2, 10
    losses = ttt_losses(head, torch.randint(64, (B, n)), torch.randn(B, n, 3 * 64), torch.randn(B, n, 32), 3)
    assert len(losses) == 3 and all(torch.isfinite(loss) for loss in losses)
