"""specdec serve over HTTP with the official openai client: completions and chat, streaming and not, equal to
generate(); a seeded request alone and among 15 concurrent others; 16 concurrent clients with mixed
parameters; models, health and metrics; every bad request named."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from specdec_ext import generate
from serve_utils import MODEL_NAME, make_app, metrics, openai_client, serve_app, tiny_pair, wait_until
from test_generate_utils import char_tokenizer

K = 3
PROMPTS = ["def fib(n):\n    return", "import os\nimport sys\n", "x = [1, 2, 3]\nprint(x", "class a:\n  def"]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def server(pair):
    yield from serve_app(pair, max_rows=16, k=K, max_seq_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _generate(pair, prompt: str, *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
              seed=None, stop=None, ignore_eos: bool = False) -> str:
    """generate()'s text for one request alone, with the server's k and runner."""
    target, draft, tokenizer = pair
    return generate([prompt], target, draft, k=K, tokenizer=tokenizer, max_new_tokens=max_tokens,
                    temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                    eos_token_id=False if ignore_eos else None).text[0]


def _chat_prompt(pair, messages) -> str:
    return pair[2].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_a_greedy_completion_equals_generate_streamed_or_not(pair, client, prompt):
    expected = _generate(pair, prompt, max_tokens=30, temperature=0.0, ignore_eos=True)
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.object == "text_completion" and whole.model == MODEL_NAME
    assert whole.usage.completion_tokens == 30 and whole.usage.prompt_tokens == len(pair[2](prompt)["input_ids"])
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) > 2


def test_eos_and_stop_strings_end_the_text_where_generate_ends_it(pair, client):
    prompt = PROMPTS[2]
    full = _generate(pair, prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    stop = full[5:7]  # a string the greedy text is known to contain
    expected = _generate(pair, prompt, max_tokens=40, temperature=0.0, stop=[stop], ignore_eos=True)
    assert stop not in expected and full.startswith(expected)
    for stream in (False, True):
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0,
                                             stop=stop, stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(response)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = response.choices[0].text, response.choices[0].finish_reason
        assert (text, reason) == (expected, "stop")
    with_eos = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert with_eos.choices[0].text == _generate(pair, PROMPTS[0], max_tokens=40, temperature=0.0)


# ------------------------------------------------------------------------------------------ chat
def test_chat_uses_the_template_and_equals_generate(pair, client):
    messages = [{"role": "system", "content": "be short"}, {"role": "user", "content": "print a list"}]
    expected = _generate(pair, _chat_prompt(pair, messages), max_tokens=25, temperature=0.8, seed=11,
                         ignore_eos=True)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=25, temperature=0.8,
                                           seed=11, extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 25
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=25,
                                                 temperature=0.8, seed=11, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25


def test_chat_without_a_template_is_a_400_that_says_so(pair):
    app, _ = make_app(pair[0], pair[1], char_tokenizer(), max_rows=1, k=K, max_seq_len=64)
    response = TestClient(app).post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})  # (the engine never starts)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
    assert error["param"] == "messages" and error["code"] == "no_chat_template"


def test_an_unexpected_failure_is_a_500_in_openai_form(pair, monkeypatch):
    """A bug of the server's (here an exception planted in the completion route) answers OpenAI's error body
    with type server_error, not starlette's plain-text 500, which an OpenAI client cannot parse."""
    app, _ = make_app(pair[0], pair[1], char_tokenizer(), max_rows=1, k=K, max_seq_len=64)

    async def broken(self, body, http):
        raise RuntimeError("planted")

    monkeypatch.setattr(type(app.state.service), "completion", broken)
    response = TestClient(app, raise_server_exceptions=False).post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "ab", "max_tokens": 2})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError: planted" in error["message"]


