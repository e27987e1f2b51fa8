"""Plan a run on machines we don't have (`python bench.py --plan ...`): arithmetic only.

From the shapes alone (costs.py's estimates), for a preset on --gpus GPUs of one kind at a layout:
parameters, training FLOPs, per-GPU memory by kind under each ZeRO stage and activation
checkpointing mode, bytes sent per step and their time on NVLink or the network, the pipeline
bubble, step time and days at a stated MFU, whether it fits, and the cost (GPU-hours, energy,
money). --ramp plans each stage of Llama 3's growing batch; --budget-flops says what a compute budget
buys by Chinchilla's fit, beside what Llama 3 chose; --launch writes the Slurm batch script or the
Kubernetes PyTorchJob that runs train.py at the planned layout.

Contents: the plan and its printout, the flags, running it (a ramp too), sizing, launching.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

import checks
import config
import costs
import model as M
import parallel as P
import ramp


def refuse(message: str):
    """A plan these flags cannot make: bench.py says why in one line (config.ConfigError)."""
    raise config.ConfigError(message)


# ----------------------------------------------------------------------------------------------------
# The plan: arithmetic only (costs.memory_estimate and comm_estimate, model.flops_per_token)


def plan(model: str, tokens: float, layout: P.Layout, shape: costs.Shape, gpu: str = "H100",
         mfu: float = 0.4, *, reserve_gb: float = 4.0, pue: float = 1.1, usd_per_gpu_hour: float = 2.0,
         lora: tuple | None = None) -> dict:
    """A --plan run on layout.world GPUs (see the module docstring), with its memory under each of
    ZeRO 0 to 3 and each activation checkpointing mode (the chosen one marked). It fits within the
    GPU's capacity less reserve_gb, kept for what no tensor count sees: the CUDA context and kernels,
    NCCL's buffers (one set per process group), the allocator's fragmentation. lora (rank, targets):
    LoRA fine-tuning: the model frozen (costs.memory_estimate), no weight gradients, FLOPs 4N + 12LdT."""
    margs, gpus, tp, cp, pp, dp = M.PRESETS[model], layout.world, layout.tp, layout.cp, layout.pp, layout.dp
    micro_batch, seq_len, grad_accum = shape.micro_batch, shape.seq_len, shape.grad_accum
    precision = shape.precision
    n, active = costs.count_params(margs), costs.count_params(margs, active=True)  # (a mixture: top_k experts)
    tokens_micro = micro_batch * seq_len
    tokens_step = tokens_micro * grad_accum * dp
    steps = math.ceil(tokens / tokens_step)
    flops_tok = costs.flops_per_token(margs, seq_len, frozen=lora is not None)
    memory = lambda z, ck: costs.memory_estimate(margs, dataclasses.replace(layout, zero=z),
                                                 shape._replace(act_ckpt=ck), lora=lora)
    stages = [z for z in (0, 1, 2, 3) if not (lora and z == 3) and not (margs.n_experts and z == 3)
              and not (layout.ep > 1 and z == 2)]  # (what training refuses: checks.check_experts, LoRA)
    variants = {f"zero{z}_ckpt{costs.ckpt_label(c)}": memory(z, c) for z in stages
                for c in (False, "selective", "full")}
    chosen = variants[f"zero{layout.zero}_ckpt{costs.ckpt_label(shape.act_ckpt)}"]
    comm = costs.comm_estimate(margs, layout, shape)
    peak = costs.gpu_peak(gpu, precision)[0]
    step_s = flops_tok["palm"] * tokens_step / (gpus * peak * mfu)
    capacity = costs.SYSTEMS[gpu].memory_gb * 1e9
    optimal = costs.compute_optimal(6 * active * tokens)
    return {"model": model, "params": n, "active_params": active, "gpus": gpus, "gpu": gpu, "tp": tp, "cp": cp,
            "pp": pp, "dp": dp, "ep": layout.ep,
            "gpus_per_replica": tp * cp * pp, "micro_batch": micro_batch, "seq_len": seq_len,
            "grad_accum": grad_accum,
            "tokens_per_micro_batch": tokens_micro, "tokens_per_global_batch": tokens_step, "tokens": tokens,
            "steps": steps, "flops": (4 if lora else 6) * active * tokens, "flops_per_token": flops_tok,
            "precision": precision,
            "memory_per_gpu_bytes": chosen["total"], "memory_per_gpu": chosen, "memory_variants": variants,
            "comm_bytes_per_step": comm, "bubble": (pp - 1) / (layout.virtual * grad_accum + pp - 1), "mfu": mfu,
            "peak_flops": peak, "step_time_s": step_s, **costs.run_costs(gpu, gpus, steps * step_s, pue,
                                                                          usd_per_gpu_hour),
            "comm_seconds_per_step": costs.comm_seconds(comm, gpu, tp, cp, pp, gpus, layout.ep),
            "links": costs.links(gpu, tp, cp, pp, gpus, layout.ep),
            "compute_optimal": {"parameters": optimal[0], "tokens": optimal[1]}, "gpu_memory_bytes": capacity,
            "reserve_bytes": reserve_gb * 1e9, "fits": chosen["total"] <= capacity - reserve_gb * 1e9,
            "zero": layout.zero, "act_ckpt": shape.act_ckpt, "sp": layout.sp, "schedule": layout.schedule,
            "virtual_stages": layout.virtual,
            "lora": {"rank": lora[0], "targets": list(lora[1]),
                     "trained": costs.lora_params(margs, *lora) * margs.n_layers} if lora else None}


def print_plan(r: dict):
    gb = lambda x: f"{x / 1e9:,.2f} GB"
    active = f" ({r['active_params']:,} active)" if r["active_params"] != r["params"] else ""
    experts = f", the experts over ep {r['ep']} of them" if r["ep"] > 1 else ""
    print(f"{r['model']}: {r['params']:,} parameters{active} on {r['gpus']:,} {r['gpu']} = {r['dp']} replicas "
          f"x {r['gpus_per_replica']} GPUs (tp {r['tp']} x cp {r['cp']} x pp {r['pp']}){experts}")
    print(f"  batch: {r['micro_batch']} x {r['seq_len']:,} = {r['tokens_per_micro_batch']:,} tokens per "
          f"micro-batch, x {r['grad_accum']} accumulation x {r['dp']} dp = {r['tokens_per_global_batch']:,} "
          "tokens per step")
    sizing = (f"; {r['tokens'] / r['params']:,.0f} tokens per parameter, where Chinchilla's 20 would spend "
              f"these FLOPs on {r['compute_optimal']['parameters'] / 1e9:,.0f}B parameters and "
              f"{r['compute_optimal']['tokens'] / 1e12:,.2f}T tokens") if not r["lora"] else ""
    print(f"  {r['tokens']:.3g} tokens: {r['steps']:,} steps, {'4ND' if r['lora'] else '6ND'} = "
          f"{r['flops']:.3g} FLOPs ({r['flops_per_token']['palm'] / 1e9:.1f} GFLOP/token PaLM, "
          f"{r['flops_per_token']['megatron'] / 1e9:.1f} Megatron){sizing}")
    print(f"  at {100 * r['mfu']:.0f}% MFU of {r['peak_flops'] / 1e12:,.0f} TFLOP/s ({r['precision']}): "
          f"{r['step_time_s']:.2f} s per step, {r['days']:,.1f} days; pipeline bubble {r['bubble']:.3f} "
          f"({r['schedule']}" + (f", {r['virtual_stages']} chunks per rank)" if r["virtual_stages"] > 1
                                 else ")"))
    if r["lora"]:
        print(f"  LoRA rank {r['lora']['rank']} on {', '.join(r['lora']['targets'])}: "
              f"{r['lora']['trained']:,} trained parameters, the model frozen in {r['precision']}")
    zero = f"ZeRO-{int(r['zero'])}" if r["zero"] else "no ZeRO"
    print(f"  memory of the busiest GPU ({zero}, "
          f"{ {None: 'no ', 'full': '', 'selective': 'selective '}[costs.ckpt_mode(r['act_ckpt'])]}"
          f"activation checkpointing, {'' if r['sp'] else 'no '}sequence parallelism): "
          + ", ".join(f"{k} {gb(v)}" for k, v in r["memory_per_gpu"].items() if v)
          + f" -> {'fits in' if r['fits'] else 'does NOT fit in'} {gb(r['gpu_memory_bytes'])} less a "
          f"{gb(r['reserve_bytes'])} reserve (CUDA context, NCCL buffers, fragmentation)")
    for name, m in r["memory_variants"].items():
        print(f"    {name:12s} total {gb(m['total'])}")
    print("  bytes sent per GPU per step: " + ", ".join(f"{k} {gb(v)}" for k,
                                                        v in r["comm_bytes_per_step"].items()))
    print_costs(r)


def print_costs(r: dict):
    system = costs.SYSTEMS[r["gpu"]]
    over = lambda s: ", more than the compute)" if s > r["step_time_s"] else ")"
    times = [f"{dim} {s:.2f} s ({r['links'][dim]}{over(s)}"
             for dim, s in r["comm_seconds_per_step"].items() if s]
    print(f"  on the links ({system.link_gbs:g} GB/s {system.link} each way within {system.domain} GPUs, "
          f"{system.network_gbs:g} GB/s network): " + (", ".join(times) or "nothing")
          + f"; compute {r['step_time_s']:.2f} s a step (all bytes exposed, none overlapped)")
    print(f"  cost: {r['gpu_hours'] / 1e6:,.2f}M GPU-hours; {r['energy_mwh']:,.0f} MWh ({system.watts:g} W a "
          f"GPU x PUE {r['pue']:g}); ${r['usd'] / 1e6:,.2f}M at ${r['usd_per_gpu_hour']:g} a GPU-hour")


def gpu_name(text: str) -> str:
    """--gpu in any case, '-' or '_' for spaces: h100, h100-nvl -> the table's H100, H100 NVL."""
    canonical = {name.lower(): name for name in costs.GPU_PEAK_TFLOPS}
    return canonical.get(text.strip().lower().replace("-", " ").replace("_", " "), text)



