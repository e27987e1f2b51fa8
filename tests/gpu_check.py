"""The first day on GPUs: one command that checks the CUDA path end to end, printing PASS / FAIL lines.

    python tests/gpu_check.py          # on a machine with 1 to 8 NVIDIA GPUs; exit 1 if anything failed

1. Parity on NCCL: a small model trained STEPS steps on one GPU, then under each layout that fits the GPUs
   here (LAYOUTS: dp, tp, pp, cp, ZeRO-1, 2 and 3, --sp, activation checkpointing, --compile, the
   attention kernels), with the same global batch. Every step's loss must equal the single-GPU run's
   within PARITY_RTOL: in fp32 (TF32 matmuls: sums in another order differ in about the 4th digit), in
   bf16 (its 8-bit mantissa: about the 2nd or 3rd digit) and, for a few layouts, in fp16 (loss scaling).
   Packed SFT and DPO likewise, at dp 2 against one GPU.
2. bf16 against fp32: the default run's first CURVE_STEPS steps in both; bf16's loss at every logged step
   within CURVE_RTOL of fp32's.
3. bench.py in bf16: tokens/s and MFU against the GPU's datasheet peak, printed.
4. Packed documents: FlexAttention's block mask against SDPA's dense mask, a small model's loss and every
   gradient on 4 rows of 2,048 tokens cut into documents of random lengths, in fp32 (TF32 off) and bf16.
5. Host-device synchronizations: torch's sync debug mode armed during SYNC_STEPS training steps, on one GPU
   and on two, must report one per step (the step's tally), listing any other by file and line.
6. On 8 GPUs, Llama 3.1 8B: a two-step smoke run at the layout the README plans (ZeRO-1, activation
   checkpointing, 8,192 tokens), its max_memory_allocated beside costs.memory_estimate; then the
   tokens/s and MFU of each of LAYOUTS_8B, in one table beside torchtitan's published figure.
Every check runs under a time limit (CHECK_TIMEOUT_S). Without CUDA it prints one SKIP line and exits 0
(the test suite runs that path).

    python tests/gpu_check.py --quick [--budget SECONDS] [--report DIR]   # a GPU day on one GPU, in minutes

The quick day, for GPU time that is rare and short: its parts in order of importance, each under its own
time limit and all within --budget (600 s), each result appended to DIR/report.md and DIR/report.jsonl as
it finishes (a part the budget cannot fit is reported skipped): the default run (wall time, val loss);
Llama 3.2 1B at 4,096 tokens a sequence, eager and compiled, micro-batches of 4 and 2, with each attention
kernel that applies (tokens/s, MFU, peak memory beside the estimate, the kernel that ran); how long a step
waits for a 1B checkpoint and how long it takes to write; ours against transformers' LlamaForCausalLM at
the same shape; one compiled 1B step's GPU time by kind, from torch's
profiler; then the checks that fit one GPU. It uses the torch it finds, installs nothing, reaches no
network (the data come from DATA_MIRROR, as the tests'); without CUDA it says so and exits 0.
"""

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
STEPS, CURVE_STEPS, SYNC_STEPS = 20, 200, 5
PARITY_RTOL = {"fp32": 2e-3, "bf16": 3e-2, "fp16": 1e-2}
CHECK_TIMEOUT_S = 1200  # one check (a training run, a benchmark); --compile's first step compiles for minutes
CURVE_RTOL = 0.02
MODEL = ["--model", "mini", "--seq-len", "256", "--lr", "1e-3", "--warmup", "5", "--log-every", "1",
         "--eval-every", "-1", "--ckpt-every", "0", "--sample-tokens", "0"]
GLOBAL_BATCH = 16  # sequences per step in every layout
# cp: FlexAttention's block mask over global positions and NCCL's cp group, which the CPU tests cannot run;
# ZeRO-3's storage freed and regathered under CUDA's caching allocator; the interleaved schedule's transfers
# at pp 2, which NCCL matches by order alone
LAYOUTS = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "pp": 2, "dp": 2}, {"cp": 2},
           {"cp": 2, "tp": 2, "pp": 2}, {"dp": 2, "zero": 3}, {"pp": 2, "virtual": 2},
           # the layouts the README recommends for 8B, and what they are made of
           {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"tp": 2, "sp": 1},
           {"dp": 2, "zero": 1, "act_ckpt": "full"}, {"tp": 2, "sp": 1, "act_ckpt": "selective"},
           {"tp": 2, "sp": 1, "compile": 1}, {"dp": 2, "zero": 1, "compile": 1},
           {"attn": "flash"}, {"attn": "cudnn"}]
