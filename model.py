"""The Llama 3 architecture in one file, free of distributed code.

Read top to bottom:
  1. ModelArgs and PRESETS        every Llama 3 size, from a CPU toy to 405B, Mixtral 8x7B, and their
                                 checks (1b)
  2. RMSNorm, RoPE                normalization; rotary positions with Llama 3.1's frequency scaling
  3. Attention, FeedForward, MoE  grouped-query attention (SDPA), SwiGLU MLP, packed-document masks; a
                                 mixture of SwiGLU experts with a router and its load-balancing loss;
                                 a linear's matmuls in float8 (FP8Linear, --precision fp8)
  4. Transformer                  embedding -> Blocks -> norm -> head; LoRA (add_lora, merge_lora)
  5. Generation                   sampling with a KV cache (temperature, top-k, top-p; 0 = greedy), and K
                                 replies to one prompt in one batch (sample)
  6. Counting                     `python model.py` lists parameter counts; FLOPs, memory: costs.py

Nothing here knows about tensor/pipeline/data parallelism: parallel.py changes a built model from
the outside (sharding linears, dropping other stages' layers). So layers are keyed by *global* index
("0", "1", ...), as a mixture's experts are, and parameter names do not depend on which a rank keeps;
attention infers its local head count from its tensors. Names follow Meta's code (tok_embeddings, layers.N.attention.wq,
feed_forward.w1, ...); RoPE uses Hugging Face's "rotate half" layout (weights.py converts both).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import sys
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

# ----------------------------------------------------------------------------------------------------
# 1. Hyperparameters


# --precision's names -> the dtype a model computes in
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = 320
    multiple_of: int = 64  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    ffn_hidden: Optional[int] = None  # explicit FFN hidden size (HF's intermediate_size); overrides the rule
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1: factor, low_freq_factor, high_freq_factor, original_max_seq_len
    rope_scaling: Optional[dict] = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # a head of num_labels outputs in place of the vocabulary's logits: a reward model's score (1), as
    # Hugging Face's LlamaForSequenceClassification; None: a language model
    num_labels: Optional[int] = None
    # a mixture of experts (Mixtral, Jiang et al. 2024): every moe_every-th layer's feed-forward is
    # n_experts SwiGLU experts of expert_hidden (None: hidden_dim), each token routed to top_k of them
    # (Llama 4 interleaves MoE and dense layers: moe_every 2); 0 experts: a dense model
    n_experts: int = 0
    top_k: int = 2
    expert_hidden: Optional[int] = None
    moe_every: int = 1

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_args(self)  # (below: every value it cannot be built from, from any way in)

    @classmethod
    def from_dict(cls, d) -> "ModelArgs":
        """Model args as a file records them (a checkpoint's meta.json: dataclasses.asdict), checked."""
        check_record(d, [f.name for f in fields(cls)])
        return cls(**d)

    @property
    def output_size(self) -> int:
        return self.num_labels or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (a global index) has experts: the moe_every-th, 2 x moe_every-th, ..."""
        return self.n_experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @property
    def expert_dim(self) -> int:
        return self.expert_hidden if self.expert_hidden is not None else self.hidden_dim

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim (same parameter count as a 4*dim GELU MLP), scaled, rounded up."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# ----------------------------------------------------------------------------------------------------
# 1b. Checks

# Far past any real size; a larger one (from JSON) would overflow torch's int64, naming no field.
_MAX_SIZE = 2 ** 31 - 1
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is not a size


def _is_positive_number(v) -> bool:
    """An int or float in (0, largest float]: NaN fails the comparison, and an int too large for a float
    (from a 400-digit number in a JSON file) would overflow inside torch."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= sys.float_info.max


def show(v, limit: int = 60) -> str:
    """repr(v) for a message, cut to `limit` characters (Python refuses to print ints of 4300+ digits)."""
    try:
        text = repr(v)
    except (ValueError, RecursionError):
        text = f"<{type(v).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_rope_scaling(s):
    """None or Llama 3.1's four numbers, high_freq_factor > low_freq_factor (it divides by their
    difference), factor >= 1: else NaN or infinite frequencies; a run trains on with a NaN loss."""
    if s is None:
        return
    if not isinstance(s, dict):
        raise ValueError(f"rope_scaling must be null or an object with {', '.join(ROPE_SCALING_KEYS)}, got "
                         f"{show(s)}")
    wrong = [f"missing {k}" for k in ROPE_SCALING_KEYS if k not in s] + \
        [f"unknown {show(k)}" for k in s if k not in ROPE_SCALING_KEYS]
    if wrong:
        raise ValueError(f"rope_scaling needs exactly the keys {', '.join(ROPE_SCALING_KEYS)} (null: no "
                         f"scaling): {', '.join(wrong)}")
    for k in ROPE_SCALING_KEYS[:3]:
        if not _is_positive_number(s[k]):
            raise ValueError(f"rope_scaling {k} must be a positive number, got {show(s[k])}")
    if s["factor"] < 1:
        raise ValueError(f"rope_scaling factor must be at least 1 (how much longer the context gets), got "
                         f"{s['factor']}")
    if not s["high_freq_factor"] > s["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor ({s['high_freq_factor']}) must be larger than "
                         f"low_freq_factor ({s['low_freq_factor']})")
    if not is_int(s["original_max_seq_len"]) or not 1 <= s["original_max_seq_len"] <= _MAX_SIZE:
        raise ValueError(f"rope_scaling original_max_seq_len must be a positive integer, got "
                         f"{show(s['original_max_seq_len'])}")


def check_args(a: ModelArgs):
    """Every value a model cannot be built from, or would train on with a NaN loss, refused (ValueError, one
    line): each way in (presets, flags, config.json, params.json, a checkpoint's meta.json) is checked."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len",
                 *(["ffn_hidden"] if a.ffn_hidden is not None else [])):
        value = getattr(a, name)
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {show(value)}")
        if value > _MAX_SIZE:
            raise ValueError(f"{name} must be at most {_MAX_SIZE}, got {show(value)}")
    for name in ("norm_eps", "rope_theta", *(["ffn_dim_multiplier"] if a.ffn_dim_multiplier is not None
                                             else [])):
        value = getattr(a, name)
        if not _is_positive_number(value):
            raise ValueError(f"{name} must be a positive number, got {show(value)}")
    if not isinstance(a.tie_embeddings, bool):
        raise ValueError(f"tie_embeddings must be true or false, got {show(a.tie_embeddings)}")
    if a.num_labels is not None and not (is_int(a.num_labels) and 1 <= a.num_labels <= _MAX_SIZE):
        raise ValueError(f"num_labels must be null or a positive integer, got {show(a.num_labels)}")
    if a.num_labels is not None and a.tie_embeddings:
        raise ValueError("a head of num_labels outputs cannot be tied to the embedding table")
    if a.dim % a.n_heads:
        raise ValueError(f"dim {a.dim} is not divisible by n_heads {a.n_heads}")
    if a.n_heads % a.n_kv_heads:
        raise ValueError(f"n_heads {a.n_heads} is not divisible by n_kv_heads {a.n_kv_heads}")
    if a.head_dim % 2:
        raise ValueError(f"head_dim {a.head_dim} must be even for RoPE")
    if a.ffn_hidden is None and a.ffn_dim_multiplier is not None and \
            not 1 <= a.ffn_dim_multiplier * int(2 * 4 * a.dim / 3) <= _MAX_SIZE:
        raise ValueError(f"ffn_dim_multiplier {a.ffn_dim_multiplier} makes the FFN hidden size of dim "
                         f"{a.dim} less than 1 or more than {_MAX_SIZE}")
    check_rope_scaling(a.rope_scaling)
    check_experts(a)


def check_experts(a: ModelArgs):
    """A mixture's sizes: 0 experts (dense) or 2 or more, top_k of them, every moe_every-th layer."""
    if not is_int(a.n_experts) or not (a.n_experts == 0 or 2 <= a.n_experts <= 4096):
        raise ValueError(f"n_experts must be 0 (a dense model) or 2 to 4096, got {show(a.n_experts)}")
    if a.n_experts and not (is_int(a.top_k) and 1 <= a.top_k <= a.n_experts):
        raise ValueError(f"top_k must be 1 to n_experts {a.n_experts}, got {show(a.top_k)}")
    if a.expert_hidden is not None and not (is_int(a.expert_hidden) and 1 <= a.expert_hidden <= _MAX_SIZE):
        raise ValueError(f"expert_hidden must be null or a positive integer, got {show(a.expert_hidden)}")
    if not (is_int(a.moe_every) and 1 <= a.moe_every <= a.n_layers):
        raise ValueError(f"moe_every must be 1 to n_layers {a.n_layers}, got {show(a.moe_every)}")


def check_record(d, known: list[str]):
    """Refuse (one line) model args that are not a dict, have keys ModelArgs lacks (named: from
    another version or program) or miss a size the weights need (the defaults are a toy's)."""
    if not isinstance(d, dict):
        raise ValueError(f"model args must be an object of named values, got {show(d)}")
    unknown = [show(k) for k in d if k not in known]
    if unknown:
        raise ValueError(f"model args have unknown keys {', '.join(unknown)}; ModelArgs takes "
                         f"{', '.join(known)}: was the file written by another version?")
    missing = [k for k in ("dim", "n_layers", "n_heads", "vocab_size") if k not in d]
    if missing:
        raise ValueError(f"model args miss {', '.join(missing)}: the file is incomplete")


LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
LLAMA32_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
           ffn_dim_multiplier=1.3)