# ------------------------------------------------------------------------------------------ concurrency
def _mixed_requests(count: int, seed: int):
    """Requests with their own prompts, kinds, filters, seeds, stops, lengths and streaming."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        requests.append(dict(prompt=rng.choice(PROMPTS), chat=i % 4 == 3, stream=i % 2 == 1,
                             max_tokens=rng.randint(4, 40), temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
                             top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([0, 5, 20]), seed=rng.randrange(10_000),
                             stop=rng.choice([None, None, ["):"], ["\n"]]), ignore_eos=rng.random() < 0.5))
    return requests


def _send(client, r) -> str:
    """One request through the openai client; its text."""
    common = dict(model=MODEL_NAME, max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                  seed=r["seed"], stop=r["stop"], stream=r["stream"],
                  extra_body={"top_k": r["top_k"], "ignore_eos": r["ignore_eos"]})
    if r["chat"]:
        response = client.chat.completions.create(messages=[{"role": "user", "content": r["prompt"]}], **common)
        if r["stream"]:
            return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        return response.choices[0].message.content
    response = client.completions.create(prompt=r["prompt"], **common)
    if r["stream"]:
        return "".join(c.choices[0].text for c in response)
    return response.choices[0].text


def _expected(pair, r) -> str:
    prompt = _chat_prompt(pair, [{"role": "user", "content": r["prompt"]}]) if r["chat"] else r["prompt"]
    return _generate(pair, prompt, max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                     top_k=r["top_k"], seed=r["seed"], stop=r["stop"], ignore_eos=r["ignore_eos"])


def test_16_concurrent_clients_with_mixed_parameters_each_get_generates_text(pair, server, client):
    requests = _mixed_requests(16, seed=5)
    with ThreadPoolExecutor(len(requests)) as pool:
        texts = list(pool.map(lambda r: _send(client, r), requests))
    assert texts == [_expected(pair, r) for r in requests]
    assert wait_until(server.engine.idle)
    assert server.engine.batcher.budget.used == 0


def test_a_seeded_request_returns_the_same_text_alone_and_among_15_concurrent_others(pair, server, client):
    probe = dict(prompt=PROMPTS[0], chat=False, stream=True, max_tokens=40, temperature=1.0, top_p=0.9, top_k=0,
                 seed=1234, stop=None, ignore_eos=True)
    alone = _send(client, probe)
    requests = _mixed_requests(15, seed=9)
    requests.insert(7, probe)
    with ThreadPoolExecutor(len(requests)) as pool:
        texts = list(pool.map(lambda r: _send(client, r), requests))
    assert texts[7] == alone == _expected(pair, probe)
    assert len(alone) >= 30  # 40 tokens; a few may be ids without text (the vocabulary's padding)


# ------------------------------------------------------------------------------------------ other routes
def test_a_request_may_fill_the_advertised_context(server, client):
    """/v1/models' max_model_len is what prompt + max_tokens may reach: a row's positions less the two steps of
    drafts it may write past them (it advertised the row's positions, and a request that asked for exactly
    that got a 400)."""
    listed = httpx.get(server.url + "/v1/models").json()["data"][0]
    context = listed["max_model_len"]
    assert context == 256 - 2 * (K + 1)
    prompt = "def f(x):"
    prompt_tokens = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1).usage.prompt_tokens
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=context - prompt_tokens,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == context - prompt_tokens and full.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=context - prompt_tokens + 1)
    assert refused.value.body["param"] == "max_tokens" and f"context of {context}" in refused.value.body["message"]
    # a chat request without max_tokens gets the rest of the context (OpenAI's default)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == context


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = metrics(server)
    client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server)
    grew = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)
    assert grew("specdec_requests_total", (("finish_reason", "length"),)) == 1
    assert grew("specdec_generated_tokens_total") == 12
    assert grew("specdec_target_passes_total") >= 1
    assert 1.0 <= after[("specdec_tokens_per_target_pass", ())] <= K + 1
    for position in ("1", "2", "3"):
        assert 0.0 <= after[("specdec_draft_acceptance_rate", (("position", position),))] <= 1.0
    assert after[("specdec_queue_length", ())] == 0 and after[("specdec_running_rows", ())] == 0
    assert after[("specdec_cuda_graphs_captured", ())] == 0  # the CPU: eager steps
    assert after[("specdec_cache_budget_in_use", (("unit", "rows"),))] == 0
    assert grew("specdec_time_per_output_token_seconds_count") == 1
    assert after[("specdec_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] >= 1


# ------------------------------------------------------------------------------------------ bad requests
BAD_COMPLETIONS = [
    ("malformed JSON", b'{"model": "tiny-pair", "prompt": ', 400, None, "not valid JSON"),
    ("not JSON at all", b"model=tiny-pair", 400, None, "Content-Type: application/json"),
    ("negative temperature", {"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("temperature of the wrong type", {"temperature": "hot"}, 400, "temperature", "valid number"),
    ("a temperature float32 cannot hold", {"temperature": 1e39}, 400, "temperature", "at most 3.403e+38"),
    ("top_p zero", {"top_p": 0}, 400, "top_p", "greater than 0"),
    ("top_p above one", {"top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("top_k below -1", {"top_k": -2}, 400, "top_k", "greater than or equal to -1"),
    ("max_tokens negative", {"max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed when stream is true"),
    ("include_usage of the wrong type", {"stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options", "valid boolean"),
    ("a stop string with a lone surrogate", {"stop": ["x", "\udfff"]}, 400, "stop", "not valid text"),
    ("max_tokens fractional", {"max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("negative seed", {"seed": -1}, 400, "seed", "greater than or equal to 0"),
    ("n above the rows", {"n": 17}, 400, "n", "n = 17 choices need 17 rows but this server runs 16"),
    ("n of zero", {"n": 0}, 400, "n", "greater than or equal to 1"),
    ("two prompts", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("empty prompt", {"prompt": ""}, 400, "prompt", "empty"),
    ("a prompt with a lone surrogate", {"prompt": "x\ud800y"}, 400, "prompt", "not valid text: character 1"),
    ("no prompt", {"prompt": None}, 400, "prompt", ""),
    ("token ids out of range", {"prompt": [1, 2, 999]}, 400, "prompt", "outside [0, 64)"),
    ("empty stop string", {"stop": ["x", ""]}, 400, "stop", "must not be empty"),
    ("logprobs above 20", {"logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("best_of", {"best_of": 3}, 400, "best_of", "not supported"),
    ("a penalty above 2", {"presence_penalty": 2.5}, 400, "presence_penalty", "less than or equal to 2"),
    ("a frequency penalty below -2", {"frequency_penalty": -3}, 400, "frequency_penalty", "greater than or equal to -2"),
    ("a logit_bias key that is no token id", {"logit_bias": {"x": 1}}, 400, "logit_bias", "not an integer token id"),
    ("a logit_bias key with a space", {"logit_bias": {" 11": 1}}, 400, "logit_bias", "not an integer token id"),
    ("a logit_bias key in Arabic-Indic digits", {"logit_bias": {"\u0661\u0661": 1}}, 400, "logit_bias",
     "not an integer token id"),
    ("a logit_bias key outside the vocabulary", {"logit_bias": {"64": 1}}, 400, "logit_bias", "[0, 64)"),
    ("a logit_bias value above 100", {"logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("min_p above one", {"min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
    ("a repetition penalty of zero", {"repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ("a repetition penalty above float32", {"repetition_penalty": 1e308}, 400, "repetition_penalty", "[1e-30, 1e+30]"),
    ("a repetition penalty below float32", {"repetition_penalty": 1e-308}, 400, "repetition_penalty",
     "[1e-30, 1e+30]"),
    ("a regex that does not compile", {"regex": "(ab"}, 400, "regex", "regex"),
    ("a grammar that does not compile", {"grammar": "start: ??"}, 400, "grammar", "grammar"),
    ("a regex and a json response format", {"regex": "a+", "response_format": {"type": "json_object"}}, 400,
     "regex", "not both"),
    ("another model", {"model": "gpt-4"}, 404, "model", "does not exist"),
    ("too long for the cache", {"max_tokens": 1000}, 400, "max_tokens",
     "1003 tokens, past this server's context of 248"),
    ("a prompt that fills the context alone", {"prompt": list(range(1, 60)) * 5}, 400, "prompt",
     "the prompt has 295 tokens, which leaves no room to generate in this server's context of 248"),
    ("a text prompt too long to tokenize", {"prompt": "x" * 200_000}, 400, "prompt",
     "the prompt has at least"),
    ("max_tokens as a string", {"max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ("temperature as a string", {"temperature": "0"}, 400, "temperature", "valid number"),
    ("stream as a string", {"stream": "yes"}, 400, "stream", "valid boolean"),
    ("five stop sequences", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop sequences, got 5"),
]


def test_a_prompt_past_the_context_is_refused_with_openai_s_code_and_the_numbers(server, client):
    """code context_length_exceeded; the prompt alone names the prompt (or messages), with max_tokens names
    max_tokens; "1 token", not "1 tokens"; and a text that cannot fit is refused by its length, untokenized: a
    megabyte answers as fast as a short request (tokenizing 5 MB held every client for 3 s)."""
    context = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=[5], max_tokens=context)
    body = refused.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    assert f"the prompt has 1 token and max_tokens={context}: {context + 1} tokens" in body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "ab" * context}])
    body = refused.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages", body
    for text in ("x" * (1 << 20), "\u00e9" * (1 << 19)):
        response = _post_json(server.url + "/v1/completions", {"model": MODEL_NAME, "prompt": text})
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert "the prompt has at least" in error["message"] and error["param"] == "prompt"


def test_every_get_route_answers_head_a_405_names_the_methods_and_the_model_has_its_own_route(server, client):
    for path in ("/health", "/v1/models", "/metrics", f"/v1/models/{MODEL_NAME}"):
        head = httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b"", path
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and "error" in wrong.json()
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.model_extra["max_model_len"] == 256 - 2 * (K + 1)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"


def _post_json(url: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON text with its non-ASCII escaped, as JSON allows: a lone surrogate is then sent as
    \\ud800 (httpx's json= writes UTF-8, which cannot encode one)."""
    return httpx.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_a_bad_completion_request_is_refused_naming_the_field(server, case):
    _, change, status, param, words = case
    if isinstance(change, bytes):
        kind = "application/json" if change.startswith(b"{") else "application/x-www-form-urlencoded"
        response = httpx.post(server.url + "/v1/completions", content=change, headers={"Content-Type": kind})
    else:
        body = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 4}
        body.update(change)
        body = {k: v for k, v in body.items() if v is not None}
        response = _post_json(server.url + "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


BAD_CHATS = [
    ("no messages", {"messages": []}, "messages", "at least 1"),
    ("an unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", "robot"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ("an unknown response format", {"response_format": {"type": "xml"}}, "response_format", "unknown type"),
    ("a json schema without a schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ("n of minus one", {"n": -1}, "n", "greater than or equal to 1"),
    ("a message with a lone surrogate", {"messages": [{"role": "user", "content": "x\ud800y"}]}, "messages",
     "not valid text"),
]


@pytest.mark.parametrize("case", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_a_bad_chat_request_is_refused_naming_the_field(server, case):
    _, change, param, words = case
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(change)
    response = _post_json(server.url + "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_top_k_beyond_int32_and_a_top_p_below_float32_are_taken_for_their_meaning(client):
    """Neither fits the row's int32 / float32 (they failed the whole step with a 500): a top_k past any
    vocabulary is no top-k filter, a tiny positive top_p keeps the top token."""
    def text(**fields):
        return client.completions.create(model=MODEL_NAME, prompt="def f(x):", max_tokens=12, seed=5,
                                         extra_body=dict(fields, ignore_eos=True)).choices[0].text

    assert text(temperature=1.0, top_k=2 ** 40) == text(temperature=1.0, top_k=0)
    assert text(temperature=1.0, top_p=1e-300) == text(temperature=0.0)


def test_the_openai_client_surfaces_errors_and_unknown_fields_are_ignored(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="abc", temperature=-0.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="abc")
    ok = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=3, user="someone",
                                   extra_body={"some_future_field": 1, "ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_token_id_prompts_and_a_random_seed(server, client):
    first = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=20, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=20, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens == 3 and first.usage.completion_tokens == 20
    assert first.choices[0].text != second.choices[0].text  # no seed: each request draws its own
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 2,
                                                          "stream": True, "ignore_eos": True})
    lines = [line for line in raw.text.split("\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
