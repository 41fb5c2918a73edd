"""specdec serve with an EAGLE-3 draft, as real clients use it (the official openai client and raw httpx):

* the OpenAI sampling surface on EAGLE-3 chains (k = 4 fixed, so every step drafts): logit_bias bans and
  boosts (one boost of a token outside the head's draft vocabulary), presence / frequency / repetition
  penalties, min_p, top_p / top_k, stop strings, logprobs / top_logprobs, n > 1, regex and json_schema, on
  /v1/completions and /v1/chat/completions, streamed and not: greedy answers (text and logprobs) equal the
  same request to a plain-decoding server (drafter "none"); seeded sampled answers equal themselves
  (streamed or not) and generate()'s for the request alone (docs/eagle.md, Serving); choice i of a seeded
  n-choice request equals a one-choice request with choice_seed(seed, i);
* clients that leave: mid-stream disconnects, streams closed before their first token, non-streaming
  clients that time out, a slow reader, 24-32 concurrent clients mixing all of it: everyone else's outputs
  stay exact, cancelled rows are counted and freed, nothing is left running, RSS stays flat over a few
  hundred requests;
* bad input: a 400 with OpenAI's error body naming the field, never a 500 or a hang (and the server serves
  on, exactly, afterwards);
* /metrics and /health against what was served (requests by finish reason, prompt and generated tokens).

Three tests failed when this file was written, each a bug since fixed (see their comments): a long stop
string stalled the server's event loop; null for OpenAI's nullable fields (n, stream, echo) was refused;
a regex past llguidance's lexer limits ended as "grammar_dead_end" after one token.
"""
from __future__ import annotations

import gc
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import httpx
import openai
import pytest

import specdec_ext
from specdec_ext.eagle import EagleDrafterSpec
from specdec_ext.models import Models, load_models
from specdec_ext.serve.app import choice_seed, create_app
from specdec_ext.serve.build import EngineOptions, build_engine, eos_token_ids
from serve_utils import CHAT_TEMPLATE, ServerThread, metrics, openai_client, wait_until

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

MODEL = "eagle-pair"
K = 4  # the EAGLE server's fixed draft length (k by load mostly drafts nothing on this busy 2-core CPU)
MAX_SEQ_LEN = 320
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def", "for i in range(10):",
           "x = [1, 2, 3]\nprint(x"]
OFF_VOCAB_TOKEN = 4  # '$': not in the bundled head's draft vocabulary (its t2d is False there: checked below)
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "bb", "ccc"]}},
          "required": ["x", "tag"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA, "strict": True}}

# Request fields (the extensions go in extra_body with the openai client), each set exercised greedy and seeded
FIELD_SETS = {
    "logit_bias ban and boost": dict(logit_bias={"11": 5.0, "25": -100.0, "199": -100.0}),
    "boost off the draft vocabulary": dict(logit_bias={str(OFF_VOCAB_TOKEN): 6.0}),
    "openai penalties": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "min_p top_p top_k": dict(min_p=0.05, top_p=0.9, top_k=20),
    "stop strings": dict(stop=["\n\n", "return", ":"]),
    "regex": dict(regex=r"[a-z_]{1,12}\(([a-z]{1,6}, ){0,2}[a-z]{1,6}\)"),
    "json_schema": dict(response_format=RESPONSE_FORMAT),
}
# the openai client's own keyword arguments per endpoint (the rest travel in extra_body)
COMPLETION_FIELDS = {"logit_bias", "presence_penalty", "frequency_penalty", "top_p", "stop", "seed", "temperature",
                     "max_tokens", "n", "logprobs", "echo", "stream", "stream_options", "user"}
CHAT_FIELDS = COMPLETION_FIELDS - {"echo"} | {"top_logprobs", "response_format", "max_completion_tokens"}


# ------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def models():
    models = load_models(None, "eagle")
    models.tokenizer.chat_template = CHAT_TEMPLATE  # (the bundled tokenizer has none; chat needs one)
    assert models.drafter == "eagle"
    assert not bool(models.draft.t2d[OFF_VOCAB_TOKEN]) and bool(models.draft.t2d[11])
    return models


def _server(models: Models, **options) -> ServerThread:
    engine = build_engine(models, EngineOptions(max_seq_len=MAX_SEQ_LEN, **options))
    app = create_app(engine, models.tokenizer, model_name=MODEL,
                     eos_token_ids=eos_token_ids(models.target, models.tokenizer))
    return ServerThread(app, engine, grace_s=5.0).start()