_70B = dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
            ffn_dim_multiplier=1.3)

# The published models (Meta's params.json), then CPU-sized ones on the byte tokenizer's vocabulary
# (256 bytes + 12 specials, padded to 320; train.py resizes vocab_size to its tokenizer).
PRESETS: dict[str, ModelArgs] = {
    "llama3-8b": ModelArgs(**_8B, max_seq_len=8192),
    "llama3-70b": ModelArgs(**_70B, max_seq_len=8192),
    "llama3.1-8b": ModelArgs(**_8B, max_seq_len=131072, rope_scaling=LLAMA31_ROPE),
    "llama3.1-70b": ModelArgs(**_70B, max_seq_len=131072, rope_scaling=LLAMA31_ROPE),
    "llama3.1-405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                               multiple_of=4096, ffn_dim_multiplier=1.2, max_seq_len=131072,
                               rope_scaling=LLAMA31_ROPE),
    "llama3.2-1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             multiple_of=256, ffn_dim_multiplier=1.5, max_seq_len=131072,
                             rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    "llama3.2-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                             multiple_of=256, ffn_dim_multiplier=1.0, max_seq_len=131072,
                             rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=256),
    # mini is train.py's default: the best of a sweep for ~100 s of training on 2 CPU cores (README).
    "mini": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=512,
                      rope_theta=10000.0),
    "small": ModelArgs(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=320, max_seq_len=1024),
    "medium": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=320, max_seq_len=1024),
    # mixtures of experts: Mixtral 8x7B (Mistral's params.json), then CPU-sized ones whose two active
    # experts of half the dense FFN make as many active parameters per token as tiny and mini
    "mixtral-8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden=14336,
                              rope_theta=1e6, max_seq_len=32768, n_experts=8, top_k=2),
    "moe-tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=256,
                          n_experts=4, top_k=2, expert_hidden=96),
    "moe-mini": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=512,
                          rope_theta=10000.0, n_experts=8, top_k=2, expert_hidden=192),
}


