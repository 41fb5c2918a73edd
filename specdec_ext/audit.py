"""audit(): the losslessness audit and break-even report a user runs on their own (target, draft) pair.

1. Losslessness. For each prompt, ``samples`` seeded speculative generations and ``samples`` plain
   samples (an independent sampler: full HF forwards, the filtered softmax, ``torch.multinomial``)
   of the first ``positions`` tokens. Per position (and for the joint of all positions) a two-sample
   chi-square test over the token counts (categories with fewer than MIN_POOLED_COUNT samples in
   both sets pooled), and the total variation between the two empirical distributions next to the
   TV of a random split of the pooled samples (what sampling noise alone gives). Verdict: PASS when
   every p-value exceeds alpha / number of tests (Bonferroni).
2. Break-even. For k = 1..8: the measured acceptance a, the draft cost c and the verify cost v (both
   relative to one plain target step), the cost model's tokens per pass and speedup E / (v + k c),
   and the measured tokens per pass and decode speedup over plain decoding with the same runner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch

from .grammar import compile_grammar, grammar_spec
from .ops import GREEDY_TEMPERATURE
from .processing import Processing
from .runners import output_vocab_size
from .step import lossless_verify
from .generate import generate, is_integer, normalise_prompts, plain_generate
from .eagle.spec import is_eagle_draft
from .models import load_models, load_pair
from .plots import pair_label
from .progress import progress_bar
from .sampling import SamplingParams, filtered_probs
from .stats import expected_tokens_per_pass, predicted_speedup

AUDIT_K = 4  # draft length of the losslessness runs
AUDIT_BATCH = 256  # rows per generate call of the losslessness runs
MIN_POOLED_COUNT = 10  # chi-square categories rarer than this (both sets together) are pooled
DEFAULT_ALPHA = 1e-3  # family-wise false-alarm rate of the verdict
DEFAULT_KS = tuple(range(1, 9))
BENCH_PROMPTS = 2  # prompts timed (batch 1 each) per k in the break-even report
PERMUTATION_SEED = 0


@dataclass
class DistributionTest:
    prompt: int
    position: str  # "1", "2", ... or "joint"
    samples_spec: int
    samples_plain: int
    categories: int  # after pooling
    chi2: float
    dof: int
    p_value: float
    tv: float  # total variation between the two empirical distributions
    tv_noise: float  # TV between two random halves of the pooled samples (the noise level)


@dataclass
class BreakEvenRow:
    k: int
    acceptance: float
    draft_cost: float  # c
    verify_cost: float  # v
    predicted_tokens_per_pass: float
    measured_tokens_per_pass: float
    predicted_speedup: float
    measured_speedup: float


@dataclass
class AuditReport:
    sampling: SamplingParams
    tests: List[DistributionTest]
    alpha: float
    break_even: List[BreakEvenRow] = field(default_factory=list)
    target_step_time: Optional[float] = None
    acceptance: Optional[float] = None
    pair: str = ""  # the models audited, for the figure's title

    def plot(self, path: str) -> str:
        """Draw the TV per position next to its noise floor and the predicted vs measured speedup per k into
        ``path`` (a .png, 1200 x 450 pixels) and return ``path``; needs ``pip install ".[plot]"``."""
        from .plots import plot_audit

        return plot_audit(self, path)

    @property
    def threshold(self) -> float:
        return self.alpha / max(len(self.tests), 1)

    @property
    def inconclusive(self) -> bool:
        """No test had two categories (too few samples: every token was pooled into one), so nothing was tested."""
        return not any(t.dof > 0 for t in self.tests)

    @property
    def passed(self) -> bool:
        return not self.inconclusive and all(t.p_value > self.threshold for t in self.tests)

    @property
    def verdict(self) -> str:
        return "INCONCLUSIVE" if self.inconclusive else "PASS" if self.passed else "FAIL"

    def text(self) -> str:
        s = self.sampling
        lines = [f"losslessness audit: T={s.temperature} top_k={s.top_k} top_p={s.top_p}",
                 f"{'prompt':>6} {'pos':>5} {'n_spec':>7} {'n_plain':>7} {'cats':>5} {'chi2':>9} {'dof':>4} "
                 f"{'p-value':>9} {'TV':>7} {'TV noise':>8}"]
        for t in self.tests:
            lines.append(f"{t.prompt:>6} {t.position:>5} {t.samples_spec:>7} {t.samples_plain:>7} {t.categories:>5} "
                         f"{t.chi2:>9.2f} {t.dof:>4} {t.p_value:>9.3g} {t.tv:>7.4f} {t.tv_noise:>8.4f}")
        if self.inconclusive:  # (no p-value to compare with a threshold)
            lines.append(f"verdict: {self.verdict}: nothing was tested: no test ({len(self.tests)} in all) had two "
                         f"categories of {MIN_POOLED_COUNT} samples (too few samples, or positions where the target is "
                         "all but certain)")
        else:
            lines.append(f"verdict: {self.verdict} (every p-value must exceed {self.threshold:.2g} = alpha "
                         f"{self.alpha:g} / {len(self.tests)} tests); "
                         + ("the speculative tokens are indistinguishable from plain sampling" if self.passed else
                            "the speculative tokens do NOT follow plain target sampling"))
        if self.break_even:
            lines.append("")
            lines.append(f"break-even (plain target step {self.target_step_time * 1e3:.2f} ms, measured acceptance "
                         f"a={self.acceptance:.3f}):")
            lines.append(f"{'k':>3} {'a':>6} {'c':>6} {'v':>6} {'E pred':>7} {'E meas':>7} {'speedup pred':>12} "
                         f"{'speedup meas':>12}")
            for r in self.break_even:
                lines.append(f"{r.k:>3} {r.acceptance:>6.3f} {r.draft_cost:>6.3f} {r.verify_cost:>6.3f} "
                             f"{r.predicted_tokens_per_pass:>7.2f} {r.measured_tokens_per_pass:>7.2f} "
                             f"{r.predicted_speedup:>11.2f}x {r.measured_speedup:>11.2f}x")
            best = max(self.break_even, key=lambda r: r.measured_speedup)
            lines.append(f"best measured k = {best.k} ({best.measured_speedup:.2f}x); speculation "
                         + ("pays off" if best.measured_speedup > 1 else "does not pay off") + " on this pair")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- statistics
def two_sample_chi_square(a: Sequence, b: Sequence):
    """Chi-square test of homogeneity of two samples of hashable categories -> (chi2, dof, p, cats)."""
    counts_a, counts_b = _counts(a), _counts(b)
    cats = sorted(set(counts_a) | set(counts_b), key=repr)
    table, pooled = [], [0, 0]
    for c in cats:
        x, y = counts_a.get(c, 0), counts_b.get(c, 0)
        if x + y < MIN_POOLED_COUNT:
            pooled[0] += x
            pooled[1] += y
        else:
            table.append([x, y])
    if sum(pooled):
        table.append(pooled)
    if len(table) < 2:
        return 0.0, 0, 1.0, len(table)
    obs = torch.tensor(table, dtype=torch.float64)  # [cats, 2]
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    chi2 = float(((obs - expected) ** 2 / expected).sum())
    dof = len(table) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)))
    return chi2, dof, p, len(table)


def total_variation(a: Sequence, b: Sequence) -> float:
    counts_a, counts_b = _counts(a), _counts(b)
    return 0.5 * sum(abs(counts_a.get(c, 0) / len(a) - counts_b.get(c, 0) / len(b))
                     for c in set(counts_a) | set(counts_b))


def _counts(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


# ------------------------------------------------------------------------------- sampling
@torch.no_grad()
def plain_samples(model, prompt: List[int], count: int, positions: int, sampling: SamplingParams,
                  seed: int, progress=None, processors: Optional["PlainProcessors"] = None) -> List[tuple]:
    """``count`` plain samples of the first ``positions`` tokens: full HF forwards, filtered softmax,
    torch.multinomial (nothing of the speculative machinery). ``progress``: a bar advanced per sample;
    ``processors``: the logits processors, applied by this module's own reference (``PlainProcessors``)."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out: List[tuple] = []
    for start in range(0, count, AUDIT_BATCH):
        rows = min(AUDIT_BATCH, count - start)
        ids = torch.tensor([prompt] * rows, dtype=torch.int64, device=device)
        grammars = processors.new_rows(rows) if processors is not None else None
        for _ in range(positions):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()  # [rows, V]
            if processors is not None:
                logits = processors.apply(logits, ids, len(prompt), sampling.temperature, grammars)
            probs = filtered_probs(logits, sampling)
            token = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
            if grammars is not None:
                for grammar, t in zip(grammars, token[:, 0].tolist()):
                    grammar.commit([t])
            ids = torch.cat([ids, token], dim=1)
        out.extend(tuple(r) for r in ids[:, len(prompt):].tolist())
        if progress is not None:
            progress.update(rows)
    return out


