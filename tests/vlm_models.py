"""Tiny random-weight vision-language checkpoints built offline with
transformers' own classes (`save_pretrained`), a processor saved beside
each (`AutoProcessor.from_pretrained(dir)` works with HF_HUB_OFFLINE=1), and
the float32 transformers forward as the tests' independent reference.

Three architectures, each as its real checkpoints are laid out:

- `build_qwen2_5_vl`: Qwen2_5_VLForConditionalGeneration (model_type
  qwen2_5_vl). Vision: patch 14, temporal patch 2, merge 2, depth 2 with
  window attention (window_size 56 px = 2x2 merged units, so a 112 px image
  has 4 windows) in block 0 and full attention in block 1
  (fullatt_block_indexes [1]). Text: M-RoPE, mrope_section [2, 3, 3]
  (head_dim 16). Images are resized to 56..112 px sides (min_pixels 56*56,
  max_pixels 112*112): one image gives (h/28)*(w/28) `<|image_pad|>` tokens,
  4 for 56x56, 16 for 112x112, 12 for 112 wide x 84 high.
- `build_gemma3`: Gemma3ForConditionalGeneration (model_type gemma3, SigLIP
  vision tower). Every image is resized to 56x56, 4x4 patches of 14, pooled
  2x2 into mm_tokens_per_image = 4 `<image_soft_token>`s; the prompt's
  `<start_of_image>` becomes "\\n\\n<start_of_image>" + 4 x
  `<image_soft_token>` + "<end_of_image>\\n\\n". Text: layers [sliding 16,
  full], query_pre_attn_scalar 16, tied embeddings.
- `build_qwen3_5_vl`: Qwen3_5ForConditionalGeneration (model_type qwen3_5).
  Vision: patch 16, merge 2, depth 2, learned 8x8 position grid
  (num_position_embeddings 64, interpolated to other grids). Text: layers
  [linear_attention (gated delta net), full_attention], partial rotary 0.5
  (8 of 16 dims), interleaved M-RoPE, mrope_section [2, 1, 1]. Images are
  resized to 64..128 px sides (min_pixels 64*64, max_pixels 128*128): one
  image gives (h/32)*(w/32) tokens, 4 for 64x64, 16 for 128x128.

All text models: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16;
vision towers hidden 64, 4 heads, depth 2; float32. The tokenizer is the
embedded SmolLM2 one (`ensure_default_model`) with the architecture's
special tokens appended as added special tokens (ids from 49152 up, see
`*_TOKENS`) and a chat template that renders OpenAI-style messages with
image parts into the model's own placeholder text (as the real checkpoints'
templates do). vocab_size is exactly the tokenizer's length.

Weights are drawn as tests/families.py draws them: matrices at std
1/sqrt(fan_in) (unit-variance activations), 1-D parameters (norms, biases,
A_log, dt_bias) their init + 0.05 * N(0, 1); logits peaked (greedy choices
well defined, top-1 log-probabilities around -1.5 against -10.8 uniform):
Qwen2.5-VL (untied) with embeddings and lm_head 4x, the tied Gemma 3 and
Qwen3.5 with small embeddings (else the residual stream is mostly the input
token's embedding and the tied head repeats it) and a final-norm gain of 8
and 4.

vLLM 0.33 notes (checked against these checkpoints): vLLM's own processor
(`MULTIMODAL_REGISTRY.create_processor(model_config)`) gives exactly the
transformers processor's input_ids for all three. For Qwen2.5-VL and
Qwen3.5, ModelConfig's mm_device_do_normalize defaults to True and the
processor then returns raw uint8 pixel_values (rescale and normalize left to
the model); mm_device_do_normalize=False gives transformers' float32 values.
Gemma 3 placeholder ranges span "\\n\\n<start_of_image>...<end_of_image>\\n\\n"
(is_embed marks the 4 image tokens); two adjacent images share one merged
newline token. The Qwen3.5 tokenizer loads as Qwen3_5Tokenizer
(transformers' choice for model_type qwen3_5): SmolLM2's vocabulary with
Qwen3.5's pre-tokenizer regex.

Functions: `build_qwen2_5_vl`, `build_gemma3`, `build_qwen3_5_vl` (out,
tokenizer_dir, seed) -> out; `BUILDERS` (model_type -> builder);
`make_image(seed, size)`; `messages(text, n_images)`; `prompt_text`;
`hf_inputs(model_dir, prompt_or_messages, images)`;
`reference_logprobs(model_dir, inputs)`; `image_token_id`;
`placeholder_count(model_dir, input_ids)`. Processors and models are cached
per directory: build each checkpoint into a directory of its own.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

# ---- tokens -----------------------------------------------------------------

BASE_VOCAB = 49152  # the embedded SmolLM2 tokenizer; added tokens follow in this order
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>",
                 "<bos>", "<eos>", "<pad>")
# Runs of 1-4 newlines as single (non-special) tokens, as Gemma's vocabulary has them: vLLM's Gemma 3
# processor looks "\n" .. "\n\n\n\n" up in the vocabulary and merges the "\n\n" around an image with
# its neighbours as the tokenizer would.
GEMMA3_NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")

# SmolLM2 ids kept by the Qwen tokenizers: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2
ENDOFTEXT, IM_START, IM_END = 0, 1, 2

# Qwen2-VL / Qwen2.5-VL's chat template (Qwen3.5's renders images the same way).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma 3's chat template (google/gemma-3-*-it), one <start_of_image> per image part.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' or item['type'] == 'image_url' -%}\n"
    "                {{ '<start_of_image>' }}\n            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n            {%- endif -%}\n        {%- endfor -%}\n"
    "    {%- else -%}\n        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)


def _tokenizer(tokenizer_dir, added: tuple[str, ...], chat_template: str, plain: tuple[str, ...] = (), **special):
    """The embedded tokenizer with `added` appended as special tokens and
    `plain` as ordinary added tokens after them (`special`: pad_token=...,
    extra_special_tokens={...} for AutoTokenizer.from_pretrained)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), **special)
    extra = set(special.get("extra_special_tokens", {}).values())
    missing = [t for t in added if t not in extra]
    if missing:
        tok.add_tokens(missing, special_tokens=True)
    if plain:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])
    ids = tok.convert_tokens_to_ids(list(added + plain))
    if ids != list(range(BASE_VOCAB, BASE_VOCAB + len(added) + len(plain))) or len(tok) != ids[-1] + 1:
        raise AssertionError(f"added tokens got ids {ids}")
    tok.chat_template = chat_template
    return tok