# ----------------------------------------------------------------------------------------------------
# 2. Normalization and rotary position embeddings


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019). Computed in fp32 for stability, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i < head_dim/2, with Llama 3.1's long-context scaling:
    wavelengths past the original context slowed by `factor`, short ones kept, the band between
    interpolated. fp32, recomputed per forward (a few tiny ops) so model.to() never casts it."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    s = args.rope_scaling
    if s:
        old_len = s["original_max_seq_len"]
        low_wavelen = old_len / s["low_freq_factor"]
        high_wavelen = old_len / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        mid = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / s["factor"],
                               torch.where(wavelen < high_wavelen, inv_freq, mid))
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """positions (B, T) or (T,) -> cos, sin of shape (B or 1, T, 1, head_dim), broadcast over heads."""
    angles = positions.float()[..., None] * inv_freq  # (.., T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: pair i with i + head_dim/2
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rope(x, cos, sin):
    """Rotate each (x_i, x_{i+d/2}) pair of x (B, T, heads, head_dim) by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


# Device types on which packed documents get FlexAttention's block mask (its backward has no CPU kernel).
BLOCK_MASK_DEVICES = ("cuda",)


def document_mask(doc_ids: torch.Tensor | None, q_pos: torch.Tensor | None = None,
                  kv_pos: torch.Tensor | None = None) -> torch.Tensor | BlockMask:
    """Causal attention within packed documents: query i sees key j iff j <= i in the same document
    (doc_ids (B, T); None: one per row). q_pos, kv_pos (1-D; default: the whole sequence) name the
    queries' and keys' positions (context parallelism: a rank's T/cp queries, every rank's keys).

    On CUDA a FlexAttention BlockMask: the kernel skips empty 128 x 128 tiles (most, for short
    documents) and no (B, T, T) mask exists. Elsewhere a boolean (B or 1, 1, Tq, Tkv) mask of B*T^2
    bytes (2 GB for 8 x 16K tokens), which only SDPA's memory-efficient and math kernels take."""
    device = (doc_ids if doc_ids is not None else kv_pos).device
    if q_pos is None:
        q_pos = kv_pos = torch.arange(doc_ids.shape[1], device=device)
    if device.type in BLOCK_MASK_DEVICES:
        def visible(b, h, q, kv):  # index tensors in, a boolean out, for any tile
            causal = kv_pos[kv] <= q_pos[q]
            return causal if doc_ids is None else causal & (doc_ids[b, q_pos[q]] == doc_ids[b, kv_pos[kv]])
        return create_block_mask(visible, None if doc_ids is None else doc_ids.shape[0], None, len(q_pos),
                                 len(kv_pos), device=device,
                                 _compile=device.type == "cuda")  # compiled: tile by tile, never (B, T, T)
    mask = (kv_pos[None, :] <= q_pos[:, None])[None]  # (1, Tq, Tkv)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, q_pos, None] == doc_ids[:, None, kv_pos])  # (B, Tq, Tkv)
    return mask[:, None]  # broadcast over heads


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) non-decreasing document ids -> position of each token inside its own document."""
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


# ----------------------------------------------------------------------------------------------------
# 3. Attention and feed-forward


def left_padding(pad: torch.Tensor, start_pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows left-padded by pad (B,) tokens, at positions start_pos .. start_pos+T-1 of a KV cache ->
    each row's RoPE positions (B, T), counted from its first real token (so a row's numbers are those of
    its prompt alone), and the mask (B, 1, T, start_pos+T): a query sees the keys at or before it that are
    not padding; a padding query sees itself too, so that no softmax row is empty (NaN)."""
    q = torch.arange(start_pos, start_pos + T, device=pad.device)[None, :, None]  # (1, T, 1)
    kv = torch.arange(start_pos + T, device=pad.device)[None, None, :]  # (1, 1, S)
    first = pad[:, None, None]  # (B, 1, 1)
    mask = (kv <= q) & (kv >= first) | (kv == q)
    return (q[..., 0] - pad[:, None]).clamp(min=0), mask[:, None]


class KVCache:
    """One layer's keys and values, (B, kv heads, max_len, head_dim), filled in order; head count,
    dtype and device come from the first keys (a tp rank holds only its own heads)."""

    def __init__(self, max_len: int):
        self.max_len, self.k, self.v, self.filled = max_len, None, None, 0

    def select(self, rows: torch.Tensor):
        """Keep the rows `rows` (indices, repeats allowed: a prompt's cache for each of its continuations),
        copying only the positions filled so far: a row that ends early costs a copy of what is written,
        not of all max_len positions (those past it are written before they are read)."""
        k = self.k.new_empty(len(rows), *self.k.shape[1:])
        v = torch.empty_like(k)
        k[:, :, :self.filled] = self.k[rows, :, :self.filled]
        v[:, :, :self.filled] = self.v[rows, :, :self.filled]
        self.k, self.v = k, v

    def update(self, start_pos: int, k, v):
        B, heads, T, head_dim = k.shape
        if self.k is None:
            self.k = k.new_zeros(B, heads, self.max_len, head_dim)
            self.v = torch.zeros_like(self.k)
        self.k[:, :, start_pos:start_pos + T] = k
        self.v[:, :, start_pos:start_pos + T] = v
        self.filled = max(self.filled, start_pos + T)
        return self.k[:, :, :start_pos + T], self.v[:, :, :start_pos + T]


class Linear(nn.Linear):
    """x W^T, no bias: the linears of attention and the MLP, in float8 where set_fp8 says (FP8Linear).
    One may carry a LoRA update (add_lora): x W^T + (alpha / r) (x A^T) B^T, A (r, in) and B (out, r)."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__(in_features, out_features, bias=False, device=device)
        self.register_parameter("lora_A", None)
        self.register_parameter("lora_B", None)
        self.lora_scale, self.lora_on = 0.0, True
        self.fp8 = False  # a training setting (set_fp8)

    def forward(self, x):
        fp8 = self.fp8 and self.training and x.numel() > 0  # (an expert no token chose: nothing to scale)
        y = FP8Linear.apply(x, self.weight) if fp8 else F.linear(x, self.weight)
        if self.lora_A is not None and self.lora_on:  # (B, T, in) -> (B, T, r) -> (B, T, out)
            y = y + self.lora_scale * F.linear(F.linear(x, self.lora_A), self.lora_B)
        return y


# FP8 training (--precision fp8): a block's linears multiply in float8 (8 bits: e4m3, 3 mantissa bits and
# 4 of exponent, or e5m2), at twice bf16's matmul rate on an H100; everything else stays bf16, the master
# weights, gradients and optimizer state as bf16 training keeps them. Tensorwise dynamic scaling: each
# operand is multiplied so its largest magnitude this step lands on the format's largest, cast, and the
# matmul divides the product by both scales (torch._scaled_mm, on an FP8 GPU or a CPU).
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def to_fp8(t: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """t (2-D) scaled so its amax lands on dtype's largest number, cast -> (t8, fp32 inverse scale)."""
    amax = t.detach().abs().amax().float().clamp(min=1e-12)  # (an all-zero t: any scale serves)
    scale = FP8_MAX[dtype] / amax
    return (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype), scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column: _scaled_mm's layout for its second operand."""
    return t.t().contiguous().t()