BF16_ONLY = ({"attn": "flash"}, {"attn": "cudnn"})  # kernels of bf16 and fp16 only: fp32 runs refuse them
FP16_LAYOUTS = [{"dp": 2}, {"dp": 2, "zero": 1}, {"tp": 2, "sp": 1}]
# Llama 3.1 8B on 8 GPUs, 8,192 tokens a sequence, 4 per GPU a step: the README's plan, then its variants
BENCH_8B = ["--model", "llama3.1-8b", "--seq-len", "8192", "--micro-batch", "1", "--grad-accum", "4",
            "--zero", "1", "--act-ckpt"]
LAYOUTS_8B = "zero=1;compile=1;attn=cudnn;zero=3,act_ckpt=selective;tp=2,sp=1,mb=2,accum=4"
# torchtitan's docs/performance.md, Table 1: Llama 3.1 8B on 8 H100 (96 GB, 500 W), FSDP, local batch 2 of
# 8,192 tokens, selective activation checkpointing: 5,762 tokens/s per GPU, 6,667 with torch.compile
TORCHTITAN_8B = {"eager": 5762, "compile": 6667}


def run(cmd: list, **kw) -> tuple[bool, str, str]:
    """(succeeded, its last line of errors, its output), within CHECK_TIMEOUT_S."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=CHECK_TIMEOUT_S, **kw)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {CHECK_TIMEOUT_S} s: {' '.join(map(str, cmd[-12:]))}", ""
    return p.returncode == 0, (p.stderr.strip().splitlines() or ["(no output)"])[-1], p.stdout


def torchrun(n: int, flags: list, out: Path, script: str = "train.py") -> tuple[bool, str]:
    ok, why, _ = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                      str(REPO / script), *flags, "--out-dir", str(out)])
    return ok, why


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def compare(name: str, got: list, want: list, rtol: float) -> bool:
    if len(got) != len(want):
        return report(name, False, f"{len(got)} logged steps, expected {len(want)}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return report(name, worst <= rtol, f"largest relative loss difference {worst:.2e} (allowed {rtol:.0e})")


def layout_flags(layout: dict, precision: str) -> list:
    dp, micro = layout.get("dp", 1), 4
    interleaved = ["--schedule", "interleaved", "--virtual-stages", str(layout.get("virtual"))]
    return [*MODEL, "--precision", precision, "--max-steps", str(STEPS), "--micro-batch", str(micro),
            "--grad-accum", str(GLOBAL_BATCH // (micro * dp)), "--tp", str(layout.get("tp", 1)),
            "--pp", str(layout.get("pp", 1)), "--cp", str(layout.get("cp", 1)),
            "--zero", str(layout.get("zero", 0)), "--attn-backend", layout.get("attn", "auto")] + (
        interleaved if "virtual" in layout else []) + (["--sp"] if layout.get("sp") else []) + (
        ["--compile"] if layout.get("compile") else []) + (
        ["--act-ckpt", layout["act_ckpt"]] if "act_ckpt" in layout else [])


def parity(gpus: int, work: Path) -> list[bool]:
    results = []
    fp32 = [layout for layout in LAYOUTS if layout not in BF16_ONLY]
    for precision, layouts in (("fp32", fp32), ("bf16", LAYOUTS), ("fp16", FP16_LAYOUTS)):
        ok, why = torchrun(1, layout_flags({}, precision), work / f"one-{precision}")
        if not report(f"single GPU, {precision}", ok, "trained" if ok else why):
            results.append(False)
            continue
        want = losses(work / f"one-{precision}")
        for layout in layouts:
            n = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
            name = " x ".join(f"{k} {v}" for k, v in layout.items()) + f", {precision}"
            if n > gpus:
                print(f"SKIP {name}: needs {n} GPUs, this machine has {gpus}", flush=True)
                continue
            out = work / ("-".join(f"{k}{v}" for k, v in layout.items()) + f"-{precision}")
            ok, why = torchrun(n, layout_flags(layout, precision), out)
            results.append(compare(name, losses(out), want, PARITY_RTOL[precision]) if ok
                           else report(name, False, why))
    return results


def curve(work: Path) -> bool:
    runs = {}
    for precision in ("fp32", "bf16"):
        flags = ["--precision", precision, "--max-steps", str(CURVE_STEPS), "--log-every", "10",
                 "--eval-every", "-1", "--sample-tokens", "0"]
        ok, why = torchrun(1, flags, work / f"curve-{precision}")
        if not ok:
            return report(f"default run, {precision}", False, why)
        runs[precision] = losses(work / f"curve-{precision}")
    return compare(f"bf16 loss curve against fp32 ({CURVE_STEPS} steps)", runs["bf16"], runs["fp32"],
                   CURVE_RTOL)


def bench() -> bool:
    """bench.py on one GPU, both attention kernels that fit the flag's choice side by side."""
    ok, why, out = run([sys.executable, str(REPO / "bench.py"), "--model", "small", "--precision", "bf16",
                        "--seq-len", "1024", "--micro-batch", "8", "--sweep", "attn=flash;attn=cudnn"])
    print(out, end="", flush=True)
    return report("bench.py, bf16, flash and cudnn attention", ok, "tokens/s and MFU above" if ok else why)