def _write_generation_config(out: Path, bos: int, eos: list[int], pad: int) -> None:
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}, indent=1) + "\n")


# ---- weights ----------------------------------------------------------------

def _scale(model: torch.nn.Module, seed: int, embed: float = 4.0, head: float = 4.0, norm_gain: float = 1.0) -> None:
    """Matrices at std 1/sqrt(fan_in) (token embeddings `embed` x, lm_head
    `head` x); the text model's final norm a gain of `norm_gain`; other 1-D
    parameters (norms, biases, A_log, dt_bias) their init + 0.05 * N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                if name.endswith("mm_input_projection_weight"):  # Gemma 3: [vision hidden, text hidden], x @ W
                    fan_in = p.shape[0]
                else:  # Linear [out, in], Conv [out, in, *kernel], Embedding [n, dim]
                    fan_in = math.prod(p.shape[1:])
                wide = embed if "embed_tokens" in name else head if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * (wide / math.sqrt(fan_in)))
            elif name.endswith("language_model.norm.weight"):
                offset = 1.0 if bool((p == 0).all()) else 0.0  # zero init: Gemma / Qwen3.5 scale by (1 + weight)
                p.copy_(norm_gain - offset + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _save(model, out: Path, seed: int, **scale) -> None:
    _scale(model, seed, **scale)
    model.eval().save_pretrained(str(out))


# ---- builders ---------------------------------------------------------------

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6)


def _qwen_config(config_class, architecture: str, text: dict, vision: dict, ids: dict, tie: bool):
    """A Qwen-VL config with the vision token ids of the tokenizer (`ids`)."""
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie, dtype="float32")
    config.architectures = [architecture]
    return config


def build_qwen2_5_vl(out: Path, tokenizer_dir, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL checkpoint (+ Qwen2_5_VLProcessor) in `out`.

    Tokens: <|vision_start|> 49152, <|vision_end|> 49153, <|image_pad|>
    49154 (image_token_id), <|video_pad|> 49155; bos <|endoftext|> 0, eos
    <|im_end|> 2, pad 0; vocab_size 49156."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(tokenizer_dir, QWEN_TOKENS, QWEN_VL_CHAT_TEMPLATE, pad_token="<|endoftext|>")
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(list(QWEN_TOKENS))))
    text = dict(TEXT, vocab_size=len(tok), bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=ENDOFTEXT,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, hidden_act="silu", patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  out_hidden_size=64, tokens_per_second=2)
    config = _qwen_config(transformers.Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration", text, vision, ids,
                          tie=False)
    torch.manual_seed(seed)
    _save(transformers.Qwen2_5_VLForConditionalGeneration(config), out, seed)
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    image_processor = transformers.Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    video_processor = transformers.Qwen2VLVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    transformers.Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                     chat_template=QWEN_VL_CHAT_TEMPLATE).save_pretrained(str(out))
    _write_generation_config(out, ENDOFTEXT, [IM_END, ENDOFTEXT], ENDOFTEXT)
    return out


def build_gemma3(out: Path, tokenizer_dir, seed: int = 0, sliding_window: int = 16) -> Path:
    """A tiny Gemma 3 checkpoint (+ Gemma3Processor) in `out`.

    Tokens: <start_of_image> 49152 (boi_token_index; the prompt's image
    placeholder), <end_of_image> 49153 (eoi_token_index), <image_soft_token>
    49154 (image_token_index), <start_of_turn> 49155, <end_of_turn> 49156,
    <bos> 49157, <eos> 49158, <pad> 49159, then "\\n" x 1..4 49160..49163
    (ordinary added tokens, see GEMMA3_NEWLINES); vocab_size 49164;
    generation stops at <eos> or <end_of_turn>."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(tokenizer_dir, GEMMA3_TOKENS, GEMMA3_CHAT_TEMPLATE, plain=GEMMA3_NEWLINES,
                     extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                           "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    ids = dict(zip(GEMMA3_TOKENS, tok.convert_tokens_to_ids(list(GEMMA3_TOKENS))))
    bos, eos, pad = ids["<bos>"], ids["<eos>"], ids["<pad>"]
    text = dict(TEXT, head_dim=16, vocab_size=len(tok), query_pre_attn_scalar=16, sliding_window=sliding_window,
                layer_types=["sliding_attention", "full_attention"], sliding_window_pattern=2,
                hidden_activation="gelu_pytorch_tanh",
                bos_token_id=bos, eos_token_id=[eos, ids["<end_of_turn>"]], pad_token_id=pad,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    vision = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, image_size=56, patch_size=14, vision_use_head=False, layer_norm_eps=1e-6)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=True, dtype="float32")
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    # tied, embeddings scaled by sqrt(64) in the model: entries ~0.5, small beside the layers' (post-normed)
    # outputs, else the last token repeats; the final norm's gain peaks the logits
    _save(transformers.Gemma3ForConditionalGeneration(config), out, seed, embed=0.5, norm_gain=8.0)
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": 56, "width": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3, do_pan_and_scan=False,
        pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tok, chat_template=GEMMA3_CHAT_TEMPLATE,
                                 image_seq_length=4).save_pretrained(str(out))
    _write_generation_config(out, bos, [eos, ids["<end_of_turn>"]], pad)
    return out