@pytest.fixture(scope="module")
def eagle(models):
    server = _server(models, max_rows=16, max_queue=64, k=K)
    assert server.engine.plan.drafter == "eagle" and server.engine.plan.hidden_taps
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(models):
    server = _server(Models(models.target, "none", tokenizer=models.tokenizer), max_rows=8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def eagle_client(eagle):
    return openai_client(eagle)


@pytest.fixture(scope="module")
def plain_client(plain):
    return openai_client(plain)


# ------------------------------------------------------------------------------------------ helpers
def _split(fields: dict, chat: bool):
    """(openai keyword arguments, extra_body) of a request's fields."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    kwargs = {k: v for k, v in fields.items() if k in known}
    extra = {k: v for k, v in fields.items() if k not in known}
    return kwargs, extra


def _complete(client, prompt: str, fields: dict, stream: bool = False) -> List[dict]:
    """Per choice: text, finish_reason and logprobs (the completions object), streamed chunks joined."""
    kwargs, extra = _split(fields, chat=False)
    if not stream:
        response = client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)
        return [dict(text=c.text, finish=c.finish_reason, logprobs=c.logprobs and c.logprobs.model_dump())
                for c in sorted(response.choices, key=lambda c: c.index)]
    out: Dict[int, dict] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, stream=True, **kwargs):
        for c in chunk.choices:
            choice = out.setdefault(c.index, dict(text="", finish=None, logprobs=None))
            choice["text"] += c.text
            if c.finish_reason is not None:
                assert choice["finish"] is None, "two finish reasons for one choice"
                choice["finish"] = c.finish_reason
            if c.logprobs is not None:
                piece = c.logprobs.model_dump()
                if choice["logprobs"] is None:
                    choice["logprobs"] = {key: [] for key in piece}
                for key, values in piece.items():
                    choice["logprobs"][key] += values
    return [out[i] for i in sorted(out)]


def _chat(client, prompt: str, fields: dict, stream: bool = False) -> List[dict]:
    """Chat's choices (text, finish_reason, logprobs content) for one user message."""
    kwargs, extra = _split(fields, chat=True)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **kwargs)
        return [dict(text=c.message.content, finish=c.finish_reason,
                     logprobs=c.logprobs and [t.model_dump() for t in c.logprobs.content])
                for c in sorted(response.choices, key=lambda c: c.index)]
    out: Dict[int, dict] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, stream=True,
                                                **kwargs):
        for c in chunk.choices:
            choice = out.setdefault(c.index, dict(text="", finish=None, logprobs=None))
            choice["text"] += c.delta.content or ""
            if c.finish_reason is not None:
                choice["finish"] = c.finish_reason
            if c.logprobs is not None and c.logprobs.content:
                choice["logprobs"] = (choice["logprobs"] or []) + [t.model_dump() for t in c.logprobs.content]
    return [out[i] for i in sorted(out)]


def _generate_alone(models, prompt, fields: dict, max_tokens: int) -> str:
    """generate()'s text for the request alone: the head's chains at the server's k, the same processors."""
    processors = dict(temperature=fields.get("temperature", 1.0), seed=fields.get("seed"),
                      top_p=fields.get("top_p", 1.0), top_k=fields.get("top_k", 0), min_p=fields.get("min_p", 0.0),
                      presence_penalty=fields.get("presence_penalty", 0.0),
                      frequency_penalty=fields.get("frequency_penalty", 0.0),
                      repetition_penalty=fields.get("repetition_penalty", 1.0), regex=fields.get("regex"),
                      stop=fields.get("stop"))
    if "logit_bias" in fields:
        processors["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    if "response_format" in fields:
        processors["json_schema"] = fields["response_format"]["json_schema"]["schema"]
    result = specdec_ext.generate([prompt], models.target, EagleDrafterSpec(models.draft), k=K,
                                  tokenizer=models.tokenizer, max_new_tokens=max_tokens,
                                  eos_token_id=False if fields.get("ignore_eos") else None, **processors)
    return result.text[0]


def _chat_text(models, prompt: str) -> str:
    return models.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)


def _counters(server) -> Dict[str, float]:
    """The counters and gauges of /metrics that describe what was served, by name{labels}."""
    out = {}
    for (name, labels), value in metrics(server).items():
        if name.startswith(("specdec_requests", "specdec_prompt_tokens", "specdec_generated_tokens",
                            "specdec_running_rows", "specdec_queue_length", "specdec_cache_budget_in_use",
                            "specdec_draft_accepted_total")):
            out[name + "".join(f"{{{k}={v}}}" for k, v in labels)] = value
    return out


def _delta(before: Dict[str, float], after: Dict[str, float], prefix: str) -> Dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix) and after[k] != before.get(k, 0.0)}


def _idle(server) -> bool:
    """Nothing queued, nothing running, every slot and unit of the cache budget back."""
    engine = server.engine
    return (engine.idle() and all(row is None for row in engine.batcher.rows)
            and engine.batcher.budget.used == 0)


# ------------------------------------------------------------------------------------------ 1. the surface, greedy
@pytest.mark.parametrize("name", list(FIELD_SETS))
def test_greedy_eagle_answers_equal_plain_decoding_on_both_endpoints_streamed_or_not(eagle_client, plain_client,
                                                                                     name):
    """Completions (with logprobs=3) and chat (logprobs, top_logprobs=2), streamed and not, at T = 0: the
    EAGLE server's text, finish reasons and logprobs equal the plain server's, bit for bit."""
    prompt = PROMPTS[list(FIELD_SETS).index(name) % len(PROMPTS)]
    fields = dict(FIELD_SETS[name], temperature=0, max_tokens=24)
    completion = dict(fields, logprobs=3)
    expected = _complete(plain_client, prompt, completion)
    assert expected[0]["logprobs"]["token_logprobs"], expected
    assert _complete(eagle_client, prompt, completion) == expected
    assert _complete(eagle_client, prompt, completion, stream=True) == expected

    chat = dict(fields, logprobs=True, top_logprobs=2)
    expected = _chat(plain_client, prompt, chat)
    assert expected[0]["logprobs"] and all(len(t["top_logprobs"]) == 2 for t in expected[0]["logprobs"])
    assert _chat(eagle_client, prompt, chat) == expected
    streamed = _chat(eagle_client, prompt, chat, stream=True)
    assert streamed == expected
    if name == "stop strings":
        assert expected[0]["finish"] == "stop" and not any(s in expected[0]["text"] for s in fields["stop"])
    if name == "json_schema":
        assert expected[0]["finish"] == "stop"
        value = json.loads(expected[0]["text"])
        assert set(value) == {"x", "tag"} and value["tag"] in ("a", "bb", "ccc")
    if name == "regex":
        assert expected[0]["finish"] == "stop" and re.fullmatch(fields["regex"], expected[0]["text"]), expected