def trace(work: Path, gpus: int) -> bool:
    """bench.py --trace on NCCL: a track per GPU, the phases, and every collective's bytes as counted."""
    tp, pp = (2, 2) if gpus >= 4 else (gpus, 1)
    ok, why, _ = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc_per_node={tp * pp}", str(REPO / "bench.py"), "--trace", str(work / "trace"),
                      "--model", "small", "--tp", str(tp), "--pp", str(pp), "--grad-accum", "4"])
    if not ok:
        return report(f"bench.py --trace at tp {tp} x pp {pp}", False, why)
    t = json.loads((work / "trace" / "trace.json").read_text())
    sent = {}
    for e in t["traceEvents"]:
        if e["ph"] == "b" and e["cat"] != "io":
            key = (e["pid"], "dp" if e["cat"] == "dp_cp" else e["cat"])
            sent[key] = sent.get(key, 0.0) + e["args"]["bytes"]
    counted = {(r, k): v for r, c in enumerate(t["otherData"]["counted_bytes"]) for k, v in c.items()
               if v}
    phases = {e["name"] for e in t["traceEvents"] if e["ph"] == "X" and e["tid"] == 0}
    good = sent == counted and {"1 data", "5 grad sync", "6 optimizer", "7 checkpoint"} <= phases
    bubble = t["otherData"]["bubble"]
    return report(f"bench.py --trace at tp {tp} x pp {pp}", good,
                  f"bubble {bubble['measured']:.3f} measured, {bubble['formula']:.3f} by the formula; bytes as "
                  f"counted: {sent == counted}")


def sft_dpo(work: Path) -> list[bool]:
    """Packed SFT and DPO on NCCL: dp 2 against one GPU, the same global batch (the CPU tests' data)."""
    import test_sft_dpo as S
    common = S.TINY + ["--max-steps", "5", "--lr", "3e-3"]
    jobs = {"sft.py": ["--data", str(S.write_jsonl(work / "c.jsonl", S.CONVERSATIONS * 8)), "--pack",
                       "--seq-len", "128"],
            "dpo.py": ["--data", str(S.write_jsonl(work / "p.jsonl", S.PAIRS)), "--beta", "0.5"]}
    results = []
    for script, flags in jobs.items():
        runs = {}
        for n, micro in ((1, 4), (2, 2)):
            out = work / f"{script}-{n}"
            ok, why = torchrun(n, [*common, *flags, "--micro-batch", str(micro)], out, script)
            runs[n] = losses(out) if ok else why
        name = f"{script} dp 2 against one GPU, bf16"
        results.append(compare(name, runs[2], runs[1], PARITY_RTOL["bf16"]) if all(
            isinstance(r, list) for r in runs.values()) else report(name, False, str(runs)))
    return results


# Runs train.py with torch's own detector armed inside each train_step; prints {"file:line": count} and the
# number of steps on its last line.
COUNT_SYNCS = """
import collections, json, sys, warnings
import torch
import torch.nn.functional as F
import train

seen, steps, step = collections.Counter(), [0], train.train_step

def watched_step(*args, **kwargs):
    steps[0] += 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return step(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            seen.update(f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught
                        if "called a synchronizing" in str(w.message))  # not the mode's own prototype warning

train.train_step = watched_step
train.main(sys.argv[1:])
print(json.dumps({"syncs": seen, "steps": steps[0]}))
"""