def scaled_mm(a8, b8, scale_a, scale_b, out_dtype) -> torch.Tensor:
    """(a8 scale_a)(b8 scale_b) with fp32 accumulation, in out_dtype: torch._scaled_mm. On a CPU, with
    oneDNN off for the call: where a CPU has AMX int8, torch gives e4m3 x e4m3 to oneDNN, whose float8
    matmul there is its reference loop (0.3 s for 128 x 256 x 256), and torch's own kernel otherwise
    (fp32 matmuls of the exact float8 values: the same numbers, ~100x faster)."""
    if a8.device.type != "cpu" or torch.compiler.is_compiling():
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    finally:
        torch.backends.mkldnn.enabled = was


class FP8Linear(torch.autograd.Function):
    """y = x W^T in float8, the three matmuls of a linear each in _scaled_mm: forward x8 W8^T; backward
    dx = g8 W8 and dW = g8^T x8. x and W in e4m3 (precision where values are bounded), the output's
    gradient g in e5m2 (its range: gradients span more orders of magnitude than they need digits).
    Backward keeps x8 and W8 (1 byte a number, not bf16's 2). x (..., in), W (out, in)."""

    @staticmethod
    def forward(ctx, x, weight):
        x8, sx = to_fp8(x.reshape(-1, x.shape[-1]), E4M3)  # (N, in)
        w8, sw = to_fp8(weight, E4M3)  # (out, in)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype)
        y = scaled_mm(x8, w8.t(), sx, sw, x.dtype)  # (N, out)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = to_fp8(grad.reshape(-1, grad.shape[-1]), E5M2)  # (N, out)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(g8, column_major(w8), sg, sw, ctx.dtypes[0])
            dx = dx.view(ctx.shape)  # (N, out) x (out, in)
        if ctx.needs_input_grad[1]:  # (out, N) x (N, in)
            dw = scaled_mm(g8.t().contiguous(), column_major(x8), sg, sx, ctx.dtypes[1])
        return dx, dw


class Attention(nn.Module):
    """GQA (Ainslie et al. 2023): n_heads query heads share n_kv_heads key/value heads."""
    backend = "auto"  # the kernel that computes it (ATTN_BACKENDS; set_attn_backend)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = Linear(args.dim, args.n_heads * args.head_dim)
        self.wk = Linear(args.dim, kv_dim)
        self.wv = Linear(args.dim, kv_dim)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim)

    def project(self, x, cos, sin):
        """x (B, T, dim) -> q (B, T, n_heads, head_dim), k and v (B, T, n_kv_heads, head_dim), RoPE
        on q and k. Head counts come from the tensors: under tp, wq/wk/wv hold this rank's heads."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None, start_pos: int = 0):
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))  # (B, heads, T, head_dim)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)  # (B, n_kv_heads, start_pos + T, head_dim)
        # Causal by default (lets SDPA pick the flash kernel); an explicit mask for packed documents or a
        # prefill on top of a cache. A single decoded token attends to everything cached: no mask.
        is_causal = mask is None and k.shape[2] == T and T > 1
        y = attention(q, k, v, mask, is_causal, self.backend)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_heads * head_dim)
        return self.wo(y)


# The kernels SDPA may be held to for causal attention, all equal up to float rounding. auto: SDPA's
# choice, fed K and V grouped on CUDA (FlashAttention-2 takes them so), repeated on the CPU; flash:
# FlashAttention-2 (Dao 2023), grouped; cudnn: cuDNN's fused attention (CUDA; faster than flash on
# H100; K and V repeated); efficient: memory-efficient (Rabe & Staats 2021; CUDA); math: the unfused
# reference. Masked attention (packed documents, CP) is FlexAttention's on a GPU (document_mask),
# SDPA's choice elsewhere: the flag does not reach it (checks.check_attention refuses it).
ATTN_BACKENDS = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def set_attn_backend(model: nn.Module, backend: str):
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


def attention(q, k, v, mask, is_causal: bool, backend: str = "auto"):
    """q (B, n_heads, T, head_dim), k and v (B, n_kv_heads, S, head_dim); each key/value head serves
    n_heads / n_kv_heads query heads. Kernel: ATTN_BACKENDS; a BlockMask (document_mask) goes to
    FlexAttention, which groups by itself."""
    if isinstance(mask, BlockMask):
        # compiled once on its own; inside a compiled block (--compile) the block's compilation fuses it
        flex = flex_attention if torch.compiler.is_compiling() or not q.is_cuda else compiled_flex_attention()
        return flex(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    dtype = q.dtype
    q, k, v = sdpa_inputs(q, k, v, mask, backend)
    with held_to(backend, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=k.shape[1] != q.shape[1]).to(dtype)


def held_to(backend: str, mask):
    held = mask is None and backend != "auto"
    return sdpa_kernel([ATTN_BACKENDS[backend]]) if held else contextlib.nullcontext()


def groups_kv(backend: str, cuda: bool) -> bool:
    """Whether SDPA gets an unmasked attention's K and V grouped: for flash, and auto on CUDA."""
    return backend == "flash" or backend == "auto" and cuda


