"""Benchmarks that measure, in one run, what the README reports (never timed unit tests).

  torchrun --standalone --nproc_per_node=2 bench.py --dp-vs-ddp
      step time of parallel.py's data parallelism (flat fp32 buffer, buckets all-reduced from gradient
      hooks during backward, our AdamW) against torch's DistributedDataParallel + torch.optim.AdamW on the
      same model and batch; the two alternate in blocks so both see the same machine load.
  torchrun --standalone --nproc_per_node=2 bench.py --bubble
      the pipeline bubble measured (1 - compute time / step time on each stage) for several micro-batch
      counts m, against the formula (p-1)/(m+p-1).

Both print a table and, with --json, one JSON object with the settings and versions. torch's DDP is used
here, and only here, as the baseline to beat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import model as M
import optim as O
import parallel as P


def timed_steps(step, n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def dp_vs_ddp(args, mesh, margs):
    """Same seed, model, batch and optimizer settings; ours and DDP alternate in --blocks blocks."""
    torch.manual_seed(0)
    x = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len))
    y = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len))
    n_targets = y.numel() * mesh.dp

    torch.manual_seed(0)
    ours = M.Transformer(margs)
    opt = O.AdamW(ours.named_parameters(), lr=1e-4, pad_to=mesh.dp)
    sync = P.GradSync(opt, mesh, args.bucket_mb)

    def our_step():
        logits = ours(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum") / n_targets
        sync.start()  # one micro-batch per step: reduce while backward runs
        loss.backward()
        sync.finish()
        opt.clip_grad_norm(1.0, P.grad_norm(sync, ours))
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    ref = torch.nn.parallel.DistributedDataParallel(M.Transformer(margs), bucket_cap_mb=args.bucket_mb)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def ddp_step():
        logits = ref(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # DDP averages over ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    times = {"parallel.py": [], "DDP": []}
    for _ in range(args.blocks):
        times["parallel.py"] += timed_steps(our_step, args.steps)
        times["DDP"] += timed_steps(ddp_step, args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "ratio_ddp_over_ours": med["DDP"] / med["parallel.py"],
            "grad_mb": 4 * M.count_params(margs) / 2 ** 20, "steps_each": args.steps * args.blocks}


def bubble(args, mesh, margs):
    """1F1B at pp = world, for each m: step time, this stage's compute time, measured bubble."""
    torch.manual_seed(0)
    model = M.Transformer(margs)
    P.apply_pipeline(model, mesh)
    opt = O.AdamW(model.named_parameters(), lr=1e-4)
    rows = []
    for m in args.micro_batches:
        batches = [(torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len)),
                    torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len))) for _ in range(m)]
        loss_fn = lambda logits, y: F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        stats = {}

        def step():
            P.pipeline_step(model, batches, mesh, args.seq_len, margs.dim, loss_fn, args.schedule, stats=stats)
            opt.zero_grad()

        step()
        stats.clear()
        t = timed_steps(step, args.steps, warmup=0)
        busy = torch.tensor([stats["busy_s"] / args.steps])
        total = torch.tensor([statistics.median(t)])
        every = [torch.zeros(1) for _ in range(mesh.world)]
        dist.all_gather(every, busy)
        measured = [1 - b.item() / total.item() for b in every]
        rows.append({"m": m, "step_s": total.item(), "bubble_measured_per_stage": measured,
                     "bubble_measured": sum(measured) / len(measured),
                     "bubble_formula": (mesh.pp - 1) / (m + mesh.pp - 1)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp-vs-ddp", action="store_true")
    p.add_argument("--bubble", action="store_true")
    p.add_argument("--model", default="small")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks (dp-vs-ddp)")
    p.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "afab"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not (args.dp_vs_ddp or args.bubble):
        p.error("choose --dp-vs-ddp or --bubble (run under torchrun with 2 or more processes)")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    margs = M.PRESETS[args.model]
    mesh = P.init_mesh(pp=world if args.bubble else 1)
    if world < 2:
        raise SystemExit("run under torchrun with --nproc_per_node=2 or more")
    result = {"torch": torch.__version__, "python": platform.python_version(), "device": "cpu (gloo)",
              "threads_per_process": torch.get_num_threads(), "processes": world, "model": args.model,
              "params": M.count_params(margs), "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    if args.dp_vs_ddp:
        result["dp_vs_ddp"] = dp_vs_ddp(args, mesh, margs)
    else:
        result["bubble"] = bubble(args, mesh, margs)
        result["schedule"] = args.schedule
    if mesh.rank == 0:
        if args.json:
            print(json.dumps(result))
        elif args.dp_vs_ddp:
            r = result["dp_vs_ddp"]
            print(f"{args.model} ({result['params']:,} params, {r['grad_mb']:.1f} MB of fp32 gradients), "
                  f"batch {args.micro_batch}x{args.seq_len} per rank, dp {world}, {r['steps_each']} steps each")
            for k, v in r["median_step_s"].items():
                print(f"  {k:12s} median step {1000 * v:8.1f} ms")
            print(f"  DDP / parallel.py step time: {r['ratio_ddp_over_ours']:.3f} (> 1: ours is faster)")
        else:
            print(f"pipeline bubble, {args.schedule}, pp {world}, {args.model}, micro-batch {args.micro_batch}x{args.seq_len}")
            print(f"  {'m':>3s} {'step ms':>9s} {'measured':>9s} {'(p-1)/(m+p-1)':>14s}   per stage")
            for r in result["bubble"]:
                print(f"  {r['m']:3d} {1000 * r['step_s']:9.1f} {r['bubble_measured']:9.3f} {r['bubble_formula']:14.3f}   "
                      + " ".join(f"{b:.3f}" for b in r["bubble_measured_per_stage"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