def packed_documents() -> list[bool]:
    sys.path.insert(0, str(REPO))
    import model as M
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    T, results = 2048, []
    starts = torch.zeros(4, T, dtype=torch.long)
    starts[:, 0] = 1
    starts[torch.rand(4, T, generator=g) < 1 / 300] = 1  # documents of about 300 tokens
    doc_ids = (starts.cumsum(1) - 1).cuda()
    x, y = torch.randint(0, 320, (2, 4, T), generator=g).cuda()
    for dtype, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        model = M.Transformer(dataclasses.replace(M.PRESETS["mini"], max_seq_len=T))
        model.init_weights(seed=0)
        model = model.to("cuda", dtype)
        got = {}
        for kind, devices in (("block", ("cuda",)), ("dense", ())):
            M.BLOCK_MASK_DEVICES = devices
            model.zero_grad()
            loss = F.cross_entropy(model(x, doc_ids=doc_ids).float().flatten(0, 1), y.flatten())
            loss.backward()
            got[kind] = [loss.detach()] + [p.grad.float() for p in model.parameters()]
        M.BLOCK_MASK_DEVICES = ("cuda",)
        worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(got["block"], got["dense"]))
        results.append(report(f"packed documents, FlexAttention against the dense mask, {dtype}",
                              worst <= rtol, f"largest relative difference (loss, gradients) {worst:.1e}"
                              f" (allowed {rtol:.0e})"))
    return results


def one_pass_optimizer(device: str = "cuda") -> bool:
    """--compile's optimizer step (optim.adamw_pass, compiled for this device) against the eager one on the
    small model in bf16: the master weights and moments within float error after three steps with clipping,
    the bf16 weights the master rounded, and (on a GPU) a compiled step that allocates less than a tenth of
    the state's fp32 length: no temporary of the updated weights."""
    sys.path.insert(0, str(REPO))
    import model as M
    import optim as O
    opts = []
    for compiled in (False, True):
        model = M.Transformer(M.PRESETS["small"])
        model.init_weights(seed=0)
        opts.append(O.AdamW(model.to(device, torch.bfloat16).named_parameters(), lr=1e-3))
    opts[1].compile()
    g, extra = torch.Generator(device=device).manual_seed(0), 0
    for step in range(3):
        grad = torch.randn(opts[0].numel, device=device, generator=g)
        for opt in opts:
            opt.grad.copy_(grad)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            opt.step(1e-3 * (step + 1), grad_scale=torch.tensor(1.5, device=device))
            if device == "cuda" and step and opt is opts[1]:  # (the first step compiles)
                extra = max(extra, torch.cuda.max_memory_allocated() - before)
    worst = max(((getattr(opts[1], k) - getattr(opts[0], k)).norm() / getattr(opts[0], k).norm()).item()
                for k in ("master", "exp_avg", "exp_avg_sq"))
    rounded = torch.equal(opts[1].model_flat, opts[1].master.to(torch.bfloat16))
    return report("the compiled optimizer step against the eager one", worst <= 1e-6 and rounded
                  and extra < opts[0].numel * 4 / 10, f"largest relative difference {worst:.1e} (allowed "
                  f"1e-6), bf16 weights the master rounded: {rounded}, allocated {extra:,} bytes in a step "
                  f"(state {opts[0].numel * 4:,} bytes a buffer)")


def syncs(work: Path, n: int) -> bool:
    """COUNT_SYNCS on n GPUs (dp n): every rank must synchronize once per step."""
    script = work / "count_syncs.py"
    script.write_text(COUNT_SYNCS)
    flags = [*MODEL, "--precision", "bf16", "--max-steps", str(SYNC_STEPS), "--grad-accum", str(4 // n),
             "--out-dir", str(work / f"syncs{n}")]
    ok, why, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                        str(script), *flags], env={**os.environ, "PYTHONPATH": str(REPO)})
    name = f"host-device syncs on {n} GPU{'s' if n > 1 else ''}"
    if not ok:
        return report(name, False, why)
    ranks = [json.loads(line) for line in out.splitlines() if line.startswith('{"syncs"')]
    bad = [r for r in ranks if sum(r["syncs"].values()) != r["steps"]]
    return report(name, len(ranks) == n and not bad, f"{len(ranks)} ranks, one per step expected; "
                  f"{bad or 'each had one'}")