def sdpa_inputs(q, k, v, mask, backend: str):
    """q, k, v as SDPA gets them: K and V grouped (enable_gqa, no copy) where groups_kv says, else
    repeated to n_heads (masked kernels do not all group; where one cannot, the call falls to the
    slow math path); bf16 on a CPU as fp32, faster there (the flash backward above all). A decoded token
    on a CPU reads the KV cache grouped, masked or not: repeating the cache would copy it at every token
    (and the grouped kernel is the faster one there, about 2x at 256 rows)."""
    grouped = groups_kv(backend, q.is_cuda) and mask is None or q.shape[2] == 1 and not q.is_cuda
    if k.shape[1] != q.shape[1] and not grouped:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, n_heads, S, head_dim)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        q, k, v = q.float(), k.float(), v.float()
    return q, k, v


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled once per process (uncompiled, it computes the whole (T, T) scores)."""
    return torch.compile(flex_attention, dynamic=False)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x), of hidden size `hidden` (default: args.hidden_dim)."""

    def __init__(self, args: ModelArgs, hidden: int | None = None):
        super().__init__()
        hidden = hidden or args.hidden_dim
        self.w1 = Linear(args.dim, hidden)  # gate
        self.w3 = Linear(args.dim, hidden)  # up
        self.w2 = Linear(hidden, args.dim)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Mixtral's sparse feed-forward: a router (gate, a linear dim -> n_experts) scores each token;
    softmax over the experts, the top_k kept, their weights renormalized to sum to 1; each expert is
    a SwiGLU FeedForward, and the token's output is its experts' outputs summed by weight. Dropless:
    every token reaches its top_k experts, however many choose the same one. Experts are keyed by
    global index, as layers are, so expert parallelism (parallel.py) keeps a rank's own and sets
    `dispatch`, which takes each token to the rank holding its expert and back.

    The load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4-6, as Mixtral trains with
    it): n_experts x sum over experts of (the fraction of token-expert pairs it got) x (its mean
    router probability); 1 x top_k when balanced. Its gradient reaches the router here, in backward
    (AuxLoss), weighted by aux_weight (set_moe_aux); the task's loss is untouched."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.n_experts = args.top_k, args.n_experts
        self.gate = Linear(args.dim, args.n_experts)
        self.experts = nn.ModuleDict({str(e): FeedForward(args, args.expert_dim) for e in range(args.n_experts)})
        self.dispatch = run_experts  # (expert parallelism: parallel.py's all-to-all)
        self.aux_weight = 0.0  # a training setting (set_moe_aux)
        self.stats = None  # (aux, busiest expert's share / even share, 1) summed while training: moe_stats

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim): N = B * T tokens
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (N, n_experts), in fp32
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        # (n_experts,) pairs per expert, counted into a fixed shape (bincount's depends on the data: a
        # graph break under --compile)
        ids = chosen.flatten()
        pairs = ids.new_zeros(self.n_experts).scatter_add_(0, ids, torch.ones_like(ids))
        y = self.dispatch(self.experts, x, chosen, weights, pairs).view(shape)
        aux = self.n_experts * (pairs / x.shape[0] * probs.mean(0)).sum()
        if self.training:
            self.record(aux.detach(), pairs)
        return AuxLoss.apply(y, aux, self.aux_weight) if self.aux_weight and self.training else y

    @torch.no_grad()
    def record(self, aux, pairs):
        """Sums for the log; activation checkpointing's recompute records twice, which no mean sees."""
        busiest = pairs.max() * self.n_experts / pairs.sum()
        s = torch.stack([aux, busiest.to(aux.dtype), torch.ones_like(aux)])
        self.stats = s if self.stats is None else self.stats + s


def run_experts(experts: nn.ModuleDict, x, chosen, weights, pairs):
    """x (N, dim) through the experts: each (token, slot) pair goes to its expert, grouped by expert
    so each runs one matmul over all its tokens; chosen, weights (N, top_k); pairs (n_experts,) the
    pairs each expert got. -> (N, dim)."""
    n, k = chosen.shape
    order = chosen.flatten().argsort(stable=True)  # the N * top_k pairs, grouped by expert
    counts = pairs.tolist()  # (a host sync: the sizes)
    grouped = x[order // k]  # (N * top_k, dim): each pair's token
    y = torch.cat([experts[key](part) for key, part in zip(experts, grouped.split(counts))])
    out = torch.empty_like(y)
    out[order] = y * weights.flatten()[order, None]  # back in (token, slot) order
    return out.view(n, k, -1).sum(1)  # each token's top_k outputs, summed in slot order (deterministic)


class AuxLoss(torch.autograd.Function):
    """The layer's output unchanged; in backward the load-balancing loss gets the gradient `weight`, as
    though weight x aux had been added to the loss (Megatron-LM's MoEAuxLossAutoScaler): the router
    learns it on its own pipeline stage, recomputed with its block under activation checkpointing."""

    @staticmethod
    def forward(ctx, y, aux, weight: float):
        ctx.weight = weight
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, device=grad.device), None


