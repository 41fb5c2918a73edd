"""specdec serve's OpenAI sampling surface (issue 28) with the official openai client, on the bundled pair:
json_schema responses parse and validate (nested objects, enums, arrays, numbers), in chat and completions;
seeded requests with penalties, logit_bias or a grammar return the same tokens alone and among 15 other
concurrent requests; greedy logprobs equal plain decoding's; the logprobs objects of both endpoints."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec_ext import plain_generate
from specdec_ext.models import load_models
from serve_utils import CHAT_TEMPLATE, MODEL_NAME, ServerThread, make_app, openai_client

PROMPTS = ["def fibonacci(n):", "import numpy as np\nx = np.", "class Stack:\n    def", "for i in range(10):"]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "id": {"type": "integer"}},
                 "required": ["name", "id"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "enum-and-array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                  "maxItems": 4}},
        "required": ["color", "sizes"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1000, "maximum": 1000},
                                                 "y": {"type": "number", "minimum": -1000, "maximum": 1000},
                                                 "label": {"type": "string", "maxLength": 8}},
                "required": ["x", "y", "label"], "additionalProperties": False},
}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def server():
    models = load_models()
    models.tokenizer.chat_template = CHAT_TEMPLATE
    app, engine = make_app(models.target, models.draft, models.tokenizer, max_rows=16, k=4, max_seq_len=256)
    server = ServerThread(app, engine, grace_s=5.0).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _valid(value, schema) -> bool:
    """A tiny validator for the schema subset above."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        return (isinstance(value, dict) and set(value) == set(schema["properties"])
                and all(_valid(value[k], s) for k, s in schema["properties"].items()))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10 ** 9)
                and all(_valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 10 ** 9)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(kind)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_chat_responses_parse_and_validate(client, name, temperature):
    schema = SCHEMAS[name]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=120,
        temperature=temperature, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    assert _valid(json.loads(choice.message.content), schema), choice.message.content


def test_json_object_completions(client):
    # (free-form JSON from a 26M code model ends only on some prompts; a schema bounds it, the tests above)
    response = client.completions.create(model=MODEL_NAME, prompt="config = ", max_tokens=80, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(response.choices[0].text), dict)


def _seeded(client, prompt: str, fields: dict) -> str:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=32, temperature=0.9, seed=11,
                                     extra_body={"ignore_eos": True, **fields}).choices[0].text


@pytest.mark.parametrize("fields", [
    dict(presence_penalty=0.8, frequency_penalty=0.5), dict(repetition_penalty=1.3, min_p=0.05),
    dict(logit_bias={"11": 4.0, "25": -100}), dict(regex=r"[a-z_]+\(([a-z]+, )*[a-z]+\)")],
    ids=["openai-penalties", "repetition-min_p", "logit_bias", "regex"])
def test_a_seeded_request_returns_the_same_tokens_alone_and_among_15_others(client, fields):
    alone = _seeded(client, PROMPTS[0], fields)
    others = [dict(presence_penalty=0.3), {}, dict(logit_bias={"5": 2}), dict(min_p=0.1)]
    with ThreadPoolExecutor(16) as pool:
        crowd = [pool.submit(_seeded, client, PROMPTS[(i % 3) + 1], others[i % 4]) for i in range(15)]
        again = pool.submit(_seeded, client, PROMPTS[0], fields)
        [f.result() for f in crowd]
    assert again.result() == alone


def test_greedy_logprobs_equal_plain_decoding(client):
    expected = plain_generate([PROMPTS[2]], max_new_tokens=12, eos_token_id=False, logprobs=3)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                         logprobs=3, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == [e.logprob for e in expected.logprobs[0]]
    assert len(logprobs.tokens) == 12 and all(len(top) == 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob == item.top_logprobs[0].logprob for item in content)  # greedy: the top one
    assert "".join(item.token for item in content) == chat.choices[0].message.content


def test_logprobs_of_tokens_that_hold_part_of_a_character_give_their_bytes(client):
    """A byte-level token may hold part of a multi-byte character: its logprobs entry shows it as OpenAI does,
    "bytes:\\x..", chat's "bytes" are the token's own, and text_offset counts the characters before each
    token (a token inside a character adds none until the one that completes it)."""
    regex = "é🎉日本 [a-z]+"
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                         logprobs=1, extra_body={"regex": regex})
    text, lp = response.choices[0].text, response.choices[0].logprobs
    assert text.startswith("é🎉日本 ")
    assert any(t.startswith("bytes:\\x") for t in lp.tokens) and "\ufffd" not in "".join(lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset) and all(0 <= o < len(text) for o in lp.text_offset)
    ascii_tail = [i for i, t in enumerate(lp.tokens) if t and t.isascii() and not t.startswith("bytes:")]
    for i in ascii_tail:  # a whole token's characters sit where its offset says
        assert text[lp.text_offset[i]: lp.text_offset[i] + len(lp.tokens[i])] == lp.tokens[i]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=20, temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"regex": regex})
    content = chat.choices[0].logprobs.content
    assert bytes(b for item in content for b in item.bytes).decode("utf-8") == chat.choices[0].message.content


