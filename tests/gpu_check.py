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
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
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
    for precision, layouts in (("fp32", LAYOUTS), ("bf16", LAYOUTS), ("fp16", FP16_LAYOUTS)):
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


def main() -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("SKIP gpu_check: no CUDA device on this machine", flush=True)
        return 0
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