def add_plan_args(g):
    g.add_argument("--tokens", type=float, default=15e12, help="training tokens (Llama 3: 15e12)")
    g.add_argument("--gpu", default="H100", type=gpu_name, choices=sorted(costs.GPU_PEAK_TFLOPS),
                   help="GPU model, in any case (H100 is the SXM part; h100-pcie names the PCIe one)")
    g.add_argument("--gpus", type=int, default=8, help="GPUs in all (= tp x cp x pp x dp)")
    g.add_argument("--mfu", type=float, default=0.40, help="assumed model FLOPs utilization")
    g.add_argument("--ramp", default=None,
                   help="train.py's --ramp (e.g. 0:4096x1024,252M:8192x1024,2.87T:8192x2048): a plan per "
                        "stage, its accumulation from its sequences, the last stage up to --tokens")
    g.add_argument("--reserve-gb", type=float, default=4.0,
                   help="GPU memory kept for what tensors do not show: CUDA context, NCCL buffers, "
                   "fragmentation")
    g.add_argument("--pue", type=float, default=1.1,
                   help="the data center's power usage effectiveness: its power over the GPUs' (cooling...)")
    g.add_argument("--usd-per-gpu-hour", type=float, default=2.0, help="the price of one GPU for an hour")
    g.add_argument("--budget-flops", type=float, default=None,
                   help="also say what model size and tokens this many training FLOPs buy (Chinchilla), beside "
                        "what Llama 3 chose")
    g.add_argument("--launch", choices=["slurm", "k8s"], default=None,
                   help="print, instead of the plan, a Slurm batch script or a Kubernetes PyTorchJob that runs "
                        "train.py at the planned layout")
    g.add_argument("--gpus-per-node", type=int, default=None, help="--launch: default 8 (4 for GB200)")
    g.add_argument("--image", default="llama3-train:latest",
                   help="--launch k8s: a container image holding this repository and its requirements")


