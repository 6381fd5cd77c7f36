"""`vllm serve` of a Qwen2.5-VL checkpoint (tests/vlm_models.py) as a real
subprocess: OpenAI chat requests with images as data URLs and as local files
give transformers' greedy answer (the same again: the encoder and prefix
caches keep it), and every bad input gets a 4xx naming the problem while the
server keeps serving: a corrupt or truncated image, bad base64, an unreachable URL, a
file outside --allowed-local-media-path, more images than
--limit-mm-per-prompt, a video (not served: limit 0). A huge image is
resized by the processor, as vLLM does, and answered."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
import vlm_models as vm
from server_helpers import SERVED_NAME, vllm_server

httpx = pytest.importorskip("httpx")

TEXT = "Describe the picture."


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def content(*urls: str, text: str = TEXT) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-serve")
    out = vm.build_qwen2_5_vl(root / "qwen2_5_vl", model_dir)
    media = root / "media"
    media.mkdir()
    vm.make_image(3, (64, 64)).save(media / "local.png")
    with vllm_server(str(out), "--limit-mm-per-prompt", json.dumps({"image": 2}),
                     "--allowed-local-media-path", str(media), log_path=root / "serve.log") as (base, _):
        with httpx.Client(base_url=base, timeout=120) as client:
            yield client, out, media


def chat(client, parts, max_tokens: int = 8):
    return client.post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
        "temperature": 0})


def transformers_greedy(model_dir, image, n: int = 8) -> str:
    inputs = vm.hf_inputs(model_dir, vm.messages(TEXT, 1), [image])
    out = vm.hf_model(str(model_dir)).generate(**inputs, max_new_tokens=n, do_sample=False)
    return vm.processor(str(model_dir)).tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_chat_with_images_answers_as_transformers(server):
    client, model_dir, media = server
    image = vm.make_image(1, (112, 84))
    want = transformers_greedy(model_dir, image)
    for _ in range(2):  # again: from the encoder and prefix caches
        reply = chat(client, content(data_url(image)))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == want
    local = chat(client, content(f"file://{media / 'local.png'}"))
    assert local.status_code == 200, local.text
    assert local.json()["choices"][0]["message"]["content"] == transformers_greedy(model_dir, vm.make_image(3, (64, 64)))
    jpeg = chat(client, content(data_url(image.convert("RGB"), "JPEG"), data_url(vm.make_image(2, (56, 56)))))
    assert jpeg.status_code == 200 and jpeg.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_vllm_serve_answers_with_images_for_every_family(family, model_dir, tmp_path):
    """Gemma 3 and Qwen3.5 checkpoints through `vllm serve` with vLLM's
    defaults (prefix caching, chunked prefill, async scheduling): a chat
    request with an image gives transformers' greedy answer, twice."""
    out = vm.BUILDERS[family](tmp_path / family, model_dir)
    image = vm.make_image(5, (96, 72))
    want = transformers_greedy(out, image)
    with vllm_server(str(out), log_path=tmp_path / "serve.log") as (base, _):
        with httpx.Client(base_url=base, timeout=120) as client:
            for _ in range(2):
                reply = chat(client, content(data_url(image)))
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("case", ["corrupt", "truncated", "bad base64", "unreachable", "outside",
                                  "too many", "video"])
def test_bad_input_is_a_4xx_naming_it(server, case, tmp_path):
    client, model_dir, media = server
    good = data_url(vm.make_image(1, (112, 84)))
    parts, words = {
        "corrupt": (content("data:image/png;base64," + base64.b64encode(b"not an image").decode()), "image"),
        "truncated": (content("data:image/png;base64," + base64.b64encode(
            base64.b64decode(good.split(",", 1)[1])[:600]).decode()), "image"),
        "bad base64": (content(good[:len(good) // 2 + 1] + "*"), "base64"),
        "unreachable": (content("http://vllm-metal.invalid/cat.png"), "vllm-metal.invalid"),
        "outside": (content("file:///etc/hostname"), "allowed-local-media-path"),
        "too many": (content(good, good, good), "At most 2 image"),
        "video": ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                   {"type": "text", "text": TEXT}], "video"),
    }[case]
    start = time.monotonic()
    reply = chat(client, parts)
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)
    assert words.lower() in reply.text.lower()
    assert time.monotonic() - start < 30
    ok = chat(client, content(good), max_tokens=2)  # nothing already accepted is lost; the server goes on
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_huge_image_is_resized_and_answered(server):
    from PIL import Image

    client, _, _ = server
    huge = Image.new("RGB", (12000, 9000), (40, 90, 160))
    reply = chat(client, content(data_url(huge)), max_tokens=2)
    assert reply.status_code == 200, reply.text
    # the processor's max_pixels bound it: 16 image tokens (4x4 merged patches), not millions
    assert reply.json()["usage"]["prompt_tokens"] < 64