def dropped(x, p: float, training: bool):
    """Dropout while training (Llama 3 has none; a small model on a small data set needs it)."""
    return F.dropout(x, p, training=True) if p and training else x


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + ffn(norm(.)), each branch dropped out."""

    def __init__(self, args: ModelArgs, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if moe else FeedForward(args)
        self.dropout = 0.0  # a training setting, not the architecture's (set_dropout)

    def forward(self, x, cos, sin, mask=None, cache=None, start_pos=0):
        x = x + dropped(self.attention(self.attention_norm(x), cos, sin, mask, cache, start_pos),
                        self.dropout, self.training)
        return x + dropped(self.feed_forward(self.ffn_norm(x)), self.dropout, self.training)


def moe_layers(model: nn.Module) -> list[MoE]:
    """This rank's mixture layers (its pipeline stage's), in layer order."""
    return [b.feed_forward for b in model.layers.values() if isinstance(b.feed_forward, MoE)]


def set_moe_aux(model: nn.Module, weight: float):
    """The load-balancing loss's gradient weight in every MoE layer: --moe-aux-coef over the MoE layers
    and the step's micro-batches (over every dp rank), times fp16's loss scale."""
    for m in moe_layers(model):
        m.aux_weight = weight


def moe_stats(model: nn.Module) -> torch.Tensor | None:
    """(aux loss, busiest expert's share over the even share, count) summed over this rank's MoE
    layers and forwards since the last call, which clears them; None for a dense model."""
    sums = [m.stats for m in moe_layers(model) if m.stats is not None]
    for m in moe_layers(model):
        m.stats = None
    return torch.stack(sums).sum(0) if sums else None


def set_fp8(model: nn.Module, on: bool):
    """Float8 matmuls (FP8Linear) in every block's linears while training, the experts' included; the
    router, the embedding and the head stay in the compute precision, as evaluation and generation do."""
    for block in model.layers.values():
        routers = {id(m.gate) for m in block.modules() if isinstance(m, MoE)}
        for m in block.modules():
            if isinstance(m, Linear) and id(m) not in routers:
                m.fp8 = on


def set_dropout(model: nn.Module, p: float):
    """Dropout p on the embedding's and every block branch's output while training."""
    for m in model.modules():
        if isinstance(m, (Block, Transformer)):
            m.dropout = p


# ----------------------------------------------------------------------------------------------------
# 4. The model


def init_tensor(args: ModelArgs, name: str, shape, seed: int, device="cpu") -> torch.Tensor:
    """The initial value of parameter `name` (full, unsharded shape), fp32. Linears and the
    embedding ~ N(0, 0.02); wo and w2, which write into the residual stream, ~
    N(0, 0.02 / sqrt(2 * n_layers)) so the residual's variance does not grow with depth (GPT-2);
    norms = 1. Each parameter's generator is seeded by (seed, name), so a tp or pp rank builds only
    its own pieces yet holds exactly the whole model's weights (parallel.materialize). Drawn on the
    CPU by default: one seed, one model on any device."""
    if name.endswith(("norm.weight", "lora_B")):  # (LoRA's B: zero, so training starts from the model)
        return torch.full(shape, float(name.endswith("norm.weight")), device=device)
    g = torch.Generator(device=device)  # seeded by a digest: the same in every process (unlike hash())
    g.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little"))
    if name.endswith("lora_A"):  # as nn.Linear draws its weight (PEFT's LoRA too): U(-1/sqrt(in), 1/sqrt(in))
        return torch.empty(shape, device=device).uniform_(-shape[1] ** -0.5, shape[1] ** -0.5, generator=g)
    std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return torch.empty(shape, device=device).normal_(0.0, std, generator=g)


# Parameters a training recipe keeps beside the model's own (rl.py's PPO value head): its checkpoints hold
# them, the model does not, so reading a checkpoint as a model (--init, an export) leaves them out.
TRAINING_ONLY = ("value_head.",)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # no default initialization (init_weights, or a checkpoint, gives every weight its value); on the meta
        # device nn.Embedding's own normal_ would import torch's compiler stack: a second of start-up
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleDict({str(i): Block(args, args.is_moe(i)) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.output_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # activation checkpointing (train.py sets it): False; "full" (or True), each block recomputed in
        # backward; "selective", only its cheap element-wise work (selective_recompute)
        self.act_ckpt = False
        # torch.compile'd blocks for training steps (train.py --compile), by layer key; a plain dict, so
        # they are not registered twice as submodules. Evaluation and generation run the blocks eagerly.
        self.compiled_blocks = {}
        # for each parameter tensor parallelism cuts, (dim, full size along dim): parallel.py fills it, and
        # the checkpoints and the gradient norm read it (empty: nothing is cut)
        self.tp_placement = {}
        self.dropout = 0.0  # of the embedding's output while training (set_dropout)
        if self.tok_embeddings.weight.device.type != "meta":  # on meta: no storage, initialized later
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Every parameter from init_tensor(seed); seed None draws one from the global RNG, so
        torch.manual_seed(s) before Transformer(args) gives one model per s."""
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        for name, p in self.named_parameters():
            p.copy_(init_tensor(self.args, name, p.shape, seed, p.device))

    def forward(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, start_pos: int = 0, seq_len: int | None = None,
                layers: tuple[int, int] | None = None, head: bool = True, pad: torch.Tensor | None = None):
        """tokens (B, T) int64 -> logits (B, T, vocab_size), for what this model holds.

        doc_ids (B, T), optional: non-decreasing ids of packed documents; attention stays inside
        each and RoPE positions restart at 0 in each. caches, start_pos: KV-cached generation at
        positions start_pos .. start_pos+T-1; pad (B,): each row's count of left padding there
        (prompts of unequal lengths generated in one batch: left_padding). head=False: stop at the
        final norm (B, T, dim), for a loss that applies the head itself (loss.py's chunks).

        A pipeline stage (parallel.py) holds some layers: it embeds only if it holds the embedding
        (inputs are then token ids, else the previous stage's residual stream (B, T, dim)) and ends
        with the norm and head only if it holds them. `layers` (start, end): run one model chunk of
        those held (the interleaved schedule). seq_len: the whole sequence's length, where a rank
        holds part of it (context or sequence parallelism; default: inputs' length).
        """
        first = self.tok_embeddings is not None if layers is None else layers[0] == 0
        last = self.output is not None if layers is None else layers[1] == self.args.n_layers
        h = dropped(self.tok_embeddings(inputs), self.dropout, self.training) if first else inputs  # (B, T, dim)
        T = inputs.shape[1] if seq_len is None else seq_len
        cos, sin, mask = self.attention_inputs(T, h.device, doc_ids, caches, start_pos, pad)
        keys = None if layers is None else [str(i) for i in range(*layers)]
        h = self.run_layers(h, cos, sin, mask, caches, start_pos, keys)
        if not last:
            return h
        return self.output(self.norm(h)) if head else self.norm(h)

    def attention_inputs(self, T: int, device, doc_ids=None, caches=None, start_pos: int = 0, pad=None):
        """RoPE cos/sin for each position and the attention mask (None: plain causal) for T tokens."""
        mask = None
        if doc_ids is not None:
            positions = document_positions(doc_ids)  # (B, T)
            mask = document_mask(doc_ids)
        elif pad is not None:
            positions, mask = left_padding(pad, start_pos, T)
        else:
            positions = torch.arange(start_pos, start_pos + T, device=device)
            # prefill after a prefix: query i sees keys <= start_pos+i
            if caches is not None and start_pos > 0 and T > 1:
                mask = torch.ones(T, start_pos + T, dtype=torch.bool, device=device).tril(start_pos)
        cos, sin = rope_cos_sin(positions, rope_frequencies(self.args, device))
        return cos, sin, mask

    def run_layers(self, h, cos, sin, mask=None, caches=None, start_pos: int = 0, keys=None):
        """h (B, T, dim) through this module's blocks (or those of `keys`), in global order."""
        for key in self.layers if keys is None else keys:
            layer = self.layers[key]
            cache = caches[int(key)] if caches is not None else None
            if self.training:
                layer = self.compiled_blocks.get(key, layer)
            if self.act_ckpt and self.training:
                context = selective_recompute if self.act_ckpt == "selective" else noop_context_fn
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, mask, use_reentrant=False,
                                                      context_fn=context)
            else:
                h = layer(h, cos, sin, mask, cache, start_pos)
        return h


# Selective activation checkpointing keeps a block's matmul and attention outputs (the FLOPs) and
# its SP/CP sequence gathers (the bytes; parallel.py's ops, listed by name so this file stays free
# of distributed code); norms, RoPE, SiLU and products cost a few memory passes to recompute.
KEPT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention", "llama3::all_gather", "llama3::reduce_scatter")