def plan_lora(a) -> tuple | None:
    """(rank, targets) of --lora-rank and --lora-targets for plan(), checked as sft.py does."""
    lora = config.lora_of(a)
    if lora is None:
        return None
    if a.launch or a.zero == 3:
        refuse("--lora-rank: " + (
            "--launch writes train.py's command, which trains every weight" if a.launch else
            "--zero 3 shards what the optimizer trains, under LoRA the adapters alone: plan --zero 1 or 2"))
    checks.check_lora_shape(*lora, M.PRESETS[a.model])
    return lora[0], lora[2]


def planned_layout(a, grad_accum: int, seq_len: int) -> P.Layout:
    """The flags' layout on --gpus GPUs (dp: what tp x cp x pp leave; sequence parallelism wherever
    tp cuts), checked as train.py checks its own (checks.check_layout)."""
    cut = a.tp * a.cp * a.pp
    layout = P.Layout(tp=a.tp, cp=a.cp, pp=a.pp, dp=a.gpus // cut if cut > 0 else 0, sp=a.sp or a.tp > 1,
                      zero=int(a.zero), schedule=a.schedule, virtual=a.virtual_stages, ep=a.ep)
    checks.check_layout(layout, a.gpus, M.PRESETS[a.model], grad_accum, seq_len)
    checks.check_experts(a, M.PRESETS[a.model], layout)
    return layout