def test_a_boost_off_the_draft_vocabulary_and_a_ban_of_the_greedy_token(models, eagle_client, plain_client):
    """+100 on a token the head can never draft makes every token that one (each draft rejected); -100 on
    the plain greedy first token moves the answer to another one: both as plain decoding gives them."""
    boosted = dict(temperature=0, max_tokens=12, logit_bias={str(OFF_VOCAB_TOKEN): 100}, logprobs=1)
    got = _complete(eagle_client, PROMPTS[0], boosted)
    assert got == _complete(plain_client, PROMPTS[0], boosted) and got[0]["text"] == "$" * 12
    first = _complete(plain_client, PROMPTS[1], dict(temperature=0, max_tokens=1, logprobs=1))[0]
    ids = models.tokenizer(first["text"], add_special_tokens=False)["input_ids"]
    assert len(ids) == 1
    banned = dict(temperature=0, max_tokens=16, logprobs=2, logit_bias={str(ids[0]): -100})
    got = _complete(eagle_client, PROMPTS[1], banned)
    assert got == _complete(plain_client, PROMPTS[1], banned)
    assert got[0]["logprobs"]["tokens"][0] != first["logprobs"]["tokens"][0]


def test_sampling_that_keeps_only_the_top_token_equals_plain_greedy(eagle_client, plain_client):
    """min_p = 1, top_k = 1 or a tiny top_p leave the argmax alone: a seeded sample at any temperature
    through EAGLE's sampled drafting and verification is then the plain greedy text, for every choice."""
    greedy = _complete(plain_client, PROMPTS[2], dict(temperature=0, max_tokens=20))[0]["text"]
    for fields in (dict(min_p=1.0, temperature=1.3, seed=1), dict(top_k=1, temperature=0.9, seed=2, n=3),
                   dict(top_p=1e-9, temperature=2.0, seed=3)):
        got = _complete(eagle_client, PROMPTS[2], dict(fields, max_tokens=20))
        assert [c["text"] for c in got] == [greedy] * fields.get("n", 1), fields