def smoke_8b(work: Path) -> bool:
    """Two steps of Llama 3.1 8B at the README's planned layout: the memory torch allocated at its peak
    beside what costs.memory_estimate planned for it."""
    ok, why, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                        str(REPO / "bench.py"), *BENCH_8B, "--steps", "1", "--warmup-steps", "1", "--json"])
    if not ok:
        return report("Llama 3.1 8B, two steps on 8 GPUs", False, why)
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    return report("Llama 3.1 8B, two steps on 8 GPUs", True, f"max_memory_allocated "
                  f"{row['peak_memory_gb']:.1f} GB, estimated {row['memory_estimate_gb']['total']:.1f} GB")


def table_8b() -> bool:
    """Tokens/s and MFU of Llama 3.1 8B on 8 GPUs per layout, beside torchtitan's published figure."""
    ok, why, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                        str(REPO / "bench.py"), *BENCH_8B, "--sweep", LAYOUTS_8B, "--json"])
    if not ok:
        return report("Llama 3.1 8B layouts on 8 GPUs", False, why)
    print(f"  {'layout':44s} {'tok/s/GPU':>9s} {'MFU':>6s} {'mem GB':>7s}  torchtitan tok/s/GPU")
    for r in json.loads(out.strip().splitlines()[-1])["rows"]:
        name = (f"tp {r['tp']} dp {r['dp']} mb {r['micro_batch']} zero {r['zero']} ckpt {r['act_ckpt']}"
                + " sp" * bool(r["sp"]) + " compile" * r["compile"] + f" attn {r['attn_backend']}")
        theirs = TORCHTITAN_8B["compile" if r["compile"] else "eager"]
        print(f"  {name:44s} {r['tokens_per_s_per_device']:9,.0f} {100 * r['mfu']['palm']:5.1f}% "
              f"{r['peak_memory_gb']:7.1f}  {theirs:,}", flush=True)
    return report("Llama 3.1 8B layouts on 8 GPUs", True, "table above")


# ----------------------------------------------------------------------------------------------------
# The quick GPU day (--quick)


class Report:
    """DIR/report.md (a table for people) and DIR/report.jsonl (a record per result, for programs), both
    appended to and flushed as each result comes, so a day cut short keeps what it measured."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        self.about = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
                      "cuda": torch.version.cuda}
        with open(folder / "report.md", "a") as f:
            f.write(f"\n# GPU day {self.about['date']}: {gpu}, torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda}\n\n| part | result | status | seconds | details |\n"
                    "| --- | --- | --- | --- | --- |\n")

    def add(self, part: str, name: str, status: str, seconds: float, result: dict | None = None,
            detail: str = ""):
        """One result: status pass, fail, measured or skipped; result, the numbers; detail, a line of text."""
        record = {"part": part, "name": name, "status": status, "seconds": round(seconds, 1),
                  "result": result or {}, "detail": detail, **self.about}
        with open(self.folder / "report.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(self.folder / "report.md", "a") as f:
            f.write(f"| {part} | {name} | {status} | {seconds:.0f} | {detail.replace('|', '/')} |\n")
        print(f"{status.upper():8s} {part}: {name} ({seconds:.0f} s) {detail}", flush=True)


def quick_day(day: Report, budget: float, parts=None) -> int:
    """Each part in order, given min(its own limit, what is left of the budget); a part with under 20 s left
    is reported skipped. A part takes (report, work folder, seconds) and reports its own results; one that
    raises is reported failed, and the day goes on. Exit code 1 if any result failed."""
    parts = QUICK_PARTS if parts is None else parts
    deadline, failed = time.monotonic() + budget, False
    with tempfile.TemporaryDirectory(prefix="gpu-day-") as tmp:
        for name, limit, part in parts:
            left = deadline - time.monotonic()
            if left < 20:
                day.add(name, "(all)", "skipped", 0.0, detail=f"--budget {budget:g} s spent")
                continue
            t0 = time.monotonic()
            try:
                failed |= part(day, Path(tmp), min(limit, left)) is False
            except Exception as e:  # a part's own failure is a result too
                day.add(name, "(all)", "fail", time.monotonic() - t0, detail=f"{type(e).__name__}: {e}"[:300])
                failed = True
    return 1 if failed else 0


def timed_run(cmd: list, seconds: float, **kw) -> tuple[bool, str, str, float]:
    """(succeeded, its last line of errors, its output, seconds it took), within `seconds`."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=seconds, **kw)
    except subprocess.TimeoutExpired:
        return False, f"over its limit of {seconds:.0f} s", "", time.monotonic() - t0
    why = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return p.returncode == 0, why, p.stdout + p.stderr, time.monotonic() - t0


