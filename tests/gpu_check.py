"""The first day on GPUs: one command that checks the CUDA path end to end, printing PASS / FAIL lines.

    python tests/gpu_check.py          # on a machine with 1 to 8 NVIDIA GPUs; exit 1 if anything failed

1. Parity on NCCL: a small model trained STEPS steps on one GPU, then under each layout that fits the GPUs
   here (dp 2, tp 2, pp 2, tp 2 x pp 2, tp 2 x pp 2 x dp 2), with the same global batch. Every step's loss
   must equal the single-GPU run's within PARITY_RTOL: in fp32 (TF32 matmuls: sums in another order differ
   in about the 4th digit) and in bf16 (its 8-bit mantissa: about the 2nd or 3rd digit).
2. bf16 against fp32: the default run's first CURVE_STEPS steps in both; bf16's loss at every logged step
   within CURVE_RTOL of fp32's.
3. bench.py in bf16: tokens/s and MFU against the GPU's datasheet peak, printed.
4. Packed documents: FlexAttention's block mask against SDPA's dense mask, a small model's loss and every
   gradient on 4 rows of 2,048 tokens cut into documents of random lengths, in fp32 (TF32 off) and bf16.
5. Host-device synchronizations: torch's sync debug mode armed during SYNC_STEPS training steps on one GPU
   must report one per step (the step's tally), listing any other by file and line.
Without CUDA it prints one SKIP line and exits 0 (the test suite runs that path).
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
PARITY_RTOL = {"fp32": 2e-3, "bf16": 3e-2}
CURVE_RTOL = 0.02
MODEL = ["--model", "mini", "--seq-len", "256", "--lr", "1e-3", "--warmup", "5", "--log-every", "1",
         "--eval-every", "-1", "--ckpt-every", "0", "--sample-tokens", "0"]
GLOBAL_BATCH = 16  # sequences per step in every layout
# cp: FlexAttention's block mask over global positions and NCCL's cp group, which the CPU tests cannot run;
# ZeRO-3's storage freed and regathered under CUDA's caching allocator; the interleaved schedule's transfers
# at pp 2, which NCCL matches by order alone
LAYOUTS = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "pp": 2, "dp": 2}, {"cp": 2},
           {"cp": 2, "tp": 2, "pp": 2}, {"dp": 2, "zero": 3}, {"pp": 2, "virtual": 2}]


def torchrun(n: int, flags: list, out: Path) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(REPO / "train.py"), *flags, "--out-dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    return p.returncode == 0, (p.stderr.strip().splitlines() or ["(no output)"])[-1]


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
            "--zero", str(layout.get("zero", 0))] + (interleaved if "virtual" in layout else [])


def parity(gpus: int, work: Path) -> list[bool]:
    results = []
    for precision in ("fp32", "bf16"):
        ok, why = torchrun(1, layout_flags({}, precision), work / f"one-{precision}")
        if not report(f"single GPU, {precision}", ok, "trained" if ok else why):
            results.append(False)
            continue
        want = losses(work / f"one-{precision}")
        for layout in LAYOUTS:
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
    p = subprocess.run([sys.executable, str(REPO / "bench.py"), "--model", "small", "--precision", "bf16",
                        "--seq-len", "1024", "--micro-batch", "8"], capture_output=True, text=True, cwd=REPO)
    print(p.stdout, end="", flush=True)
    return report("bench.py, bf16", p.returncode == 0, "tokens/s and MFU above" if p.returncode == 0
                  else (p.stderr.strip().splitlines() or ["(no output)"])[-1])


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


def syncs(work: Path) -> bool:
    flags = [*MODEL, "--precision", "bf16", "--max-steps", str(SYNC_STEPS), "--out-dir", str(work / "syncs")]
    p = subprocess.run([sys.executable, "-c", COUNT_SYNCS, *flags], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if p.returncode != 0:
        return report("host-device syncs", False, (p.stderr.strip().splitlines() or ["(no output)"])[-1])
    result = json.loads(p.stdout.strip().splitlines()[-1])
    total = sum(result["syncs"].values())
    return report("host-device syncs", total == result["steps"],
                  f"{total} in {result['steps']} steps (expected one per step): {result['syncs']}")


def main() -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("SKIP gpu_check: no CUDA device on this machine", flush=True)
        return 0
    print(f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        results = (parity(min(gpus, 8), Path(tmp)) + packed_documents()
                   + [syncs(Path(tmp)), curve(Path(tmp)), bench()])
    print(f"{sum(results)} of {len(results)} checks passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
