"""specdec serve as real clients use it, swept over the drafters the other serve tests leave out: a draft model
at a fixed k, the n-gram lookup (k by load) and plain decoding (no draft), on the tiny char pair and on the
bundled pair (its tokenizer runs grammars). The official openai client and raw httpx: overlapping stop
strings, stops that must not match the prompt, logprobs next to stops and over a padded vocabulary, n
choices streamed with usage, OpenAI's function-calling fields, error bodies, prompt shapes, clients that
leave n-choice streams and chunked prefills, a crowd of mixed clients (greedy, seeded, grammar, n, logprobs)
whose every answer equals its solo one, and /metrics checked by a strict Prometheus text parser."""
from __future__ import annotations

import json
import math
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_utils import (CHAT_TEMPLATE, MODEL_NAME, ServerThread, make_app, metrics, openai_client, serve_app,
                         slow_target, tiny_pair, wait_until)

K = 3
PROMPTS = ["def fib(n):\n    return", "import os\nimport sys\n", "x = [1, 2, 3]\nprint(x"]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


# ------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def spec(pair):
    """A draft model at a fixed k: several tokens accepted per step."""
    yield from serve_app(pair, max_rows=8, k=K, max_seq_len=256)


@pytest.fixture(scope="module")
def ngram(pair):
    yield from serve_app((pair[0], "ngram", pair[2]), max_rows=8, max_seq_len=256)  # (k by load)


@pytest.fixture(scope="module")
def plain(pair):
    yield from serve_app((pair[0], None, pair[2]), max_rows=8, max_seq_len=256)


@pytest.fixture(scope="module")
def bundled():
    from specdec_ext.models import load_models

    models = load_models()
    models.tokenizer.chat_template = CHAT_TEMPLATE
    return models


def _idle(server) -> bool:
    m = metrics(server)
    return (m[("specdec_running_rows", ())] == 0 and m[("specdec_queue_length", ())] == 0
            and m[("specdec_cache_budget_in_use", (("unit", "rows"),))] == 0)


def _greedy_text(client, prompt, max_tokens=30, **fields) -> str:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, **GREEDY,
                                     **fields).choices[0].text