# The README's first command on one H100 or H200 ends at a validation loss of at most 1.47 (nanoGPT's 1.4697 on
# the same text) within 90 s of wall time.
DEFAULT_GOAL = dict(val_loss=1.47, wall_s=90.0)


def default_run(day: Report, work: Path, seconds: float) -> bool:
    """The README's first command as a GPU user runs it: its wall time and its last validation loss, a
    pass where both meet DEFAULT_GOAL."""
    out = work / "default"
    ok, why, _, took = timed_run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=1", str(REPO / "train.py"), "--out-dir", str(out)], seconds)
    if not ok:
        day.add("default run", "torchrun train.py", "fail", took, detail=why)
        return False
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r][-1]
    met = val["val_loss"] <= DEFAULT_GOAL["val_loss"] and took <= DEFAULT_GOAL["wall_s"]
    day.add("default run", "torchrun train.py", "pass" if met else "fail", took,
            {"wall_s": took, "val_loss": val["val_loss"], "train_s": val["time_s"], "step": val["step"]},
            f"val loss {val['val_loss']:.4f} at step {val['step']}, {took:.0f} s wall, {val['time_s']:.0f} s "
            f"of training (goal: at most {DEFAULT_GOAL['val_loss']} within {DEFAULT_GOAL['wall_s']:.0f} s)")
    return met


# Llama 3.2 1B at 4,096 tokens a sequence: each row a bench.py run (its own process), in order of importance.
# On one H200 (2026-11-29) a row took 17 s eager and 34-46 s compiled.
LLAMA_1B = ["--model", "llama3.2-1b", "--precision", "bf16", "--seq-len", "4096", "--steps", "5",
            "--warmup-steps", "3"]
QUICK_ROWS = [["--micro-batch", "4", "--compile"], ["--micro-batch", "4", "--compile", "--precision", "fp8"],
              ["--micro-batch", "4"],
              ["--micro-batch", "4", "--compile", "--no-doc-mask", "--attn-backend", "cudnn"],
              ["--micro-batch", "4", "--compile", "--no-doc-mask", "--attn-backend", "flash"],
              ["--micro-batch", "2", "--compile"]]


def llama_rows(day: Report, work: Path, seconds: float) -> bool:
    """QUICK_ROWS, each within what is left of the part's time (at most 90 s a row: a compiled one compiles
    for about half a minute the first time, less once inductor's cache holds its kernels)."""
    deadline, good, first = time.monotonic() + seconds, True, None
    for flags in QUICK_ROWS:
        left = deadline - time.monotonic()
        name = " ".join(flags)
        if left < 30:
            day.add("1B rows", name, "skipped", 0.0, detail="the part's time is spent")
            continue
        ok, why, out, took = timed_run([sys.executable, str(REPO / "bench.py"), *LLAMA_1B, *flags, "--json"],
                                       min(90, left))
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not ok or not rows or "error" in rows[-1]:
            day.add("1B rows", name, "fail", took, detail=rows[-1].get("error", why) if rows else why)
            good = False
            continue
        r = rows[-1]
        first = first or r  # (the compiled bf16 row, which an fp8 row is measured against)
        versus = f"; {r['tokens_per_s'] / first['tokens_per_s']:.2f}x the first row's tokens/s" if r["fp8"] else ""
        warned = [line for line in out.splitlines() if "compiled_flex_attention" in line]  # dynamo's warning
        day.add("1B rows", name, "fail" if warned else "measured", took, r,
                f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']['palm']:.1f}%, attention "
                f"{r['attn_kernel']}, peak {r['peak_memory_gb']:.1f} GB (estimate "
                f"{r['memory_estimate_gb']['total']:.1f}), step {1000 * r['step_s']:.0f} ms; phases (ms) "
                + " ".join(f"{k.split()[0]}:{1000 * v:.1f}" for k, v in r["phases_s"].items()) + "; floors "
                + " ".join(f"{k.split()[0]}:{v:.1f}" for k, v in r["floors_ms"].items())
                + f", ceiling MFU {100 * r['ceiling_mfu']['palm']:.1f}%" + versus
                + (f"; dynamo warned: {warned[0][:100]}" if warned else ""))
        good &= not warned
    return good


