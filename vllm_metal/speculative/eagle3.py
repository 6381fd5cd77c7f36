"""EAGLE-3 (vLLM's method "eagle3"): a separately trained one-layer head
that drafts from the target's auxiliary hidden states -- the residual
stream before the layers eagle3_config.aux_layer_ids names, captured in the
target's step graph (models/loaded_model.py, `aux_layers`).

The head (vLLM's llama_eagle3.py / qwen3_eagle3.py, same weights, same
arithmetic): for the pair (token t_{i+1}, g_i = fc([aux states of
position i])) at position i, its decoder layer attends from
[input_layernorm(embed(t_{i+1})), hidden_norm(g_i)] (the q/k/v projections
read 2 x hidden) with g_i as the residual, over its own paged KV cache
(`layer_name`: declared to vLLM beside the target's layers, one block table
addresses both), giving the pre-norm row m_i; the draft for position i + 2
is argmax(lm_head(norm(m_i))), a draft-vocabulary id mapped to the
target's by d2t (id + d2t[id]) where the head has a smaller vocabulary.
Pass j > 1 feeds that draft and m (pre-norm, as vLLM's proposer does) at
the next position. Greedy, as vLLM's proposer drafts. The embedding is the
target's unless the head has its own (vLLM shares it likewise); so is the
lm_head where the head has none.

Where it runs: exactly as an MTP layer (speculative/mtp.py, whose state
machine Eagle3Drafter inherits: pairs written in the step's graph, pass 1
after the step, pending pairs), with fc applied to the step's aux states
first.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from vllm_metal.models.loaded_model import LoadedModel, decoder_owner
from vllm_metal.speculative.eagle3_config import HEAD_LAYERS, architecture, aux_layer_ids, problem
from vllm_metal.speculative.mtp import MtpDrafter


class _PassInputs:
    """What the head's layer reads besides the decoder's input rows, set per pass."""

    embeds: mx.array | None = None  # [1, rows, hidden]: embed(t_{i+1})
    rows: mx.array | None = None  # [1, rows, hidden]: g_i (fc of the aux states) or m of the pass before


class _Given:
    """Stands in for the block's token embedding: the hidden rows of this pass (the residual)."""

    def __init__(self, given: _PassInputs):
        self.given = given

    def __call__(self, ids: mx.array) -> mx.array:
        return self.given.rows


class Eagle3Input(nn.Module):
    """The head layer's attention input in place of mlx-lm's input_layernorm:
    [input_layernorm(embeds), hidden_norm(x)] (vLLM's layer 0, norm after residual)."""

    def __init__(self, hidden: int, eps: float, given: _PassInputs):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        object.__setattr__(self, "_given", given)  # (not a child module)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([self.input_layernorm(self._given.embeds), self.hidden_norm(x)], axis=-1)


class Eagle3Drafter(MtpDrafter):
    """The MTP drafter's state machine (write_step, propose) over an EAGLE-3 head."""

    def __init__(self, block: LoadedModel, embed: nn.Module, fc: nn.Linear, norm: nn.RMSNorm,
                 target_ids: mx.array | None, given: _PassInputs, k: int, max_model_len: int):
        super().__init__(block, embed, {"enorm": None, "hnorm": None, "eh_proj": None, "shared_norm": norm}, k,
                         max_model_len)
        self.fc, self.norm, self.target_ids, self.given_inputs = fc, norm, target_ids, given

    @staticmethod
    def layer_name(i: int) -> str:
        return f"draft_model.model.layers.{i}.self_attn"

    def write_step(self, rows, states, spec, hidden: mx.array, inputs_for):
        """`hidden`: the step's aux states [tokens, n_aux x hidden]; combined by fc first (vLLM's
        combine_hidden_states), then written as the MTP layer's pairs are."""
        return super().write_step(rows, states, spec, self.fc(hidden.astype(self.model.dtype)), inputs_for)

    def run(self, inputs, tokens: mx.array, previous: mx.array) -> mx.array:
        """The head over `inputs`' pairs (their next tokens, the hidden rows g or m before them):
        its pre-norm output rows (lazy), its cache written."""
        self.given_inputs.embeds = self.embed(tokens).astype(self.model.dtype)[None]
        self.given_inputs.rows = previous.astype(self.model.dtype)[None]
        try:
            return self.model.forward_hidden(self.kv, inputs)
        finally:
            self.given_inputs.embeds = self.given_inputs.rows = None

    def drafts(self, m: mx.array) -> tuple[mx.array, mx.array]:
        """A pass's pre-norm rows -> (their greedy drafts as target ids, the rows the next pass reads: m)."""
        ids = self.model.greedy_tokens(self.norm(m.astype(self.model.dtype)))
        return (self.target_ids[ids] if self.target_ids is not None else ids), m