def build_qwen3_5_vl(out: Path, tokenizer_dir, seed: int = 0) -> Path:
    """A tiny Qwen3.5 checkpoint with its vision tower (+ Qwen3VLProcessor)
    in `out`. Token ids and vocab_size as `build_qwen2_5_vl`."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(tokenizer_dir, QWEN_TOKENS, QWEN_VL_CHAT_TEMPLATE, pad_token="<|endoftext|>")
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(list(QWEN_TOKENS))))
    text = dict(TEXT, head_dim=16, vocab_size=len(tok), bos_token_id=ENDOFTEXT, eos_token_id=IM_END,
                pad_token_id=ENDOFTEXT, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)
    config = _qwen_config(transformers.Qwen3_5Config, "Qwen3_5ForConditionalGeneration", text, vision, ids, tie=True)
    torch.manual_seed(seed)
    # tied: embeddings as small as the layers' outputs (else the last token repeats); the final norm's
    # gain peaks the logits
    _save(transformers.Qwen3_5ForConditionalGeneration(config), out, seed, embed=1.0, norm_gain=4.0)
    size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    image_processor = transformers.Qwen2VLImageProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
                                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = transformers.Qwen3VLVideoProcessor(size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
                                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    transformers.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                  chat_template=QWEN_VL_CHAT_TEMPLATE).save_pretrained(str(out))
    _write_generation_config(out, ENDOFTEXT, [IM_END, ENDOFTEXT], ENDOFTEXT)
    return out


BUILDERS = {"qwen2_5_vl": build_qwen2_5_vl, "gemma3": build_gemma3, "qwen3_5": build_qwen3_5_vl}


# ---- inputs and references --------------------------------------------------

def make_image(seed: int, size: tuple[int, int] = (112, 112)):
    """A deterministic random RGB PIL image of `size` = (width, height):
    smooth colour blobs plus pixel noise (so resizing keeps it distinct)."""
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (4, 4, 3))
    ys, xs = np.linspace(0, 3, h), np.linspace(0, 3, w)
    y0, x0 = np.minimum(ys.astype(int), 2), np.minimum(xs.astype(int), 2)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    c = lambda dy, dx: coarse[y0[:, None] + dy, x0[None, :] + dx]  # noqa: E731
    smooth = (c(0, 0) * (1 - fy) * (1 - fx) + c(0, 1) * (1 - fy) * fx + c(1, 0) * fy * (1 - fx) + c(1, 1) * fy * fx)
    pixels = np.clip(smooth + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def messages(text: str, n_images: int = 1) -> list[dict]:
    """One OpenAI-style user message: `n_images` image parts, then the text."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@functools.lru_cache(maxsize=8)