def _keep_expensive(ctx, op, *args, **kwargs):
    name = op.name() if hasattr(op, "name") else str(op)
    return CheckpointPolicy.MUST_SAVE if name in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_recompute():
    """torch.utils.checkpoint's context_fn for --act-ckpt selective (KEPT_OPS)."""
    return create_selective_checkpoint_contexts(_keep_expensive)


# ----------------------------------------------------------------------------------------------------
# 4b. LoRA (Hu et al. 2021): beside each chosen linear's frozen W, a trained low-rank update
#     (alpha / r) B A; B starts at zero, so training starts from the model. W has no gradient, fp32
#     master or optimizer state: under 1% of the parameters train. merge_lora gives the plain model.

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def lora_linears(model: Transformer) -> list[tuple[str, Linear]]:
    """(name, module) of every linear LoRA can adapt: "layers.3.attention.wq", ... (this stage's layers)."""
    parts = (("attention", LORA_TARGETS[:4]), ("feed_forward", LORA_TARGETS[4:]))
    return [(f"layers.{key}.{part}.{name}", getattr(getattr(block, part), name))
            for key, block in model.layers.items() for part, names in parts for name in names]


def add_lora(model: Transformer, rank: int, alpha: float, targets, train=()):
    """Freeze all parameters but those whose names start with one of `train` (a new head); give each
    targeted linear (wq ... w3) factors A (r, in) and B (out, r) of its local shape, left for
    init_tensor to draw. Under tp (model.tp_placement) a column-parallel linear's B is split with
    its rows, a row-parallel one's A with its columns; the other factor is whole on every rank, its
    gradient a partial sum over tp (each rank sees its slice of the linear's outputs or inputs)."""
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(tuple(train)))
    for name, linear in lora_linears(model):
        if name.rsplit(".", 1)[1] in targets:
            (out, inp), w = linear.weight.shape, linear.weight
            linear.lora_A = nn.Parameter(torch.empty(rank, inp, device=w.device, dtype=w.dtype))
            linear.lora_B = nn.Parameter(torch.empty(out, rank, device=w.device, dtype=w.dtype))
            linear.lora_scale = alpha / rank
            dim, size = model.tp_placement.get(f"{name}.weight", (None, None))
            if dim is not None:
                model.tp_placement[f"{name}.lora_{'BA'[dim]}"] = (dim, size)


def is_lora(name: str) -> bool:
    return name.endswith(("lora_A", "lora_B"))


def merge_lora(weight, lora_A, lora_B, scale: float) -> torch.Tensor:
    """W + scale * B A, in fp32 (the merged linear computes what the adapted one did, in one matmul)."""
    return weight.float() + scale * (lora_B.float() @ lora_A.float())


@contextlib.contextmanager
def without_lora(model: Transformer):
    """The base model, LoRA off, inside the block (dpo.py's and rl.py's reference: no copy)."""
    adapted = [linear for _, linear in lora_linears(model) if linear.lora_A is not None]
    for linear in adapted:
        linear.lora_on = False
    try:
        yield model
    finally:
        for linear in adapted:
            linear.lora_on = True


# ----------------------------------------------------------------------------------------------------
# 5. Generation with a KV cache


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, vocab) -> next token ids (B,). temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(next_probs(logits, temperature, top_k, top_p), 1, generator=generator).squeeze(-1)


def next_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
               top_p: float | None = None) -> torch.Tensor:
    """logits (B, vocab) -> the distribution each row's next token is drawn from (temperature > 0), row
    by row: rows batched together get the probabilities each would get alone."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Nucleus: keep the smallest set of tokens whose probability mass reaches top_p (the first is kept).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None):
    """Refuse settings that sample nothing (top_p 0) or upside down (a negative temperature)."""
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(model: Transformer, prompt_tokens, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None, n_vocab: int | None = None,
             whole_vocab=None) -> torch.Tensor:
    """Continue prompts (B, T) (or one list of ids) by up to max_new_tokens; returns the new tokens (B, n).

    The prompt runs once (prefill) to fill each layer's KV cache; each later step feeds only the
    newest token, so it costs O(T), not O(T^2). Stops once every row has produced eos_id. n_vocab:
    sample only ids below it (rows padding the embedding past the tokenizer's vocabulary are no
    tokens). whole_vocab: the model's logits (B, its columns) -> the whole vocabulary's (tp: each
    rank holds a slice; all then draw the same tokens from the same generator state).
    """
    check_sampling(temperature, top_k, top_p)
    was_training = model.training
    model.eval()
    device = model.tok_embeddings.weight.device
    tokens = torch.as_tensor(prompt_tokens, dtype=torch.long, device=device)
    if tokens.dim() == 1:
        tokens = tokens[None]
    B, T = tokens.shape
    total = min(T + max_new_tokens, model.args.max_seq_len)
    if T >= total:
        raise ValueError(f"prompt of {T} tokens leaves no room under max_seq_len {model.args.max_seq_len}")
    caches = [KVCache(total) for _ in range(model.args.n_layers)]
    out = []
    done = torch.zeros(B, dtype=torch.bool, device=device)
    whole_vocab = whole_vocab or (lambda logits: logits)
    logits = whole_vocab(model(tokens, caches=caches, start_pos=0)[:, -1])
    for pos in range(T, total):
        if n_vocab is not None:
            logits[:, n_vocab:] = float("-inf")
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        out.append(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
            if done.all():
                break
        if pos + 1 < total:
            logits = whole_vocab(model(nxt[:, None], caches=caches, start_pos=pos)[:, -1])
    model.train(was_training)
    return torch.stack(out, dim=1)


def replies_stream(seed: int, index: int, device) -> torch.Generator:
    """The random stream of prompt `index`'s replies: one per (seed, prompt), whichever rank draws it."""
    state = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(state)


@torch.no_grad()
def sample(model: Transformer, ids: list[int], k: int, max_new_tokens: int, generator, eos: int, n_vocab: int,
           temperature: float = 1.0, top_p: float | None = None, whole_vocab=None) -> list[list[int]]:
    """K continuations of `ids` in one batch (one prefill shape, one KV cache) -> each one's new
    tokens, with its eos if it finished within max_new_tokens. whole_vocab: as generate's."""
    return sample_groups(model, [ids], k, [max_new_tokens], [generator], eos, n_vocab, temperature, top_p,
                         whole_vocab)[0][0]