def _tensors(directory: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _refuse(head_dir, what: str) -> ValueError:
    return ValueError(f"{head_dir}: {what}; use the EAGLE-3 head made for this target, or method 'ngram' / "
                      "'draft_model'")


def load_eagle3(target: LoadedModel, spec_config, dtype: str, dequantize: bool, fuse: bool,
                norm_rope: bool) -> Eagle3Drafter:
    """The head of `--speculative-config` ("model": its directory), the target told which aux states to keep."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from vllm_metal.formats.model_dir import resolve_model_dir
    from vllm_metal.models.loader import DTYPES, prepare_model

    head_dir = resolve_model_dir(str(spec_config.draft_model_config.model))  # a directory, or a hub id
    head = json.loads((head_dir / "config.json").read_text())
    reason = problem(head, target.config)
    if reason is not None:
        raise ValueError(f"{head_dir}: {reason}")
    hidden, eps = head["hidden_size"], head.get("rms_norm_eps", 1e-6)
    vocab = target.config["vocab_size"]
    draft_vocab = head.get("draft_vocab_size") or vocab
    heads = head["num_attention_heads"]
    one = {"model_type": HEAD_LAYERS[architecture(head)], "hidden_size": hidden, "num_hidden_layers": 1,
           "intermediate_size": head["intermediate_size"], "num_attention_heads": heads,
           "num_key_value_heads": head.get("num_key_value_heads") or heads,
           "head_dim": head.get("head_dim") or hidden // heads, "rms_norm_eps": eps,
           "rope_theta": head.get("rope_theta", 10000.0), "rope_scaling": head.get("rope_scaling"),
           "max_position_embeddings": head.get("max_position_embeddings", 2048), "vocab_size": draft_vocab,
           "tie_word_embeddings": False}
    tensors = _tensors(head_dir)
    # vLLM's names (llama_eagle3 load_weights): midlayer.* is layer 0 ("layers.0." taken as is)
    layer = {k.split(".", 1)[1] if k.startswith("midlayer.") else k[len("layers.0."):]: v
             for k, v in tensors.items() if k.startswith(("midlayer.", "layers.0."))}
    for name in ("input_layernorm", "hidden_norm"):  # both under the layer's Eagle3Input
        if f"{name}.weight" in layer:
            layer[f"input_layernorm.{name}.weight"] = layer.pop(f"{name}.weight")
    model_class, args_class = _get_classes(one)
    model = model_class(args_class.from_dict(one))
    block, given = model.model.layers[0], _PassInputs()
    attn = block.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):  # [embeds, hidden] in: 2 x hidden
        setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).weight.shape[0], bias=False))
    block.input_layernorm = Eagle3Input(hidden, eps, given)
    wanted = dict(tree_flatten(block.parameters()))
    missing = sorted(set(wanted) - set(layer))
    if missing or "fc.weight" not in tensors or "norm.weight" not in tensors:
        names = [f"midlayer.{m}" for m in missing] + [n for n in ("fc.weight", "norm.weight") if n not in tensors]
        raise _refuse(head_dir, f"the EAGLE-3 head lacks {names[:4]}{' ...' if len(names) > 4 else ''}")
    bad = [f"midlayer.{k} {tuple(layer[k].shape)} (expected {tuple(v.shape)})" for k, v in wanted.items()
           if tuple(layer[k].shape) != tuple(v.shape)]
    if bad:
        raise _refuse(head_dir, f"the EAGLE-3 head's tensors do not fit its config: {bad[:3]}")
    block.load_weights([(k, layer[k]) for k in wanted])
    aux = aux_layer_ids(head, target.num_layers)
    fc = nn.Linear(len(aux) * target.config["hidden_size"], hidden, bias=False)
    norm = nn.RMSNorm(hidden, eps=eps)
    if tuple(tensors["fc.weight"].shape) != tuple(fc.weight.shape):
        raise _refuse(head_dir, f"the EAGLE-3 head's fc.weight is {tuple(tensors['fc.weight'].shape)}, not "
                                f"{tuple(fc.weight.shape)} for the {len(aux)} target layers {list(aux)} it reads")
    fc.weight, norm.weight = tensors["fc.weight"], tensors["norm.weight"]
    owner = decoder_owner(target.model)
    target_ids = None
    if draft_vocab != vocab:  # vLLM's draft_id_to_target_id
        if "d2t" not in tensors or tuple(tensors["d2t"].shape) != (draft_vocab,):
            raise _refuse(head_dir, f"the EAGLE-3 head drafts {draft_vocab} of the target's {vocab} tokens but has "
                                    "no d2t mapping of that size")
        target_ids = (mx.arange(draft_vocab) + tensors["d2t"].astype(mx.int64)).astype(mx.int32)
    if "lm_head.weight" in tensors:
        if tuple(tensors["lm_head.weight"].shape) != (draft_vocab, hidden):
            raise _refuse(head_dir, f"the EAGLE-3 head's lm_head.weight is {tuple(tensors['lm_head.weight'].shape)}, "
                                    f"not ({draft_vocab}, {hidden})")
        model.lm_head.weight = tensors["lm_head.weight"]
    elif target_ids is not None:
        raise _refuse(head_dir, "the EAGLE-3 head has a draft vocabulary but no lm_head.weight")
    elif "lm_head" in owner:  # vLLM shares the target's head with a head that has none
        model.lm_head = owner["lm_head"]
    elif isinstance(owner["model"].embed_tokens, nn.QuantizedEmbedding):
        raise _refuse(head_dir, "the EAGLE-3 head has no lm_head.weight and the target's tied head is MLX-quantized")
    else:  # a tied target head: the embedding's matrix
        model.lm_head.weight = owner["model"].embed_tokens.weight
    embed = owner["model"].embed_tokens
    if "embed_tokens.weight" in tensors:  # the head's own (vLLM keeps a distinct one)
        embed = nn.Embedding(vocab, hidden)
        embed.weight = tensors["embed_tokens.weight"]
    decoder = model.model
    decoder.embed_tokens, decoder.norm = _Given(given), nn.Identity()
    block_model = prepare_model(model, one, dtype, dequantize, True, fuse, norm_rope)
    extras = [fc, norm] + ([embed] if "embed_tokens.weight" in tensors else [])
    for m in extras:
        m.set_dtype(DTYPES[dtype])
    mx.eval([m.parameters() for m in extras], target_ids if target_ids is not None else [])
    block_model.weights_bytes += sum(v.nbytes for m in extras for _, v in tree_flatten(m.parameters()))
    if "lm_head.weight" not in tensors:  # counted with the target's weights
        block_model.weights_bytes -= sum(v.nbytes for _, v in tree_flatten(model.lm_head.parameters()))
    target.aux_layers = aux  # the target's step keeps these residual streams (its hidden_out)
    return Eagle3Drafter(block_model, embed, fc, norm, target_ids, given, spec_config.num_speculative_tokens,
                         spec_config.target_model_config.max_model_len)