@dataclass
class PlainProcessors:
    """The audit's own reference of the logits processors (processing.py states the semantics; this is
    written apart from ops.process_logits on purpose, over whole sequences, so that the audit checks the
    kernel and its draft-prefix bookkeeping instead of repeating them)."""

    processing: Processing
    grammar: object = None  # grammar.CompiledGrammar, or None

    def new_rows(self, rows: int) -> Optional[list]:
        return None if self.grammar is None else [self.grammar.new_row() for _ in range(rows)]

    def apply(self, logits: torch.Tensor, ids: torch.Tensor, prompt_len: int, temperature: float,
              grammars: Optional[list]) -> torch.Tensor:
        """logits [R, V] fp32 after ids [R, t] (the prompt is the first prompt_len) -> processed [R, V]."""
        p, V = self.processing, logits.shape[-1]
        for token, bias in p.logit_bias:
            logits[:, token] += bias
        generated = torch.zeros_like(logits).scatter_add_(1, ids[:, prompt_len:],
                                                          torch.ones_like(ids[:, prompt_len:], dtype=logits.dtype))
        seen = (generated > 0) | torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids[:, :prompt_len], True)
        r = p.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - p.frequency_penalty * generated - p.presence_penalty * (generated > 0).to(logits.dtype)
        if grammars is not None:
            allowed = torch.stack([torch.as_tensor(g.mask_at_committed()).view(torch.int32) for g in grammars])
            bits = (allowed[:, torch.arange(V) // 32] >> (torch.arange(V) % 32)) & 1  # [R, V]
            logits = logits.masked_fill(bits == 0, -float("inf"))
        if p.min_p > 0 and math.isfinite(temperature) and temperature >= GREEDY_TEMPERATURE:
            top = logits.amax(-1, keepdim=True)
            logits = logits.masked_fill(logits < top + temperature * math.log(p.min_p), -float("inf"))
        return logits


def speculative_samples(target, draft, prompt: List[int], count: int, positions: int, sampling: SamplingParams,
                        seed: int, options: dict, progress=None) -> List[tuple]:
    """``count`` seeded speculative samples of the first ``positions`` tokens (k = AUDIT_K).
    ``options``: generate()'s runner=, verifier=, the processors and, for a draft with another tokenizer,
    tokenizer= and draft_tokenizer=; ``progress``: a bar advanced per sample."""
    out: List[tuple] = []
    for start in range(0, count, AUDIT_BATCH):
        rows = min(AUDIT_BATCH, count - start)
        result = generate([prompt] * rows, target, draft, max_new_tokens=positions, k=AUDIT_K,
                          temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          seed=[seed + start + i for i in range(rows)], eos_token_id=False, cost_probe=False,
                          **options)
        out.extend(tuple(t) for t in result.token_ids)
        if progress is not None:
            progress.update(rows)
    return out


def _test(prompt_index: int, label: str, spec: List, plain: List) -> DistributionTest:
    chi2, dof, p, cats = two_sample_chi_square(spec, plain)
    pooled = spec + plain
    order = torch.randperm(len(pooled), generator=torch.Generator().manual_seed(PERMUTATION_SEED)).tolist()
    half = len(pooled) // 2
    noise = total_variation([pooled[i] for i in order[:half]], [pooled[i] for i in order[half:]])
    return DistributionTest(prompt_index, label, len(spec), len(plain), cats, chi2, dof, p,
                            total_variation(spec, plain), noise)


def _plain_processors(processors: Optional[dict], tokenizer, target_model) -> Optional[PlainProcessors]:
    """The plain sampler's reference of audit(processors=...) (None: no processors)."""
    if not processors:
        return None
    fields = dict(processors)
    spec = grammar_spec(json_schema=fields.pop("json_schema", None), regex=fields.pop("regex", None),
                        grammar=fields.pop("grammar", None))
    processing = Processing.of(grammar=spec, **fields)
    processing.validate(output_vocab_size(target_model))
    compiled = None
    if spec is not None:
        if tokenizer is None:
            raise ValueError("audit: structured output needs the target's tokenizer")
        compiled = compile_grammar(spec, tokenizer, output_vocab_size(target_model), eos_token_ids=[])
    return PlainProcessors(processing, compiled)


# ------------------------------------------------------------------------------- break-even
def break_even(target, draft, prompts: List[List[int]], sampling: SamplingParams, *, ks=DEFAULT_KS,
               max_new_tokens: int = 48, runner="auto", seed: int = 0, progress: Optional[bool] = None,
               tokenizers=None):
    """Rows of the break-even table, the plain target step time and the pooled acceptance.
    ``progress``: a bar of the timed runs on stderr (None: when stderr is a terminal); ``tokenizers``: as in
    ``speculative_samples``."""
    bench = prompts[:BENCH_PROMPTS]
    bar = progress_bar(len(bench) * (1 + len(ks)), "audit break-even", unit="run", show=progress)
    kw = dict(max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
              top_p=sampling.top_p, seed=seed, eos_token_id=False, runner=runner)
    draft_kw = tokenizers or {}
    generate([bench[0]], target, draft, k=1, **{**kw, "max_new_tokens": 4}, **draft_kw)  # warm-up
    plain_steps, plain_time = 0, 0.0
    for p in bench:
        stats = plain_generate([p], target, **kw).stats
        bar.update()
        plain_steps += stats.steps
        plain_time += stats.decode_time
    plain_step = plain_time / plain_steps
    rows, accepted, reached = [], 0, 0
    for k in ks:
        runs = []
        for p in bench:
            runs.append(generate([p], target, draft, k=k, **kw, **draft_kw).stats)
            bar.update()
        acc = sum(sum(s.accepted) for s in runs) / max(sum(sum(s.reached) for s in runs), 1)
        accepted += sum(sum(s.accepted) for s in runs)
        reached += sum(sum(s.reached) for s in runs)
        steps = sum(s.steps for s in runs)
        unit = plain_step  # costs relative to a step of plain decoding over the same runner
        c = sum(s.draft_time for s in runs) / steps / k / unit
        v = sum(s.verify_time for s in runs) / steps / unit
        tpp = sum(s.emitted for s in runs) / sum(s.row_steps for s in runs)
        decode_time = sum(s.decode_time for s in runs)
        decode_tokens = sum(s.new_tokens - s.batch_size for s in runs)  # the first token is prefill's
        measured = decode_tokens / decode_time * plain_step
        rows.append(BreakEvenRow(k, acc, c, v, expected_tokens_per_pass(acc, k), tpp,
                                 predicted_speedup(acc, k, c, v), measured))
    bar.close()
    return rows, plain_step, accepted / max(reached, 1)


# ------------------------------------------------------------------------------- the audit
DEFAULT_SAMPLES = 1000  # per prompt and sampler
PROCESSOR_SAMPLES = 4000  # ... with processors: a prefix-blind penalty (sampling_stats.prefix_blind) passed the
#   joint test at 1000 (p = 0.052; its samples repeat a token 10x as often as the target's) and failed at 3000


def audit(target=None, draft=None, prompts=None, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
          positions: int = 3, samples: Optional[int] = None, ks=DEFAULT_KS, bench_tokens: int = 48, alpha: float = DEFAULT_ALPHA,
          seed: int = 0, tokenizer=None, runner="auto", max_prompts: int = 2, run_break_even: bool = True,
          verbose: bool = True, verifier=lossless_verify, progress: Optional[bool] = None,
          draft_tokenizer=None, processors: Optional[dict] = None) -> AuditReport:
    """Audit a (target, draft) pair: is speculative sampling lossless on it, and where does it break even?

    Parameters
    ----------
    target, draft : model id / local path / loaded model (both None: the bundled pair)
    prompts : str, list of str or token ids; the first ``max_prompts`` are used
    temperature, top_k, top_p : the sampling filter audited (temperature > 0)
    positions : int
        Generated positions compared (each on its own, and jointly).
    samples : int, optional
        Samples per prompt of each of the speculative and the plain sampler (default ``DEFAULT_SAMPLES``, 1000;
        ``PROCESSOR_SAMPLES``, 4000, with ``processors``: a penalty that forgets the drafts before it shows in
        the joint law of the positions, which 1000 samples a side did not resolve).
    ks : draft lengths of the break-even report (default 1..8)
    bench_tokens : new tokens per timed run of the break-even report
    alpha : family-wise significance level of the verdict
    verbose : print the report
    verifier : the verification step audited (default: the lossless chain_verify)
    progress : progress bars of the sampling and the timed runs on stderr (None: when stderr is a terminal)
    tokenizer, draft_tokenizer : the target's and the draft's tokenizers; a draft tokenizer that differs from
        the target's audits the draft with another tokenizer (its intersection mode, at T > 0)
    processors : generate()'s logits processors and structured output as keywords (min_p, logit_bias,
        presence_penalty, frequency_penalty, repetition_penalty, json_schema, regex, grammar): the
        speculative runs take them, the plain sampler applies them with the audit's own reference

    Returns
    -------
    AuditReport (``.passed``, ``.verdict``, ``.tests``, ``.break_even``, ``.text()``)
    """
    sampling = SamplingParams(float(temperature), top_k, float(top_p))
    sampling.validate()
    if sampling.greedy:
        raise ValueError("audit: temperature must be > 0 (greedy decoding is checked token for token instead)")
    if samples is None:
        samples = PROCESSOR_SAMPLES if processors else DEFAULT_SAMPLES
    if not (is_integer(positions) and positions >= 1 and is_integer(samples) and samples >= 2):
        raise ValueError(f"audit: positions must be an int >= 1 and samples an int >= 2, got {positions!r} and "
                         f"{samples!r}")
    if run_break_even and (isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable) or not list(ks)
                           or not all(is_integer(k) and k >= 1 for k in ks)):
        raise ValueError(f"audit: ks (the break-even table's draft lengths) must be one or more ints >= 1, got {ks!r}")
    if not 0.0 < alpha < 1.0:  # (alpha 1 failed a lossless pair, 0 passed anything)
        raise ValueError(f"audit: alpha must be in (0, 1), got {alpha}")
    if max_prompts < 1 or (run_break_even and bench_tokens < 1):  # (bench_tokens 0 divided by zero)
        raise ValueError(f"audit: max_prompts and bench_tokens must be >= 1, got {max_prompts} and {bench_tokens}")
    if is_eagle_draft(draft):  # an EAGLE-3 head: checked against and bound to the target (eagle/spec.py)
        models = load_models(target, draft, tokenizer=tokenizer)
        target_model, draft_model, tokenizer = models.target, models.draft, models.tokenizer
    else:
        target_model, draft_model, tokenizer = load_pair(target, draft, tokenizer)
    if prompts is None:
        raise ValueError("audit: pass prompts (text or token ids)")
    token_prompts = normalise_prompts(prompts, tokenizer)[0][:max_prompts]
    tokenizers = None if draft_tokenizer is None else dict(tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)
    reference = _plain_processors(processors, tokenizer, target_model)
    options = dict(runner=runner, verifier=verifier, **(tokenizers or {}), **(processors or {}))
    if reference is not None and reference.grammar is not None:
        options["tokenizer"] = tokenizer
    tests: List[DistributionTest] = []
    bar = progress_bar(2 * samples * len(token_prompts), "audit sampling", unit="sample", show=progress)
    for i, prompt in enumerate(token_prompts):
        spec = speculative_samples(target_model, draft_model, prompt, samples, positions, sampling, seed,
                                   options, progress=bar)
        plain = plain_samples(target_model, prompt, samples, positions, sampling, seed, progress=bar,
                              processors=reference)
        for pos in range(positions):
            tests.append(_test(i, str(pos + 1), [s[pos] for s in spec], [s[pos] for s in plain]))
        if positions > 1:
            tests.append(_test(i, "joint", spec, plain))
    bar.close()
    report = AuditReport(sampling, tests, alpha, pair=pair_label(target_model, draft_model))
    if run_break_even:
        report.break_even, report.target_step_time, report.acceptance = break_even(
            target_model, draft_model, token_prompts, sampling, ks=ks, max_new_tokens=bench_tokens, runner=runner,
            seed=seed, progress=progress, tokenizers=tokenizers)
    if verbose:
        print(report.text())
    return report