def processor(model_dir) -> object:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def prompt_text(model_dir, prompt_or_messages) -> str:
    """A prompt string as is; a message list through the chat template
    (with the generation prompt)."""
    if isinstance(prompt_or_messages, str):
        return prompt_or_messages
    return processor(model_dir).apply_chat_template(prompt_or_messages, tokenize=False, add_generation_prompt=True)


def hf_inputs(model_dir, prompt_or_messages, images=()) -> dict:
    """The transformers processor's outputs (torch tensors, batch of one) for
    a prompt string holding the model's image placeholders (Qwen
    "<|vision_start|><|image_pad|><|vision_end|>", Gemma 3 "<start_of_image>"),
    or for OpenAI-style messages (rendered with the chat template)."""
    proc = processor(model_dir)
    text = prompt_text(model_dir, prompt_or_messages)
    images = list(images)
    return dict(proc(text=[text], images=images or None, return_tensors="pt"))


@functools.lru_cache(maxsize=4)
def hf_model(model_dir):
    """The checkpoint as transformers loads it: float32, eager attention."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def reference_logprobs(model_dir, inputs) -> np.ndarray:
    """float64 log-softmax [len, vocab] of transformers' float32 forward
    (eager attention) over `inputs`: `hf_inputs`' dict, or bare token ids
    (a text-only prompt). Row i predicts token i + 1."""
    if not isinstance(inputs, dict):
        inputs = {"input_ids": torch.tensor([np.asarray(inputs).reshape(-1).tolist()])}
    model = hf_model(str(model_dir))
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # Qwen's cached M-RoPE offsets from an earlier call
    kwargs = {k: v for k, v in inputs.items() if v is not None}
    with torch.no_grad():
        logits = model(**kwargs, use_cache=False).logits[0].to(torch.float64)
    return torch.log_softmax(logits, dim=-1).numpy()


def image_token_id(model_dir) -> int:
    """The id the image's embeddings go to (image_token_id / image_token_index)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("image_token_id", config.get("image_token_index"))


def placeholder_count(model_dir, input_ids) -> int:
    """How many image-embedding positions `input_ids` holds."""
    ids = np.asarray(input_ids).reshape(-1)
    return int((ids == image_token_id(model_dir)).sum())


# ---- the published checkpoints' layout ----------------------------------------

def published_layout(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint built here (transformers 5 names) in the layout
    the published checkpoints have (saved by transformers 4.4x), which loaders
    outside transformers read: Qwen2.5-VL's text fields at the top of
    config.json (rope_theta, rope_scaling {"type": "mrope"}) and tensors
    `visual.*`, `model.layers.*`; Gemma 3's SigLIP under
    `vision_tower.vision_model.*` and its text RoPE as rope_theta /
    rope_local_base_freq. The weights are the same tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if config["model_type"] == "qwen2_5_vl":
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        flat = {k: v for k, v in text.items() if k not in ("model_type", "layer_types", "dtype")}
        flat.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
        vision = {k: v for k, v in config.pop("vision_config").items() if k not in ("rope_parameters", "model_type")}
        config = {**config, **flat, "vision_config": vision, "torch_dtype": config.pop("dtype", "float32")}

        def rename(k: str) -> str:
            if k.startswith("model.visual."):
                return k[len("model."):]
            return "model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k
    else:  # gemma3
        text = config["text_config"]
        rope = text.pop("rope_parameters")
        text.update(rope_theta=rope["full_attention"]["rope_theta"],
                    rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None)

        def rename(k: str) -> str:
            if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model."):
                return "vision_tower.vision_model." + k[len("vision_tower."):]
            return k
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(str(f)).items()}, str(dst / f.name), metadata={"format": "pt"})
    return dst