def checkpoint_stall(day: Report, work: Path, seconds: float) -> bool:
    """bench.py --measure-ckpt only on 1B, 4,096 x 4, eager: how long a step waits for a checkpoint of the
    weights and optimizer state (about 15 GB: on the H200 of 2026-11-29 the first save's step waited 10.9 s
    and the write took 38 s), of that how long pinning host buffers, and how long the background write
    takes."""
    ok, why, out, took = timed_run([sys.executable, str(REPO / "bench.py"), *LLAMA_1B, "--micro-batch", "4",
                                    "--measure-ckpt", "only", "--json"], seconds)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not ok or not rows or "error" in rows[-1]:
        day.add("checkpoint", "1B, 4096 x 4", "fail", took, detail=rows[-1].get("error", why) if rows else why)
        return False
    r = rows[-1]
    day.add("checkpoint", "1B, 4096 x 4", "measured", took, r,
            f"{r['ckpt_gb']:.1f} GB: the step waited {r['ckpt_stall_s']:.2f} s "
            f"({r['ckpt_host_alloc_s']:.2f} s of it pinning host buffers, once a run), on disk after "
            f"{r['ckpt_write_s']:.1f} s")
    return True


def versus_transformers(day: Report, work: Path, seconds: float) -> bool:
    """bench.py --compare-hf on 1B at 4,096 tokens x 2, both bf16, the same AdamW settings."""
    ok, why, out, took = timed_run([sys.executable, str(REPO / "bench.py"), *LLAMA_1B, "--micro-batch", "2",
                                    "--compare-hf", "--json"], seconds)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not ok or not lines:
        day.add("ours vs transformers", "1B, 4096 x 2, bf16", "fail", took, detail=why)
        return False
    r = json.loads(lines[-1])["compare_hf"]
    day.add("ours vs transformers", "1B, 4096 x 2, bf16", "measured", took, r,
            f"ours {max(r['ours_tokens_per_s']):,.0f} tok/s, transformers {max(r['hf_tokens_per_s']):,.0f} "
            f"({r['transformers']}): {r['ratio_ours_over_hf']:.2f}x; ours keeps {r['ours_keeps']}; "
            f"transformers keeps {r['hf_keeps']}")
    return True


# One compiled training step under torch's profiler: the loss and the optimizer step run inside labelled
# scopes, so their kernels are told apart from the blocks'; prints the GPU time by kind as JSON.
PROFILE_STEP = """
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile, record_function
sys.path.insert(0, "tests")
import gpu_check, optim, train

def labelled(label, fn):
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return run

train.scaled_loss = labelled("llama3: head and loss", train.scaled_loss)
optim.AdamW.step = labelled("llama3: optimizer", optim.AdamW.step)
calls, step = [0], train.train_step

def profiled(*args, **kwargs):
    calls[0] += 1
    if calls[0] != int(sys.argv[1]):
        return step(*args, **kwargs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(json.dumps({"gpu_ms_by_kind": gpu_check.kinds_of(prof.events())}), flush=True)
    return out

train.train_step = profiled
train.main(sys.argv[2:])
"""
PROFILED_STEP = 4  # after three: the compiled blocks are built and warm


