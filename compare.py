"""Ours beside a reference, in the same run: bench.py's --compare-hf and --bubble.

  compare_hf      our loop and transformers' LlamaForCausalLM with torch.optim.AdamW on the same model
                  shape and batch, alternating so both see the same machine load: tokens/s and the ratio
  bubble          the pipeline's idle share measured on every stage, beside (p - 1) / (v m + p - 1)

Hugging Face's model is used here, and only here, as a baseline. The other baseline, torch's own data
parallelism, runs in bench.py alone: every other file's parallelism is written by hand on raw collectives.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import config
import costs
import model as M
import optim as O
import parallel as P


# ----------------------------------------------------------------------------------------------------
# Against Hugging Face transformers: the same model and batch, alternating in the same run


def compare_hf(a, margs, measure_ours) -> dict:
    """Ours and transformers' LlamaForCausalLM, alternating so both see the same machine load; each
    side is built, timed and freed before the other starts, so neither is measured in, or refused
    for, the other's memory. Both sync only at step ends (ours: timing "steps"), on one device, with
    the same AdamW settings; what each keeps in fp32 differs, as the result says. margs: the measured
    model's shape; measure_ours(): our loop's tokens/s, timed once (bench.py's measure)."""
    import transformers
    ours, theirs = [], []
    for _ in range(2):
        ours.append(measure_ours())
        free_memory()
        theirs.append(hf_tokens_per_s(a, margs))
        free_memory()
    precision = config.pick_device_and_precision(a)[1]
    low = "fp32" if precision == "fp32" else "bf16"  # (their side has no fp16 loss scaling: bf16)
    return {"ours_tokens_per_s": ours, "hf_tokens_per_s": theirs,
            "ratio_ours_over_hf": statistics.median(ours) / statistics.median(theirs),
            "transformers": transformers.__version__,
            "ours_keeps": f"{precision} weights; fp32 gradients, master weights and AdamW moments",
            "hf_keeps": f"{low} weights, gradients and AdamW moments (torch.optim.AdamW in the weights' dtype)"}


def free_memory():
    """Give back what the last measured side left: its garbage and the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def built_on(device, dtype, build):
    """build() with its parameters made on `device` in `dtype` from the start, as ours are: no fp32 copy on
    the CPU first (a 1B model's took longer to build and move than its timed steps)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(default)


def hf_tokens_per_s(a, margs) -> float:
    """LlamaForCausalLM + torch.optim.AdamW (same lr, betas, decay, clipping) on the measured
    model's shape and a random batch: tokens/s, the median of --steps after --warmup-steps."""
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=margs.dim, intermediate_size=margs.hidden_dim,
                                   num_hidden_layers=margs.n_layers, num_attention_heads=margs.n_heads,
                                   num_key_value_heads=margs.n_kv_heads, vocab_size=margs.vocab_size,
                                   rms_norm_eps=margs.norm_eps, rope_theta=margs.rope_theta,
                                   max_position_embeddings=margs.max_seq_len,
                                   tie_word_embeddings=margs.tie_embeddings)
    device, precision = config.pick_device_and_precision(a)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    hf = built_on(device, dtype, lambda: transformers.LlamaForCausalLM(cfg)).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randint(0, margs.vocab_size, (a.micro_batch, a.seq_len), device=device)

    def step():
        for _ in range(a.grad_accum):
            (hf(input_ids=x, labels=x).loss / a.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup_steps):
        step()
    times = []
    for _ in range(a.steps):
        costs.sync_device(device)
        t0 = time.perf_counter()
        step()
        costs.sync_device(device)
        times.append(time.perf_counter() - t0)
    return a.micro_batch * a.seq_len * a.grad_accum / statistics.median(times)


# ----------------------------------------------------------------------------------------------------
# The pipeline's bubble against its formula


def timed_steps(step, n: int, device, warmup: int = 2) -> list[float]:
    """Seconds of each of n steps, every rank starting together and the device's work included."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(n):
        costs.sync_device(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        costs.sync_device(device)
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def bubble_schedules(args) -> list[tuple[str, int]]:
    """--schedule (1F1B or AFAB), and beside it the interleaved one with --virtual-stages V > 1."""
    base = "afab" if args.schedule == "afab" else "1f1b"
    return [(base, 1)] + ([("interleaved", args.virtual_stages)] if args.virtual_stages > 1 else [])


def bubble(args, mesh, margs, device, counts: list[int]):
    """At pp = world, each of bubble_schedules for each m (interleaved only where pp divides m):
    step time, measured bubble and its formula, fp32. validate() checked the layouts."""
    rows = []
    for schedule, virtual in bubble_schedules(args):
        staged = mesh.scheduled(schedule, virtual)
        torch.manual_seed(0)
        model = P.apply_pipeline(M.Transformer(margs), staged).to(device)
        opt = O.AdamW(model.named_parameters(), lr=1e-4)
        for m in counts:
            if schedule != "interleaved" or m % mesh.pp == 0:
                rows.append({"schedule": schedule, "virtual": virtual, "m": m,
                             **measure_bubble(args, staged, model, opt, m, device),
                             "bubble_formula": (mesh.pp - 1) / (virtual * m + mesh.pp - 1)})
    return rows


def measure_bubble(args, mesh, model, opt, m: int, device) -> dict:
    """Median step time of m micro-batches and each stage's bubble, 1 - compute time / step time."""
    margs = model.args
    batches = [(torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), device=device),
                torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), device=device))
               for _ in range(m)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum")
    stats = {}

    def step():
        P.pipeline_step(model, batches, mesh, args.seq_len, loss_fn, stats=stats)
        opt.zero_grad()

    step()
    stats.clear()
    t = timed_steps(step, args.steps, device, warmup=0)
    busy = torch.tensor([stats["busy_s"] / args.steps], device=device)
    total = torch.tensor([statistics.median(t)])
    every = [torch.zeros(1, device=device) for _ in range(mesh.world)]
    dist.all_gather(every, busy)
    measured = [1 - b.item() / total.item() for b in every]
    return {"step_s": total.item(), "bubble_measured_per_stage": measured,
            "bubble_measured": sum(measured) / len(measured)}
