"""`vllm serve` as a real subprocess on this plugin, driven with the openai client."""

from __future__ import annotations

import json

import pytest
from server_helpers import SERVED_NAME, vllm_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "vllm_serve.log"
    with vllm_server(model_dir, log_path=log) as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", timeout=120)


def test_engine_process_runs_on_tcmalloc(server):
    """On Linux (MLX's CPU device) the plugin preloads tcmalloc into the
    engine's process (native/allocator.py); the API server keeps its own."""
    import subprocess
    import sys

    from vllm_metal.native.allocator import find_tcmalloc

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    assert find_tcmalloc() is not None, "scripts/setup.sh installs libtcmalloc-minimal4"
    proc = server[1]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    engines = [c for c in children if open(f"/proc/{c}/cmdline").read().startswith("VLLM::EngineCore")]
    assert len(engines) == 1, children
    assert "libtcmalloc" in open(f"/proc/{engines[0]}/maps").read()
    assert "libtcmalloc" not in open(f"/proc/{proc.pid}/maps").read()


def ask(client, question, **kwargs):
    return client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": question}], **kwargs)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_embeddings_refused_by_a_generation_model(client):
    """A pooling request to a generation server: vLLM registers only the
    served tasks' routes, so a 404 -- and the server keeps generating."""
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=SERVED_NAME, input="hello")
    assert ask(client, "Hi", temperature=0, max_tokens=2).usage.completion_tokens > 0


def test_an_image_to_a_text_model_is_refused(client):
    """A chat message with an image part to a text-only model: 400 from
    vLLM's input processing, and the server keeps answering."""
    png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
           "RU5ErkJggg==")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "What is this?"}]}])
    assert ask(client, "Hi", temperature=0, max_tokens=2).usage.completion_tokens > 0


def test_chat_answers_paris(client):
    reply = ask(client, "What is the capital of France?", temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(temperature=0, max_tokens=24)
    whole = ask(client, "Name a large animal.", **kwargs).choices[0].message.content
    stream = ask(client, "Name a large animal.", stream=True, **kwargs)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 3 and "".join(pieces) == whole


def test_completions(client):
    out = client.completions.create(model=SERVED_NAME, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    assert out.choices[0].text.startswith(" 5, 6, 7")
    stream = client.completions.create(model=SERVED_NAME, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=SERVED_NAME, prompt="Once upon a time", temperature=1.0,
                                         top_p=0.95, max_tokens=24, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({sample(s) for s in (1, 2, 3)} | {first}) > 1, "different seeds should differ"


def test_logprobs(client):
    out = client.completions.create(model=SERVED_NAME, prompt="The quick brown fox", temperature=0,
                                    max_tokens=4, logprobs=3, echo=False)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) >= 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_structured_output_choice(client):
    reply = ask(client, "Is the sky blue? Answer yes or no.", temperature=0.8, max_tokens=8, seed=7,
                extra_body={"structured_outputs": {"choice": ["affirmative", "negative"]}})
    assert reply.choices[0].message.content in ("affirmative", "negative")


def test_structured_output_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = ask(client, "Give a city and its population as JSON.", temperature=0, max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    data = json.loads(reply.choices[0].message.content)
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)
