"""Multi-token prediction (vLLM's method "mtp", and its aliases
"deepseek_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp"): the checkpoint's own
next-token layer (`num_nextn_predict_layers`, stored as the decoder layer
after the last: GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash, DeepSeek-V3 / R1) as
the drafter. The plain model drops these weights at load
(models/loader.py); they are read here and run on mlx-lm's own decoder
block of the family -- a latent-attention (MLA) block for DeepSeek-V3 and
GLM-4.7-Flash, whose own paged cache is then latent like the target's
(models/mla.py declares it: engine/kv_specs.py).

The layer (vLLM's Glm4MoeMultiTokenPredictorLayer, Glm4MoeLite's and
DeepSeekMultiTokenPredictorLayer: same weights, same arithmetic): for the
pair (token t_{i+1}, the target's final hidden state h_i) at position i,
x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]) (the embedding zeroed at
position 0, as vLLM does), then one decoder block with its own paged KV
cache (`layer_name`: vLLM sizes and groups it with the target's, one block
table addresses both), giving m_i; its draft is
argmax(head(shared_head.norm(m_i))) for position i + 2, head the target's
LM head (vLLM 0.33 shares it, and the embedding, with every MTP layer).
Pass j > 1 feeds the draft and the pass before's hidden row at the next
position (vLLM chains the one layer the same way for k > 1): m itself for
GLM, shared_head.norm(m) for DeepSeek (DeepSeekMTPModel returns both; its
proposer feeds the normed one back: `MtpFamily.feeds_normed`).

Where it runs: every pair whose next token the host knows before the step
(prompt tokens, scheduled drafts) is written in the target's step graph
(`write_step`, from the step's hidden states); a row's last position waits
for its sampled token: pass 1, after the step, runs it for the requests
the budget lets draft and gives their first drafts, passes 2..k one token
each, all passes one lazy graph evaluated once; a request that does not
draft leaves that pair pending, written ahead of its row in the next
step's graph (a step in which nobody drafts runs no pass). A pair written with a draft that is then rejected
is written again by pass 1 (the last accepted position) or by the next
step (the positions after it). A prefix-cached block's last slot holds the
pair of the request that wrote it (the next token may differ for a request
sharing only that block): a draft from it is still verified -- vLLM's MTP
shares the same cache the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal.models.attention_adapter import PagedKVCache
from vllm_metal.models.loaded_model import LoadedModel, decoder_owner
from vllm_metal.speculative.draft_model import InputsFor


@dataclass(frozen=True)
class MtpFamily:
    block: Callable[[dict, int], dict]  # the one-layer config of the family's block at index i (dense or MoE)
    feeds_normed: bool = False  # pass j > 1 reads shared_head.norm(m) (vLLM's DeepSeekMTPModel), else m


def _moe_at(config: dict, i: int) -> bool:
    """DeepSeek's rule (vLLM's DeepseekV2DecoderLayer, mlx-lm's): layer i is MoE."""
    return (config.get("n_routed_experts") is not None and i >= config.get("first_k_dense_replace", 0)
            and i % config.get("moe_layer_freq", 1) == 0)


def _deepseek_block(config: dict, i: int) -> dict:
    return {"first_k_dense_replace": 0 if _moe_at(config, i) else 1, "moe_layer_freq": 1}


# Families whose MTP layer is a decoder block of the family itself, as vLLM 0.33 maps them to its MTP
# models (Glm4MoeMTP, Glm4MoeLiteMTP, DeepSeekMTP). Not kimi_k2 (DeepSeek-V3's architecture): vLLM
# refuses method "mtp" on it (only model_type deepseek_v3 maps to DeepSeekMTP).
MTP_FAMILIES = {
    "glm4_moe": MtpFamily(lambda config, i: {"first_k_dense_replace": 0 if i >= config["first_k_dense_replace"]
                                             else 1}),
    "glm4_moe_lite": MtpFamily(_deepseek_block),
    "deepseek_v3": MtpFamily(_deepseek_block, feeds_normed=True),
}
EXTRAS = ("enorm", "hnorm", "eh_proj", "shared_head")  # the layer's own modules beside its decoder block


class _Given:
    """Stands in for the block's token embedding: the combined input rows of this pass."""

    rows: mx.array | None = None

    def __call__(self, ids: mx.array) -> mx.array:
        return self.rows