def kinds_of(events) -> dict[str, float]:
    """GPU milliseconds of a profiled step by kind: the kernels launched inside the labelled scopes (head and
    loss, optimizer) by their scope, the others by their names: matmul, attention, copies, element-wise."""
    out = {k: 0.0 for k in ("matmul", "attention", "head and loss", "element-wise", "optimizer", "copies")}
    for e in events:
        for kernel in getattr(e, "kernels", ()):
            scope, up = None, e
            while up is not None and scope is None:
                scope = next((k for k in ("head and loss", "optimizer") if up.name == f"llama3: {k}"), None)
                up = up.cpu_parent
            out[scope or kernel_kind(kernel.name)] += kernel.duration / 1e3  # (microseconds)
    return {k: round(v, 2) for k, v in out.items()}


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(w in n for w in ("gemm", "xmma", "cutlass", "cublas", "nvjet", "matmul", "_mm_")):
        return "matmul" if not any(w in n for w in ("fmha", "flash", "attention", "sdpa")) else "attention"
    if any(w in n for w in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(w in n for w in ("memcpy", "memset", "copy", "cat_")):
        return "copies"
    return "element-wise"


def profile_step(day: Report, work: Path, seconds: float) -> bool:
    """PROFILE_STEP on 1B at 4,096 x 4, compiled: where one step's GPU time goes."""
    script = work / "profile_step.py"
    script.write_text(PROFILE_STEP)
    flags = ["--model", "llama3.2-1b", "--seq-len", "4096", "--micro-batch", "4", "--compile", "--max-steps",
             str(PROFILED_STEP), "--warmup", "1", "--eval-every", "-1", "--ckpt-every", "0", "--sample-tokens",
             "0", "--log-every", "1", "--out-dir", str(work / "profile")]
    ok, why, out, took = timed_run([sys.executable, str(script), str(PROFILED_STEP), *flags], seconds,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
    found = [json.loads(line) for line in out.splitlines() if line.startswith('{"gpu_ms_by_kind"')]
    if not ok or not found:
        day.add("profile", "one compiled 1B step", "fail", took, detail=why)
        return False
    kinds = found[-1]["gpu_ms_by_kind"]
    day.add("profile", "one compiled 1B step", "measured", took, kinds,
            ", ".join(f"{k} {v:.1f} ms" for k, v in kinds.items()))
    return True


def one_gpu_checks(day: Report, work: Path, seconds: float) -> bool:
    """The correctness checks that fit one GPU: FlexAttention against the dense mask, the compiled optimizer
    step against the eager one, one host-device sync a step, and a kernel that cannot serve fp32 refused in
    one line."""
    t0, good = time.monotonic(), True
    for ok in packed_documents():
        good &= ok
    day.add("checks", "packed documents: FlexAttention = dense mask", "pass" if good else "fail",
            time.monotonic() - t0, detail="fp32 and bf16, loss and gradients")
    t0 = time.monotonic()
    one_pass = one_pass_optimizer()
    day.add("checks", "the compiled optimizer step = the eager one", "pass" if one_pass else "fail",
            time.monotonic() - t0, detail="small model, bf16, three steps; no state-sized temporary")
    t0 = time.monotonic()
    synced = syncs(work, 1)
    day.add("checks", "one host-device sync a step", "pass" if synced else "fail", time.monotonic() - t0)
    ok, why, _, took = timed_run([sys.executable, str(REPO / "train.py"), *MODEL, "--max-steps", "1",
                                  "--warmup", "1", "--precision", "fp32", "--attn-backend", "flash",
                                  "--out-dir", str(work / "fp32-flash")], min(60, seconds))
    refused = not ok and why.startswith("error: --attn-backend flash cannot compute this run's attention")
    day.add("checks", "fp32 with --attn-backend flash is refused in one line", "pass" if refused else "fail",
            took, detail=why)
    return good and one_pass and synced and refused


# Each part's limit, sized from the H200 day of 2026-11-29 (in brackets what each took): the default run
# 90, its goal (59 s wall for 900 steps), the 1B rows 215 (17-46 s a row, five rows in 171 s, the sixth
# about 35), the checkpoint 95 (over 70 s: a 1B build, two steps, a 15 GB write of 38 s), ours against
# transformers 60 (42), the profile 50 (37), the one-GPU checks 90 (the packed documents 40, the compiled
# optimizer step, not yet timed there, then a short training run and a refusal): 600 s in all, the
# --budget default.
QUICK_PARTS = [("default run", 90, default_run), ("1B rows", 215, llama_rows),
               ("checkpoint", 95, checkpoint_stall), ("ours vs transformers", 60, versus_transformers),
               ("profile", 50, profile_step), ("checks", 90, one_gpu_checks)]



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The CUDA path checked end to end; --quick: a GPU day on one GPU.")
    p.add_argument("--quick", action="store_true", help="the quick day on one GPU (see the docstring)")
    p.add_argument("--budget", type=float, default=600.0, help="--quick: seconds in all")
    p.add_argument("--report", default="gpu-report", help="--quick: the folder of report.md and report.jsonl")
    a = p.parse_args(argv)
    if not 0 < a.budget < float("inf"):  # (NaN fails it too: a budget that every comparison would ignore)
        p.error(f"--budget must be a positive number of seconds, got {a.budget}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("SKIP gpu_check: no CUDA device on this machine", flush=True)
        return 0
    if a.quick:
        return quick_day(Report(Path(a.report)), a.budget)
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        results = (parity(min(gpus, 8), work) + packed_documents() + (sft_dpo(work) if gpus >= 2 else [])
                   + [syncs(work, n) for n in (1, 2) if n <= gpus] + [curve(work), bench()]
                   + ([trace(work, gpus)] if gpus >= 2 else []))
        if gpus >= 8:
            results += [smoke_8b(work), table_8b()]
        else:
            print(f"SKIP Llama 3.1 8B on 8 GPUs: this machine has {gpus}", flush=True)
    print(f"{sum(results)} of {len(results)} checks passed", flush=True)
    return 0 if all(results) else 1

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