@pytest.mark.parametrize("fields", [{"min_p": 0.3}, {"regex": "[0-9]{3}"}])
def test_logprobs_of_masked_alternatives_are_json(client, server, fields):
    """min_p and a grammar mask tokens to -inf; with fewer allowed tokens than top_logprobs those came back as
    -Infinity: a 500 in plain text, and stream chunks that were not JSON. They are now LOGPROB_FLOOR, as vLLM's."""
    import httpx

    from specdec_ext.serve.protocol import LOGPROB_FLOOR
    body = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 3, "temperature": 0.8, "seed": 3, "logprobs": 20,
            **fields}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    values = [lp for top in logprobs["top_logprobs"] for lp in top.values()] + logprobs["token_logprobs"]
    assert LOGPROB_FLOOR in values and min(values) == LOGPROB_FLOOR  # some alternatives were masked
    assert all(lp > LOGPROB_FLOOR for lp in logprobs["token_logprobs"])  # (the sampled ones never are)
    def strict(constant):  # JSON has no -Infinity, NaN (Python's json reads them unless told)
        raise AssertionError(f"{constant} in a streamed chunk")

    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        chunks = [json.loads(line[6:], parse_constant=strict) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and all("error" not in chunk for chunk in chunks)
    streamed = [lp for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for top in c["choices"][0]["logprobs"]["top_logprobs"] for lp in top.values()]
    assert min(streamed) == LOGPROB_FLOOR


def test_every_chunk_has_a_usage_field_with_include_usage(server):
    """OpenAI: with stream_options.include_usage every chunk but the last has "usage": null (it was absent)."""
    import httpx
    body = {"model": MODEL_NAME, "prompt": "def f(", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert all("usage" in chunk for chunk in chunks)
    assert [chunk["usage"] is None for chunk in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream_options": None}, timeout=60) as s:
        assert all("usage" not in json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {"))


def test_streamed_logprobs_cover_every_token(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x = 1"}],
                                            max_tokens=10, temperature=0, logprobs=True, stream=True,
                                            extra_body={"ignore_eos": True})
    items = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
             for item in chunk.choices[0].logprobs.content]
    assert len(items) == 10


def test_n_choices_are_one_row_each_with_their_own_streams(client, server):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    one = client.completions.create(**kw)
    three = client.completions.create(n=3, logprobs=1, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    assert len({c.text for c in three.choices}) == 3  # the others draw their own streams
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * 16
    assert all(len(c.logprobs.token_logprobs) == 16 for c in three.choices)
    streamed = client.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in three.choices]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=3, response_format={"type": "json_object"})
    assert [c.index for c in chat.choices] == [0, 1]


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(client, server):
    """The prompt tokens' logprobs (the first null) equal the target's log-softmax over the prompt, the
    completion's equal those of the request without echo, and the stream carries the same objects."""
    import torch

    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == PROMPTS[1] + plain.text
    models = load_models()
    ids = models.tokenizer.encode(PROMPTS[1])
    P = len(ids)
    with torch.no_grad():
        reference = torch.log_softmax(models.target(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # [P, V]
    lp = echoed.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == P + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, P)]
    assert lp.token_logprobs[1:P] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) >= chosen - 1e-6
               for top, chosen in zip(lp.top_logprobs[1:P], lp.token_logprobs[1:P]))
    assert lp.token_logprobs[P:] == plain.logprobs.token_logprobs  # the completion's, unchanged by echo
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[P] == sum(len(t) for t in lp.tokens[:P])
    streamed = {"text": "", "tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(echo=True, stream=True, **kw):
        c = chunk.choices[0]
        streamed["text"] += c.text
        if c.logprobs is not None:
            streamed["tokens"] += c.logprobs.tokens
            streamed["token_logprobs"] += c.logprobs.token_logprobs
    assert streamed == {"text": echoed.text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs}


def test_max_tokens_zero_scores_the_prompt_and_draws_nothing(client):
    """max_tokens=0 with echo and logprobs (how a client scores a text): the prompt's text and logprobs, no
    completion token, finish_reason "length", the same objects streamed; n choices each get them."""
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], temperature=0, logprobs=2, echo=True)
    scored = client.completions.create(max_tokens=0, **kw)
    with_one = client.completions.create(max_tokens=1, **kw).choices[0]
    choice = scored.choices[0]
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    P = scored.usage.prompt_tokens
    assert scored.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == P
    assert choice.logprobs.token_logprobs == with_one.logprobs.token_logprobs[:P]
    streamed = list(client.completions.create(max_tokens=0, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPTS[1]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    two = client.completions.create(max_tokens=0, n=2, **kw)
    assert [c.text for c in two.choices] == [PROMPTS[1]] * 2 and two.usage.completion_tokens == 0
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=0).choices[0]
    assert plain.text == "" and plain.finish_reason == "length"


def test_echo_prepends_the_prompt(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == PROMPTS[0] + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw))
    assert streamed == echoed