# ------------------------------------------------------------------------------------------ stops
def _first_stop(text: str, stops) -> str:
    """Plain decoding's answer: the text up to the stop string that is completed first (token by token, the
    row ends after the token that completes one), the string excluded."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)]
    return text


def test_overlapping_stop_strings_end_the_text_where_plain_decoding_ends_it(spec, ngram, plain):
    """Was a defect, fixed: with stop = [t[2:4], t[1:5]] the shorter string is completed one token before the longer one,
    so plain decoding ends the text at t[:2]. When a step accepts the whole run of drafts, the stop check picks
    the string that STARTS first (stops._find_stop_string: min over start indices) and ends the text at t[:1]:
    the answer depends on how many drafts were accepted in a step, i.e. it is not lossless
    (e.g. '-3p==...' with stop ['p=', '3p=='] gives '-' from the draft-model server and '-3' without drafts)."""
    clients = {name: openai_client(server) for name, server in [("spec", spec), ("ngram", ngram), ("plain", plain)]}
    answers = {name: [] for name in clients}
    expected = []
    for prompt in PROMPTS:
        full = _greedy_text(clients["plain"], prompt)
        stops = [full[2:4], full[1:5]]
        assert len(full) >= 6 and _first_stop(full, stops) == full[:2]  # (the shorter string ends first)
        expected.append(_first_stop(full, stops))
        for name, client in clients.items():
            choice = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, stop=stops,
                                               **GREEDY).choices[0]
            answers[name].append((choice.text, choice.finish_reason))
    wanted = [(text, "stop") for text in expected]
    assert answers["plain"] == wanted
    assert answers["ngram"] == wanted
    assert answers["spec"] == wanted, f"speculative {answers['spec']} vs plain decoding's {wanted}"


def test_a_stop_string_never_matches_the_prompt_nor_its_echo(spec):
    """A stop string that spans the end of the prompt and the start of the completion, or that occurs only in
    the prompt (echoed or not), ends nothing: stop strings are matched against the completion alone."""
    client = openai_client(spec)
    prompt = PROMPTS[0]
    full = _greedy_text(client, prompt, max_tokens=12)
    for stop in (prompt[-1] + full[0], prompt[-2:], [prompt[:3], "QQ"]):
        for echo in (False, True):
            choice = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, stop=stop,
                                               echo=echo, **GREEDY).choices[0]
            assert (choice.text, choice.finish_reason) == ((prompt if echo else "") + full, "length"), stop
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, echo=True,
                                              stop=prompt[-2:], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == prompt + full


def test_a_held_back_beginning_of_a_stop_string_is_sent_when_the_row_ends(spec):
    """A stream holds back an end of the text that could begin a stop string; when the row ends by its length
    (or the string never completes) that text is sent: each stream equals the whole response, n=2 included."""
    client = openai_client(spec)
    for prompt in PROMPTS:
        full = _greedy_text(client, prompt, max_tokens=12)
        for stop in (full[-1] + "\u00e9", full[-2:] + "Q", [full[-1] + "Z", full[-3:-1] + "Y"]):
            chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, stop=stop, n=2,
                                                    stream=True, **GREEDY))
            texts = ["", ""]
            for chunk in chunks:
                for c in chunk.choices:
                    texts[c.index] += c.text
            assert texts == [full, full] and chunks[-1].choices[0].finish_reason == "length", (stop, texts)


def test_logprobs_describe_the_returned_text_when_a_stop_string_ends_it(spec):
    """Was a defect, fixed: a stop string is cut from the text but its tokens stay in the logprobs (stops.apply_stops keeps
    the logprobs of every token through the one that completes the string): with stop '==' the text is '-3p'
    and the legacy logprobs' tokens are ['-', '3', 'p', '=', '='] with text_offset past the end of the text;
    chat's logprobs.content ("the message content tokens") spells more than the message. On the char pair every
    token is one character, so the tokens of the returned text are exactly its characters."""
    client = openai_client(spec)
    prompt = PROMPTS[0]
    full = _greedy_text(client, prompt)
    stop = full[3:5]
    assert full.index(stop) == 3
    choice = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, logprobs=2, stop=stop,
                                       **GREEDY).choices[0]
    assert choice.text == full[:3] and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text, lp.tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert all(offset < len(choice.text) for offset in lp.text_offset), lp.text_offset
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, logprobs=2,
                                              stop=stop, stream=True, **GREEDY))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:3]
    assert tokens == lp.tokens
    messages = [{"role": "user", "content": "hi"}]
    chat_full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30,
                                               **GREEDY).choices[0].message.content
    chat_stop = chat_full[6:8]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, logprobs=True,
                                          top_logprobs=1, stop=chat_stop, **GREEDY).choices[0]
    assert chat.finish_reason == "stop" and chat_full.startswith(chat.message.content)
    assert "".join(item.token for item in chat.logprobs.content) == chat.message.content


# ------------------------------------------------------------------------------------------ logprobs
def test_logprobs_over_a_vocabulary_padded_past_the_tokenizer_are_served(spec):
    """Was a defect, fixed: the model's vocabulary (64) is padded past the tokenizer's 61 tokens, as many real checkpoints'
    are; ids 61-63 are valid (logit_bias takes them). A logprobs response whose tokens or top alternatives hold
    such an id failed: SharedTokenizer.token_bytes ran a regex over convert_ids_to_tokens(id), which is None,
    so `logprobs: 20` gave a 500 (TypeError) and a stream was cut mid-body without an error event or [DONE].
    Such an id has no text: it is served as an empty token, like the other tokens without text."""
    client = openai_client(spec)
    url = spec.url
    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    top20 = httpx.post(url + "/v1/completions", json={**body, "logprobs": 20}, timeout=60)
    assert top20.status_code == 200, top20.text
    lp = top20.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(top) >= 1 for top in lp["top_logprobs"])
    forced = httpx.post(url + "/v1/completions", json={**body, "logprobs": 1, "logit_bias": {"62": 100}}, timeout=60)
    assert forced.status_code == 200, forced.text
    forced = forced.json()["choices"][0]
    assert forced["text"] == "" and len(forced["logprobs"]["tokens"]) == 4
    assert all(isinstance(t, str) and math.isfinite(v) for t, v in zip(forced["logprobs"]["tokens"],
                                                                       forced["logprobs"]["token_logprobs"]))
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**body, "logprobs": 1, "logit_bias": {"62": 100}, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all("error" not in json.loads(x[6:]) for x in lines[:-1])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=20, **GREEDY)
    assert len(chat.choices[0].logprobs.content) == 4
    assert httpx.get(url + "/health").json() == {"status": "ok"} and wait_until(lambda: _idle(spec))


def test_a_stream_that_fails_ends_with_an_error_event_and_done(spec, monkeypatch):
    """A failure inside a streamed response (the padded-vocabulary bug above was one: token_bytes raising) cut the
    body mid-stream, the client left with "incomplete chunked read". Now the stream ends with a server_error event
    and [DONE], its rows are freed, and the server serves on."""
    from specdec_ext.serve.text import SharedTokenizer

    def broken(self, token):
        raise RuntimeError("token_bytes broke")

    body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    monkeypatch.setattr(SharedTokenizer, "token_bytes", broken)
    with httpx.stream("POST", spec.url + "/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line]
    monkeypatch.undo()
    assert lines[-1] == "data: [DONE]", lines
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and "token_bytes broke" in error["message"], error
    assert wait_until(lambda: _idle(spec))
    assert _greedy_text(openai_client(spec), "abc", max_tokens=6) != ""


# ------------------------------------------------------------------------------------------ request fields
def test_function_calling_fields_are_refused_like_tools(spec):
    """Was a defect, fixed: `tools` is refused (400, param tools: the server cannot call functions), but the same request
    in the older spelling, `functions` / `function_call`, or a `tool_choice` that demands a call, is served as
    if the fields were not there: the client gets plain text where it asked for a function call. OpenAI
    answers 400 for tool_choice without tools; by the server's own rule (protocol.py: fields that would change
    the output are refused) these are refused naming the field."""
    client = openai_client(spec)
    messages = [{"role": "user", "content": "hi"}]
    function = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    cases = [("functions", dict(functions=[function])),
             ("function_call", dict(function_call={"name": "get_weather"})),
             ("tool_choice", dict(tool_choice="required")),
             ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}))]
    served = []
    for param, fields in cases:
        try:
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, **fields)
            served.append(param)
        except openai.BadRequestError as refused:
            assert refused.body["param"] == param, refused.body
    assert served == [], f"served as plain text: {served}"
    ok = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, user="u1",
                                        metadata={"k": "v"}, store=False)
    assert ok.choices[0].finish_reason in ("length", "stop")  # (fields that change nothing are taken)


def test_a_context_overflow_names_max_completion_tokens_when_the_client_sent_it(spec):
    """Was a defect (an unclear error), fixed: chat's max_completion_tokens past the context is refused with param
    "max_tokens" and a message about "max_tokens=1000", a field the client never sent."""
    client = openai_client(spec)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=1000)
    body = refused.value.body
    assert body["code"] == "context_length_exceeded"
    assert body["param"] == "max_completion_tokens" and "max_completion_tokens=1000" in body["message"], body


def test_prompt_shapes_whitespace_unicode_token_ids_and_one_element_lists(pair, spec):
    """A prompt of whitespace, one of characters the tokenizer does not know (its unk), token ids, and the
    one-element list forms the SDK sends for a batch of one: each is served, counted, and a list of one
    prompt answers what the prompt alone answers."""
    client = openai_client(spec)
    encode = lambda text: pair[2](text)["input_ids"]
    for prompt in (" ", "\n\n", "\t x", "h\u00e9llo \U0001F389 \u65e5\u672c", "x" * 200):
        choice = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, echo=True, **GREEDY)
        assert choice.usage.prompt_tokens == len(encode(prompt)) and choice.usage.completion_tokens == 5
        assert choice.choices[0].text.startswith(prompt)
    text = PROMPTS[1]
    ids = encode(text)
    alone = _greedy_text(client, text, max_tokens=10)
    assert _greedy_text(client, ids, max_tokens=10) == alone
    assert _greedy_text(client, [ids], max_tokens=10) == alone
    assert _greedy_text(client, [text], max_tokens=10) == alone
    for empty in ("", [], [[]], [""]):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt=empty, max_tokens=3)
    assert _greedy_text(client, text, max_tokens=10) == alone  # (served on)


def test_greedy_with_every_processor_is_the_same_on_every_drafter(spec, ngram, plain):
    """Penalties, logit_bias, min_p and repetition_penalty apply to the target at each draft position: greedy
    answers under them are the same from a draft model at k=3, the n-gram lookup with k by load and plain
    decoding, streamed or not, in both endpoints; and a frequency penalty does change a repetitive answer."""
    fieldsets = [dict(frequency_penalty=1.5), dict(presence_penalty=-0.5, frequency_penalty=0.3),
                 dict(logit_bias={"10": 3, "25": -100, "38": 2.5}),
                 dict(extra={"repetition_penalty": 1.3, "min_p": 0.2})]

    def ask(client, prompt, fields, stream, chat):
        fields = dict(fields)
        extra = dict(fields.pop("extra", {}), ignore_eos=True)
        common = dict(model=MODEL_NAME, max_tokens=25, temperature=0, stream=stream, extra_body=extra, **fields)
        if chat:
            response = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
            return response.choices[0].message.content
        response = client.completions.create(prompt=prompt, **common)
        return "".join(c.choices[0].text for c in response) if stream else response.choices[0].text

    clients = [openai_client(s) for s in (spec, ngram, plain)]
    for i, fields in enumerate(fieldsets):
        prompt, stream, chat = PROMPTS[i % 3], i % 2 == 1, i == 2
        answers = [ask(c, prompt, fields, stream, chat) for c in clients]
        assert answers[0] == answers[1] == answers[2], (fields, answers)
    repetitive = _greedy_text(clients[2], PROMPTS[0])
    penalised = ask(clients[2], PROMPTS[0], dict(frequency_penalty=2.0), False, False)
    assert max(map(repetitive.count, set(repetitive))) > max(map(penalised.count, set(penalised)))


def test_n_choices_streamed_with_usage_match_the_whole_response(ngram):
    """n=3 streamed with include_usage: every chunk but the last has usage null, each index ends exactly once,
    the last chunk has no choices and the usage of the whole response (prompt once, completion summed), and
    each choice's text equals the non-streamed response's; chat opens each choice with the assistant role."""
    client = openai_client(ngram)
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=9, temperature=1.0, seed=17, n=3,
              stop=["e", "=="], extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == len(PROMPTS[2])
    assert whole.usage.completion_tokens <= 27 and whole.usage.total_tokens == whole.usage.prompt_tokens + \
        whole.usage.completion_tokens
    texts, ends = ["", "", ""], {0: [], 1: [], 2: []}
    for chunk in chunks:
        assert chunk.id == chunks[0].id and chunk.object == "text_completion" and chunk.created == chunks[0].created
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                ends[c.index].append(c.finish_reason)
    assert texts == [c.text for c in whole.choices]
    assert [ends[i] for i in range(3)] == [[c.finish_reason] for c in whole.choices]
    chat = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, temperature=0.9, seed=4, n=2, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    first = {}
    for chunk in chat:
        for c in chunk.choices:
            first.setdefault(c.index, c.delta.role)
    assert first == {0: "assistant", 1: "assistant"}
    assert chat[-1].usage.completion_tokens == 10 and chat[-1].choices == []


# ------------------------------------------------------------------------------------------ errors
def test_every_error_has_openai_s_shape_and_the_sdk_class(spec):
    url = spec.url
    client = openai_client(spec)
    responses = [httpx.get(url + "/v1/nothing"), httpx.post(url + "/v1/embeddings", json={}),
                 httpx.delete(url + "/v1/models"), httpx.put(url + "/v1/chat/completions", json={}),
                 httpx.post(url + "/v1/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"}),
                 httpx.post(url + "/v1/completions", content=b"", headers={"Content-Type": "application/json"}),
                 httpx.post(url + "/v1/completions", content=b'{"model": "tiny-pair", "prompt": "ab", "x": '
                            + b"[" * 50_000 + b"]" * 50_000 + b"}", headers={"Content-Type": "application/json"}),
                 httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "ab"}),
                 httpx.post(url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
                     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})]
    assert [r.status_code for r in responses] == [404, 404, 405, 405, 400, 400, 400, 404, 400]
    for response in responses:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        assert error["message"] and isinstance(error["type"], str), response.text
    with pytest.raises(openai.NotFoundError):
        client.get("/nothing", cast_to=object)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL_NAME, prompt=list(range(2, 60)) * 5, max_tokens=1, stream=True)
    assert long.value.body["code"] == "context_length_exceeded"
    assert _greedy_text(client, "abc", max_tokens=4) == _greedy_text(client, "abc", max_tokens=4)


# ------------------------------------------------------------------------------------------ clients that leave
def test_clients_that_leave_n_choice_streams_responses_and_chunked_prefills_free_their_rows():
    """n=3 streams closed after a few chunks, an n=3 whole response given up by an httpx timeout, a chat n=2
    stream closed before it was read and clients that leave while a long prompt is still prefilled in chunks
    (beside a row that keeps decoding): every row is cancelled and freed, a greedy stream running meanwhile gets its solo text, and the server
    serves on (n-gram drafts, chunked prefill of 8 tokens, a slowed target so the rows stay in flight)."""
    target, _, tokenizer = tiny_pair()
    with slow_target(target, 0.01):
        for server in serve_app((target, "ngram", tokenizer), max_rows=4, max_queue=4, max_seq_len=256,
                                prefill_chunk=8):
            client = openai_client(server)
            cancelled = lambda: metrics(server).get(("specdec_requests_total", (("finish_reason", "cancelled"),)), 0)
            solo = _greedy_text(client, "def f(x):", max_tokens=24)
            running = client.completions.create(model=MODEL_NAME, prompt="def f(x):", max_tokens=24, stream=True,
                                                **GREEDY)
            stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=200, n=3,
                                               temperature=0.7, stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            for _ in range(4):
                next(chunks)
            stream.close()
            # (each client's rows are seen cancelled before the next client comes: on a loaded machine the next
            # one would otherwise find the rows still held and the queue full, and be refused, not cancelled)
            assert wait_until(lambda: cancelled() == 3, 30), cancelled()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", timeout=0.3, json={
                    "model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 200, "n": 3, "ignore_eos": True})
            assert wait_until(lambda: cancelled() == 6, 30), cancelled()
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
                    "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "n": 2,
                    "stream": True, "ignore_eos": True}):
                pass
            assert wait_until(lambda: cancelled() == 8, 30), cancelled()
            # a row decoding beside them, so that a joining prompt is prefilled in chunks (alone, it is one pass)
            keeper = client.completions.create(model=MODEL_NAME, prompt="def g(y):", max_tokens=200, stream=True,
                                               **GREEDY)
            next(iter(keeper))
            for n in (1, 2):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(server.url + "/v1/completions", timeout=0.1, json={
                        "model": MODEL_NAME, "prompt": "abcdefgh" * 25, "max_tokens": 10, "n": n, "stream": True})
                assert wait_until(lambda: cancelled() == 8 + n * (n + 1) // 2, 30), cancelled()
            keeper.close()
            assert "".join(c.choices[0].text for c in running) == solo
            assert wait_until(lambda: _idle(server) and cancelled() == 12, 30), (metrics(server), cancelled())
            again = client.completions.create(model=MODEL_NAME, prompt="abcdefgh" * 25, max_tokens=6, n=2, **GREEDY)
            assert again.choices[0].text == again.choices[1].text and again.usage.completion_tokens == 12
            assert wait_until(lambda: _idle(server))


# ------------------------------------------------------------------------------------------ a crowd
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
CODE = ["def fibonacci(n):", "import numpy as np\nx = np.", "class Stack:\n    def", "for i in range(10):"]
KINDS = ["greedy", "seeded", "grammar", "n", "logprobs"]


def _crowd_request(i: int) -> dict:
    rng = random.Random(i)
    return dict(kind=KINDS[i % 5], prompt=CODE[i % 4], chat=i % 3 == 0, stream=i % 2 == 0,
                max_tokens=rng.randint(8, 32), seed=rng.randrange(1000))


def _ask(client, r):
    """One client's request; per choice (text, finish_reason, [(token, logprob)])."""
    kw = dict(model=MODEL_NAME, max_tokens=80 if r["kind"] == "grammar" else r["max_tokens"], stream=r["stream"])
    kw.update(temperature=0) if r["kind"] in ("greedy", "logprobs") else kw.update(temperature=0.8, seed=r["seed"])
    extra = {}
    if r["kind"] == "n":
        kw["n"] = 2
    if r["kind"] == "grammar":
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    if r["kind"] == "logprobs":
        kw.update(dict(logprobs=True, top_logprobs=2) if r["chat"] else dict(logprobs=2))
    if r["chat"]:
        response = client.chat.completions.create(messages=[{"role": "user", "content": r["prompt"]}],
                                                  extra_body=extra, **kw)
    else:
        response = client.completions.create(prompt=r["prompt"], extra_body=extra, **kw)
    texts, reasons, lps = {}, {}, {}
    for chunk in (response if r["stream"] else [response]):
        for c in chunk.choices:
            if r["chat"]:
                piece = (c.delta.content or "") if r["stream"] else c.message.content
                lp = [(x.token, x.logprob) for x in c.logprobs.content] if c.logprobs else []
            else:
                piece = c.text
                lp = list(zip(c.logprobs.tokens, c.logprobs.token_logprobs)) if c.logprobs else []
            texts[c.index] = texts.get(c.index, "") + piece
            lps[c.index] = lps.get(c.index, []) + lp
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [(texts[i], reasons[i], lps[i]) for i in sorted(texts)]