def _checkpoint_tensors(directory: Path, prefix: str) -> dict[str, mx.array]:
    """The checkpoint's tensors whose names start with `prefix` (lazy where MLX allows)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith(prefix)})
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    out: dict[str, mx.array] = {}
    for name in files:
        out.update({k: v for k, v in mx.load(str(directory / name)).items() if k.startswith(prefix)})
    return out


def collect_drafts(drafts: list[list[int]], passes, drafting: np.ndarray) -> list[list[int]]:
    """Each pass's tokens (active rows among the drafting ones, their tokens) appended to those
    rows' drafts, in pass order."""
    for active, tokens in passes:
        for a, t in zip(active, tokens.tolist()):
            drafts[drafting[a]].append(t)
    return drafts


class MtpDrafter:
    reads_target_cache = False  # a cache of its own, allocated beside the target's
    # The embedding of a pair at position 0 zeroed (GLM's and DeepSeek's layers; not Qwen's).
    zero_first = True

    def __init__(self, block: LoadedModel, embed: nn.Module, extras: dict[str, nn.Module], k: int,
                 max_model_len: int, feeds_normed: bool = False):
        self.model, self.embed, self.k, self.max_model_len = block, embed, k, max_model_len
        self.feeds_normed = feeds_normed  # MtpFamily.feeds_normed
        self.enorm, self.hnorm, self.eh_proj, self.shared_norm = (extras[n] for n in
                                                                  ("enorm", "hnorm", "eh_proj", "shared_norm"))
        self.given = decoder_owner(block.model)["model"].embed_tokens
        self.kv: PagedKVCache | None = None
        # The step's hidden rows a request's pass 1 may need (its last 1 + drafts positions), and
        # per batch row (index of its first such row, that row's position).
        self.frontier: mx.array | None = None
        self.frontier_at: dict[int, tuple[int, int]] = {}
        # req_id -> (position, next token, hidden row): a pair to write ahead of its next row
        self.pending: dict[str, tuple[int, int, mx.array]] = {}
        self.passes = 0  # passes run (instrumentation)

    @staticmethod
    def layer_name(i: int) -> str:
        return f"mtp.layers.{i}.self_attn"

    def restart(self, req_ids) -> None:
        """Finished or preempted requests: their pending pairs go (a preempted
        request's MTP cache is recomputed with its target cache)."""
        for r in req_ids:
            self.pending.pop(r, None)

    def reach(self, position: int, room: int) -> int:
        """Drafts for a request whose newest token sits at `position`: pass j
        writes position + j - 2 (within its blocks' `room`), drafts land below max_model_len."""
        return max(0, min(self.k, room - position + 1, self.max_model_len - 1 - position))

    def run(self, inputs, tokens: mx.array, previous: mx.array) -> mx.array:
        """The layer over `inputs`' pairs (their next tokens, the hidden rows
        before them): its output rows m (lazy), its cache written."""
        e = self.embed(tokens)
        first = inputs.positions == 0
        if self.zero_first and first.any():
            e = mx.where(mx.array(first)[:, None], mx.zeros_like(e), e)
        self.given.rows = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(previous.astype(e.dtype))],
                                                      axis=-1))[None]
        try:
            return self.model.forward_hidden(self.kv, inputs)
        finally:
            self.given.rows = None

    def drafts(self, m: mx.array) -> tuple[mx.array, mx.array]:
        """A pass's output rows m -> (their greedy drafts, the rows the next pass reads)."""
        normed = self.shared_norm(m.astype(self.model.dtype))
        return self.model.greedy_tokens(normed), normed if self.feeds_normed else m

    def write_step(self, rows, states, spec: dict[str, list[int]], hidden: mx.array,
                   inputs_for: InputsFor) -> list[mx.array]:
        """In the target's step graph: the pairs of every batch row whose next
        token is known before the step (rows[i]: its ScheduledRow; states[i]:
        its request; spec: the scheduled drafts, all -1: placeholders), from
        the step's hidden states, led by the pair a request left pending after
        the step before (`propose`: it did not draft); and the hidden rows of
        each sampling row's last 1 + drafts positions, kept for pass 1. The
        arrays to evaluate with the step."""
        batch_rows, tokens, starts, picks, frontier, carried = [], [], [], [], [], []
        self.frontier_at, offset = {}, 0
        for i, (row, state) in enumerate(zip(rows, states)):
            ids, start = list(row.token_ids), row.num_computed
            drafts = spec.get(state.req_id) or []
            padded = bool(drafts) and all(d < 0 for d in drafts)
            real = len(ids) - (len(drafts) if padded else 0)  # tokens whose hidden rows mean something
            d = 0 if padded else len(drafts)
            end = start + real  # the position after the row's last real token
            nxt = state.tokens(end, end + 1)[0] if d == 0 and end < state.num_tokens else None
            pairs = ids[1:real] + ([nxt] if nxt is not None else [])
            lead = self.pending.pop(state.req_id, None)
            if lead is not None and lead[0] == start - 1:  # (position, token, hidden row) of the step before
                pairs, start = [lead[1]] + pairs, start - 1
                picks.append(-1 - len(carried))
                carried.append(lead[2])
            if pairs:
                batch_rows.append(i)
                tokens.append(pairs)
                starts.append(start)
                picks.extend(range(offset, offset + len(pairs) - (start < row.num_computed)))
            if nxt is None:  # it samples: pass 1 reads one of its last 1 + d rows
                self.frontier_at[i] = (len(frontier), end - 1 - d)
                frontier.extend(range(offset + real - 1 - d, offset + real))
            offset += len(ids)
        self.frontier = hidden[mx.array(np.asarray(frontier, np.int32))] if frontier else None
        out = [self.frontier] if frontier else []
        if batch_rows:
            inputs = inputs_for(np.asarray(batch_rows, np.int64), tokens, np.asarray(starts, np.int64))
            ids = mx.array(np.asarray([t for ts in tokens for t in ts], np.int32))
            n = hidden.shape[0]
            source = mx.concatenate([hidden, *[c.astype(hidden.dtype) for c in carried]]) if carried else hidden
            at = np.asarray([p if p >= 0 else n - 1 - p for p in picks], np.int32)  # carried rows after the step's
            self.run(inputs, ids, source[mx.array(at)])
            out.extend(self.kv.arrays())
        return out

    def propose(self, rows: np.ndarray, req_ids: Sequence[str], positions: np.ndarray, newest: Sequence[int],
                want: Sequence[int], inputs_for: InputsFor) -> list[list[int]]:
        """For every batch row `rows[i]` (request req_ids[i]) whose newest token
        newest[i] sits at positions[i]: up to want[i] drafts. The pair at
        positions[i] - 1 (its next token is the one just sampled) is written
        by pass 1 for the rows that draft; the others' is left pending, for
        the next step's graph to write ahead of their row (no pass for them)."""
        drafts: list[list[int]] = [[] for _ in rows]
        want = np.asarray(want, np.int64)
        at = np.array([self.frontier_at[int(r)][0] + int(p) - 1 - self.frontier_at[int(r)][1]
                       for r, p in zip(rows, positions)], np.int32)
        for i in np.flatnonzero(want == 0):
            self.pending[req_ids[i]] = (int(positions[i]) - 1, int(newest[i]), self.frontier[int(at[i]):int(at[i]) + 1])
        drafting = np.flatnonzero(want > 0)
        if not len(drafting):
            self.frontier, self.frontier_at = None, {}
            return drafts
        rows, positions, want = rows[drafting], positions[drafting], want[drafting]
        inputs = inputs_for(rows, [[int(newest[i])] for i in drafting], positions - 1)
        m = self.run(inputs, mx.array(np.asarray([newest[i] for i in drafting], np.int32)),
                     self.frontier[mx.array(at[drafting])])
        passes: list[tuple[np.ndarray, mx.array]] = []
        active = np.arange(len(rows))
        tokens = None
        for j in range(int(want.max(initial=0))):
            keep = want[active] > j
            if j:
                if not keep.all():
                    pick = mx.array(np.flatnonzero(keep).astype(np.int32))
                    tokens, m, active = tokens[pick], m[pick], active[keep]
                inputs = inputs_for(rows[active], [[0]] * len(active), positions[active] + j - 1)
                m = self.run(inputs, tokens, m)
            tokens, m = self.drafts(m)
            passes.append((active, tokens))
        mx.eval([t for _, t in passes], self.kv.arrays())  # the passes' one evaluation
        self.passes += len(passes)
        self.frontier, self.frontier_at = None, {}
        return collect_drafts(drafts, passes, drafting)