@torch.no_grad()
def sample_groups(model: Transformer, prompts: list[list[int]], k: int, rooms: list[int], generators: list,
                  eos: int, n_vocab: int, temperature: float = 1.0, top_p: float | None = None,
                  whole_vocab=None) -> tuple[list, list]:
    """K continuations of each prompt, all in one batch: the prompts left-padded to one length (forward's
    pad), one prefill of each prompt (prefill_groups), one KV cache, one forward a token; a row leaves the
    batch once it has drawn eos or filled its room. Prompt i's rows are drawn from generators[i] alone, as
    sample() draws them for that prompt by itself (draw_rows), so each prompt's replies are its own
    stream's, whatever else shares the batch (equal up to the float rounding of the batched forward). ->
    for each prompt, its k replies, each with its eos if it finished, and each reply token's
    log-probability under the distribution it was drawn from, softmax(logits / temperature) over the
    tokenizer's ids (before top_p cuts it; temperature 0: 1). whole_vocab: as generate's."""
    check_sampling(temperature, None, top_p)
    was_training, device = model.training, model.tok_embeddings.weight.device
    model.eval()
    T, n = max(map(len, prompts)), len(prompts)
    room = [min(r, model.args.max_seq_len - len(p)) for r, p in zip(rooms, prompts)]
    if min(room) < 1:
        raise ValueError(f"a prompt of {len(prompts[room.index(min(room))])} tokens leaves no room for a reply "
                         f"(max_seq_len {model.args.max_seq_len})")
    whole_vocab = whole_vocab or (lambda logits: logits)
    caches, logits, pad = prefill_groups(model, prompts, k, T + max(room), whole_vocab)
    rows = torch.arange(n * k, device=device)  # the batch's rows: indices into the n k replies, ascending
    last = torch.tensor(room, device=device).repeat_interleave(k) - 1  # each row's last step
    out, lps = torch.full((n * k, max(room)), eos, device=device), torch.zeros(n * k, max(room), device=device)
    for step in range(max(room)):
        logits[:, n_vocab:] = float("-inf")
        nxt = draw_rows(logits, rows, k, generators, temperature, top_p)
        out[rows, step] = nxt
        lps[rows, step] = torch.log_softmax(logits.float() / (temperature or 1), dim=-1).gather(1, nxt[:, None])[:, 0]
        going = (nxt != eos) & (last[rows] > step)
        if not going.any():
            break
        if not going.all():  # rows that have ended leave the batch, and their keys and values with them
            keep = going.nonzero()[:, 0]
            for cache in caches:
                cache.select(keep)
            nxt, rows, pad = nxt[keep], rows[keep], None if pad is None else pad[keep]
        logits = whole_vocab(model(nxt[:, None], caches=caches, start_pos=T + step, pad=pad)[:, -1])
    model.train(was_training)
    new, lps = out.tolist(), lps.tolist()
    ends = [row.index(eos) + 1 if eos in row[:room[r // k]] else room[r // k] for r, row in enumerate(new)]
    grouped = lambda rows: [[rows[i * k + j][:ends[i * k + j]] for j in range(k)] for i in range(n)]
    return grouped(new), grouped(lps)


def draw_rows(logits: torch.Tensor, rows: torch.Tensor, k: int, generators: list, temperature: float,
              top_p: float | None) -> torch.Tensor:
    """The next token of each row in the batch (logits (R, vocab); rows (R,), ascending, row r the
    (r % k)-th reply of prompt r // k), each prompt's from its own generator, in one draw of k rows as
    sample_next draws a prompt's k rows alone: a row that has left stands in with a uniform distribution
    and its token is dropped. torch.multinomial consumes its generator row by row, the same whatever
    the rows' probabilities, so the rows still there get the tokens they would get with all k (tested on
    a CPU against generate, whose rows all stay; a GPU's kernel is not checked here)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = next_probs(logits, temperature, None, top_p)  # every row at once
    prompts = sorted(set((rows // k).tolist()))
    slot = torch.searchsorted(torch.tensor(prompts, device=rows.device), rows // k) * k + rows % k
    full = probs.new_full((len(prompts) * k, probs.shape[1]), 1 / probs.shape[1])
    full[slot] = probs
    drawn = torch.cat([torch.multinomial(full[j * k:(j + 1) * k], 1, generator=generators[i])[:, 0]
                       for j, i in enumerate(prompts)])
    return drawn[slot]


def prefill_groups(model: Transformer, prompts: list[list[int]], k: int, max_len: int, whole_vocab):
    """The prompts, left-padded to the longest, through the model once each; then each one's KV cache copied
    for its k continuations (a prompt's work done once, not k times). -> the caches, the next token's
    logits (n k, vocab) and each row's padding (n k,) (None where no prompt has any: a plain causal prefill)."""
    T, device = max(map(len, prompts)), model.tok_embeddings.weight.device
    pad = torch.tensor([T - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=device)  # (n, T)
    caches = [KVCache(max_len) for _ in range(model.args.n_layers)]
    pad = pad if pad.any() else None
    logits = whole_vocab(model(tokens, caches=caches, start_pos=0, pad=pad)[:, -1])
    for cache in caches:
        cache.select(torch.arange(len(prompts), device=device).repeat_interleave(k))
    return caches, logits.repeat_interleave(k, dim=0), None if pad is None else pad.repeat_interleave(k)


if __name__ == "__main__":  # python model.py: list the presets with their sizes
    for name, a in PRESETS.items():
        with torch.device("meta"):
            params = sum(p.numel() for p in Transformer(a).parameters())  # (a tied head counted once)
        # a token meets its top_k experts in each MoE layer, not the others
        active = params - a.moe_layers * (a.n_experts - a.top_k) * 3 * a.dim * a.expert_dim
        experts = f" experts {a.top_k} of {a.n_experts} ({a.expert_dim})" if a.n_experts else ""
        print(f"{name:14s} params {params:>16,d} active {active:>16,d}  dim {a.dim:5d} layers {a.n_layers:3d} "
              f"heads {a.n_heads:3d}/{a.n_kv_heads:<2d} ffn {a.hidden_dim:6d}{experts} vocabulary "
              f"{a.vocab_size:7,d}")