def planned_shape(a, seq_len: int, grad_accum: int) -> costs.Shape:
    """The run's shape; fp8 planned as bf16 (its weights, and activations it keeps no larger)."""
    precision = {"auto": "bf16", "fp8": "bf16"}.get(a.precision, a.precision)
    return costs.Shape(a.micro_batch, seq_len, precision, grad_accum, a.act_ckpt, a.loss_chunk)


def run_plan(a):
    sizing = sizing_for(a.budget_flops) if a.budget_flops else None
    if sizing and not a.json:
        print_sizing(sizing)
    if a.ramp:
        return run_ramp_plan(a)
    try:
        layout = planned_layout(a, a.grad_accum, a.seq_len)
    except P.LayoutError as e:
        refuse(f"invalid parallel layout: {e}")
    r = plan(a.model, a.tokens, layout, planned_shape(a, a.seq_len, a.grad_accum), a.gpu, a.mfu,
             reserve_gb=a.reserve_gb, pue=a.pue, usd_per_gpu_hour=a.usd_per_gpu_hour, lora=plan_lora(a))
    if a.launch:
        return print(launch_script(a, r))
    print(json.dumps({**r, "sizing": sizing} if sizing else r)) if a.json else print_plan(r)


# ----------------------------------------------------------------------------------------------------
# Launching the planned run: a Slurm batch script or a Kubernetes PyTorchJob. Slurm gives a job
# whole nodes and runs one task on each (srun); Kubernetes schedules pods, one per node here, via
# Kubeflow's training operator, which gives each pod torchrun's rendezvous (PET_* variables). Either
# way torchrun starts one process per GPU on every node; they meet at the first (c10d rendezvous).


def nodes_of(a) -> tuple[int, int]:
    """(nodes, GPUs a node) for --launch: --gpus must fill whole nodes and each tp group lie in one
    NVLink (or PCIe, Infinity Fabric) domain, a node or a GB200 NVL72 rack (NVLink across trays)."""
    per_node, rack = a.gpus_per_node or (4 if a.gpu == "GB200" else 8), costs.SYSTEMS[a.gpu].domain
    domain = rack if rack > 8 else per_node  # (8: an HGX board, one node)
    if a.gpus % per_node:
        refuse(f"--launch: --gpus {a.gpus} is not a number of whole nodes of {per_node} GPUs "
               "(--gpus-per-node)")
    if a.tp > domain or (per_node % a.tp if a.tp <= per_node else a.tp % per_node):
        refuse(f"--launch: tp {a.tp} groups would not lie within nodes of {per_node} GPUs, {domain} in one "
               f"{costs.SYSTEMS[a.gpu].link} domain: tensor parallelism's all-reduces must not cross the "
               "network")
    return a.gpus // per_node, per_node


def train_flags(a, r: dict) -> list[str]:
    """train.py's flags for the planned run (the data, its tokenizer and the steps included)."""
    flags = ["--model", a.model, "--data", a.data, "--seq-len", str(a.seq_len), "--micro-batch",
             str(a.micro_batch), "--grad-accum", str(a.grad_accum), "--tp", str(a.tp), "--cp", str(a.cp),
             "--pp", str(a.pp), "--zero", str(a.zero), "--max-steps", str(r["steps"])] + (
                 ["--ep", str(a.ep)] if a.ep > 1 else [])
    flags += ["--tokenizer", "llama3"] if a.model.startswith("llama") else []
    flags += ["--sp"] if a.sp or a.tp > 1 else []
    flags += (["--act-ckpt"] + (["selective"] if a.act_ckpt == "selective" else [])) if a.act_ckpt else []
    flags += ["--schedule", a.schedule] if a.pp > 1 else []
    flags += ["--virtual-stages", str(a.virtual_stages)] if a.virtual_stages > 1 else []
    flags += ["--ramp", a.ramp] if a.ramp else []  # (its stages set --seq-len and --grad-accum)
    return flags


