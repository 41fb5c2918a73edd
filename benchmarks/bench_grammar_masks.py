"""What structured output costs on the host per verify pass (specdec_ext/grammar.py, llguidance): one
grammar mask, a chain of k masks (fill_chain), a tree (fill_tree), a commit, on the bundled tokenizer
(ByteLevel BPE, 8192 tokens) for a JSON schema.

    python benchmarks/bench_grammar_masks.py [--repeats 5] [--k 4]

A row walks the tokens of a valid JSON document; at every position the operations run at the committed
state (drafts: the document's next k tokens, all allowed). "cold" is the first walk (llguidance builds
its lexer states lazily, shared by every row of the compiled grammar), "warm" the median over the later
walks. Times are medians over positions (and walks), in microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))

from _timing import machine_description  # noqa: E402
from specdec_ext.grammar import GrammarSpec, TokenizerGrammar, fill_chains  # noqa: E402

import torch  # noqa: E402  (machine_description)

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "specdec_ext", "default_pair", "tokenizer")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "role": {"enum": ["admin", "editor", "viewer"]},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False},
    "scores": {"type": "array", "items": {"type": "number"}}},
    "required": ["name", "age", "role", "address", "scores"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor",
            "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"},
            "scores": [0.5, 12.25, -3, 1e3, 7.125]}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def walk_once(grammars: TokenizerGrammar, spec: GrammarSpec, ids: List[int], k: int) -> Dict[str, List[float]]:
    """One walk over the document: per position, each operation's time (us)."""
    row = grammars.row(spec)
    matcher = row._matcher  # raw llguidance mask, for the wrapper's overhead
    words = np.zeros((k + 1, grammars.num_words), dtype=np.int32)
    tree = np.zeros((2 * k + 1, grammars.num_words), dtype=np.int32)
    raw = np.zeros(grammars.num_words, dtype=np.int32)
    times: Dict[str, List[float]] = {name: [] for name in
                                     ("llguidance mask", "mask", f"chain k={k}", f"tree {2 * k} nodes", "commit 1")}
    for i in range(len(ids) - k):
        draft = ids[i:i + k]
        # a tree: the document's path plus a sibling per level (the next-next token: mostly disallowed)
        tokens = [t for j in range(k) for t in (draft[j], ids[min(i + j + 2, len(ids) - 1)])]
        parents = [-1, -1] + [p for j in range(1, k) for p in (2 * (j - 1), 2 * (j - 1))]
        times["llguidance mask"].append(timed(lambda: matcher.unsafe_compute_mask_ptr(raw.ctypes.data, raw.nbytes)))
        times["mask"].append(timed(row.mask_at_committed))
        times[f"chain k={k}"].append(timed(lambda: row.fill_chain(words, draft)))
        times[f"tree {2 * k} nodes"].append(timed(lambda: row.fill_tree(tree, tokens, parents)))
        times["commit 1"].append(timed(lambda: row.commit(ids[i:i + 1])))
        matcher = row._matcher
    return times


def batch_times(grammars: TokenizerGrammar, spec: GrammarSpec, ids: List[int], k: int, rows: int,
                repeats: int) -> Dict[str, float]:
    """A batch of rows at different points of the document: each row's fill_chain in turn against one
    fill_chains call (llguidance's executor threads); median us per batch."""
    batch = [grammars.row(spec) for _ in range(rows)]
    starts = [(b * 7) % (len(ids) - k) for b in range(rows)]
    for row, start in zip(batch, starts):
        row.commit(ids[:start])
    drafts = [ids[start:start + k] for start in starts]
    words = np.zeros((rows, k + 1, grammars.num_words), dtype=np.int32)
    serial = lambda: [row.fill_chain(words[b], drafts[b]) for b, row in enumerate(batch)]  # noqa: E731
    parallel = lambda: fill_chains(batch, words, drafts)  # noqa: E731
    serial(), parallel()
    samples = {"serial": [], "parallel": []}
    for _ in range(repeats):
        samples["serial"].append(timed(serial))
        samples["parallel"].append(timed(parallel))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="walks over the document (the first is cold)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per chain")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="batch sizes for fill_chains")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    start = time.perf_counter()
    grammars = TokenizerGrammar(tokenizer)
    build = time.perf_counter() - start
    spec = GrammarSpec.json_schema(SCHEMA)
    compile_us = timed(lambda: grammars.compile(spec))
    compiled = grammars.compile(spec)
    row_us = statistics.median(timed(compiled.new_row) for _ in range(50))
    ids = tokenizer.encode(json.dumps(DOCUMENT))
    walks = [walk_once(grammars, spec, ids, args.k) for _ in range(max(2, args.repeats))]
    print(f"# {machine_description(torch.device('cpu'))}; llguidance tokenizer for {grammars.vocab_size} tokens "
          f"built in {build * 1e3:.0f} ms; schema compiled in {compile_us / 1e3:.2f} ms; a row in {row_us:.1f} us")
    print(f"# {len(ids)} document tokens, {len(ids) - args.k} positions per walk, {len(walks)} walks; us")
    print(f"{'operation':<22}{'cold median':>12}{'cold max':>10}{'warm median':>12}{'warm p90':>10}")
    for name in walks[0]:
        cold = walks[0][name]
        warm = [t for walk in walks[1:] for t in walk[name]]
        print(f"{name:<22}{statistics.median(cold):>12.1f}{max(cold):>10.0f}{statistics.median(warm):>12.1f}"
              f"{np.percentile(warm, 90):>10.1f}")
    print(f"# a batch's chains (k={args.k}, warm): each row's fill_chain in turn vs one fill_chains call; us per batch")
    print(f"{'rows':>6}{'serial':>10}{'fill_chains':>13}{'per row':>9}")
    for rows in args.rows:
        times = batch_times(grammars, spec, ids, args.k, rows, max(5, 3 * args.repeats))
        print(f"{rows:>6}{times['serial']:>10.0f}{times['parallel']:>13.0f}{times['parallel'] / rows:>9.1f}")


if __name__ == "__main__":
    main()