def _leave(client):
    stream = client.completions.create(model=MODEL_NAME, prompt=CODE[0], max_tokens=300, temperature=1.0, n=2,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()


def _valid(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "n"} and isinstance(value["name"], str)
            and len(value["name"]) <= 8 and type(value["n"]) is int and 0 <= value["n"] <= 99)


def test_a_crowd_of_mixed_clients_on_ngram_and_plain_servers_gets_its_solo_answers(bundled):
    """20 clients on the bundled pair (greedy, seeded, a json_schema grammar, n=2 seeded, logprobs; chat and
    completions; streamed or not) at once, with 3 more that leave their n=2 streams: each answer equals the one
    it got alone, logprobs included, on an n-gram server (k by load) and a plain one; greedy answers and their
    logprobs are the same on both; every grammar answer parses and fits its schema; no row is left."""
    requests = [_crowd_request(i) for i in range(20)]
    answers = {}
    for name, draft in (("ngram", "ngram"), ("plain", None)):
        app, engine = make_app(bundled.target, draft, bundled.tokenizer, max_rows=8, max_queue=32, max_seq_len=512)
        server = ServerThread(app, engine, grace_s=5.0).start()
        try:
            client = openai_client(server)
            solo = [_ask(client, r) for r in requests]
            with ThreadPoolExecutor(23) as pool:
                leavers = [pool.submit(_leave, client) for _ in range(3)]
                crowd = list(pool.map(lambda r: _ask(client, r), requests))
                [f.result() for f in leavers]
            for r, alone, among in zip(requests, solo, crowd):
                assert among == alone, (name, r)
                if r["kind"] == "grammar":
                    assert all(reason == "stop" and _valid(json.loads(text)) for text, reason, _ in alone), alone
                if r["kind"] == "logprobs":
                    assert all("".join(t for t, _ in lp) == text and all(math.isfinite(v) and v <= 0 for _, v in lp)
                               for text, _, lp in alone)
            assert wait_until(lambda: _idle(server))
            answers[name] = solo
        finally:
            server.stop()
    for r, a, b in zip(requests, answers["ngram"], answers["plain"]):
        if r["kind"] in ("greedy", "logprobs"):
            assert [x[:2] for x in a] == [x[:2] for x in b], r
            assert [[t for t, _ in x[2]] for x in a] == [[t for t, _ in x[2]] for x in b]
            assert [v for x in a for _, v in x[2]] == pytest.approx([v for x in b for _, v in x[2]], abs=1e-4)


