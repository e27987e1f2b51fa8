"""What a run costs: estimated from the shapes alone, and measured on the device at hand.

  Counting    count_params and flops_per_token (PaLM's and Megatron's conventions)
  Estimates   memory_estimate (one rank's peak bytes, by kind), build_bytes (its peak while the
              model is built), comm_estimate (bytes sent per step, per dimension), for any model
              and layout: checks.py's memory check refuses a run that cannot fit before allocating;
              bench.py sets them beside a run's measurements, plan.py plans runs on machines we lack.
  Instruments peak FLOP/s for MFU (a datasheet table for GPUs, else measured), peak and available
              memory, PhaseTimer (the seven phases' seconds), attention_kernel (SDPA's pick)

Each estimate's terms are buffers this code allocates; tests/test_memory.py holds the totals against
a CPU run's allocations and the bytes against the collectives' own count (parallel.py, section 2).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import resource
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

import loss
import model as M
import parallel as P


# ----------------------------------------------------------------------------------------------------
# Estimates: the memory one rank holds at its peak and the bytes it sends per step


BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def count_params(args: M.ModelArgs, embedding: bool = True, active: bool = False) -> int:
    """Exact parameter count of model.Transformer(args), without building it; active: the parameters
    one token meets (in an MoE layer the router and top_k of the experts)."""
    d, hd, L, V = args.dim, args.head_dim, args.n_layers, args.vocab_size
    attn = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2  # wq, wo + wk, wv
    ffn, moe = 3 * d * args.hidden_dim, args.moe_layers
    experts = d * args.n_experts + (args.top_k if active else args.n_experts) * 3 * d * args.expert_dim
    n = L * (attn + 2 * d) + (L - moe) * ffn + moe * experts + d  # + two norms per layer, the final norm
    n += args.output_size * d if not args.tie_embeddings else 0  # output head
    return n + (V * d if embedding else 0)


def flops_per_token(args: M.ModelArgs, seq_len: int, frozen: bool = False) -> dict[str, float]:
    """Training FLOPs per token (forward + backward = 3x forward), by two conventions: 'palm' (PaLM
    appendix B, nanoGPT, torchtitan) 6*N_matmul + 12*L*d*T; 'megatron' (Megatron-LM, llm.c) halves
    the attention term, as causal masking skips half. N_matmul: every weight in a matmul a token
    meets (an MoE layer's top_k experts of n_experts), all but the embedding table, the head
    included (a tied matrix counts once, as the head). frozen (LoRA): no weight gradients, so
    4*N_matmul (the adapters' own FLOPs, r/dim of that, left out)."""
    n_matmul = count_params(args, embedding=False, active=True) + (args.vocab_size * args.dim
                                                                   if args.tie_embeddings else 0)
    attn, matmuls = 12 * args.n_layers * args.dim * seq_len, (4 if frozen else 6) * n_matmul
    return {"palm": matmuls + attn, "megatron": matmuls + attn / 2}


def rank_layers(n_layers: int, layout: P.Layout, stage: int) -> int:
    """How many layers pipeline rank `stage` holds (over its layout.virtual model chunks)."""
    ranges = P.stage_layers(n_layers, layout.pp * layout.virtual, layout.split)
    return sum(end - start for start, end in ranges[stage::layout.pp])


def unit_params(args: M.ModelArgs, layout: P.Layout = P.Layout(), stage: int = 0) -> list[int]:
    """Parameters one rank of pipeline stage `stage` holds, unit by unit in forward order (unit_of):
    the embedding on the first stage, its layers (linears split over tp, norms whole), the final
    norm and the head on the last (vocab padded to tp; a tied head is the embedding's unit)."""
    tp, pp = layout.tp, layout.pp
    d, hd, V = args.dim, args.head_dim, P.padded_vocab(args.vocab_size, tp)
    attention = (2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd) // tp + 2 * d  # (and the norms)
    experts = d * args.n_experts + args.n_experts // layout.ep * 3 * d * args.expert_dim  # router, experts (/ ep)
    ranges = P.stage_layers(args.n_layers, pp * layout.virtual, layout.split)[stage::pp]
    units = [V // tp * d] if stage == 0 else []  # embedding
    units += [attention + (experts if args.is_moe(i) else 3 * d * args.hidden_dim // tp)
              for start, end in ranges for i in range(start, end)]
    head = P.padded_vocab(args.output_size, tp) // tp * d
    units += [d] + ([head] if not args.tie_embeddings else []) if stage == pp - 1 else []  # norm, head
    return units


def expert_units(args: M.ModelArgs, layout: P.Layout, stage: int) -> list[int]:
    """The expert parameters one rank of pipeline stage `stage` holds, mixture layer by layer (E / ep each)."""
    ranges = P.stage_layers(args.n_layers, layout.pp * layout.virtual, layout.split)[stage::layout.pp]
    return [args.n_experts // layout.ep * 3 * args.dim * args.expert_dim
            for start, end in ranges for i in range(start, end) if args.is_moe(i)]


def stage_params(args: M.ModelArgs, layout: P.Layout = P.Layout(), stage: int = 0) -> int:
    """Parameters one rank of pipeline stage `stage` holds."""
    return sum(unit_params(args, layout, stage))


def lora_shapes(args: M.ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a block that LoRA can adapt, whole."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"wq": (args.dim, q), "wk": (args.dim, kv), "wv": (args.dim, kv), "wo": (q, args.dim),
            "w1": (args.dim, args.hidden_dim), "w2": (args.hidden_dim, args.dim),
            "w3": (args.dim, args.hidden_dim)}


def lora_params(args: M.ModelArgs, rank: int, targets, tp: int = 1) -> int:
    """LoRA's parameters in one block on one tp rank: r (in + out) per targeted linear, the side tp
    splits (a column-parallel linear's outputs, a row-parallel one's inputs) divided by tp."""
    rows = ("wo", "w2")
    return sum(rank * (i // tp + o if t in rows else i + o // tp)
               for t, (i, o) in lora_shapes(args).items() if t in targets)


class Kept(NamedTuple):
    """How a run's kernels change what its blocks keep for backward (kept_by sets it)."""
    compiled: bool = False  # --compile: inductor's partition keeps a block's inputs, recomputes norms, SiLU
    grouped_kv: bool = True  # attention keeps K and V at n_kv_heads (a GPU's kernels) or repeated to n_heads
    fp32_attention: bool = False  # attention computed in fp32 (bf16 on a CPU: model.sdpa_inputs)
    dropout: float = 0  # --dropout: bytes a number of each branch's mask (0: none)


def kept_by(device_type: str, precision: str, backend: str, masked: bool, compiled: bool,
            dropout: bool = False) -> Kept:
    """A run's Kept: masked attention (packed documents) keeps K and V grouped on a GPU
    (FlexAttention), repeated elsewhere (SDPA, dense mask); unmasked, as model.groups_kv says.
    A dropout mask is a boolean on a GPU (native_dropout), the input's dtype on a CPU."""
    cuda = device_type == "cuda"
    grouped = cuda if masked else M.groups_kv(backend, cuda)
    mask = (1 if cuda else BYTES[precision]) if dropout else 0
    return Kept(compiled, grouped, device_type == "cpu" and precision == "bf16", mask)


def activation_bytes(args: M.ModelArgs, tokens: int, precision: str, tp: int = 1, sp: bool = False,
                     cp: int = 1, loss_chunk: int = 0, kept: Kept = Kept()) -> dict:
    """Bytes of one micro-batch of `tokens` tokens (under cp, 1/cp of each sequence) as the forward
    and the loss keep them; b bytes per number in the compute precision, V one TP rank's vocab rows:
      layer: what backward keeps of one block (layer_bytes); layer_input: its input alone (what
        activation checkpointing keeps).
      layer_selective: what selective checkpointing keeps (model.KEPT_OPS): the input, the outputs
        of the seven matmuls (q, k, v, w1 x, w3 x split over tp; wo's and w2's whole) and of
        attention (the output, split over tp, and its log-sum-exp); under cp the gathered k and v,
        under SP the linears' gathered inputs and the scattered outputs.
      head: the final norm and the head's input. logits: b per row. loss_saved: fp32 per row, kept
        for backward (the log-softmax; vocab-parallel: the softmax).
      loss_forward / loss_backward: what the loss holds on top while it runs: an fp32 copy of the
        logits (bf16, or vocab-parallel on a rank with padding), the vocab-parallel loss's shifted
        logits and their exponentials; in backward two fp32 gradients (one and a cast under TP).
      layer_backward: one block's backward (its feed-forward's, ffn_bytes).
      weight_grad: the embedding's or head's weight gradient, whole before it joins the fp32 buffer.
    With loss_chunk, the loss's terms are chunked_loss_bytes'."""
    d, b, s = args.dim, BYTES[precision], tp if sp else 1
    V = P.padded_vocab(args.vocab_size, tp) // tp
    rows = tokens * V
    norm = tokens * d * (4 + b) / s
    copy = 4 if b < 4 or P.padded_vocab(args.vocab_size, tp) != args.vocab_size else 0
    ffn = ffn_bytes(args, b, tp, kept.compiled)
    out = {"layer": layer_bytes(args, tokens, b, tp, sp, cp, kept),
           "layer_input": tokens * d * b / s, "head": norm + tokens * d * b, "logits": rows * b,
           "loss_saved": rows * 4,
           "loss_forward": rows * ((4 if b < 4 else 0) if tp == 1 else copy + 8),
           "loss_backward": rows * (8 if tp == 1 else 4 + (b if b < 4 else 0)),
           "layer_backward": tokens * ffn["backward"], "weight_grad": V * d * b}
    kv = args.n_kv_heads * args.head_dim
    matmuls = (2 * d + 2 * kv * (1 + (cp if cp > 1 else 0))) / tp + 2 * d
    sequence = (2 * d + 2 * d / tp) if sp else 0.0  # SP: the gathered inputs, the scattered outputs
    out["layer_selective"] = out["layer_input"] + tokens * ((matmuls + sequence) * b + ffn["selective"]
                                                            + args.n_heads // tp * 4)
    if 0 < loss_chunk < tokens:
        out.update(chunked_loss_bytes(args, tokens, precision, tp, loss_chunk, kept.compiled))
    return out


def layer_bytes(args: M.ModelArgs, tokens: int, b: int, tp: int, sp: bool, cp: int, kept: Kept) -> float:
    """What backward keeps of one block for `tokens` tokens. Attention: q and the output (dim each),
    k and v (n_kv_heads wide if grouped, else dim) of every cp rank's tokens, in the attention's
    precision (fp32 on a CPU in bf16, where wo keeps a b-byte copy of the output), all split over
    tp, and an fp32 log-sum-exp per head. Eager: each RMSNorm's fp32 input and normalized values,
    4 + b a number (split over tp under SP); the linears' two normalized inputs (whole, or gathered
    under SP); SwiGLU's w1 x, silu(w1 x), w3 x and product, 4 * hidden split over tp. Compiled
    (inductor's min-cut partition, as bench.py --memory-census measures): norms and SiLU are
    recomputed in backward from the block's input and post-attention residual, b each, and w1 x.
    Dropout keeps a mask of each branch's output (dim, split over tp under SP)."""
    d, s, heads = args.dim, tp if sp else 1, args.n_heads // tp
    ab = 4 if kept.fp32_attention else b
    kv = args.n_kv_heads * args.head_dim if kept.grouped_kv else d
    attention = (2 * d + 2 * kv * cp) * ab + (d * b if ab != b else 0)
    norms = 2 * d * b / s if kept.compiled else 2 * d * (4 + b) / s
    per_token = norms + 2 * d * b + attention / tp + ffn_bytes(args, b, tp, kept.compiled)["kept"]
    return tokens * (per_token + heads * 4 + 2 * d * kept.dropout / s)


def ffn_bytes(args: M.ModelArgs, b: int, tp: int, compiled: bool) -> dict:
    """A block's feed-forward per token, b bytes a number: what backward keeps of it, what selective
    checkpointing keeps (the matmuls' outputs beside w2's, counted with wo's) and its backward's
    temporaries. SwiGLU keeps w1 x, silu(w1 x), w3 x and their product (hidden each, split over tp;
    compiled, SiLU recomputed: 3), selectively w1 x and w3 x; backward makes 3 hidden-sized gradients.
    A mixture layer does that for each of a token's top_k rows (each at expert_dim), and keeps each
    row's gathered input and its expert's output (dim each; selectively the outputs of top_k - 1 rows
    more than a dense w2), the router's scores and its fp32 probabilities (n_experts each). Routing
    balanced: a rank whose experts get more rows under ep holds more. Mixed layers: the mean, the
    largest backward."""
    h, swiglu = args.hidden_dim / tp, 3 if compiled else 4
    dense = dict(kept=swiglu * h * b, selective=2 * h * b, backward=3 * h * b)
    if not args.n_experts:
        return dense
    k, e, d, share = args.top_k, args.n_experts, args.dim, args.moe_layers / args.n_layers
    moe = dict(kept=k * (swiglu * args.expert_dim + 2 * d) * b + e * (b + 4),
               selective=k * 2 * args.expert_dim * b + (k - 1) * d * b + e * b,
               backward=k * (3 * args.expert_dim + 2 * d) * b)
    mean = {key: share * moe[key] + (1 - share) * dense[key] for key in ("kept", "selective")}
    return dict(mean, backward=max(moe["backward"], dense["backward"] if share < 1 else 0.0))


def chunked_loss_bytes(args: M.ModelArgs, tokens: int, precision: str, tp: int, loss_chunk: int,
                       compiled: bool = False) -> dict:
    """activation_bytes' loss terms with loss_chunk (head_loss_sum, at fewer tokens than the
    micro-batch): no logits held; the loss keeps fp32 gradients of the head's input and weight, and
    while it runs holds one chunk's logits, their fp32 copy (which becomes their softmax in place;
    compiled: never made) and its cast to the compute precision (bf16, fp16), then that gradient
    beside the two matmuls' results, which backward casts the kept ones to."""
    d, b, V = args.dim, BYTES[precision], P.padded_vocab(args.vocab_size, tp) // tp
    rows_c = loss_chunk * V
    one_pass = rows_c * (2 * b if compiled else 4 + 2 * b) if b < 4 else rows_c * 4
    made = (V + loss_chunk) * d * b  # one chunk's gradients of W and h, before they join the fp32 sums
    return dict(logits=0.0, loss_saved=(tokens + V) * d * 4, loss_forward=max(one_pass, rows_c * b + made),
                loss_backward=(tokens + V) * d * b if b < 4 else 0.0)


class Shape(NamedTuple):
    """What one step computes on a rank, besides its layout: grad_accum micro-batches of micro_batch
    rows of seq_len tokens (cp cuts each row), in precision, recomputing as act_ckpt says, the loss
    taking loss_chunk tokens at a time (0: all; loss.loss_chunk_used says where chunks help)."""
    micro_batch: int = 1
    seq_len: int = 2048
    precision: str = "bf16"
    grad_accum: int = 1
    act_ckpt: bool | str = False
    loss_chunk: int = 0


def ckpt_mode(act_ckpt) -> str | None:
    """--act-ckpt as the estimates read it: None, "selective", or "full" (any other true value)."""
    return None if not act_ckpt else "selective" if act_ckpt == "selective" else "full"


def ckpt_label(act_ckpt) -> str:
    """0, 1 (full) or sel: --act-ckpt in a table's column or a variant's name."""
    return {None: "0", "full": "1", "selective": "sel"}[ckpt_mode(act_ckpt)]


def memory_estimate(args: M.ModelArgs, layout: P.Layout = P.Layout(), shape: Shape = Shape(),
                    stage: int | None = None, *, bucket_mb: float = 25.0, lora: tuple | None = None,
                    kept: Kept = Kept()) -> dict[str, float]:
    """Bytes one rank holds at its peak while training, by kind, for pipeline stage `stage` (None:
    the busiest); under cp, activations of seq_len / cp tokens (and every rank's K and V per layer).
    Model states (optim.AdamW, GradSync): weights, b bytes each (padded to a multiple of dp x cp);
    grads, the fp32 gradient buffer; master, fp32 (in fp32 none unless ZeRO shards it: the weights
    are the master); optimizer, AdamW's fp32 m and v (its fused update needs no temporary). ZeRO-1
    divides master, m and v over dp x cp and keeps its reduced gradient pieces (zero_buffers: fp32,
    packed); ZeRO-2 divides the gradients too and keeps instead three buckets of bucket_mb being
    filled or reduced (and two pieces); ZeRO-3 divides the weights too (sharded_weights_bytes).
    activations (held_activations): per micro-batch in flight, its layers' (checkpointed: inputs
    only), on the last stage the head's and the loss's; without a pipeline the logits too.
    temporaries: the largest of the loss's, a layer's backward (checkpointed: recomputed first) and
    the embedding's or head's weight gradient (the step and ZeRO's all-gathers add none).
    Not counted: the CUDA context, NCCL's buffers and allocator fragmentation (bench.py's plan keeps
    a reserve for them), a checkpoint's gathered state (host memory), fp16's overflow check (a byte
    per parameter), packed documents' attention mask (B x T x T booleans), DPO's frozen reference,
    the embedding's dropout mask.
    shape.loss_chunk: train.py's --loss-chunk (0: whole logits; whole too where chunks would not help:
    loss.loss_chunk_used). lora (rank, targets): the weights frozen
    (b bytes each, nothing else), the model states above for the adapters alone, no weight gradient
    of the embedding or head; LoRA's own activations (r a token per adapted linear) left out."""
    if stage is None:
        return max((memory_estimate(args, layout, shape, s, bucket_mb=bucket_mb, lora=lora, kept=kept)
                    for s in range(layout.pp)), key=lambda m: m["total"])
    pp, tokens = layout.pp, shape.micro_batch * shape.seq_len // layout.cp
    out = model_state_bytes(args, layout, shape.precision, stage, bucket_mb, lora)
    loss_chunk = loss.loss_chunk_used(shape.loss_chunk, tokens, layout.zero)  # (0 where chunks don't help)
    a = activation_bytes(args, tokens, shape.precision, layout.tp, layout.sp, layout.cp, loss_chunk, kept)
    a["weight_grad"] = 0.0 if lora else a["weight_grad"]
    act_ckpt = ckpt_mode(shape.act_ckpt)
    layers, first, last = rank_layers(args.n_layers, layout, stage), stage == 0, stage == pp - 1
    out["activations"] = held_activations(a, layers, stage, layout, shape.grad_accum, act_ckpt)
    in_loss = max(a["loss_forward"] + (a["logits"] if pp > 1 else 0.0), a["loss_backward"]) if last else 0.0
    head_done = a["head"] + a["loss_saved"] if last else 0.0  # freed before backward reaches the layers
    recomputed = {"full": a["layer"], "selective": a["layer"] - a["layer_selective"]}.get(act_ckpt, 0.0)
    layer = a["layer_backward"] + recomputed - head_done
    during_backward = max(in_loss, layer, a["weight_grad"] if first or last else 0.0)
    out["temporaries"] = during_backward  # (the optimizer step allocates nothing)
    out["total"] = sum(out.values())
    return out


def model_state_bytes(args: M.ModelArgs, layout: P.Layout, precision: str, stage: int, bucket_mb: float,
                      lora: tuple | None = None) -> dict:
    """memory_estimate's model states on a rank of stage `stage`, padded and sharded over the ranks
    holding the same weights (dp x cp, which ZeRO shards over); with lora, the adapters'."""
    dp, zero = layout.dp_cp, layout.zero
    b, zdp = BYTES[precision], dp if zero and dp > 1 else 1
    n, frozen = stage_params(args, layout, stage), 0
    if lora:
        n, frozen = lora_params(args, *lora, layout.tp) * rank_layers(args.n_layers, layout, stage), n
    n = -(-n // dp) * dp
    experts = sum(expert_units(args, layout, stage)) if layout.ep > 1 and not lora else 0
    shard = (n - experts) / zdp + experts / (layout.edp if zdp > 1 else 1)  # (ep: experts over edp)
    out = {"weights": (n + frozen) * b, "grads": n * 4,
           "master": shard * 4 if precision != "fp32" or zdp > 1 else 0.0,
           "optimizer": 2 * shard * 4, "zero_buffers": shard * 4 if zdp > 1 else 0.0}
    if zero >= 2 and zdp > 1:  # staging (GradSync._launch): the bucket filling, two in flight, their pieces
        bucket = min(n, bucket_mb * 2 ** 20 / 4)
        out["grads"], out["zero_buffers"] = n * 4 / zdp, (3 * bucket + 2 * bucket / zdp) * 4
    if zero >= 3 and zdp > 1:
        out.update(sharded_weights_bytes(args, b, layout, stage))
    return out


def build_bytes(args: M.ModelArgs, layout: P.Layout = P.Layout(), precision: str = "bf16", stage: int = 0,
                lora: tuple | None = None) -> float:
    """One rank's peak bytes at stage `stage` while train.py builds its model and optimizer. Each
    parameter is drawn or read whole in fp32, one at a time, and cut to its tp piece (another fp32
    copy if tp cuts). Without ZeRO-3 the pieces make the model (b bytes each), which AdamW copies
    into its flat buffer beside the fp32 gradients: for a moment both exist. ZeRO-3 over dp x cp
    writes each piece straight into this rank's 1/dp share of the model copy (materialize_empty,
    AdamW(initial=)): the share beside one parameter or unit's buffer (made and released once).
    lora: the optimizer takes the adapters alone; the frozen model stays as built."""
    tp, dp, b = layout.tp, layout.dp_cp, BYTES[precision]
    n = -(-stage_params(args, layout, stage) // dp) * dp
    if lora:
        n_lora = lora_params(args, *lora, tp) * rank_layers(args.n_layers, layout, stage)
        one_fp32 = 4 * max(args.dim * args.hidden_dim, args.vocab_size * args.dim)  # read whole, then cut
        return n * b + max(one_fp32, n_lora * (2 * b + 4))
    fulls = [args.dim * args.hidden_dim, args.n_heads * args.head_dim * args.dim]
    fulls += [args.vocab_size * args.dim] if stage in (0, layout.pp - 1) else []
    one = max(4 * f * (1 + (1 / tp if tp > 1 else 0)) for f in fulls)
    if layout.zero == 3 and dp > 1:
        return n * b / dp + max(one, max(unit_params(args, layout, stage)) * b)
    grads = n * 4 if layout.zero < 2 or dp == 1 else 0
    return max(n * b + one, 2 * n * b + grads)


def held_activations(a: dict, layers: int, stage: int, layout: P.Layout, grad_accum: int,
                     act_ckpt: str | None) -> float:
    """memory_estimate's activations on pipeline rank `stage` over its `layers` layers (`a`:
    activation_bytes) at the schedule's peak: one micro-batch without a pipeline, 1F1B pp - stage at
    most, AFAB all, interleaved its warm-up's chunk forwards + 1 (each 1/virtual of the layers)."""
    pp, schedule, virtual = layout.pp, layout.schedule, layout.virtual
    per_layer = {"full": a["layer_input"], "selective": a["layer_selective"]}.get(act_ckpt, a["layer"])
    head = a["head"] + a["loss_saved"] if stage == pp - 1 else 0.0
    if schedule == "interleaved" and pp > 1:
        chunks = min(2 * (pp - 1 - stage) + (virtual - 1) * pp + 1, grad_accum * virtual)
        return chunks * layers / virtual * per_layer + head
    in_flight = 1 if pp == 1 else grad_accum if schedule == "afab" else min(pp - stage, grad_accum)
    return in_flight * (layers * per_layer + head) + (a["logits"] if pp == 1 else 0.0)


def sharded_weights_bytes(args: M.ModelArgs, b: int, layout: P.Layout, stage: int) -> dict:
    """ZeRO-3's model states on one rank, each unit padded to a multiple of dp (x cp): 1/dp of the
    model copy, master (unless the fp32 model copy is it), gradients, m and v; two neighbouring
    units' whole weights (one computing, one prefetched), three with a tied head (the embedding
    stays whole from the head's backward to its own); up to three units' gradients being staged or
    reduce-scattered (two in flight, GradSync._launch), with two units' pieces."""
    dp = layout.dp_cp
    units = [-(-u // dp) * dp for u in unit_params(args, layout, stage)]
    n, first, last = sum(units), stage == 0, stage == layout.pp - 1
    whole = max([u + v for u, v in zip(units, units[1:])] or units)
    whole += units[0] if args.tie_embeddings and first and last else 0
    return {"weights": n * b / dp + whole * b, "grads": n * 4 / dp, "master": n * 4 / dp if b != 4 else 0.0,
            "optimizer": 2 * n * 4 / dp, "zero_buffers": sum(sorted(units)[-3:]) * 4
            + sum(sorted(units)[-2:]) * 4 / dp}


def comm_estimate(args: M.ModelArgs, layout: P.Layout = P.Layout(), shape: Shape = Shape(),
                  stage: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per step, per dimension, as section 2 counts them (a ring all-reduce
    sends 2(n-1)/n of its buffer, an all-gather or reduce-scatter (n-1)/n), for stage `stage` (None:
    the most any stage sends); scalars (the loss normalizer, train.py's step tally) left out.
      tp: per layer and micro-batch, 2 all-reduces of the residual stream forward (after wo and w2)
        and 2 backward (the norms' f); one for the embedding (first stage), one for the head (last)
        and the vocab-parallel cross-entropy's all-gather and all-reduce of one fp32 number per
        token (loss.py: each rank's log-sum-exp, the target's logit). Sequence parallelism
        swaps each all-reduce for an all-gather and a reduce-scatter (the same bytes) and adds, once
        per step, the norm weights' gradients. Activation checkpointing recomputes a block only up
        to its last saved tensor, w2's input (torch's checkpoint stops early): wo's all-reduce runs
        again, w2's not; under SP the norms' all-gathers and wo's reduce-scatter.
      cp: per layer and micro-batch, K and V all-gathered (all ranks' tokens, this rank's kv heads),
        their gradients reduce-scattered, again on recompute; all else carries seq_len / cp tokens.
      pp: each micro-batch's activations to the next stage, their gradient back (split under SP).
      ep: per mixture layer and micro-batch, each token's top_k rows to its experts' ranks and back,
        forward and backward, again on recompute, (ep-1)/ep of them off this rank when the router
        balances the experts; and each expert's count of rows (ep_bytes).
      dp: dp_bytes."""
    if stage is None:  # per dimension, the most any stage sends
        stages = [comm_estimate(args, layout, shape, s) for s in range(layout.pp)]
        return {dim: max(c[dim] for c in stages) for dim in ("tp", "cp", "pp", "dp", "ep")}
    tp, cp, pp, sp, grad_accum = layout.tp, layout.cp, layout.pp, layout.sp, shape.grad_accum
    b, tokens = BYTES[shape.precision], shape.micro_batch * shape.seq_len // cp
    stream = tokens * args.dim * b  # one micro-batch of the residual stream
    layers, first, last = rank_layers(args.n_layers, layout, stage), stage == 0, stage == pp - 1
    ring = lambda n: (n - 1) / n
    # what recomputing a block sends again, in all-reduces' worth of bytes: selective checkpointing
    # keeps the gathered and scattered sequences (SP, cp's K and V) but reruns the all-reduces
    act_ckpt, sequence = ckpt_mode(shape.act_ckpt), sp
    recomputed = {"full": 1.5 if sequence else 1, "selective": 0 if sequence else 1}.get(act_ckpt, 0)
    all_reduces = layers * (4 + recomputed) + first + last
    cross_entropy = (tp + 2) * ring(tp) * tokens * 4  # all-gather: (tp - 1) numbers a token; all-reduce: 2 ring
    tp_bytes = grad_accum * (all_reduces * 2 * ring(tp) * stream + (cross_entropy if last else 0))
    if sp:  # the norms' weight gradients are partial sums over the sequence chunks: all-reduced once per step
        tp_bytes += 2 * ring(tp) * args.dim * 4 * (2 * layers + last)
    boundary = stream / tp if sp and tp > 1 else stream  # under SP a stage sends only its sequence chunk
    # each micro-batch crosses every chunk boundary but the model's two ends: forward and back
    pp_bytes = grad_accum * boundary * (2 * layout.virtual - first - last) if pp > 1 else 0.0
    kv = shape.micro_batch * shape.seq_len * 2 * args.n_kv_heads * args.head_dim // tp * b  # every rank's K, V
    cp_bytes = grad_accum * layers * (2 + (act_ckpt == "full")) * ring(cp) * kv
    return {"tp": tp_bytes if tp > 1 else 0.0, "cp": cp_bytes, "pp": pp_bytes,
            "dp": dp_bytes(args, b, layout, grad_accum, stage), "ep": ep_bytes(args, layout, shape, stage)}


def ep_bytes(args: M.ModelArgs, layout: P.Layout, shape: Shape, stage: int) -> float:
    """comm_estimate's all-to-all bytes under expert parallelism, with the router balancing the experts."""
    if layout.ep == 1:
        return 0.0
    ranges = P.stage_layers(args.n_layers, layout.pp * layout.virtual, layout.split)[stage::layout.pp]
    moe = sum(args.is_moe(i) for start, end in ranges for i in range(start, end))
    forwards = 1 + bool(ckpt_mode(shape.act_ckpt))  # (the all-to-alls run again when a block is recomputed)
    rows = shape.micro_batch * shape.seq_len * args.top_k * args.dim * BYTES[shape.precision]
    # each forward: the counts (int64), the rows out and back; backward: their gradients, out and back
    per_layer = forwards * (args.n_experts * 8 + 2 * rows) + 2 * rows
    return shape.grad_accum * moe * (layout.ep - 1) / layout.ep * per_layer


def dp_bytes(args: M.ModelArgs, b: int, layout: P.Layout, grad_accum: int, stage: int) -> float:
    """comm_estimate's dp bytes over the dp x cp replicas: fp32 gradients all-reduced; ZeRO-1
    reduce-scatters them, then all-gathers the updated weights (training precision: 0.75 of an
    all-reduce in bf16); ZeRO-2 reduce-scatters each micro-batch's (its buffer cannot hold the sum);
    ZeRO-3 adds two weight all-gathers per micro-batch (forward, backward), none after the step."""
    dp, zero = layout.dp_cp, layout.zero
    if dp == 1:
        return 0.0
    ring = (dp - 1) / dp
    n = -(-stage_params(args, layout, stage) // dp) * dp
    if layout.ep > 1:  # the experts' gradients go over the edp ranks holding the same experts: fewer hops
        experts = sum(u for u in expert_units(args, layout, stage))
        n, edp = n - experts, layout.edp
        also = (edp - 1) / edp * experts * ((4 + b) if zero else 8)
        return ring * n * (4 + b) + also if zero else 2 * ring * n * 4 + also
    if zero >= 3:  # every micro-batch: each unit gathered for its forward and again for its backward
        units = [-(-u // dp) * dp for u in unit_params(args, layout, stage)]
        tied = args.tie_embeddings and stage == 0 and stage == layout.pp - 1
        again = units[0] if tied else 0  # for the tied head's forward
        return ring * grad_accum * (sum(units) * (4 + 2 * b) + again * b)
    return ring * n * (4 * (grad_accum if zero >= 2 else 1) + b) if zero else 2 * ring * n * 4


# ----------------------------------------------------------------------------------------------------
# What a run costs: GPU-hours, energy, money, whether the links keep up; and the size a budget buys


class System(NamedTuple):
    """One GPU as a cluster holds it (datasheets): memory, board power, the link to its server's or
    rack's GPUs (NVLink, AMD's Infinity Fabric, or PCIe), its bandwidth each way and how many GPUs
    it joins, and its share of the scale-out network (InfiniBand, Ethernet) each way."""
    memory_gb: float
    watts: float
    link: str
    link_gbs: float
    domain: int
    network_gbs: float


# HGX boards join 8 GPUs by NVLink: 600 GB/s both ways on an A100 (NVLink 3), 900 on an H100 or H200
# (NVLink 4), 1.8 TB/s on a B200 (NVLink 5); PCIe and NVL cards are bridged in pairs; a GB200 NVL72
# rack is one NVLink domain of 72 (TP or EP up to 72). MI300X platforms join 8 by Infinity Fabric: 7
# links of 64 GB/s each way, one per peer. Cards without either (L4, L40S, A10, A10G, GeForce) use
# PCIe in a server of 8: 32 GB/s each way on Gen4, 64 on Gen5. Network: an InfiniBand NIC per GPU,
# HDR 200 Gb/s (A100), NDR 400 (H100, H200, MI300X), XDR 800 (B200, GB200); for PCIe cards a
# 100 Gb/s Ethernet share, what such clusters vary most in. A B200 holds 180 GB (the first datasheet
# said 192), a GB200's GPU 186.
SYSTEMS = {"RTX 4090": System(24, 450, "PCIe", 32, 8, 12.5), "RTX 5090": System(32, 575, "PCIe", 64, 8, 12.5),
           "L4": System(24, 72, "PCIe", 32, 8, 12.5), "L40S": System(48, 350, "PCIe", 32, 8, 12.5),
           "A10": System(24, 150, "PCIe", 32, 8, 12.5), "A10G": System(24, 300, "PCIe", 32, 8, 12.5),
           "A100": System(80, 400, "NVLink", 300, 8, 25), "A100 40GB": System(40, 400, "NVLink", 300, 8, 25),
           "H100": System(80, 700, "NVLink", 450, 8, 50), "H100 PCIe": System(80, 350, "NVLink", 300, 2, 50),
           "H100 NVL": System(94, 400, "NVLink", 300, 2, 50), "H200": System(141, 700, "NVLink", 450, 8, 50),
           "H200 NVL": System(141, 600, "NVLink", 450, 2, 50), "B200": System(180, 1000, "NVLink", 900, 8, 100),
           "GB200": System(186, 1200, "NVLink", 900, 72, 100),
           "MI300X": System(192, 750, "Infinity Fabric", 448, 8, 50)}


def run_costs(gpu: str, gpus: int, seconds: float, pue: float, usd_per_gpu_hour: float) -> dict:
    """`gpus` GPUs for `seconds`: GPU-hours, days, energy (board power times the facility's PUE, its
    power over the IT equipment's: cooling, conversion; CPUs, network, storage left out), money."""
    gpu_hours = gpus * seconds / 3600
    return {"gpu_hours": gpu_hours, "days": seconds / 86400, "pue": pue, "usd_per_gpu_hour": usd_per_gpu_hour,
            "energy_mwh": gpu_hours * SYSTEMS[gpu].watts * pue / 1e6, "usd": gpu_hours * usd_per_gpu_hour}


def links(gpu: str, tp: int, cp: int, pp: int, gpus: int, ep: int = 1) -> dict[str, str]:
    """Each dimension's link: the GPU's own ("NVLink", "PCIe", ...) where a group lies in one of its
    domains, else "network". The mesh puts tp innermost, then cp, pp, dp (parallel.init_mesh), so a
    group spans the product of the sizes up to its own; ep's, the innermost ep of the dp ranks."""
    span = {"tp": tp, "cp": tp * cp, "pp": tp * cp * pp, "dp": gpus}
    span |= {"ep": tp * cp * pp * ep} if ep > 1 else {}  # (a dimension there is no need for named nowhere)
    return {dim: SYSTEMS[gpu].link if n <= SYSTEMS[gpu].domain else "network" for dim, n in span.items()}


def comm_seconds(comm: dict, gpu: str, tp: int, cp: int, pp: int, gpus: int, ep: int = 1) -> dict:
    """Seconds per step each dimension's bytes (comm_estimate's, sent by one GPU) take on its link:
    bytes over bandwidth each way, all exposed (latency and overlap with compute left out)."""
    system, link = SYSTEMS[gpu], links(gpu, tp, cp, pp, gpus, ep)
    return {dim: sent / 1e9 / (system.network_gbs if link[dim] == "network" else system.link_gbs)
            for dim, sent in comm.items() if dim in link}  # (ep: only where there is expert parallelism)


TOKENS_PER_PARAMETER = 20  # Chinchilla's own shape: 70B parameters on 1.4T tokens


def compute_optimal(flops: float) -> tuple[float, float]:
    """(parameters, tokens) that `flops` = 6 N D trains to the lowest loss by Chinchilla's
    approaches 1 and 2 (Hoffmann et al. 2022, Table 3): N and D grow as C^0.5, about 20 tokens per
    parameter. Approach 3, the parametric fit, puts more tokens per parameter at large budgets; its
    published constants are rounded, and Besiroglu et al. 2024 found it at odds with 1 and 2."""
    parameters = math.sqrt(flops / (6 * TOKENS_PER_PARAMETER))
    return parameters, TOKENS_PER_PARAMETER * parameters


# ----------------------------------------------------------------------------------------------------
# Instruments: peak FLOP/s for MFU, memory, the phases' time


class Peak(NamedTuple):
    """A GPU's dense tensor-core peak in TFLOP/s: bf16 (and fp16), and TF32, which fp32 matmuls run
    on here (train() allows TF32); and the figures' source."""
    bf16: float
    tf32: float
    source: str


# Dense figures: the datasheets' headlines assume 2:4 sparsity (an asterisk), halved here. NVL parts
# clock lower than SXM ones, a GB200's B200 higher. GeForce cards multiply bf16 with an fp32
# accumulator (what training uses) at half their fp16-accumulate rate; the whitepapers list both.
GPU_PEAK_TFLOPS = {
    "RTX 4090": Peak(165.2, 82.6, "NVIDIA Ada Lovelace architecture whitepaper, appendix A: bf16 with fp32 "
                                  "accumulate 165.2, TF32 82.6"),
    "RTX 5090": Peak(209.5, 104.8, "NVIDIA RTX Blackwell architecture whitepaper: bf16 with fp32 accumulate "
                                   "209.5; TF32 half that, as on every GeForce part"),
    "L4": Peak(121, 60, "NVIDIA L4 datasheet: 242 / 120 with sparsity"),
    "L40S": Peak(362.05, 183, "NVIDIA L40S datasheet: 733 / 366 with sparsity"),
    "A10": Peak(125, 62.5, "NVIDIA A10 datasheet: 250 / 125 with sparsity"),
    # no datasheet: AWS's GA102 for its G5 instances, fp32 accumulate at half rate as on GeForce
    # parts; a published GEMM benchmark measured 69.5 / 34.7
    "A10G": Peak(70, 35, "derived: 80 SMs x 1.71 GHz x 512 bf16 FLOP per clock (no NVIDIA datasheet)"),
    "A100": Peak(312, 156, "NVIDIA A100 datasheet (40 and 80 GB, SXM and PCIe): 624 / 312 with sparsity"),
    "A100 40GB": Peak(312, 156, "NVIDIA A100 datasheet: 624 / 312 with sparsity"),
    "H100 PCIe": Peak(756, 378, "NVIDIA H100 datasheet: 1,513 / 756 with sparsity"),
    "H100 NVL": Peak(835, 417.5, "NVIDIA H100 datasheet: 1,671 / 835 with sparsity"),
    "H100": Peak(989, 494.5, "NVIDIA H100 datasheet, SXM: 1,979 / 989 with sparsity"),
    "H200 NVL": Peak(835, 417.5, "NVIDIA H200 datasheet: 1,671 / 835 with sparsity"),
    "H200": Peak(989, 494.5, "NVIDIA H200 datasheet, SXM: 1,979 / 989 with sparsity"),
    "B200": Peak(2250, 1100, "NVIDIA Blackwell datasheet, HGX B200: 4.5 / 2.2 PFLOP/s with sparsity"),
    "GB200": Peak(2500, 1250, "NVIDIA Blackwell datasheet, GB200 NVL72 per GPU: 5 / 2.5 PFLOP/s with sparsity"),
    "MI300X": Peak(1307.4, 653.7, "AMD Instinct MI300X data sheet: 2,614.9 / 1,307.4 with sparsity"),
}


def gpu_peak(name: str, precision: str) -> tuple[float, str] | None:
    """(FLOP/s, which figure and its source) for a GPU named as torch.cuda.get_device_name() names
    it ("NVIDIA A100-SXM4-80GB"), or None if unknown. Keys match as whole words ("L4" is not an L40,
    "H200" not a GH200), the longest first ("H100 NVL" before "H100")."""
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            kind = "tf32" if precision == "fp32" else "bf16"
            peak = getattr(GPU_PEAK_TFLOPS[key], kind)
            return peak * 1e12, (f"{name} ({key}, dense {kind.upper()} {peak:g} TFLOP/s: "
                                 f"{GPU_PEAK_TFLOPS[key].source})")
    return None


@functools.lru_cache(maxsize=None)
def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """Peak dense FLOP/s in the run's precision: the table for known GPUs, else measured_peak, once
    per process so bench.py's sweep shares one denominator. The description flags a precision at
    under half of fp32's speed (a CPU without native bf16 kernels): fp32 would train faster."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    known = gpu_peak(name, precision) if device.type == "cuda" else None
    if known:
        return known
    peak = measured_peak(device, M.DTYPES[precision])
    source = (f"{name}: not in the peak table, so measured: the best {precision} nn.Linear matmul"
              if device.type == "cuda" else f"{name} measured: the best {precision} nn.Linear matmul")
    if precision != "fp32":
        fp32 = measured_peak(device, torch.float32)
        if peak < fp32 / 2:
            source += (f"; {precision} runs {fp32 / peak:.0f}x slower than fp32 ({rate(fp32)}) on this "
                       f"{device.type}: --precision fp32 would train faster")
    return peak, source


@functools.lru_cache(maxsize=None)
def measured_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The best FLOP/s of square matmuls through F.linear, the model's kernel (on a CPU without
    native bf16, `a @ b` in bf16 is 10x slower, understating the peak and overstating MFU): three
    sizes, two tries each, more while under 0.3 s in all, as the machine may be shared and a CPU
    without fp16 kernels takes seconds per fp16 matmul."""
    best, t_start = 0.0, time.perf_counter()
    for n in ((256, 512, 1024) if device.type == "cpu" else (4096, 8192)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        w = torch.randn(n, n, device=device, dtype=dtype)
        for tries in range(8):
            sync_device(device)
            t0 = time.perf_counter()
            F.linear(a, w)
            sync_device(device)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
            if tries >= 1 and time.perf_counter() - t_start > 0.3:
                break
    return best


@functools.lru_cache(maxsize=None)
def measured_rates(device: torch.device, precision: str) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) on this device, measured once per process: the best square
    matmul in the precision (measured_peak, whatever the peak table says), and the best copy of a
    buffer of 64 MB on a CPU, 1 GB on a GPU, bytes read plus written (a smaller buffer, inside a
    CPU's caches, copies faster)."""
    n = 2 ** 24 if device.type == "cpu" else 2 ** 28
    src, dst, best = torch.ones(n, device=device), torch.empty(n, device=device), 0.0
    for _ in range(5):
        sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        best = max(best, 2 * 4 * n / (time.perf_counter() - t0))
    return measured_peak(device, M.DTYPES[precision]), best


def optimizer_bytes(owned: int, precision: str) -> float:
    """The least the optimizer step must move for `owned` parameters: AdamW reads and writes the fp32
    master and both moments (24 bytes), reads the fp32 gradient (4) and, below fp32, writes the
    model's copy in the compute precision (2); the clipping norm's read and the gradients' reset are
    above this floor."""
    return owned * (24 + 4 + (BYTES[precision] if precision != "fp32" else 0))


def phase_floors(args: M.ModelArgs, seq_len: int, tokens: float, owned: int, precision: str,
                 rates: tuple[float, float], chunked: bool, pipeline: bool) -> dict[str, float]:
    """The seconds each phase of a rank's step could not beat: phases 2-4 their FLOPs (PaLM's count,
    as MFU's) for `tokens` tokens at the matmul rate, phase 6 optimizer_bytes at the copy rate (rates:
    measured_rates). With the chunked loss the head's forward and backward (6 x dim x vocabulary a
    token) are phase 3's, the blocks' forward a third of the rest, their backward two thirds; with
    whole logits the head's are in 2 and 4, and the loss, element-wise, has no floor here; a pipeline
    times 2-4 as one. Data, grad sync and the checkpoint have none here either."""
    matmul, copy = rates
    flops = flops_per_token(args, seq_len)["palm"] * tokens
    head = 6 * args.dim * args.output_size * tokens if chunked else 0.0
    if pipeline:
        out = {"2-4 pipeline": flops / matmul}
    else:
        out = {"2 forward": (flops - head) / 3 / matmul, "3 loss": head / matmul,
               "4 backward": 2 * (flops - head) / 3 / matmul}
        out = {k: v for k, v in out.items() if v or k != "3 loss"}
    return {**out, "6 optimizer": optimizer_bytes(owned, precision) / copy}


def rate(flops: float) -> str:
    """A FLOP/s figure with the unit that shows its digits: 14.2 GFLOP/s, 989 TFLOP/s."""
    return f"{flops / 1e12:,.2f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.1f} GFLOP/s"


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB: process peak RSS


def available_memory(device) -> float | None:
    """Bytes this process may still use: on a GPU the free memory plus what its caching allocator
    holds unused (bench.py's second run in a process finds the first's blocks cached: free to it,
    though the device counts them taken); on a CPU the host's available memory shared by torchrun's
    processes on it (None if unreadable)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(torch.cuda.mem_get_info(device)[0] + cached)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


class PhaseTimer:
    """Seconds per phase of every step. mode "phases": between device syncs, one after each phase
    (costing throughput); "steps": synced only at a step's start and end, so the phases sum to the
    step's time as a plain run spends it (their split is host time); None: off."""

    def __init__(self, device, mode: str | None = None, tracer: StepTracer | None = None):
        if mode not in (None, "phases", "steps"):
            raise ValueError(f"PhaseTimer mode {mode!r}: use None, 'phases' or 'steps'")
        self.device, self.mode, self.steps, self.tracer = device, mode, [], tracer

    def start(self, step: int | None = None):
        """A step begins (0-based `step`), or with None phase 7, the checkpoint after one."""
        if self.tracer is not None:
            self.tracer.start(step)
        if self.mode:
            sync_device(self.device)
            self.steps.append({})
            self.t = time.perf_counter()

    def close(self):
        """The run is over: a trace still recording is written."""
        if self.tracer is not None:
            self.tracer.finish()

    def mark(self, phase: str):
        if self.tracer is not None and self.tracer.trace is not None:
            self.tracer.trace.phase(phase)
        if self.mode:
            if self.mode == "phases":
                sync_device(self.device)
            now = time.perf_counter()
            self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + now - self.t
            self.t = now

    def end(self, phase: str):
        """The step's last phase. When timing (either mode) the device is synced first, so the
        phases add up to the step's time (an untimed run does not wait here: see Tally)."""
        if self.mode:
            sync_device(self.device)
        self.mark(phase)


# which kernel computes the attention: named in the banner, and refused where the flags ask one that cannot
SDPA_KERNELS = {int(b): name for name, b in M.ATTN_BACKENDS.items() if b is not None}  # (torch's numbering)


def attention_kernel(q, k, v, mask, is_causal: bool, backend: str = "auto") -> str:
    """The kernel model.attention uses on these inputs: flex for a BlockMask, else SDPA's own pick under
    `backend`. ValueError with SDPA's reasons where `backend` cannot take them."""
    if isinstance(mask, M.BlockMask):
        return "flex"
    q, k, v = M.sdpa_inputs(q, k, v, mask, backend)
    with warnings.catch_warnings(record=True) as why, M.held_to(backend, mask):
        warnings.simplefilter("always")
        try:
            choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, enable_gqa=k.shape[1] != q.shape[1])
        except RuntimeError:
            choice = -1
    if choice not in SDPA_KERNELS:  # SDPA says why each kernel cannot, in warnings
        reasons = sorted({" ".join(str(w.message).split())[:150] for w in why})
        raise ValueError("; ".join(reasons) or "no SDPA kernel takes these inputs")
    return SDPA_KERNELS[choice]


# ----------------------------------------------------------------------------------------------------
# One step's timeline on every rank (--trace-step, bench.py --trace): a Chrome trace and its picture


class StepTrace:
    """One step on one rank as Chrome trace events (ui.perfetto.dev, chrome://tracing): phases and
    micro-batches' forward and backward slices on the rank's track (a process per rank); collectives
    as async slices with op, group (tp, cp, pp, dp, world, io) and bytes sent. Host microseconds
    since a barrier all ranks passed; on a GPU each slice ends with a device sync, so it is device
    time too (and the traced step overlaps less). A collective's slice ends when it completes: at
    its future's callback on a CPU; on a GPU where it is waited for (launch.Work), the device
    synced."""

    def __init__(self, rank: int, device):
        self.rank, self.device, self.events, self.ids = rank, device, [], iter(range(10 ** 9))
        self.t0 = time.perf_counter()
        self.last = 0.0  # where the next phase slice starts

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e6

    def add(self, name: str, start: float, track: int, **args):
        sync_device(self.device)
        self.events.append({"name": name, "ph": "X", "ts": start, "dur": self.now() - start, "pid": self.rank,
                            "tid": track, "args": args})

    def phase(self, name: str):
        """PhaseTimer.mark: the slice since the last mark (or the step's start), on track 0."""
        self.add(name, self.last, 0)
        self.last = self.events[-1]["ts"] + self.events[-1]["dur"]

    @contextmanager
    def span(self, name: str):
        """A micro-batch's forward or backward (a pipeline stage's compute), on track 1."""
        start = self.now()
        yield
        self.add(name, start, 1)

    def collective(self, op: str, dim: str, sent: float):
        """A collective launched now; the returned function ends its slice (once, any thread)."""
        k, start, ended = next(self.ids), self.now(), []

        def done():
            if not ended:
                ended.append(True)
                sync_device(self.device)  # (on a CPU nothing: this may run on gloo's thread)
                head = {"name": op, "cat": dim, "id": k, "pid": self.rank, "tid": 2}
                self.events.extend([{**head, "ph": "b", "ts": start, "args": {"group": dim, "bytes": sent}},
                                    {**head, "ph": "e", "ts": self.now()}])
        return done


class StepTracer:
    """Records step `step` (0-based) on every rank: at its start a barrier, a StepTrace hung on the
    mesh (for the collectives) and on the PhaseTimer; at the next step's start or the run's end,
    rank 0 gathers the events and writes `path` (.json) and, with matplotlib, its picture (.png).
    `layout`: what the files say of the run (tp, pp, micro-batches, ...)."""

    def __init__(self, step: int, path: Path, mesh, device, layout: dict):
        self.step, self.path, self.mesh, self.device, self.layout = step, Path(path), mesh, device, layout
        self.trace, self.counted, self.done = None, None, False

    def start(self, step: int | None):
        if step is not None and self.trace is not None:
            self.finish()  # the traced step is over (or was skipped: its attempt is what is written)
        if step == self.step and not self.done:
            P.barrier(self.mesh)
            self.trace, self.counted = StepTrace(self.mesh.rank, self.device), dict(self.mesh.comm_bytes)
            self.mesh.trace = self.trace
        elif self.trace is not None:  # phase 7 after the traced step: its own slice, from now
            self.trace.last = self.trace.now()

    def finish(self):
        if self.trace is None:
            return
        self.mesh.trace, trace, self.done = None, self.trace, True
        self.trace = None
        counted = {k: v - self.counted[k] for k, v in self.mesh.comm_bytes.items()}
        ranks = P.all_gather_objects((trace.events, counted), self.mesh)
        if self.mesh.rank == 0:
            write_trace(self.path, [events for events, _ in ranks], {**self.layout, "step": self.step + 1,
                        "counted_bytes": [c for _, c in ranks]})


def write_trace(path: Path, ranks: list[list[dict]], info: dict):
    """The Chrome trace (path.json) of all ranks' events, a process per rank named by its mesh
    place, with the measured bubble beside the formula's; and the picture (path.png) if matplotlib
    is installed (else one line says so)."""
    tp, cp, pp = info["tp"], info["cp"], info["pp"]
    names = {0: "phases", 1: "micro-batches", 2: "collectives"}
    meta = []
    for r in range(len(ranks)):
        where = f"tp {r % tp}, cp {r // tp % cp}, pp {r // (tp * cp) % pp}, dp {r // (tp * cp * pp)}"
        meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} ({where})"}})
        meta += [{"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": n}}
                 for t, n in names.items()]
    info = {**info, "bubble": bubble(ranks, info)}
    path.with_suffix(".json").write_text(json.dumps({"traceEvents": meta + [e for es in ranks for e in es],
                                                     "displayTimeUnit": "ms", "otherData": info}))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"wrote {path.with_suffix('.json')} (no picture: pip install matplotlib)", flush=True)
        return
    plot_trace(path.with_suffix(".png"), ranks, info)
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.png')}", flush=True)


def bubble(ranks: list[list[dict]], info: dict) -> dict:
    """The pipeline's idle share: measured, each rank's time in the schedule (its "2-4 pipeline"
    phase) not spent on a micro-batch's forward or backward, averaged over the ranks; and by the
    formula, (p - 1) / (v m + p - 1) (p stages, m micro-batches, v chunks per rank)."""
    p, m, v = info["pp"], info["micro_batches"], info.get("virtual", 1)
    idle = []
    for events in ranks:
        schedule = sum(e["dur"] for e in events if e.get("tid") == 0 and e["name"] == "2-4 pipeline")
        busy = sum(e["dur"] for e in events if e.get("tid") == 1 and e["ph"] == "X")
        if schedule:
            idle.append(1 - busy / schedule)
    return {"measured": sum(idle) / len(idle) if idle else 0.0, "formula": (p - 1) / (v * m + p - 1)}


def plot_trace(path: Path, ranks: list[list[dict]], info: dict):
    """The ranks' timelines one above another: phases as wide pale bars, micro-batches' forwards and
    backwards over them, collectives as thin bars beneath, coloured by group."""
    from matplotlib.figure import Figure  # no pyplot: no window, no process-wide backend
    from matplotlib.patches import Patch
    fig = Figure(figsize=(12, 1.4 + 0.75 * len(ranks)))
    ax = fig.subplots()
    colour = {"1": "#d9d9d9", "2": "#c6dbef", "3": "#fdd0a2", "4": "#c7e9c0", "5": "#fcbba1", "6": "#dadaeb",
              "7": "#f0f0f0", "forward": "#3182bd", "backward": "#31a354", "tp": "#e6550d", "cp": "#756bb1",
              "pp": "#636363", "dp": "#de2d26", "dp_cp": "#de2d26", "world": "#000000", "io": "#bdbdbd",
              "ckpt": "#bdbdbd"}
    seen = {}
    for r, events in enumerate(ranks):
        y, starts = len(ranks) - 1 - r, {}
        for e in events:
            if e["ph"] == "X":  # a phase (track 0, its first character names it) or a micro-batch's work
                key = e["name"][0] if e["tid"] == 0 else e["name"].split()[0]
                lane, z = ((y + 0.3, 0.6), 1) if e["tid"] == 0 else ((y + 0.4, 0.4), 2)
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], lane, color=colour[key], zorder=z)
                seen.setdefault(key, e["name"] if e["tid"] == 0 else key)
            elif e["ph"] == "b":
                starts[e["id"]] = e
            elif e["id"] in starts:
                b = starts.pop(e["id"])
                ax.broken_barh([(b["ts"] / 1e3, (e["ts"] - b["ts"]) / 1e3)], (y + 0.05, 0.2), zorder=3,
                               color=colour.get(b["cat"], "#000000"))
                seen.setdefault(b["cat"], f"{b['cat']} collectives")
    tp, cp, pp = info["tp"], info["cp"], info["pp"]
    ax.set_yticks([len(ranks) - 1 - r + 0.5 for r in range(len(ranks))],
                  [f"rank {r}\npp {r // (tp * cp) % pp}, tp {r % tp}" for r in range(len(ranks))])
    ax.set_xlabel("ms from the step's start")
    ax.legend(handles=[Patch(color=colour[k], label=label) for k, label in sorted(seen.items())],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize=8, frameon=False)
    b = info["bubble"]
    title = (f"step {info['step']}: tp {tp} x cp {cp} x pp {pp} x dp {info['dp']}, "
             f"{info['micro_batches']} micro-batches")
    if pp > 1:
        title += f", {info['schedule']}: bubble {b['measured']:.2f} measured, {b['formula']:.2f} by the formula"
    ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def tracer_for(args, mesh, device) -> StepTracer | None:
    """--trace-step N's tracer (None without it): step N as the logs number it, into the out-dir."""
    if args.trace_step is None:
        return None
    layout = {**mesh.layout.record(), "micro_batches": args.grad_accum}
    return StepTracer(args.trace_step - 1, Path(args.out_dir) / f"trace_step_{args.trace_step:06d}", mesh,
                      device, layout)