def load_mtp(target: LoadedModel, model_dir: str, spec_config, dtype: str, dequantize: bool, fuse: bool,
             norm_rope: bool) -> MtpDrafter:
    """The target checkpoint's MTP layer (its first: vLLM chains it for every draft). Its embedding and
    head are the target's; the layer's own copies (DeepSeek-V3's embed_tokens, shared_head.head) are not read."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from vllm_metal.formats.checkpoint import open_checkpoint
    from vllm_metal.models.loader import DTYPES, mtp_layer_count, prepare_model

    checkpoint = open_checkpoint(model_dir)
    config = checkpoint.config
    family, n = config.get("model_type"), config["num_hidden_layers"]
    quantized = config.get("quantization") or config.get("quantization_config")
    if family not in MTP_FAMILIES or not checkpoint.native or quantized or mtp_layer_count(config) < 1:
        kind = f"{'quantized ' if quantized else ''}{checkpoint.format}"
        raise ValueError(f"{model_dir}: no multi-token-prediction layer vllm-metal can run (a {family} {kind} "
                         f"checkpoint with num_nextn_predict_layers={mtp_layer_count(config)}; served: "
                         f"{sorted(MTP_FAMILIES)} unquantized safetensors checkpoints)")
    prefix = f"model.layers.{n}."
    tensors = _checkpoint_tensors(Path(checkpoint.source), prefix)
    one = {**config, "num_hidden_layers": 1, **MTP_FAMILIES[family].block(config, n)}
    model_class, args_class = _get_classes(one)
    model = model_class(args_class.from_dict(one))
    block = {f"model.layers.0.{k[len(prefix):]}": v for k, v in tensors.items()
             if not k[len(prefix):].startswith((*EXTRAS, "embed_tokens"))}
    block = model.sanitize(block)
    wanted = {k for k, _ in tree_flatten(model.model.layers[0].parameters())}
    missing = sorted(wanted - {k[len("model.layers.0."):] for k in block})
    if missing:
        raise ValueError(f"{model_dir}: the MTP layer {n} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    model.load_weights(list(block.items()), strict=False)
    owner = decoder_owner(target.model)
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    extras = {"enorm": nn.RMSNorm(hidden, eps=eps), "hnorm": nn.RMSNorm(hidden, eps=eps),
              "eh_proj": nn.Linear(2 * hidden, hidden, bias=False), "shared_norm": nn.RMSNorm(hidden, eps=eps)}
    for name, module in extras.items():
        key = prefix + ("shared_head.norm" if name == "shared_norm" else name) + ".weight"
        if key not in tensors:
            raise ValueError(f"{model_dir}: the MTP layer {n} lacks {key}")
        module.weight = tensors[key]
        module.set_dtype(DTYPES[dtype])
    # The target's head, as vLLM 0.33's proposer shares it with every MTP layer (its shared_head.head
    # replaced: a checkpoint's copy, DeepSeek-V3's layers.61.shared_head.head, is not read).
    if "lm_head" in owner:
        model.lm_head = owner["lm_head"]
    else:  # a tied head: the embedding's matrix
        model.lm_head.weight = owner["model"].embed_tokens.weight
    decoder = decoder_owner(model)["model"]
    decoder.embed_tokens, decoder.norm = _Given(), nn.Identity()
    block_model = prepare_model(model, one, dtype, dequantize, True, fuse, norm_rope)
    block_model.share_greedy_head(target)
    mx.eval([m.parameters() for m in extras.values()])
    block_model.weights_bytes += sum(v.nbytes for m in extras.values() for _, v in tree_flatten(m.parameters()))
    block_model.weights_bytes -= sum(v.nbytes for _, v in tree_flatten(model.lm_head.parameters()))  # the target's
    return MtpDrafter(block_model, owner["model"].embed_tokens, extras, spec_config.num_speculative_tokens,
                      spec_config.target_model_config.max_model_len, MTP_FAMILIES[family].feeds_normed)