def launch_script(a, r: dict) -> str:
    nodes, per_node = nodes_of(a)
    name = a.model.replace(".", "-")
    about = (f"{a.model} on {a.gpus:,} {a.gpu} ({nodes:,} nodes x {per_node}): tp {a.tp} x cp {a.cp} x pp "
             f"{a.pp} x dp {r['dp']}, {r['memory_per_gpu_bytes'] / 1e9:.1f} GB per GPU, {r['steps']:,} steps, "
             f"{r['days']:.1f} days at {100 * a.mfu:.0f}% MFU (bench.py --plan)")
    return (slurm_script if a.launch == "slurm" else k8s_job)(a, r, nodes, per_node, name, about)


def slurm_script(a, r: dict, nodes: int, per_node: int, name: str, about: str) -> str:
    flags = " ".join(shlex.quote(f) for f in train_flags(a, r))
    return f"""#!/bin/bash
# {about}
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # the rendezvous: the first node
export OMP_NUM_THREADS=$(( SLURM_CPUS_ON_NODE / {per_node} ))
export NCCL_DEBUG=WARN  # what fails, without every step of NCCL's start
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective ends the job rather than hanging it
# export NCCL_SOCKET_IFNAME=...  # the interface between the nodes, if NCCL picks another
OUT_DIR=${{OUT_DIR:-$PWD/out-{name}}}  # one folder every node sees
srun torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d \\
    --rdzv-endpoint=$head:29500 train.py {flags} --out-dir "$OUT_DIR" --resume"""


def yaml_string(text: str) -> str:
    """`text` as a YAML double-quoted scalar that reads back as `text`: printable ASCII as JSON
    writes it (with " and \\ escaped), any other character as \\uXXXX, or past U+FFFF as \\UXXXXXXXX
    (YAML reads JSON's surrogate pair for it as two characters)."""
    return '"' + "".join(json.dumps(c)[1:-1] if " " <= c <= "~" else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF
                         else f"\\U{ord(c):08x}" for c in text) + '"'


def k8s_job(a, r: dict, nodes: int, per_node: int, name: str, about: str) -> str:
    q = yaml_string  # every value from a flag
    pod = f"""      template:
        spec:
          containers:
            - name: pytorch
              image: {q(a.image)}
              command: ["torchrun", "train.py", {", ".join(q(f) for f in train_flags(a, r))},
                        "--out-dir", {q(f"/shared/out-{name}")}, "--resume"]
              env:
                - {{name: NCCL_DEBUG, value: WARN}}
                - {{name: TORCH_NCCL_ASYNC_ERROR_HANDLING, value: "1"}}
              resources:
                limits: {{nvidia.com/gpu: {per_node}}}
              volumeMounts:
                - {{name: shared, mountPath: /shared}}  # one folder every pod sees
          volumes:
            - name: shared
              persistentVolumeClaim: {{claimName: {q(name + "-shared")}}}"""
    workers = f"""
    Worker:
      replicas: {nodes - 1}
      restartPolicy: OnFailure
{pod}""" if nodes > 1 else ""
    return f"""# {about}
# torchrun reads its rendezvous from the PET_* variables the training operator sets in every pod
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: {q(name)}
spec:
  nprocPerNode: "{per_node}"
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
{pod}{workers}"""


# What Llama 3 chose at its budget (Dubey et al. 2024): section 3.2's IsoFLOP fit put the flagship's
# 3.8e25 FLOPs at 402B parameters on 16.55T tokens, and the curves grow flat near their minimum, so
# 405B on 15.6T tokens cost little; per the introduction, the smaller models were trained "much
# longer than is compute-optimal", and beat compute-optimal models at the same inference budget.
LLAMA3 = {"llama3.1-405b": 15.6e12, "llama3-70b": 15e12, "llama3-8b": 15e12}


def sizing_for(flops: float) -> dict:
    """--budget-flops: Chinchilla's compute-optimal size, and Llama 3's tokens per parameter."""
    parameters, tokens = costs.compute_optimal(flops)
    return {"budget_flops": flops, "parameters": parameters, "tokens": tokens,
            "tokens_per_parameter": costs.TOKENS_PER_PARAMETER,
            "llama3": {m: {"parameters": costs.count_params(M.PRESETS[m]), "tokens": t,
                           "tokens_per_parameter": t / costs.count_params(M.PRESETS[m])}
                       for m, t in LLAMA3.items()}}