# ------------------------------------------------------------------------------------------ /metrics
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{((?:[a-zA-Z_][a-zA-Z0-9_]*=\"(?:[^\"\\\n]|\\.)*\",?)*)\}})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def parse_prometheus(text: str) -> dict:
    """A strict reader of the Prometheus text format 0.0.4: {family: (type, help, [(name, labels, value)])}.
    HELP and TYPE once per family and before its samples, a family's samples together, no series twice."""
    assert text.endswith("\n")
    families, order, seen, current = {}, [], set(), None
    for line in text.splitlines():
        assert line, "an empty line"
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            kind, name, rest = line[2:6], *line[7:].split(" ", 1)
            assert re.fullmatch(_NAME, name) and rest, line
            family = families.setdefault(name, {"type": None, "help": None, "samples": []})
            key = "help" if kind == "HELP" else "type"
            assert family[key] is None and not family["samples"], f"{kind} of {name} twice or after its samples"
            if key == "type":
                assert rest in ("counter", "gauge", "histogram", "summary", "untyped"), line
            family[key] = rest
            if name not in order:
                order.append(name)
            current = name
            continue
        assert not line.startswith("#"), line
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, labels, value = match.group(1), dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
        kind = families[current]["type"] if current else None
        assert current is not None and name in [current + s for s in suffixes.get(kind, ("",))], \
            f"{name} outside its family ({current})"
        series = (name, tuple(sorted(labels.items())))
        assert series not in seen, f"{series} twice"
        seen.add(series)
        families[current]["samples"].append((name, labels, value))
    for name, family in families.items():
        assert family["type"] and family["help"] is not None, name
        if family["type"] == "counter":
            assert all(v >= 0 for _, _, v in family["samples"]), name
    return families


def test_metrics_are_strict_prometheus_text_with_cumulative_histograms(spec):
    client = openai_client(spec)
    client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, n=2, temperature=1.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=10_000)
    response = httpx.get(spec.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = parse_prometheus(response.text)
    histograms = [name for name, f in families.items() if f["type"] == "histogram"]
    assert {"specdec_time_to_first_token_seconds", "specdec_time_per_output_token_seconds"} <= set(histograms)
    for name in histograms:
        samples = families[name]["samples"]
        buckets = [(s[1]["le"], s[2]) for s in samples if s[0] == name + "_bucket"]
        bounds = [float(le) for le, _ in buckets]
        counts = [count for _, count in buckets]
        assert buckets[-1][0] == "+Inf" and bounds == sorted(bounds) and len(set(bounds)) == len(bounds), name
        assert counts == sorted(counts), f"{name}: buckets not cumulative {counts}"
        (total,) = [s[2] for s in samples if s[0] == name + "_count"]
        (seconds,) = [s[2] for s in samples if s[0] == name + "_sum"]
        assert total == counts[-1] >= 2 and seconds >= 0
    assert all(name.endswith("_total") for name, f in families.items() if f["type"] == "counter")
    rejected = {s[1]["reason"]: s[2] for s in families["specdec_requests_rejected_total"]["samples"]}
    assert rejected.get("too_large", 0) >= 1