# ------------------------------------------------------------------------------------------ 2. seeded sampling
SEEDED = {
    "plain T=0.9": dict(temperature=0.9),
    "bias + penalties": dict(temperature=0.8, logit_bias={"11": 4.0, "25": -100.0}, presence_penalty=0.8,
                             frequency_penalty=0.5),
    "repetition + min_p + top_k + top_p": dict(temperature=1.1, repetition_penalty=1.2, min_p=0.05, top_k=40,
                                               top_p=0.95),
    "regex": dict(temperature=1.0, regex=r"[a-z_]+\(([a-z]+, )*[a-z]+\)"),
    "json_schema": dict(temperature=0.7, response_format=RESPONSE_FORMAT),
    "stop": dict(temperature=0.9, stop=["\n"]),
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_a_seeded_request_repeats_and_equals_generate_alone(models, eagle_client, name):
    prompt = PROMPTS[list(SEEDED).index(name) % len(PROMPTS)]
    fields = dict(SEEDED[name], seed=41 + len(name), max_tokens=24)
    if "regex" not in fields and "response_format" not in fields and "stop" not in fields:
        fields["ignore_eos"] = True
    first = _complete(eagle_client, prompt, fields)
    assert _complete(eagle_client, prompt, fields) == first
    assert _complete(eagle_client, prompt, fields, stream=True) == first
    assert first[0]["text"] == _generate_alone(models, prompt, fields, 24)
    chat = _chat(eagle_client, prompt, fields)
    assert chat[0]["text"] == _generate_alone(models, _chat_text(models, prompt), fields, 24)
    assert _chat(eagle_client, prompt, fields, stream=True) == chat


def test_n_choices_greedy_and_seeded(models, eagle, eagle_client, plain_client):
    """Greedy n = 3: three copies of plain greedy. Seeded n = 3 (with processors): choice i equals a one-choice
    request with choice_seed(seed, i), streamed or not; the usage counts the prompt once."""
    greedy = dict(temperature=0, max_tokens=16, presence_penalty=0.5, logprobs=2)
    expected = _complete(plain_client, PROMPTS[3], greedy)
    assert _complete(eagle_client, PROMPTS[3], dict(greedy, n=3)) == expected * 3
    assert _complete(eagle_client, PROMPTS[3], dict(greedy, n=3), stream=True) == expected * 3

    seeded = dict(temperature=0.9, seed=2024, max_tokens=20, logit_bias={"25": -100}, min_p=0.02, ignore_eos=True)
    choices = _complete(eagle_client, PROMPTS[4], dict(seeded, n=3))
    assert len({c["text"] for c in choices}) > 1  # distinct streams
    assert _complete(eagle_client, PROMPTS[4], dict(seeded, n=3), stream=True) == choices
    for i, choice in enumerate(choices):
        alone = _complete(eagle_client, PROMPTS[4], dict(seeded, seed=choice_seed(seeded["seed"], i)))
        assert alone == [choice], i
    response = httpx.post(eagle.url + "/v1/completions", timeout=60,
                          json=dict(model=MODEL, prompt=PROMPTS[4], n=3, **seeded)).json()
    prompt_tokens = len(models.tokenizer(PROMPTS[4])["input_ids"])
    assert response["usage"]["prompt_tokens"] == prompt_tokens and response["usage"]["completion_tokens"] == 3 * 20
    assert response["usage"]["total_tokens"] == prompt_tokens + 60


def test_chat_n_choices_streamed_with_logprobs(eagle_client, plain_client):
    fields = dict(temperature=0, max_tokens=12, n=2, logprobs=True, top_logprobs=3, frequency_penalty=0.3)
    expected = _chat(plain_client, PROMPTS[0], dict(fields, n=1))
    assert _chat(eagle_client, PROMPTS[0], fields, stream=True) == expected * 2
    assert _chat(eagle_client, PROMPTS[0], fields) == expected * 2


def test_logprobs_objects_are_consistent(eagle_client):
    """Completions: one entry per token, the tokens spell the text, text_offset the characters before each,
    top_logprobs holds the chosen token's own logprob when it is among the top; chat: 20 alternatives."""
    got = _complete(eagle_client, PROMPTS[1], dict(temperature=0.8, seed=5, max_tokens=20, logprobs=5,
                                                   ignore_eos=True))[0]
    lp = got["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 20
    assert "".join(lp["tokens"]) == got["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(20)]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 5 and logprob <= 0.0
        assert max(top.values()) >= logprob - 1e-6
        if token in top:
            assert abs(top[token] - logprob) < 1e-5
    chat = _chat(eagle_client, PROMPTS[1], dict(temperature=0, max_tokens=6, logprobs=True, top_logprobs=20))[0]
    assert len(chat["logprobs"]) == 6 and all(len(t["top_logprobs"]) == 20 for t in chat["logprobs"])
    assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in chat["logprobs"])  # greedy: the top one


def test_echo_and_max_tokens_zero_score_the_prompt_as_plain_decoding(eagle_client, plain_client):
    fields = dict(max_tokens=0, echo=True, logprobs=2)
    expected = _complete(plain_client, PROMPTS[2], fields)
    assert expected[0]["text"] == PROMPTS[2] and expected[0]["logprobs"]["token_logprobs"][0] is None
    assert _complete(eagle_client, PROMPTS[2], fields) == expected
    fields = dict(max_tokens=8, echo=True, logprobs=1, temperature=0, n=2)
    expected = _complete(plain_client, PROMPTS[2], dict(fields, n=1))
    assert _complete(eagle_client, PROMPTS[2], fields) == expected * 2
    assert _complete(eagle_client, PROMPTS[2], fields, stream=True) == expected * 2


def test_a_request_that_fills_the_context_exactly(models, eagle, eagle_client, plain_client):
    """prompt + max_tokens = max_model_len (the row's positions less two steps of drafts): the last drafts
    run against the end of the row's cache, and the answer is still plain decoding's; one more token: 400."""
    context = httpx.get(eagle.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    assert context == MAX_SEQ_LEN - 2 * (K + 1)
    prompt = models.tokenizer(open(specdec_ext.serve.app.__file__).read())["input_ids"][: context - 40]
    got, want = (client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, logprobs=1,
                                           extra_body={"ignore_eos": True}) for client in (eagle_client, plain_client))
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 40
    assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as error:
        eagle_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=41)
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "max_tokens"


def test_chat_without_max_tokens_drafts_up_to_the_end_of_the_context(models, eagle, plain):
    """Chat without max_tokens generates up to max_model_len (OpenAI's rule): EAGLE's last chains run against
    the end of the row's cache; its tokens are plain decoding's (whose context, without drafts, is longer:
    the EAGLE text is a prefix of the plain one)."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}], temperature=0, ignore_eos=True)
    got, want = (httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
                 for server in (eagle, plain))
    context = MAX_SEQ_LEN - 2 * (K + 1)
    assert got["usage"]["total_tokens"] == context and got["choices"][0]["finish_reason"] == "length"
    assert want["usage"]["total_tokens"] == MAX_SEQ_LEN - 2
    assert want["choices"][0]["message"]["content"].startswith(got["choices"][0]["message"]["content"])


# ------------------------------------------------------------------------------------------ 3. clients that leave
def _stream_text(url: str, body: dict, *, read_delay: float = 0.0, stop_after: Optional[int] = None) -> str:
    """A streamed completion's text read with httpx (``read_delay`` seconds per line: a slow reader);
    ``stop_after`` data lines: the client closes the connection there."""
    text, lines = "", 0
    with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines += 1
            if stop_after is not None and lines >= stop_after:
                return text
            if read_delay:
                time.sleep(read_delay)
            if line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _text(url: str, body: dict) -> str:
    response = httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _timed_out(url: str, body: dict) -> None:
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=0.05)


def _body(i: int, greedy: bool) -> dict:
    names = list(FIELD_SETS)
    fields = {k: v for k, v in FIELD_SETS[names[i % 5]].items()}  # (the first five: no stop, no grammar)
    body = dict(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12 + 4 * (i % 3), ignore_eos=True, **fields)
    body.update(dict(temperature=0) if greedy else dict(temperature=0.9, seed=300 + i))
    return body


def test_concurrent_clients_that_leave_do_not_disturb_the_others(eagle, plain):
    """28 clients at once: 18 that read everything (streamed or not, greedy or seeded, with processors),
    one slow reader, 4 that disconnect mid-stream, 2 that close their stream before its first token, 3
    non-streaming ones that time out. Everyone who reads gets what the request gets alone (greedy: plain
    decoding); the 9 that left are counted as cancelled and every slot and budget unit comes back."""
    bodies = [(_body(i, greedy=i % 2 == 0), i % 2 == 0) for i in range(19)]
    expected = [_text(plain.url if greedy else eagle.url, body) for body, greedy in bodies]
    assert wait_until(lambda: _idle(eagle))
    before = _counters(eagle)
    long = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=250, ignore_eos=True, temperature=0.8, seed=9)
    with ThreadPoolExecutor(28) as pool:
        readers = [pool.submit(_stream_text if i % 3 == 0 else _text, eagle.url, body)
                   for i, (body, _) in enumerate(bodies[:-1])]
        slow = pool.submit(_stream_text, eagle.url, bodies[-1][0], read_delay=0.1)
        leavers = [pool.submit(_stream_text, eagle.url, long, stop_after=2 + i) for i in range(4)]
        leavers += [pool.submit(_stream_text, eagle.url, dict(long, seed=i), stop_after=0) for i in range(2)]
        leavers += [pool.submit(_timed_out, eagle.url, dict(long, temperature=0)) for _ in range(3)]
        got = [f.result() for f in readers] + [slow.result()]
        [f.result() for f in leavers]
    assert got == expected
    assert wait_until(lambda: _idle(eagle)), "rows or cache budget left behind"
    after = _counters(eagle)
    ended = _delta(before, after, "specdec_requests_total")
    assert ended == {"specdec_requests_total{finish_reason=cancelled}": 9.0,
                     "specdec_requests_total{finish_reason=length}": 19.0}, ended
    assert after["specdec_running_rows"] == after["specdec_queue_length"] == 0
    assert after["specdec_cache_budget_in_use{unit=rows}"] == 0
    assert httpx.get(eagle.url + "/health", timeout=10).json() == {"status": "ok"}


def test_a_queued_request_whose_client_leaves_is_dropped_from_the_queue(models):
    """Two rows busy with long requests, two streams queued behind them: when those clients close their
    streams (before any token) the queue empties at once and a 429 turns into a place in the queue."""
    server = _server(models, max_rows=2, max_queue=2, k=K)
    try:
        long = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=260, ignore_eos=True, temperature=0)
        with ThreadPoolExecutor(4) as pool:
            holders = [pool.submit(_text, server.url, long) for _ in range(2)]
            assert wait_until(lambda: server.engine.batcher.running and len(server.engine.batcher.running) == 2)
            with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
                streams = [c.stream("POST", server.url + "/v1/completions", json=dict(long, stream=True, max_tokens=4))
                           for c in (a, b)]
                responses = [s.__enter__() for s in streams]
                assert all(r.status_code == 200 for r in responses)
                assert wait_until(lambda: metrics_value(server, "specdec_queue_length") == 2)
                full = httpx.post(server.url + "/v1/completions", json=dict(long, max_tokens=4), timeout=30)
                assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
                assert int(full.headers["retry-after"]) >= 1
                for s in streams:
                    s.__exit__(None, None, None)
            assert wait_until(lambda: metrics_value(server, "specdec_queue_length") == 0, timeout_s=5)
            assert len(server.engine.batcher.running) == 2  # (the long ones still run)
            short = pool.submit(_text, server.url, dict(long, max_tokens=4))
            assert short.result() and all(h.result() for h in holders)
        assert metrics_value(server, "specdec_requests_total", finish_reason="cancelled") == 2
        assert metrics_value(server, "specdec_requests_rejected_total", reason="queue_full") == 1
    finally:
        server.stop()


def metrics_value(server, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return metrics(server).get(key, 0.0)


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0])


def _live(*classes) -> Dict[str, int]:
    gc.collect()
    counts = {cls.__name__: 0 for cls in classes}
    for obj in gc.get_objects():
        if type(obj) in classes:
            counts[type(obj).__name__] += 1
    return counts


def test_a_few_hundred_requests_leak_nothing(eagle):
    """300 short requests from 16 threads (a third streamed, every 10th disconnecting mid-stream, every 15th
    timing out), the first 100 a warm-up: afterwards nothing runs, every slot and connection is free, no
    request, row, reply, text stream or event object is alive, no thread was added but the event loop's
    bounded to_thread pool, RSS grew by under 32 MiB (measured: ~15 MiB of allocator warm-up that levels off
    by ~600 requests; no object survives); /metrics counts every request."""
    def one(i: int):
        body = dict(model=MODEL, prompt=PROMPTS[i % 5], max_tokens=6, temperature=0.7, seed=i,
                    ignore_eos=True, presence_penalty=0.2 * (i % 3), logit_bias={"11": i % 4})
        if i % 10 == 3:
            return _stream_text(eagle.url, dict(body, max_tokens=200), stop_after=2)
        if i % 15 == 7:
            return _timed_out(eagle.url, dict(body, max_tokens=300))
        return _stream_text(eagle.url, body) if i % 3 == 0 else _text(eagle.url, body)

    def batch(start: int):
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(start, start + 100)))

    from specdec_ext.serve import app as app_module, batcher as batcher_module, request as request_module, text

    tracked = (request_module.GenerationRequest, request_module.RowEvent, app_module.Reply, app_module.Choice,
               text.TextStream, batcher_module.Row)
    batch(0)
    assert wait_until(lambda: _idle(eagle))
    rss, threads = _rss_kib(), {t.name for t in threading.enumerate()}
    before = _counters(eagle)
    batch(100)
    batch(200)
    assert wait_until(lambda: _idle(eagle))
    state = eagle.server.server_state
    assert wait_until(lambda: not state.connections and not state.tasks, timeout_s=5)
    assert _live(*tracked) == {cls.__name__: 0 for cls in tracked}
    growth = _rss_kib() - rss
    assert growth < 32 * 1024, f"RSS grew by {growth} KiB over 200 requests"
    added = {t.name for t in threading.enumerate()} - threads
    assert all(name.startswith("asyncio_") for name in added), added  # (asyncio.to_thread's pool: at most 6)
    ended = _delta(before, _counters(eagle), "specdec_requests_total")
    cancelled = sum(1 for i in range(100, 300) if i % 10 == 3 or i % 15 == 7)
    assert ended == {"specdec_requests_total{finish_reason=cancelled}": cancelled,
                     "specdec_requests_total{finish_reason=length}": 200 - cancelled}, ended


# ------------------------------------------------------------------------------------------ 4. bad input
BASE = dict(model=MODEL, prompt="hi", max_tokens=4)
CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
BAD = [  # (path, body or raw bytes, status, param)
    ("completions", b'{"model": "eagle-pair", "prompt": ', 400, None),
    ("completions", b'[1, 2]', 400, None),
    ("completions", b'"hello"', 400, None),
    ("completions", b'{"model": "eagle-pair", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("completions", dict(BASE, max_tokens="10"), 400, "max_tokens"),
    ("completions", dict(BASE, max_tokens=-1), 400, "max_tokens"),
    ("completions", dict(BASE, max_tokens=10 ** 12), 400, "max_tokens"),
    ("completions", dict(BASE, max_tokens=2 ** 70), 400, "max_tokens"),
    ("completions", dict(BASE, temperature=-0.5), 400, "temperature"),
    ("completions", dict(BASE, temperature="hot"), 400, "temperature"),
    ("completions", dict(BASE, top_p=0), 400, "top_p"),
    ("completions", dict(BASE, top_p=1.5), 400, "top_p"),
    ("completions", dict(BASE, top_k=-2), 400, "top_k"),
    ("completions", dict(BASE, seed=-1), 400, "seed"),
    ("completions", dict(BASE, seed=2 ** 64), 400, "seed"),
    ("completions", dict(BASE, n=0), 400, "n"),
    ("completions", dict(BASE, n=17), 400, "n"),
    ("completions", dict(BASE, n=10 ** 9), 400, "n"),
    ("completions", dict(BASE, prompt=""), 400, "prompt"),
    ("completions", dict(BASE, prompt=[]), 400, "prompt"),
    ("completions", dict(BASE, prompt=[[]]), 400, "prompt"),
    ("completions", dict(BASE, prompt=[-1, 5]), 400, "prompt"),
    ("completions", dict(BASE, prompt=[8192]), 400, "prompt"),
    ("completions", dict(BASE, prompt=["a", "b"]), 400, "prompt"),
    ("completions", dict(BASE, prompt="x = 1\n" * 400), 400, "prompt"),
    ("completions", dict(BASE, prompt=[5] * 400), 400, "prompt"),
    ("completions", dict(BASE, prompt=[5] * 300, max_tokens=100), 400, "max_tokens"),
    ("completions", dict(BASE, logit_bias={"8192": 5}), 400, "logit_bias"),
    ("completions", dict(BASE, logit_bias={"-1": 5}), 400, "logit_bias"),
    ("completions", dict(BASE, logit_bias={str(2 ** 70): 5}), 400, "logit_bias"),
    ("completions", dict(BASE, logit_bias={"abc": 5}), 400, "logit_bias"),
    ("completions", dict(BASE, logit_bias={"5": 101}), 400, "logit_bias"),
    ("completions", dict(BASE, logit_bias={"5": "x"}), 400, "logit_bias"),
    ("completions", b'{"model": "eagle-pair", "prompt": "hi", "logit_bias": {"5": NaN}}', 400, "logit_bias"),
    ("completions", dict(BASE, presence_penalty=2.5), 400, "presence_penalty"),
    ("completions", dict(BASE, frequency_penalty=-3), 400, "frequency_penalty"),
    ("completions", dict(BASE, repetition_penalty=0), 400, "repetition_penalty"),
    ("completions", dict(BASE, repetition_penalty=1e40), 400, "repetition_penalty"),
    ("completions", dict(BASE, min_p=1.5), 400, "min_p"),
    ("completions", dict(BASE, logprobs=21), 400, "logprobs"),
    ("completions", dict(BASE, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("completions", dict(BASE, stop=[""]), 400, "stop"),
    ("completions", dict(BASE, best_of=3), 400, "best_of"),
    ("completions", dict(BASE, stream="yes"), 400, "stream"),
    ("completions", dict(BASE, stream_options={"include_usage": True}), 400, "stream_options"),
    ("completions", dict(BASE, regex="([a-"), 400, "regex"),
    ("completions", dict(BASE, grammar="start: ("), 400, "grammar"),
    ("completions", dict(BASE, regex="a", response_format={"type": "json_object"}), 400, "regex"),
    ("completions", dict(BASE, response_format={"type": "xml"}), 400, "response_format"),
    ("completions", dict(BASE, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                    "schema": {"type": "nope"}}}),
     400, "response_format"),
    ("completions", dict(BASE, model="gpt-4"), 404, "model"),
    ("completions", {"prompt": "hi"}, 400, "model"),
    ("chat/completions", dict(CHAT, messages=[]), 400, "messages"),
    ("chat/completions", dict(CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("chat/completions", dict(CHAT, max_tokens=0), 400, "max_tokens"),
    ("chat/completions", dict(CHAT, top_logprobs=3), 400, "top_logprobs"),
    ("chat/completions", dict(CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat/completions", dict(CHAT, n=17), 400, "n"),
    ("chat/completions", dict(CHAT, logit_bias={"9999": 1}), 400, "logit_bias"),
    ("chat/completions", dict(CHAT, max_completion_tokens=10 ** 6), 400, "max_completion_tokens"),  # (as the client named it)
    ("chat/completions", dict(CHAT, tools=[{"type": "function"}]), 400, "tools"),
    ("chat/completions", dict(CHAT, messages=[{"role": "user", "content": [{"type": "image_url",
                                                                            "image_url": {"url": "x"}}]}]),
     400, "messages"),
    ("chat/completions", dict(CHAT, messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("chat/completions", dict(CHAT, messages="hi"), 400, "messages"),
    ("chat/completions", dict(CHAT, stop=["a"] * 5), 400, "stop"),
    ("chat/completions", dict(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "response_format"),
]


def test_bad_requests_get_a_400_naming_the_field_and_the_server_serves_on(eagle, plain):
    expected = _text(plain.url, dict(BASE, prompt=PROMPTS[0], max_tokens=12, temperature=0))
    before = metrics(eagle)
    too_long = 0
    with httpx.Client(base_url=eagle.url + "/v1/", timeout=30) as client:
        for path, body, status, param in BAD:
            if isinstance(body, bytes):
                response = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=body)
            label = f"{path} {body if isinstance(body, bytes) else {k: body[k] for k in body if k not in BASE or body[k] != BASE.get(k)}}"
            assert response.status_code == status, (label, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], label
            assert error["param"] == param, (label, error)
            too_long += error["code"] == "context_length_exceeded"
    after = metrics(eagle)
    changed = {key: after[key] - before.get(key, 0.0) for key in after
               if key[0].startswith("specdec_requests") and after[key] != before.get(key, 0.0)}
    # none of them ran; those past the context are counted as rejected (too_large), the others nowhere
    assert too_long == 6 and changed == {("specdec_requests_rejected_total", (("reason", "too_large"),)): too_long}
    assert httpx.get(eagle.url + "/health", timeout=10).json() == {"status": "ok"}
    assert _text(eagle.url, dict(BASE, prompt=PROMPTS[0], max_tokens=12, temperature=0)) == expected


def test_unknown_fields_are_ignored_and_ids_at_the_edge_of_the_vocabulary_are_taken(eagle_client, plain_client):
    fields = dict(temperature=0, max_tokens=8, logit_bias={"8191": -100, "0": -100}, frobnicate={"a": 1},
                  user="someone")
    assert _complete(eagle_client, PROMPTS[0], fields) == _complete(plain_client, PROMPTS[0], fields)


def test_null_for_openai_nullable_fields_means_not_given(eagle_client):
    # Was a bug (fixed): OpenAI's API (and the openai client's own types: CompletionCreateParams.n: Optional[int], echo:
    # Optional[bool], stream: Optional[Literal[False]]) takes null for these fields as "not given"; the
    # server refuses it with a 400 ("n: Input should be a valid integer"), so a client that passes n=None,
    # echo=None or stream=None gets an error. serve/protocol.py declares them non-optional
    # (SamplingFields.n: int = Field(1, ge=1), stream: bool = False, CompletionRequest.echo: bool = False).
    response = eagle_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                               n=None, echo=None)
    assert len(response.choices) == 1 and response.choices[0].text
    response = eagle_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, temperature=0, n=None, stream=None)
    assert len(response.choices) == 1


def test_a_long_stop_string_is_served(eagle):
    # Was a bug: TextStream._held_back (serve/text.py) tried every prefix length of every stop string at every
    # pushed event, O(len(stop)^2) on the server's event loop: one request with a 400,000-character stop string
    # blocked every client, /health included, for about a second per event (1 MB: ~6 s; 5 MB: minutes). Now
    # stops.stop_prefix_len compares only the text's ends that start with the stop string's first character
    # (python_tests/test_stops.py counts its reads of the stop string).
    response = httpx.post(eagle.url + "/v1/completions", timeout=120, json=dict(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=["\x01" * 400_000]))
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(eagle.url + "/health", timeout=30).status_code == 200


def test_a_regex_llguidance_cannot_run_is_refused(eagle, plain):
    # Was a bug: a bounded repetition past llguidance's lexer limits ("a{300000}": max_lexer_states is 250,000;
    # "a{250001}" runs) compiled, and llguidance's matcher failed after the first token ("lexer error: too many
    # expressions constructed"), which the row took for a dead end: a 200 with "aa" and "grammar_dead_end".
    # Now the compile consumes the first allowed token (grammar._check_first_token) and refuses it by name.
    for server in (eagle, plain):
        response = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
            model=MODEL, prompt="name = ", max_tokens=6, temperature=0, regex="a{300000}"))
        if response.status_code == 400:
            assert response.json()["error"]["param"] == "regex"
            continue
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("a" * len(choice["text"]), "length"), choice
        assert len(choice["text"]) >= 6


def test_a_grammar_compiling_blocks_neither_other_requests_nor_their_text(plain, plain_client, monkeypatch):
    # Was a bug: a request's schema or regex compiled on the server's event loop, holding the tokenizer's lock
    # (a 1-MB regex stalled every client ~1 s). Now it compiles in a worker thread, the lock held only while
    # llguidance first reads the vocabulary: here a compile held open while a plain request is served.
    def plain_text() -> str:
        return plain_client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True}, timeout=30.0).choices[0].text

    alone = plain_text()
    compile_grammar = specdec_ext.grammar.TokenizerGrammar.compile
    entered, release = threading.Event(), threading.Event()

    def held_compile(self, spec):
        entered.set()
        assert release.wait(60)
        return compile_grammar(self, spec)

    monkeypatch.setattr(specdec_ext.grammar.TokenizerGrammar, "compile", held_compile)
    regex = "[a-z]{1,8}"
    with ThreadPoolExecutor(1) as pool:
        try:
            constrained = pool.submit(plain_client.completions.create, model=MODEL, prompt="name = ", max_tokens=8,
                                      temperature=0, extra_body={"regex": regex})
            assert entered.wait(60)
            assert plain_text() == alone and not release.is_set()
        finally:
            release.set()
        assert re.fullmatch(regex, constrained.result(60).choices[0].text)


# ------------------------------------------------------------------------------------------ 5. metrics and health
def test_metrics_count_what_was_served(eagle):
    """Rows (n counted as n), prompt tokens per row, generated tokens = the usage's completion tokens,
    finish reasons as the responses give them; the EAGLE head's drafts were accepted; /health and
    /v1/models answer, HEAD too."""
    assert wait_until(lambda: _idle(eagle))
    before = _counters(eagle)
    requests = [dict(prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["\n"]),
                dict(prompt=PROMPTS[1], max_tokens=10, temperature=0.9, seed=3, n=3, ignore_eos=True),
                dict(prompt="phone: ", max_tokens=20, temperature=0, regex="[0-9]{3}-[a-z]{2}"),
                dict(prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=1),
                dict(prompt=PROMPTS[3], max_tokens=8, logit_bias={"0": 100}),
                dict(prompt=PROMPTS[4], max_tokens=12, n=2, stream=True, stream_options={"include_usage": True})]
    completion_tokens = prompt_tokens = 0
    reasons: Dict[str, int] = {}
    for fields in requests:
        body = dict(model=MODEL, **fields)
        if fields.get("stream"):
            usage, finish = None, []
            with httpx.stream("POST", eagle.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        finish += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        else:
            response = httpx.post(eagle.url + "/v1/completions", json=body, timeout=60).json()
            usage, finish = response["usage"], [c["finish_reason"] for c in response["choices"]]
        completion_tokens += usage["completion_tokens"]
        prompt_tokens += usage["prompt_tokens"] * fields.get("n", 1)
        for reason in finish:
            reasons[reason] = reasons.get(reason, 0) + 1
    after = _counters(eagle)
    ended = _delta(before, after, "specdec_requests_total")
    # (the server's "eos" and "stop" are both OpenAI's "stop")
    served = {r: n for r, n in reasons.items()}
    counted = {}
    for key, n in ended.items():
        reason = re.search(r"finish_reason=(\w+)", key).group(1)
        reason = "stop" if reason == "eos" else reason
        counted[reason] = counted.get(reason, 0) + int(n)
    assert counted == served
    assert sum(counted.values()) == 1 + 3 + 1 + 1 + 1 + 2
    assert _delta(before, after, "specdec_generated_tokens_total") == {"specdec_generated_tokens_total":
                                                                       completion_tokens}
    assert _delta(before, after, "specdec_prompt_tokens_total") == {"specdec_prompt_tokens_total": prompt_tokens}
    assert sum(_delta(before, after, "specdec_draft_accepted_total").values()) > 0  # EAGLE drafted, and was right
    for path in ("/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics"):
        assert httpx.get(eagle.url + path, timeout=10).status_code == 200
        assert httpx.head(eagle.url + path, timeout=10).status_code == 200
    assert httpx.get(eagle.url + "/v1/models/other", timeout=10).status_code == 404