def count(n: float) -> str:
    """A count in the unit that fits it: 405B, 15.60T, 3.2M, 950K, 12."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.3g}{unit}" if n < 100 * size else f"{n / size:,.0f}{unit}"
    return f"{n:.3g}"


def print_sizing(s: dict):
    print(f"{s['budget_flops']:.3g} FLOPs, compute-optimal by Chinchilla (Hoffmann et al. 2022, approaches 1 "
          f"and 2: N and D both as C^0.5, {s['tokens_per_parameter']} tokens per parameter): "
          f"{count(s['parameters'])} parameters on {count(s['tokens'])} tokens")
    print("  Llama 3 chose: " + ", ".join(f"{m} on {v['tokens'] / 1e12:g}T tokens "
                                         f"({v['tokens_per_parameter']:,.0f} per parameter)"
                                         for m, v in s["llama3"].items()))
    print("  (its own fit put 3.8e25 FLOPs at 402B parameters on 16.55T tokens, and the curves are flat near "
          "the optimum; the smaller models were trained far past it: a model is trained once and served many "
          "times, and at the same inference cost they beat compute-optimal ones)")


def run_ramp_plan(a):
    """--plan --ramp: one plan per stage (its sequence length, its accumulation, its share of
    --tokens) and the run's totals; the largest stage's memory decides whether the layout fits."""
    try:
        stages = ramp.parse(a.ramp)
    except ramp.RampError as e:
        refuse(str(e))
    dp, rows = a.gpus // (a.tp * a.cp * a.pp), []
    for i, s in enumerate(stages):
        end = stages[i + 1].seen if i + 1 < len(stages) else a.tokens
        if end <= s.seen or s.sequences % (a.micro_batch * dp):
            refuse(f"--ramp stage at {s.tokens:,.0f} tokens: " + (
                f"it starts after --tokens {a.tokens:.3g}" if end <= s.seen else
                f"{s.sequences} sequences do not divide into micro-batches of {a.micro_batch} on {dp} dp "
                "ranks"))
        accum = s.sequences // (a.micro_batch * dp)
        try:
            layout = planned_layout(a, accum, s.seq_len)
        except P.LayoutError as e:
            refuse(f"invalid parallel layout at the stage of {s.seq_len}-token sequences: {e}")
        rows.append(plan(a.model, end - s.seen, layout, planned_shape(a, s.seq_len, accum), a.gpu, a.mfu,
                         reserve_gb=a.reserve_gb, pue=a.pue, usd_per_gpu_hour=a.usd_per_gpu_hour))
    if a.launch:  # the whole ramp as one run: its steps, its largest stage's memory
        worst = max(rows, key=lambda r: r["memory_per_gpu_bytes"])
        return print(launch_script(a, {**worst, "steps": sum(r["steps"] for r in rows),
                                       "days": sum(r["days"] for r in rows)}))
    if a.json:
        return print(json.dumps(rows))
    gb = lambda x: f"{x / 1e9:,.1f} GB"
    print(f"{a.model} on {a.gpus:,} {a.gpu} (tp {a.tp} x cp {a.cp} x pp {a.pp} x dp {dp}), {a.tokens:.3g} "
          f"tokens in {len(rows)} stages, at {100 * a.mfu:.0f}% MFU:")
    for r in rows:
        print(f"  {r['seq_len']:>7,} x {r['tokens_per_global_batch'] // r['seq_len']:,} = "
              f"{r['tokens_per_global_batch'] / 1e6:,.1f}M tokens a step ({r['grad_accum']} accumulation), "
              f"{r['tokens']:.3g} tokens in {r['steps']:,} steps, {gb(r['memory_per_gpu_bytes'])} per GPU, "
              f"{r['steps'] * r['step_time_s'] / 3600:,.1f} h")
    worst = max(rows, key=lambda r: r["memory_per_gpu_bytes"])
    print(f"  in all {sum(r['steps'] for r in rows):,} steps, {sum(r['days'] for r in rows):,.1f} days; the "
          f"largest stage needs {gb(worst['memory_per_gpu_bytes'])} per GPU: "
          f"{'fits' if worst['fits'] else 'does NOT fit'} in {gb(worst['gpu_memory_bytes'])} less "
          f"{gb(worst['reserve_bytes'])}")
