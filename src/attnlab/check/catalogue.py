"""The catalogue of known attention mistakes that ``attnlab check`` tests as hypotheses.

Each :class:`Mistake` is one classic error, taken from the seeds' pitfalls and error table
(seed 002: sections 2.1-2.4, 3.3, 4.1; seed 000: the walk-through) and from what people get
wrong in practice. A mistake is recognised one of three ways:

- ``recipe``: a numerical mistake. The output is recomputed with it (:func:`attnlab.check.recipe.
  recipe_attention`, on the module's own weights and inputs); it is named when the module's
  outputs match that recomputation and not the textbook formula's.
- ``behaviour``: a mistake seen in what the module does in one situation (a fully masked row,
  NaN in a padded value, training mode, float64); :mod:`attnlab.check.diagnose` tests each.
- ``crash``: an exception the module raises, recognised by its message.

A mistake marked ``hardening`` is robustness a textbook module is not written for (NaN in padded
values, fully masked rows, a fill float16 cannot hold, float32 inside a float64 run): the module
computes attention correctly, so its rows are printed as hardening notes, each with its fix, and
fail the check only with ``--strict``.

``found`` and ``fix`` may name the sizes: ``{E}`` embed_dim, ``{H}`` heads, ``{G}`` K/V heads,
``{D}`` head dim, ``{scale}`` the expected scale, ``{rE}`` 1/sqrt(E), ``{rD}`` 1/sqrt(D).
The gallery in ``docs/check_gallery.md`` is generated from this list
(``python scripts/check_gallery.py``); a test keeps the two in sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .recipe import Recipe

__all__ = ["MISTAKES", "Mistake", "by_id"]

S_DIMS = "seed 002, section 1.3"
S_PROJ = "seed 002, section 2.1"
S_SPLIT = "seed 002, section 2.2"
S_SCALE = "seed 002, section 2.3"
S_MASK = "seed 002, section 2.4"
S_GRAD = "seed 002, section 3.3"
S_ERRORS = "seed 002, section 4.1"
S_WALK = "seed 000, sections 2 and 4"
S_ROPE = "beyond the seeds: rotary position embeddings (RoFormer, Su et al. 2021, section 3.4)"
S_ALIBI = "beyond the seeds: ALiBi, attention with linear biases (Press et al. 2022, section 3)"


@dataclass(frozen=True)
class Mistake:
    id: str
    kind: Literal["recipe", "behaviour", "crash"]
    found: str  # what is wrong, as the report says it
    fix: str  # the one-line fix
    seed: str  # where the seeds discuss it
    symptom: str  # which rows fail, for the gallery
    recipe: Recipe | None = None  # for kind "recipe": the computation with the mistake
    pattern: str = ""  # for kind "crash": a regular expression on the exception's message
    # The mistake turns masked scores (-inf) into NaN rows (a softmax over a slice that a mask empties):
    # under a mask, only the module's finite rows are compared.
    nan_under_masks: bool = False
    hardening: bool = False  # robustness, not correctness: a note unless --strict (see the module docstring)
    # other forms the same mistake takes in code people write (for kind "recipe"); each is tried as well
    also: tuple[Recipe, ...] = ()
    # rows this mistake fails by what it is, not by its numbers (they measure the module alone, without a
    # reference the recipe could replace): explained whenever they fail beside it
    implies: tuple[str, ...] = ()

    def text(self, field: str, dims: dict[str, object]) -> str:
        return str(getattr(self, field)).format(**dims)


_R = Recipe
MISTAKES: tuple[Mistake, ...] = (
    # -- scaling (seed 002, 2.3; seed 000, 3.1: "divide by sqrt(8), not sqrt(64)") --
    Mistake(
        "scale_embed_dim", "recipe",
        "scores are scaled by 1/sqrt(embed_dim) = {rE:.4g}, not 1/sqrt(head_dim) = {rD:.4g}",
        "divide the scores by math.sqrt(head_dim), with head_dim = embed_dim // num_heads = {D}",
        S_SCALE, "every output row (parity, masks, fully masked rows, dropout)", _R(scale="embed_dim"),
    ),
    Mistake(
        "scale_missing", "recipe",
        "scores are not scaled: Q K^T goes into softmax without the 1/sqrt(head_dim) = {rD:.4g}",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)",
        S_SCALE, "every output row", _R(scale="none"),
    ),
    Mistake(
        "scale_head_dim_not_sqrt", "recipe",
        "scores are divided by head_dim = {D}, not by its square root",
        "divide by math.sqrt(head_dim), not head_dim",
        S_SCALE, "every output row", _R(scale="head_dim"),
    ),
    Mistake(
        "scale_multiplied", "recipe",
        "scores are multiplied by sqrt(head_dim) instead of divided by it",
        "scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)",
        S_SCALE, "every output row", _R(scale="multiplied"),
    ),
    Mistake(
        "scale_after_softmax", "recipe",
        "the 1/sqrt(head_dim) scale is applied to the weights after softmax, not to the scores before it",
        "scale the scores: softmax(q @ k.transpose(-2, -1) / math.sqrt(head_dim), dim=-1)",
        S_SCALE, "every output row", _R(scale_after_softmax=True),
    ),
    Mistake(
        "scale_k_only", "recipe",
        "only K is scaled, by head_dim^-1/4 = {D}^-0.25: the scale is split between Q and K and Q's half is missing, "
        "so the scores carry head_dim^-1/4, not 1/sqrt(head_dim) = {rD:.4g}",
        "scale both: q = q * head_dim**-0.25 and k = k * head_dim**-0.25 (or the scores once by 1/sqrt(head_dim))",
        S_SCALE, "every output row", _R(scale="quarter"),
    ),
    Mistake(
        "scale_by_length", "recipe",
        "scores are scaled by 1/sqrt(sequence length), not 1/sqrt(head_dim) = {rD:.4g}: the wrong size was "
        "taken (x.size(1) or T in place of head_dim), so the scale changes with the input's length",
        "divide by math.sqrt(head_dim), the last dim of q (q.size(-1)), not the length",
        S_SCALE, "every output row", _R(scale="length"),
        also=(_R(scale="query_length"),),  # the length read off q (a Flax port's query.shape[1] of (B, T, H, D))
    ),
    # -- softmax --
    Mistake(
        "softmax_query_axis", "recipe",
        "softmax runs over the query axis (dim=-2): each column of the weights sums to 1, not each row",
        "torch.softmax(scores, dim=-1): each query's weights over the keys sum to 1",
        S_WALK, "every output row", _R(softmax_dim=-2), nan_under_masks=True,
        # with a finite fill (-1e9), a padded key's column is uniform, not zero
        also=(_R(softmax_dim=-2, fill="finite"),),
    ),
    Mistake(
        "softmax_head_axis", "recipe",
        "softmax runs over the heads (dim=1): the weights of one query and key sum to 1 across heads",
        "torch.softmax(scores, dim=-1)",
        S_WALK, "every output row", _R(softmax_dim=1), nan_under_masks=True,
    ),
    # -- masks (seed 002, 2.4) --
    Mistake(
        "mask_after_softmax", "recipe",
        "the mask is applied after softmax: blocked keys are zeroed but still took their share of each row",
        "mask the scores before softmax: scores.masked_fill(~keep, float('-inf')), then softmax",
        S_MASK, "masked parity, no causal leak, padding invariance", _R(mask_stage="after"),
    ),
    Mistake(
        "masked_fill_zero", "recipe",
        "masked scores are filled with 0, not -inf: a blocked key keeps exp(0) of the softmax, as much as a key "
        "scoring 0, so the mask only dents the weights",
        "scores.masked_fill(~keep, float('-inf')) (or torch.finfo(scores.dtype).min), never 0",
        S_MASK, "every masked row, no causal leak, padding invariance", _R(fill="zero"),
        also=(_R(fill="zero_dropped"),),  # and the blocked weights zeroed after softmax (ESPnet's second fill)
    ),
    Mistake(
        "bool_mask_added", "recipe",
        "a bool mask is added to the scores as 0/1 numbers (True adds 1.0) instead of masking them",
        "bool masks: scores.masked_fill(~attn_mask, float('-inf')); add only float masks",
        S_ERRORS, "mask_semantics (the checks then pass float masks)", _R(bool_mask_added=True),
    ),
    Mistake(
        "mask_ignored", "recipe",
        "the attention mask never reaches the scores: masked and unmasked calls give the same output",
        "apply the mask to the scores before softmax: scores.masked_fill(~attn_mask, float('-inf'))",
        S_MASK, "every masked row", _R(mask_ignored=True),
        implies=("mask_semantics",),  # a mask that reaches nothing reads as neither keep nor block
    ),
    Mistake(
        "causal_sees_next", "recipe",
        "the causal mask lets each query see one future key (the diagonal of tril/triu is off by one)",
        "keep = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q): query i sees keys j <= i",
        S_MASK, "no_causal_leak, causal parity, KV cache", _R(causal="sees_next"),
    ),
    Mistake(
        "causal_hides_self", "recipe",
        "the causal mask hides each query's own position: query i sees only keys j < i (and query 0 none)",
        "keep = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q): the diagonal stays visible",
        S_MASK, "causal parity, KV cache", _R(causal="hides_self"),
    ),
    Mistake(
        "causal_reversed", "recipe",
        "the causal mask is reversed (triu for tril): each query sees the future and not the past",
        "keep the lower triangle: torch.ones(T, T, dtype=torch.bool).tril()",
        S_MASK, "no_causal_leak, causal parity", _R(causal="reversed"),
    ),
    Mistake(
        "padding_ignored", "recipe",
        "key_padding_mask is accepted but never applied: padded keys are attended to",
        "block the padded keys: scores.masked_fill(key_padding_mask[:, None, None, :], float('-inf'))",
        S_MASK, "padding parity, padding_invariance", _R(padding="ignored"),
    ),
    Mistake(
        "padding_inverted", "recipe",
        "key_padding_mask is read as True = keep: real keys are blocked and padded ones attended to",
        "True in key_padding_mask marks padding: masked_fill(key_padding_mask[:, None, None, :], float('-inf'))",
        S_MASK, "padding parity, padding_invariance", _R(padding="inverted"),
    ),
    Mistake(
        "padding_on_queries", "recipe",
        "the padding mask is laid along the query axis (mask[:, None, :, None]): padded queries are blocked, not padded keys",
        "broadcast padding over queries: key_padding_mask[:, None, None, :] is (B, 1, 1, T_k)",
        S_MASK, "padding parity, padding_invariance", _R(padding="queries"),
    ),
    Mistake(
        "padding_mask_added", "recipe",
        "the padding mask is added to the scores as 0/1 numbers (key_padding_mask.float()): padded keys get +1 instead of -inf",
        "block the padded keys: scores.masked_fill(key_padding_mask[:, None, None, :], float('-inf')); "
        "as an additive mask: torch.zeros_like(m, dtype=scores.dtype).masked_fill(m, float('-inf'))",
        S_MASK, "padding parity, padding_invariance", _R(padding="added"),
    ),
    Mistake(
        "rows_misassigned", "recipe",
        "lengths or masks reach the wrong batch rows: (sequence b, head h) gets sequence (b*H + h) mod B's, "
        "as valid_lens.repeat(num_heads) does where repeat_interleave belongs",
        "repeat per sequence, not per tile: valid_lens.repeat_interleave(num_heads, dim=0) for rows laid out (B*H, ...)",
        S_MASK, "padding parity, padding_invariance, masked rows", _R(rows="tiled"),
        # a window mask (nW rows, the batch nW * B folded windows fastest) spread window-major: Swin's masks
        # repeat_interleave'd where they repeat
        also=(_R(rows="windows_major"),),
    ),
    # -- heads: split and merge (seed 002, 2.2; seed 000, sections 2 and 4) --
    Mistake(
        "split_without_transpose", "recipe",
        "heads are split with view(B, H, T, D) directly, without view(B, T, H, D).transpose(1, 2): positions and heads are mixed",
        "q = q.view(B, T, num_heads, head_dim).transpose(1, 2)  # (B, H, T, D)",
        S_SPLIT, "every output row", _R(split="no_transpose"),
        also=(_R(split="time_first_memory"),),  # fairseq's view(B*H, T, D) of (T, B, E) memory, not transposed
    ),
    Mistake(
        "merge_without_transpose", "recipe",
        "heads are merged with reshape(B, T, E) straight from (B, H, T, D), without transposing back: positions and heads are mixed",
        "out = context.transpose(1, 2).contiguous().view(B, T, embed_dim)",
        S_SPLIT, "every output row, permutation_equivariance", _R(merge="no_transpose"),
        also=(_R(merge="no_transpose_time_first"),),  # Megatron's [b, np, sq, hn] viewed as its [sq, b, hp]
    ),
    Mistake(
        "heads_interleaved", "recipe",
        "heads take interleaved features (view(B, T, D, H)): head h is features h, h+H, ..., not the block h*D .. (h+1)*D",
        "q.view(B, T, num_heads, head_dim): each head takes head_dim consecutive features, as nn.MultiheadAttention and checkpoints do",
        S_SPLIT, "every output row", _R(split="interleaved", merge="interleaved"),
        also=(_R(split="interleaved", merge="transpose"),),  # merged back as plain blocks (HF's transpose_for_scores)
    ),
    Mistake(
        "gqa_kv_heads_tiled", "recipe",
        "K/V heads are expanded with repeat (g0 g1 g0 g1 ..) instead of repeat_interleave (g0 g0 g1 g1 ..): query heads meet the wrong K/V head",
        "k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)",
        S_SPLIT, "every output row", _R(kv_repeat="tile"),
    ),
    Mistake(
        "batch_seq_swapped", "recipe",
        "batch and sequence axes are swapped: (B, T, E) inputs are read as (T, B, E), so attention runs across "
        "the batch at each position (nn.MultiheadAttention without batch_first=True)",
        "nn.MultiheadAttention(embed_dim, num_heads, batch_first=True), or transpose: x.transpose(0, 1) in and out",
        S_DIMS, "every output row; masked rows raise (the masks' shapes no longer fit)", _R(batch_first=False),
    ),
    # -- projections (seed 002, 2.1) --
    Mistake(
        "v_uses_k_proj", "recipe",
        "V is computed with k_proj: v = k_proj(value)",
        "v = self.v_proj(value)",
        S_PROJ, "every output row (and dropout_rate, whose contexts are V)", _R(v_from=("k", "value")),
        also=(_R(v_from=("k", "value"), cross_only=True),),  # in the cross-attention branch alone
    ),
    Mistake(
        "v_uses_q_proj", "recipe",
        "V is computed with the query projection: v = q_proj(value)",
        "v = self.v_proj(value)",
        S_PROJ, "every output row", _R(v_from=("q", "value")),
    ),
    Mistake(
        "k_uses_q_proj", "recipe",
        "K is computed with q_proj: k = q_proj(key)",
        "k = self.k_proj(key)",
        S_PROJ, "every output row", _R(k_from=("q", "key")),
    ),
    Mistake(
        "q_uses_k_proj", "recipe",
        "Q is computed with k_proj: q = k_proj(query)",
        "q = self.q_proj(query)",
        S_PROJ, "every output row", _R(q_from=("k", "query")),
    ),
    Mistake(
        "kv_proj_swapped", "recipe",
        "K and V projections are swapped: k = v_proj(key), v = k_proj(value)",
        "k = self.k_proj(key); v = self.v_proj(value)",
        S_PROJ, "every output row", _R(k_from=("v", "key"), v_from=("k", "value")),
    ),
    Mistake(
        "qkv_split_order", "recipe",
        "the fused projection is split in the order {qkv_order}, not q, k, v: Q and K take each other's weights "
        "(a checkpoint's or nn.MultiheadAttention's in_proj_weight loads into the wrong thirds)",
        "q, k, v = self.qkv(x).chunk(3, dim=-1), in the order q, k, v",
        S_PROJ, "every output row", _R(q_from=("k", "query"), k_from=("q", "key")),
    ),
    Mistake(
        "kv_from_query", "recipe",
        "K and V are computed from the query even when another key/value is given: cross-attention is self-attention",
        "k = self.k_proj(key); v = self.v_proj(value)  (x_context in seed 000)",
        S_WALK, "parity_cross", _R(k_from=("k", "query"), v_from=("v", "query")),
    ),
    Mistake(
        "v_from_key", "recipe",
        "V is computed from the key input: v = v_proj(key) instead of v_proj(value)",
        "v = self.v_proj(value)",
        S_PROJ, "parity_cross", _R(v_from=("v", "key")),
    ),
    Mistake(
        "rotary_on_values", "recipe",
        "the rotary position map is applied to V as well as Q and K: values turn with their position, so the "
        "output depends on absolute positions",
        "rotate q and k only: q, k = apply_rotary(q, k, ...); leave v as projected",
        S_ROPE, "every output row", _R(rotary="qkv"),
    ),
    Mistake(
        "rotary_q_only", "recipe",
        "the rotary position map turns Q but not K: the scores then depend on the query's absolute position, "
        "not on the distance between query and key",
        "apply the same rotation to k: q, k = apply_rotary(q, k, freqs)",
        S_ROPE, "every output row", _R(rotary="q"),
    ),
    Mistake(
        "alibi_slope_sign", "recipe",
        "the position bias on the scores (ALiBi-style, linear in the distance between query and key) rises with the "
        "distance: its slopes have the wrong sign, so each query favours its farthest keys",
        "bias = -slope * (i - j) with positive slopes (BLOOM's slope * key position gives it, softmax forgets the "
        "row's constant): build the bias from +slopes, falling as keys get farther",
        S_ALIBI, "every output row", _R(position_bias="negated"),
    ),
    Mistake(
        "rotary_pairs_wrong", "recipe",
        "the rotary's cos/sin tables are laid out for one pairing of the features and its rotate function pairs "
        "them the other way (adjacent pairs 2i, 2i+1 against halves i, i + d/2): each feature turns against a "
        "partner of another angle, so the map is no rotation and the scores no longer depend on distance alone",
        "pair the features as the tables do: rotate_every_two with repeat_interleave'd cos/sin (GPT-J), "
        "rotate_half with cos/sin concatenated twice (NeoX, Llama)",
        S_ROPE, "every output row", _R(rotary_crossed=True),
    ),
    Mistake(
        "out_proj_missing", "recipe",
        "the output projection is never applied: the merged heads are returned as they are",
        "return self.out_proj(out)",
        S_PROJ, "every output row", _R(out_proj=False),
    ),
    # -- behaviour --
    Mistake(
        "fully_masked_nan", "behaviour",
        "a query whose keys are all masked gets NaN: softmax over a row of -inf is 0/0",
        "zero such rows after softmax: weights.masked_fill(~keep.any(-1, keepdim=True), 0.0)",
        S_MASK, "fully_masked_rows", hardening=True,
    ),
    Mistake(
        "fully_masked_uniform", "behaviour",
        "a query whose keys are all masked averages every value uniformly: a finite fill (-1e9, finfo.min) leaves equal scores",
        "zero such rows after softmax: weights.masked_fill(~keep.any(-1, keepdim=True), 0.0)",
        S_MASK, "fully_masked_rows", hardening=True,
    ),
    Mistake(
        "padded_values_nan", "behaviour",
        "NaN or inf in a padded key/value row reaches every output: weight 0 times NaN is still NaN",
        "{pad_fix}",
        S_MASK, "padded_kv_nonfinite", hardening=True,
    ),
    Mistake(
        "dropout_in_eval", "behaviour",
        "dropout still runs in eval mode: F.dropout(weights, p) defaults to training=True",
        "F.dropout(weights, p, training=self.training), or an nn.Dropout module",
        S_WALK, "determinism, dropout_off_in_eval",
    ),
    Mistake(
        "dropout_keep_prob", "behaviour",
        "dropout drops 1 - p of the weights: the keep probability is passed where the drop probability belongs",
        "nn.Dropout(p) takes the probability of dropping",
        S_WALK, "dropout_rate",
    ),
    Mistake(
        "dropout_no_rescale", "behaviour",
        "dropout drops at the right rate but does not scale the kept weights by 1/(1-p)",
        "use F.dropout / nn.Dropout, which rescale; by hand: weights * keep / (1 - p)",
        S_WALK, "dropout_rate",
    ),
    Mistake(
        "dropout_inactive", "behaviour",
        "dropout does not act on the attention weights in training (never applied, or applied to the scores before softmax)",
        "attn_weights = self.dropout(torch.softmax(scores, dim=-1))",
        S_WALK, "dropout_rate",
    ),
    Mistake(
        "float64_downcast", "behaviour",
        "a float64 module computes part of attention in float32: gradcheck's finite differences drown in its rounding",
        "upcast only half precision: torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32))",
        S_GRAD, "gradcheck rows", hardening=True,
    ),
    Mistake(
        "low_precision_loss", "behaviour",
        "in half precision the module loses more than twice what plain PyTorch attention does",
        "keep every step in at least the input dtype, and run softmax in float32: torch.softmax(scores.float(), -1).to(v.dtype)",
        S_SCALE, "low_precision rows",
    ),
    Mistake(
        "wrong_backward", "behaviour",
        "the backward pass disagrees with the forward's derivative (a custom autograd.Function or a detached step)",
        "let autograd differentiate the forward; check any custom backward with torch.autograd.gradcheck",
        S_GRAD, "gradcheck, grad_parity",
    ),
    Mistake(
        "mask_polarity", "behaviour",
        "a bool mask means the opposite of {convention} to this module",
        "{polarity_fix}",
        S_MASK, "mask_semantics (the checks then pass masks in the module's own reading)",
    ),
    Mistake(
        "scale_attribute", "behaviour",
        "the module states scale = {declared:.4g}, not the expected {scale:.4g}",
        "self.scale = 1 / math.sqrt(head_dim); if another scale is intended, pass --scale",
        S_SCALE, "scale_attribute",
    ),
    # -- crashes (seed 002, 4.1's table) --
    Mistake(
        "view_not_contiguous", "crash",
        "view() on the transposed context raises: transpose left it non-contiguous",
        "context.transpose(1, 2).contiguous().view(B, T, embed_dim), or .reshape(B, T, embed_dim)",
        S_SPLIT, "every row (the module raises)", pattern=r"view size is not compatible with input tensor's size and stride",
    ),
    Mistake(
        "key_length_from_query", "crash",
        "K/V are viewed with the query's length: cross-attention (T_k != T_q) raises a shape error",
        "k.view(B, key.size(1), num_heads, head_dim) (or view(B, -1, ...))",
        S_WALK, "parity_cross and the other cross-attention rows", pattern=r"shape '\[.*\]' is invalid for input of size",
    ),
    Mistake(
        "fill_overflows_half", "crash",
        "the mask fill -1e9 does not fit in float16 (its largest magnitude is 65504)",
        "fill with float('-inf') or torch.finfo(scores.dtype).min",
        S_ERRORS, "low_precision[fp16] rows", pattern=r"cannot be converted to type (at::|c10::)?Half without overflow",
        hardening=True,
    ),
    Mistake(
        "inplace_autograd", "crash",
        "an in-place operation overwrites a tensor autograd needs for the backward pass",
        "use the out-of-place form (scores = scores + mask, weights = weights * keep)",
        S_GRAD, "every row with a backward pass", pattern=r"modified by an inplace operation",
    ),
    Mistake(
        "mask_dtype_error", "crash",
        "the mask's dtype is not what the operation takes (masked_fill needs bool; additive masks must be float)",
        "bool masks through masked_fill, float masks added; convert once: attn_mask.to(torch.bool)",
        S_ERRORS, "masked rows", pattern=r"masked_fill_? only supports boolean masks|expected scalar type|can't be cast to the desired output type|with a bool tensor is not supported",
    ),
    Mistake(
        "device_mismatch", "crash",
        "a tensor built inside forward (a mask, torch.tril(torch.ones(..))) is on another device than the inputs",
        "build it on the inputs' device: torch.ones(T, T, dtype=torch.bool, device=x.device); or make a fixed one once, "
        "as a buffer that module.to(device) moves: self.register_buffer('causal', mask, persistent=False)",
        S_ERRORS, "every row that builds it, on a GPU (attnlab check --device cuda)",
        # CUDA's message, then the meta device's ("Tensor on device meta is not on the expected device cpu!")
        pattern=r"Expected all tensors to be on the same device|is not on the expected device",
    ),
)  # fmt: skip


def by_id(mistake_id: str) -> Mistake:
    for m in MISTAKES:
        if m.id == mistake_id:
            return m
    raise KeyError(f"no mistake {mistake_id!r} in the catalogue; ids: {[m.id for m in MISTAKES]}")


# Sizes and values the gallery fills the messages with: seed 000's case (E=64, H=8, D=8).
_EXAMPLE = {
    "E": 64,
    "H": 8,
    "G": 8,
    "D": 8,
    "scale": 1 / 8**0.5,
    "rE": 1 / 64**0.5,
    "rD": 1 / 8**0.5,
    "declared": 0.125,
    "convention": "True = may attend (the convention of the seeds and SDPA)",
    "pad_fix": "zero the padded rows of V before the weighted sum: v.masked_fill(key_padding_mask[:, None, :, None], 0.0)",
    "qkv_order": "k, q, v",
    "polarity_fix": "mask with masked_fill(~attn_mask, float('-inf')); or, if True = blocked is your convention, "
    "say so: --mask-convention block",
}
_HOW = {"recipe": "recomputed with the mistake", "behaviour": "probed", "crash": "its exception"}


def gallery_markdown(examples: dict[str, list[str]] | None = None) -> str:
    """``docs/check_gallery.md``: every catalogued mistake, what check says, the rows it fails, the fix;
    ``examples`` maps a mistake's id to the files of modules that make it."""
    examples = examples or {}
    lines = [
        "# The mistakes `attnlab check` names",
        "",
        "Generated from `attnlab.check.catalogue.MISTAKES` by `python scripts/check_gallery.py`; "
        "`tests/test_check_diagnosis.py` fails when the two differ. The messages are filled in for "
        "seed 000's sizes (embed_dim 64, 8 heads of 8). How each is recognised: *recomputed* (the output "
        "is recomputed with the mistake on the module's own weights and inputs, and matches), *probed* "
        "(a behaviour tested directly) or *its exception* (the message it raises).",
        "",
        "A *hardening note* is robustness a textbook module is not written for: the module computes "
        "attention correctly, the check passes (exit 0) and prints the note with its fix; `--strict` "
        "makes it a failure.",
        "",
        f"{len(MISTAKES)} mistakes. Each module in `tests/mistake_corpus/` makes one of them (or none) and "
        "must get it named first.",
        "",
    ]
    for m in MISTAKES:
        lines += [
            f"## `{m.id}`",
            "",
            f"- **check says:** {m.text('found', _EXAMPLE)}",
            f"- **rows that fail:** {m.symptom}",
            f"- **recognised by:** {_HOW[m.kind]}",
            *(["- **verdict:** a hardening note (the check passes; `--strict` fails on it)"] if m.hardening else []),
            f"- **fix:** {m.text('fix', _EXAMPLE)}",
            f"- **see:** {m.seed}",
        ]
        if examples.get(m.id):
            lines.append("- **written wrong in:** " + ", ".join(f"`{f}`" for f in sorted(examples[m.id])))
        lines.append("")
    return "\n".join(lines)
