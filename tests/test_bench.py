"""bench.py: the planner's arithmetic against GUIDE section 2, and the measuring modes run end to end
(their output is checked for content, never for speed)."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import bench
import compare
import config
import costs
import multiproc
import model as M
import parallel
import plan

REPO = Path(__file__).resolve().parents[1]


def test_plan_reproduces_the_llama3_70b_reference_example():
    r = plan.plan("llama3-70b", 15e12, parallel.Layout(tp=8, pp=4, dp=512, sp=True, zero=1),
                  costs.Shape(4, 8192, grad_accum=4, act_ckpt=True, loss_chunk=1024), "H100", 0.4)
    assert (r["gpus_per_replica"], r["dp"]) == (32, 512)
    assert r["tokens_per_micro_batch"] == 32_768
    assert r["tokens_per_global_batch"] == 67_108_864
    assert r["steps"] == 223_518  # 15T / 67.1M; the GUIDE's ~3.75M steps is for a ~4M-token batch
    assert r["flops"] == pytest.approx(6 * 70_553_706_496 * 15e12)
    assert r["bubble"] == pytest.approx(3 / 7)
    assert r["fits"] and 0 < r["memory_per_gpu_bytes"] < 80e9
    assert not r["memory_variants"]["zero1_ckpt0"]["total"] < 80e9  # 4 micro-batches of activations in flight
    # ZeRO-1: an fp32 reduce-scatter and a bf16 all-gather of the largest stage's parameters (0.75 of an
    # all-reduce)
    largest = max(costs.stage_params(M.PRESETS["llama3-70b"], parallel.Layout(tp=8, pp=4), s) for s in range(4))
    assert r["comm_bytes_per_step"]["dp"] == pytest.approx(511 / 512 * largest * (4 + 2))


def test_what_a_run_costs_by_hand():
    """GPU-hours, energy and money: 1,000 H100 for a day at PUE 1.2 and $2.50 an hour are 24,000 GPU-hours,
    24,000 x 700 W x 1.2 = 20.16 MWh and $60,000; a GB200 rack for 10 days, 17,280 GPU-hours and
    17,280 x 1,200 W x 1.1 = 22.81 MWh."""
    h100 = costs.run_costs("H100", 1000, 86400, pue=1.2, usd_per_gpu_hour=2.5)
    assert (h100["gpu_hours"], h100["days"], h100["usd"]) == (24_000, 1, 60_000)
    assert h100["energy_mwh"] == pytest.approx(20.16)
    assert costs.run_costs("GB200", 72, 10 * 86400, 1.1, 0)["energy_mwh"] == pytest.approx(22.8096)
    # 450 GB over H100's NVLink (450 GB/s each way) is a second; 50 GB over its network too. tp 8 is one
    # HGX board; pp and dp leave it. On a GB200 rack the 72 GPUs are one NVLink domain: dp 9 x tp 8 on it.
    sent = {"tp": 450e9, "cp": 0.0, "pp": 50e9, "dp": 100e9}
    assert costs.comm_seconds(sent, "H100", tp=8, cp=1, pp=2, gpus=64) == {"tp": 1, "cp": 0, "pp": 1, "dp": 2}
    assert costs.links("GB200", 8, 1, 1, 72) == {"tp": "NVLink", "cp": "NVLink", "pp": "NVLink", "dp": "NVLink"}
    assert costs.links("GB200", 8, 1, 1, 144)["dp"] == "network"
    # Chinchilla itself: 70B parameters on 1.4T tokens, 6 x 70e9 x 1.4e12 = 5.88e23 FLOPs
    assert costs.compute_optimal(5.88e23) == pytest.approx((70e9, 1.4e12))
    r = plan.plan("llama3-70b", 15e12, parallel.Layout(tp=8, pp=4, dp=512, sp=True, zero=1),
                  costs.Shape(4, 8192, grad_accum=4, act_ckpt=True, loss_chunk=1024), "H100", 0.4, pue=1.2,
                  usd_per_gpu_hour=3.0)
    seconds = 223_518 * 481.4e9 * 67_108_864 / (16384 * 989e12 * 0.4)  # steps x FLOPs per step / FLOP/s
    assert r["gpu_hours"] == pytest.approx(16384 * seconds / 3600, rel=1e-3)
    assert r["energy_mwh"] == pytest.approx(r["gpu_hours"] * 700 * 1.2 / 1e6)
    assert r["usd"] == pytest.approx(r["gpu_hours"] * 3.0)
    assert r["links"] == {"tp": "NVLink", "cp": "NVLink", "pp": "network", "dp": "network"}
    assert r["comm_seconds_per_step"]["dp"] == pytest.approx(r["comm_bytes_per_step"]["dp"] / 50e9)


def test_budget_flops_says_what_size_a_budget_buys():
    out = subprocess.run([*multiproc.command(0, REPO / "bench.py"), "--plan", "--budget-flops", "3.8e25",
                          "--json"], capture_output=True, text=True, check=True).stdout
    s = json.loads(out)["sizing"]
    assert s["parameters"] == pytest.approx((3.8e25 / 120) ** 0.5) and s["tokens"] == 20 * s["parameters"]
    assert s["llama3"]["llama3-8b"]["tokens_per_parameter"] == pytest.approx(15e12 / 8_030_261_248)


def test_plan_llama31_8b_on_eight_h100():
    """Llama 3.1 8B, 8,192-token sequences on 8 x 80 GB with ZeRO-1 and activation checkpointing: the model
    states are 64 GB (2 + 4 bytes of bf16 weights and fp32 gradients per parameter on every GPU; 12 of
    master weights, m and v and ZeRO's 4 of reduce-scatter pieces, sharded 8 ways). With the whole logits
    at once (--loss-chunk 0) the cross-entropy's 8.4 GB at its peak on 1 x 8,192 x 128,256 logits does not
    fit on top; with the loss in chunks of 1,024 tokens it does: the logits and their log-softmax are no
    longer kept (the fp32 gradients of the head's input and weight are), and the loss makes one chunk's at
    a time. Tensor parallelism over 2 GPUs brings it far lower."""
    n, d, V = 8_030_261_248, 4096, 128_256
    planned = lambda tp, grad_accum, loss_chunk=1024: plan.plan(
        "llama3.1-8b", 1e12, parallel.Layout(tp=tp, dp=8 // tp, sp=True, zero=1),
        costs.Shape(1, 8192, grad_accum=grad_accum, act_ckpt=True, loss_chunk=loss_chunk), "H100", 0.4)
    whole, r = planned(tp=1, grad_accum=4, loss_chunk=0), planned(tp=1, grad_accum=4)
    m = whole["memory_per_gpu"]
    assert (m["weights"], m["grads"], m["master"] + m["optimizer"]
            + m["zero_buffers"]) == (2 * n, 4 * n, 12 * n / 8 + 4 * n / 8)
    rows = 8192 * V  # the loss keeps a 4-byte log-softmax per logit and makes two 4-byte gradients
    assert m["temporaries"] == 8 * rows and not whole["fits"]
    c = r["memory_per_gpu"]
    assert c["activations"] == m["activations"] - rows * (4 + 2) + (8192 + V) * d * 4  # kept: no logits
    assert c["temporaries"] < m["temporaries"] / 2 and r["fits"]
    assert r["memory_variants"]["zero0_ckpt0"]["total"] > 2.5 * r["memory_per_gpu_bytes"]
    tp2 = planned(tp=2, grad_accum=8)
    assert tp2["fits"] and tp2["memory_per_gpu_bytes"] < 0.7 * r["memory_per_gpu_bytes"]


def test_plan_reproduces_the_llama3_405b_layouts():
    """The Llama 3 paper's Table 4: three 405B layouts of 16M tokens per step, the last with 131,072-token
    sequences over cp 16. With ZeRO-1 and activation checkpointing each fits in an 80 GB H100."""
    for gpus, cp, seq, accum, dp in [(8192, 1, 8192, 32, 64), (16384, 1, 8192, 16, 128),
                                     (16384, 16, 131072, 16, 8)]:
        r = plan.plan("llama3.1-405b", 15.6e12, parallel.Layout(tp=8, cp=cp, pp=16, dp=dp, sp=True, zero=1),
                      costs.Shape(1, seq, grad_accum=accum, act_ckpt=True, loss_chunk=1024), "H100", 0.4)
        assert r["gpus"] == gpus
        assert (r["dp"], r["tokens_per_global_batch"], r["fits"]) == (dp, 2 ** 24, True)
    # cp: per layer and micro-batch, K and V of the whole sequence (8 KV heads over tp 8: one head of 128
    # per rank, bf16) all-gathered, and their gradients reduce-scattered; checkpointing gathers them again.
    # The busiest stage holds 8 of the 126 layers.
    kv = 131072 * 2 * 128 * 2
    assert r["comm_bytes_per_step"]["cp"] == pytest.approx(16 * 8 * 3 * 15 / 16 * kv)
    # The first layout with the interleaved schedule, 2 chunks per rank: the bubble (p-1)/(Vm+p-1) instead
    # of (p-1)/(m+p-1), for twice the pipeline's bytes (each micro-batch passes every rank twice each way)
    one, two = (plan.plan("llama3.1-405b", 15.6e12, parallel.Layout(tp=8, pp=16, dp=64, sp=True, zero=1,
                                                                    schedule=schedule, virtual=virtual),
                          costs.Shape(1, 8192, grad_accum=32, act_ckpt=True, loss_chunk=1024), "H100", 0.4)
                for schedule, virtual in (("1f1b", 1), ("interleaved", 2)))
    assert (one["bubble"], two["bubble"]) == (pytest.approx(15 / 47), pytest.approx(15 / 79))
    assert two["comm_bytes_per_step"]["pp"] == pytest.approx(2 * one["comm_bytes_per_step"]["pp"])
    # ZeRO-3 over dp 64: 1/64 of a stage's 3.2 billion weights, plus two whole layers (bf16; matrices over
    # tp 8, the two norms whole)
    z3, z1 = one["memory_variants"]["zero3_ckpt1"], one["memory_variants"]["zero1_ckpt1"]
    a = M.PRESETS["llama3.1-405b"]
    d, hd = a.dim, a.head_dim
    layer = (2 * d * a.n_heads * hd + 2 * d * a.n_kv_heads * hd + 3 * d * a.hidden_dim) / 8 + 2 * d
    assert z3["weights"] == pytest.approx(z1["weights"] / 64 + 2 * 2 * layer, rel=1e-4)


def test_cpu_census_counts_each_run_alone():
    """The profiler's running total carries, from one census to the next, the tensors a run left alive and
    that were freed between censuses; each census still reports its own run's peak."""
    def run():
        keep = torch.zeros(1_000_000)  # 4 MB that outlives the census
        temporary = torch.zeros(500_000)  # 2 MB, freed inside it
        del temporary
        return keep
    peaks = []
    for _ in range(3):
        kept, peak = bench.cpu_census(run)
        del kept  # freed outside any census
        peaks.append(peak)
    assert peaks == [6_000_000] * 3


def test_plan_json_cli_carries_the_required_keys():
    out = subprocess.run([*multiproc.command(0, REPO / "bench.py"), "--plan", "--model", "llama3-8b", "--gpus",
                          "64", "--tp", "8", "--gpu", "h100-nvl", "--json"], capture_output=True, text=True,
                         check=True).stdout
    r = json.loads(out)
    assert r["gpu"] == "H100 NVL"  # GPU names in any case, '-' for a space
    for key in ("gpus_per_replica", "dp", "tokens_per_micro_batch", "tokens_per_global_batch", "steps",
                "flops", "memory_per_gpu_bytes", "bubble", "fits"):
        assert key in r
    assert r["dp"] == 8


def test_plan_follows_llama3_405b_ramp_stage_by_stage():
    """The 405B ramp on the paper's 8,192-GPU layout: each stage's accumulation is its sequences over dp 64,
    its steps its tokens over its tokens per step, the last stage runs to --tokens; a stage whose sequences
    do not divide over the replicas is refused in one line."""
    base = [*multiproc.command(0, REPO / "bench.py"), "--plan", "--model", "llama3.1-405b", "--gpus", "8192",
            "--tp", "8", "--pp", "16", "--micro-batch", "1", "--zero", "1", "--act-ckpt", "--tokens", "15.6e12"]
    rows = json.loads(subprocess.run(base + ["--ramp", "0:4096x1024,252M:8192x1024,2.87T:8192x2048", "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert [(r["seq_len"], r["grad_accum"], r["tokens_per_global_batch"]) for r in rows] == [
        (4096, 16, 4096 * 1024), (8192, 16, 8192 * 1024), (8192, 32, 8192 * 2048)]
    assert rows[0]["steps"] == 61 and sum(r["tokens"] for r in rows) == pytest.approx(15.6e12)
    assert all(r["fits"] for r in rows)
    bad = subprocess.run(base + ["--ramp", "0:4096x1000"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "error: --ramp stage at 0 tokens: 1000 sequences do not divide into micro-batches of 1 on 64 dp ranks")


def test_measure_sweep_and_compare_hf_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*multiproc.command(0, REPO / "bench.py"), "--model", "tiny", "--seq-len", "32", "--micro-batch", "4",
           "--steps", "2", "--warmup-steps", "1", "--json"]
    p = subprocess.run(cmd + ["--sweep", "mb=4;mb=4,act_ckpt=1,attn=flash;attn=math", "--measure-ckpt"],
                       capture_output=True, text=True, check=True, env=env)
    rows = [json.loads(line) for line in p.stdout.splitlines()]  # a line per row, as each finishes
    ckpt = rows.pop()  # the checkpoint's row, once, last
    assert ckpt["setting"] == {"checkpoint": "async"} and 0 < ckpt["ckpt_stall_s"] <= ckpt["ckpt_write_s"]
    assert 0 <= ckpt["ckpt_host_alloc_s"] <= ckpt["ckpt_stall_s"]
    assert ckpt["ckpt_gb"] > 0 and "tokens_per_s" not in ckpt
    assert len(rows) == 3 and rows[1]["act_ckpt"] and all(r["model"] == "tiny" for r in rows)
    assert [(r["attn_backend"], r["attn_kernel"]) for r in rows] == [("auto", "flash"), ("flash", "flash"),
                                                                    ("math", "math")]  # (what SDPA ran)
    for r in rows:
        assert set(r["phases_s"]) == {"1 data", "2 forward", "3 loss", "4 backward", "5 grad sync",
                                      "6 optimizer"}  # a row times the step alone: no checkpoint
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"]["megatron"] < r["mfu"]["palm"]
        assert r["memory_estimate_gb"]["total"] > 0
        assert_floors(r)
    for precision in ("fp32", "bf16"):  # bf16: the case that once ended in an IndexError
        hf = json.loads(subprocess.run(cmd + ["--compare-hf", "--precision", precision], capture_output=True,
                                       text=True, check=True, env=env).stdout.splitlines()[-1])["compare_hf"]
        assert len(hf["ours_tokens_per_s"]) == len(hf["hf_tokens_per_s"]) == 2
        assert hf["ratio_ours_over_hf"] > 0 and "fp32 gradients, master weights" in hf["ours_keeps"]


def assert_floors(r):
    """A row's floors, from its own fields: phases 2 and 4 the step's FLOPs on the rank (PaLM's count, as
    MFU's; with whole logits the head's are theirs) at the measured matmul rate, a third and two thirds;
    phase 6 AdamW's bytes (fp32 master, m and v read and written, the gradient read: 28 a parameter in
    fp32) at the measured copy rate; the ceiling MFU the step's FLOPs over the floors' sum."""
    floors = r["floors_ms"]
    assert set(floors) == {"2 forward", "4 backward", "6 optimizer"}, floors
    step_flops = r["mfu"]["palm"] * r["peak_flops"] * r["step_s"]  # the step's PaLM FLOPs (one rank)
    assert floors["2 forward"] + floors["4 backward"] == pytest.approx(
        1000 * step_flops / r["matmul_flops_measured"], rel=1e-6)
    assert floors["4 backward"] == pytest.approx(2 * floors["2 forward"], rel=1e-9)
    assert floors["6 optimizer"] == pytest.approx(1000 * 28 * r["params"] / r["copy_bytes_per_s_measured"],
                                                  rel=0.01)  # (the flat buffer pads a few numbers)
    assert r["ceiling_mfu"]["palm"] == pytest.approx(
        step_flops / (sum(floors.values()) / 1000 * r["peak_flops"]), rel=1e-6)


def test_a_refused_row_is_a_row_and_the_sweep_goes_on(tmp_path):
    """A refused or failed setting lost every row before it (bench.py exited, and the table and the JSON came
    at the end). Now each setting runs on its own (in one process, a process of its own), each row is
    printed as it finishes, and a refused one says why; the exit code says that one failed. No row leaves
    its run's checkpoint behind (they once filled the temporary folder)."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    cmd = [*multiproc.command(0, REPO / "bench.py"), "--model", "tiny", "--seq-len", "32", "--micro-batch", "4",
           "--steps", "1", "--warmup-steps", "1", "--sweep", "mb=4;mb=4,attn=cudnn;mb=2"]
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert p.returncode == 1 and [r["setting"] for r in rows] == [{"mb": 4}, {"mb": 4, "attn": "cudnn"}, {"mb": 2}]
    assert "error" not in rows[0] and "error" not in rows[2] and rows[2]["micro_batch"] == 2
    assert rows[1]["error"] == ("--attn-backend cudnn runs on CUDA GPUs only, and this run is on cpu: use auto, "
                                "flash or math")
    text = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout.splitlines()
    assert "  mb=4,attn=cudnn: --attn-backend cudnn runs on CUDA GPUs only" in text[4]
    assert [line.split()[0] for line in text[3:7:3]] == ["floors", "floors"]  # under each measured row
    assert len(text) == 8 and text[1].split()[:2] == ["tp", "cp"]  # 2 lines of heading, 3 rows, a note
    assert not list((tmp_path / "tmp").iterdir())


def test_compare_hf_frees_each_side_before_the_other_runs(monkeypatch):
    """--compare-hf (ours, transformers, ours again) was refused at its third run: the transformers model and
    its optimizer were alive while ours ran again. Each side is freed before the next starts (counted here
    by the garbage collector); what the allocator still caches is counted as available by the memory check
    (tests/test_memory.py)."""
    import gc
    import transformers
    import model as M
    a = bench.get_parser().parse_args(["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps",
                                       "1", "--warmup-steps", "0", "--compare-hf"])
    seen, hf = [], compare.hf_tokens_per_s
    alive = lambda kind: sum(type(o) is kind for o in gc.get_objects())

    def ours():
        seen.append(("ours", alive(transformers.LlamaForCausalLM)))
        return bench.measure(a, "steps")["tokens_per_s"]

    monkeypatch.setattr(compare, "hf_tokens_per_s", lambda a, margs: seen.append(("theirs", alive(M.Transformer)))
                        or hf(a, margs))
    assert compare.compare_hf(a, bench.model_args(a), ours)["ratio_ours_over_hf"] > 0
    assert seen == [("ours", 0), ("theirs", 0), ("ours", 0), ("theirs", 0)]


def as_rank(monkeypatch, rank: int, world: int):
    """The environment torchrun gives rank `rank` of `world` processes on one node."""
    for name, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=29500).items():
        monkeypatch.setenv(name, str(value))


def test_dp_vs_ddp_and_bubble_run_on_this_ranks_device(monkeypatch):
    """No GPU here: the calls a GPU run makes are recorded. Each rank takes its own GPU (LOCAL_RANK) and the
    mesh is built for it (NCCL, bound to it), not for the CPU under a GPU banner."""
    import parallel
    import torch
    bound, meshes = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")

    class Stop(Exception):
        pass

    def init_mesh(layout=None, **kwargs):
        meshes.append({**kwargs, "layout": layout})
        raise Stop
    monkeypatch.setattr(parallel, "init_mesh", init_mesh)
    as_rank(monkeypatch, 1, 2)
    for mode in ("--dp-vs-ddp", "--bubble"):
        monkeypatch.setattr(sys, "argv", ["bench.py", mode])
        with pytest.raises(Stop):
            bench.main()
    assert bound == [torch.device("cuda", 1)] * 2
    assert [m["device"] for m in meshes] == [torch.device("cuda", 1)] * 2 and meshes[1]["layout"].pp == 2


def test_dp_vs_ddp_and_bubble_run_end_to_end():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = multiproc.command(2, REPO / "bench.py", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2",
                          "--steps", "2", "--json")
    ddp = json.loads(subprocess.run(base + ["--dp-vs-ddp", "--blocks", "1"], capture_output=True, text=True,
                                    check=True, env=env).stdout.splitlines()[-1])
    assert ddp["torch_device"] == "cpu" and ddp["dp_vs_ddp"]["ratio_ddp_over_ours"] > 0
    bubble = base + ["--bubble", "--micro-batches", "1,2,4", "--virtual-stages", "2",
                     "--model", "mini"]  # 4 layers: 2 chunks of one on each of 2 ranks
    rows = json.loads(subprocess.run(bubble, capture_output=True, text=True, check=True,
                                     env=env).stdout.splitlines()[-1])["bubble"]
    # 1F1B at every m, the interleaved schedule (2 chunks per rank) beside it where m is a multiple of pp
    assert [(r["schedule"], r["m"], r["bubble_formula"]) for r in rows] == [
        ("1f1b", 1, 1 / 2), ("1f1b", 2, 1 / 3), ("1f1b", 4, 1 / 5), ("interleaved", 2, 1 / 5),
        ("interleaved", 4, 1 / 9)]
    assert all(0 <= b < 1 for r in rows for b in r["bubble_measured_per_stage"])


@pytest.mark.parametrize("timing", ["phases", "steps"])
def test_step_timing_synchronizes_where_its_mode_says(tmp_path, monkeypatch, timing):
    """--compare-hf times transformers with a device synchronization at each step's start and end only; ours
    ("steps") must be timed the same way, while the phase table ("phases") synchronizes after every phase."""
    import train
    events = []
    monkeypatch.setattr(costs, "sync_device", lambda device: events.append("sync"))
    mark = costs.PhaseTimer.mark
    monkeypatch.setattr(costs.PhaseTimer, "mark", lambda self, phase: (mark(self, phase),
                                                                       events.append(phase)))
    monkeypatch.setattr(costs, "peak_flops", lambda device, precision: (1e12, "test"))
    args = config.get_parser().parse_args(["--model", "tiny", "--seq-len", "32", "--micro-batch", "2",
                                           "--max-steps", "2", "--warmup", "1", "--eval-every", "-1",
                                           "--ckpt-every", "0", "--sample-tokens", "0", "--out-dir",
                                           str(tmp_path / "o")])
    run = train.train(args, time_phases=timing)
    phases = ["1 data", "2 forward", "3 loss", "4 backward", "5 grad sync", "6 optimizer"]
    if timing == "phases":  # after each phase; the loop's own at the step's end, then the last mark's
        step = ["sync"] + [e for ph in phases[:-1] for e in ("sync", ph)] + ["sync", "sync", "6 optimizer"]
    else:
        step = ["sync"] + phases[:-1] + ["sync", "6 optimizer"]
    assert events == step * 2 and len(run.phases) == 2 and set(run.phases[0]) == set(phases)


def test_a_measured_peak_says_when_the_precision_is_slow_here(monkeypatch):
    """On a CPU without native bf16, bf16 runs many times slower than fp32: the peak is measured in the
    run's precision (so the MFU stays below 100%), and its description says fp32 would train faster."""
    import torch
    speeds = {torch.float32: 1.6e11, torch.bfloat16: 1.4e10, torch.float16: 1.2e11}
    monkeypatch.setattr(costs, "measured_peak", lambda device, dtype: speeds[dtype])
    # a cache of its own: the process's may hold an earlier test's real measurement, and must not keep these
    monkeypatch.setattr(costs, "peak_flops", functools.lru_cache(maxsize=None)(costs.peak_flops.__wrapped__))
    cpu = torch.device("cpu")
    assert costs.peak_flops(cpu, "bf16") == (1.4e10, "cpu measured: the best bf16 nn.Linear matmul; bf16 "
                                             "runs 11x slower than fp32 (160.0 GFLOP/s) on this cpu: "
                                             "--precision fp32 would train faster")
    assert costs.peak_flops(cpu, "fp16") == (1.2e11, "cpu measured: the best fp16 nn.Linear matmul")
    assert costs.peak_flops(cpu, "fp32")[0] == 1.6e11
    assert (costs.rate(1.4e10), costs.rate(9.89e14)) == ("14.0 GFLOP/s", "989.00 TFLOP/s")


def test_gpu_check_skips_in_one_line_without_cuda(monkeypatch, capsys):
    """tests/gpu_check.py, the first-GPU-day script: on a machine without CUDA, one SKIP line and success."""
    import torch
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert gpu_check.main(["--quick", "--budget", "60", "--report", "x"]) == 0  # the quick day likewise
    assert capsys.readouterr().out == "SKIP gpu_check: no CUDA device on this machine\n" * 2


@pytest.mark.parametrize("val,wall,status", [(1.465, 60.0, "pass"), (1.483, 60.0, "fail"), (1.465, 95.0, "fail")])
def test_the_gpu_days_default_run_passes_only_at_its_goal(tmp_path, monkeypatch, val, wall, status):
    """The quick day's default run (the README's first command) passes where its last validation loss is at
    most 1.47 and its wall time at most 90 s; otherwise it fails, naming the goal."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_check

    def fake_run(cmd, seconds):
        out = Path(cmd[cmd.index("--out-dir") + 1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 600, "val_loss": val, "time_s": 21.0}) + "\n")
        return True, "", "", wall
    monkeypatch.setattr(gpu_check, "timed_run", fake_run)
    day = gpu_check.Report(tmp_path / "r")
    assert gpu_check.default_run(day, tmp_path, 90) is (status == "pass")
    [record] = [json.loads(line) for line in (tmp_path / "r" / "report.jsonl").read_text().splitlines()]
    assert record["status"] == status and record["result"]["val_loss"] == val
    assert "goal: at most 1.47 within 90 s" in record["detail"]


def test_a_gpu_day_writes_each_result_as_it_finishes(tmp_path, monkeypatch):
    """The quick GPU day's report on a CPU, with fake parts on a fake clock: each result appended to report.md
    and report.jsonl as it comes, a part that raises reported failed while the day goes on, a part the budget
    cannot fit reported skipped, exit code 1 when anything failed; a part's command over its time limit is a
    failure that says so."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_check
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])

    def measured(day, work, seconds):
        clock[0] += 30
        day.add("fake", "a row", "measured", 30, {"tokens_per_s": 123.0}, "123 tok/s")

    def raises(day, work, seconds):
        clock[0] += seconds  # uses all it was given
        raise RuntimeError("the GPU fell off")
    day = gpu_check.Report(tmp_path / "r")
    parts = [("first", 100, measured), ("second", 50, raises), ("third", 100, measured)]
    assert gpu_check.quick_day(day, 95, parts) == 1  # 95 s: 30 + 50 spent, 15 left for the third
    records = [json.loads(line) for line in (tmp_path / "r" / "report.jsonl").read_text().splitlines()]
    assert [(r["part"], r["status"]) for r in records] == [("fake", "measured"), ("second", "fail"),
                                                          ("third", "skipped")]
    assert records[0]["result"] == {"tokens_per_s": 123.0}
    assert records[1]["detail"] == "RuntimeError: the GPU fell off"
    assert all({"date", "gpu", "torch", "cuda", "seconds"} <= set(r) for r in records)
    md = (tmp_path / "r" / "report.md").read_text().splitlines()
    assert md[1].startswith("# GPU day ") and md[3] == "| part | result | status | seconds | details |"
    assert md[5:] == ["| fake | a row | measured | 30 | 123 tok/s |", "| second | (all) | fail | 50 | "
                      "RuntimeError: the GPU fell off |", "| third | (all) | skipped | 0 | --budget 95 s spent |"]
    monkeypatch.undo()  # the real clock, for a real command past its limit
    ok, why, _, took = gpu_check.timed_run([sys.executable, "-c", "import time; time.sleep(30)"], 1)
    assert not ok and why == "over its limit of 1 s" and took < 10


def test_the_profiled_steps_time_is_split_by_kind(tmp_path):
    """gpu_check's profile of one step: kernels inside the labelled scopes (the loss, the optimizer step) by
    scope, the others by name; and the script itself runs on a CPU (no kernels there: zeros)."""
    sys.path.insert(0, str(REPO / "tests"))
    import gpu_check
    from types import SimpleNamespace as E
    K = lambda name, us: E(name=name, duration=us)
    loss = E(name="llama3: head and loss", cpu_parent=None, kernels=[])
    opt = E(name="llama3: optimizer", cpu_parent=None, kernels=[])
    events = [E(name="aten::mm", cpu_parent=loss, kernels=[K("sm90_xmma_gemm_bf16", 2000)]),
              E(name="aten::mm", cpu_parent=None, kernels=[K("nvjet_tst_128x256", 5000)]),
              E(name="flash", cpu_parent=None, kernels=[K("flash_fwd_kernel", 1500), K("cudnn_sdpa_fwd", 500)]),
              E(name="copy", cpu_parent=None, kernels=[K("Memcpy DtoD", 100)]),
              E(name="add", cpu_parent=E(name="x", cpu_parent=opt, kernels=[]), kernels=[K("vectorized", 300)]),
              E(name="silu", cpu_parent=None, kernels=[K("triton_poi_fused_silu_mul_0", 700)])]
    assert gpu_check.kinds_of(events) == {"matmul": 5.0, "attention": 2.0, "head and loss": 2.0,
                                          "element-wise": 0.7, "optimizer": 0.3, "copies": 0.1}
    script = tmp_path / "p.py"
    script.write_text(gpu_check.PROFILE_STEP)
    p = subprocess.run([sys.executable, str(script), "2", "--model", "tiny", "--seq-len", "32", "--max-steps", "2",
                        "--warmup", "1", "--eval-every", "-1", "--ckpt-every", "0", "--sample-tokens", "0",
                        "--out-dir", str(tmp_path / "o")], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    found = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"gpu_ms_by_kind"')]
    assert p.returncode == 0 and found == [{"gpu_ms_by_kind": dict.fromkeys(
        ("matmul", "attention", "head and loss", "element-wise", "optimizer", "copies"), 0.0)}], p.stderr[-2000:]


BAD_FLAGS = [  # (argv, WORLD_SIZE, what the error line must name)
    *[(["--plan", flag, value], 1, flag) for flag, value in [
        ("--gpus", "0"), ("--gpus", "-8"), ("--mfu", "0"), ("--mfu", "1.5"), ("--mfu", "nan"),
        ("--seq-len", "0"), ("--seq-len", "100000"), ("--tokens", "nan"), ("--tokens", "inf"),
        ("--tokens", "0"), ("--tokens", "-1"), ("--reserve-gb", "-1"), ("--reserve-gb", "nan"),
        ("--reserve-gb", "inf"), ("--micro-batch", "0"), ("--grad-accum", "0"), ("--virtual-stages", "0"),
        ("--tp", "0"), ("--cp", "-1"), ("--pp", "0"), ("--budget-flops", "0"), ("--budget-flops", "nan"),
        ("--gpus-per-node", "0"),
        ("--budget-flops", "-1"), ("--pue", "0.9"), ("--pue", "nan"), ("--usd-per-gpu-hour", "-1")]],
    *[(["--sweep", text], 1, "--sweep") for text in ["", ";", " ; ", "mb=4;", "tp=2,tp=4", "mb=x", "tp",
                                                      "mb=0", "seq_len=-1", "zero=4", "act_ckpt=2",
                                                      "seq_len=4096", "tp=3", "attn=fast", "attn=1", "mb=flash"]],
    (["--sweep", "tp=2"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--sweep", "mb=4;cp=2"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--sweep", "pp=2,accum=2"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--sweep", "tp=4"], 2, "torchrun --standalone --nproc_per_node=4"),
    (["--tp", "2"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--compare-hf", "--pp", "2"], 1, "torchrun --standalone --nproc_per_node=2"),
    *[([flag, value], 1, flag) for flag, value in [
        ("--steps", "0"), ("--steps", "-3"), ("--warmup-steps", "-1"), ("--micro-batch", "0"),
        ("--grad-accum", "-1"), ("--seq-len", "0"), ("--bucket-mb", "0"), ("--bucket-mb", "nan"),
        ("--bucket-mb", "inf"), ("--blocks", "0")]],
    *[(["--bubble", "--micro-batches", text], 2, "--micro-batches")
      for text in ["0", "1,-2", "a", "", "1,,2"]],
    (["--bubble"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--launch", "slurm"], 1, "--launch"),
    *[(["--plan", "--launch", "k8s", "--image", image], 1, "--image")
      for image in ["", " ", "me/train:1\nkind: Pod", "me/train:1 # x", "me/train:1\t"]],
    *[(["--plan", "--launch", launch, f"--data={data}"], 1, "--data")
      for launch in ("slurm", "k8s") for data in ["", "a\nb", "-x", "--resume", "a\x7fb", "a\u2028b"]],
    (["--lora-rank", "8"], 1, "--lora-rank plans LoRA fine-tuning: use it with --plan"),
    (["--plan", "--lora-rank", "8", "--lora-targets", "q_proj"], 1, "q_proj matches no linear"),
    (["--plan", "--lora-rank", "8", "--zero", "3"], 1, "--zero 3 shards what the optimizer trains"),
    (["--dp-vs-ddp"], 1, "torchrun --standalone --nproc_per_node=2"),
    (["--bubble", "--model", "tiny", "--virtual-stages", "2", "--schedule", "interleaved"], 2, "layers"),
]


@pytest.mark.parametrize("argv,world,names", BAD_FLAGS, ids=[" ".join(c[0]) + f" w{c[1]}" for c in BAD_FLAGS])
def test_a_bad_flag_value_is_one_error_line_before_any_work(monkeypatch, capsys, argv, world, names):
    """A value bench.py cannot use ends in one line on stderr naming the flag, and a non-zero exit, before
    anything is planned, measured or started (each of those here would raise DidWork)."""
    class DidWork(Exception):
        pass

    def work(*args, **kwargs):
        raise DidWork
    for name in ("measure", "dp_vs_ddp"):
        monkeypatch.setattr(bench, name, work)
    for name in ("compare_hf", "bubble"):
        monkeypatch.setattr(compare, name, work)
    monkeypatch.setattr(plan, "plan", work)
    monkeypatch.setattr(parallel, "init_mesh", work)
    as_rank(monkeypatch, 0, world)
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    code, err = e.value.code, capsys.readouterr().err
    if isinstance(code, str):  # the interpreter prints it to stderr and exits with 1
        code, err = 1, err + code + "\n"
    assert code != 0 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and names in err, err


def test_a_bad_flag_value_on_the_command_line():
    """The same end to end: the line on stderr, nothing on stdout, exit code 1."""
    for argv in (["--plan", "--tokens", "nan"], ["--bubble", "--micro-batches", "1,x"]):
        r = subprocess.run([*multiproc.command(0, REPO / "bench.py"), *argv], capture_output=True, text=True,
                           env={**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": "29500"})
        assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (1, "", 1), r.stderr
        assert r.stderr.startswith(f"error: {argv[-2]} ")


def trace_by_rank(trace: dict) -> dict:
    """A trace's slices and collectives, per rank: {pid: {"phases": [names], "work": [names], "bytes":
    {group: bytes}}}, and the ranks' process names."""
    ranks = {}
    for e in trace["traceEvents"]:
        r = ranks.setdefault(e["pid"], {"phases": [], "work": [], "bytes": {}, "name": None})
        if e["ph"] == "M" and e["name"] == "process_name":
            r["name"] = e["args"]["name"]
        elif e["ph"] == "X":
            r["phases" if e["tid"] == 0 else "work"].append(e["name"])
        elif e["ph"] == "b":
            group = "dp" if e["cat"] == "dp_cp" else e["cat"]
            r["bytes"][group] = r["bytes"].get(group, 0.0) + e["args"]["bytes"]
    return ranks


def test_a_traced_step_on_every_rank_under_tp_and_pp(tmp_path):
    """train.py --trace-step under tp 2 x pp 2, 1F1B, 4 micro-batches, on 4 processes: one track per rank,
    named by its place; the seven phases (2-4 are the schedule's) on each; each micro-batch's forward and
    backward on each stage; every collective's bytes, summed by group, equal to what the step counted, which
    is what metrics.jsonl logs for it; a picture; the bubble measured near the formula's 0.2."""
    out = tmp_path / "run"
    subprocess.run(multiproc.command(4, REPO / "train.py", "--model", "tiny", "--seq-len", "64", "--micro-batch",
                                  "2", "--grad-accum", "4", "--tp", "2", "--pp", "2", "--max-steps", "2",
                                  "--warmup", "1", "--log-every", "1", "--eval-every", "-1", "--ckpt-every", "2",
                                  "--sample-tokens", "0", "--trace-step", "2", "--out-dir", out),
                   check=True, capture_output=True, text=True)
    trace = json.loads((out / "trace_step_000002.json").read_text())
    assert (out / "trace_step_000002.png").stat().st_size > 10_000
    ranks, info = trace_by_rank(trace), trace["otherData"]
    assert sorted(ranks) == [0, 1, 2, 3] and ranks[2]["name"] == "rank 2 (tp 0, cp 0, pp 1, dp 0)"
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    for r, got in ranks.items():
        assert got["phases"] == ["1 data", "2-4 pipeline", "5 grad sync", "6 optimizer", "7 checkpoint"]
        mbs = [f"{way} {i}" for way in ("forward", "backward") for i in range(4)]
        assert sorted(got["work"]) == sorted(mbs)
        counted = {k: v for k, v in info["counted_bytes"][r].items() if v}
        assert {k: v for k, v in got["bytes"].items() if k not in ("io", "ckpt")} == counted
    assert {k: v for k, v in logged["comm_bytes_per_step"].items() if v} == {
        k: v for k, v in ranks[0]["bytes"].items() if k not in ("io", "ckpt")}  # rank 0's, as metrics.jsonl
    assert info["bubble"]["formula"] == pytest.approx(0.2) and 0.05 < info["bubble"]["measured"] < 0.6


def test_bench_trace_of_one_process(tmp_path):
    """bench.py --trace DIR on one process: the micro-batches' phases in order on the one track, the files
    in DIR; a file where the folder should be is one line."""
    out = subprocess.run([*multiproc.command(0, REPO / "bench.py"), "--trace", str(tmp_path / "t"), "--model",
                          "tiny", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2",
                          "--warmup-steps", "1"], capture_output=True, text=True, check=True).stdout
    assert "rank 0: 1 data" in out and (tmp_path / "t" / "step.png").exists()
    ranks = trace_by_rank(json.loads((tmp_path / "t" / "trace.json").read_text()))
    assert list(ranks) == [0] and ranks[0]["phases"] == [
        "1 data", "2 forward", "3 loss", "4 backward", "2 forward", "3 loss", "4 backward", "5 grad sync",
        "6 optimizer", "7 checkpoint"]
    (tmp_path / "file").write_text("")
    r = subprocess.run([*multiproc.command(0, REPO / "bench.py"), "--trace", str(tmp_path / "file")],
                       capture_output=True, text=True)
    assert (r.returncode, len(r.stderr.splitlines())) == (1, 1) and "is a file" in r.stderr


def test_launch_writes_the_planned_run_for_slurm_and_kubernetes():
    """--plan --launch: a batch script of one srun task per node, torchrun's c10d rendezvous on the first
    node, and train.py at the planned layout; a PyTorchJob of one pod per node with the same train.py."""
    planned = ["--plan", "--model", "llama3.1-8b", "--gpus", "32", "--tp", "8", "--pp", "2", "--micro-batch", "1",
            "--seq-len", "8192", "--grad-accum", "4", "--zero", "1", "--act-ckpt", "--data", "/data/shards"]
    run = lambda *more: subprocess.run([*multiproc.command(0, REPO / "bench.py"), *planned, *more],
                                       capture_output=True, text=True, check=True).stdout
    script = run("--launch", "slurm")
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "#SBATCH --ntasks-per-node=1\n" in script
    command = script.split("srun ", 1)[1].replace("\\\n", " ").split()
    assert command[:3] == ["torchrun", "--nnodes=4", "--nproc_per_node=8"] and "--rdzv-backend=c10d" in command
    flags = command[command.index("train.py") + 1:]
    args = config.get_parser().parse_args([f.replace("$OUT_DIR", "out") for f in flags])
    assert (args.tp, args.pp, args.grad_accum, args.zero, args.act_ckpt, args.sp) == (8, 2, 4, 1, "full", True)
    assert (args.data, args.tokenizer, args.resume) == ("/data/shards", "llama3", True)
    job = yaml.safe_load(run("--launch", "k8s", "--image", "me/train:1"))
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (job["kind"], job["spec"]["nprocPerNode"]) == ("PyTorchJob", "8")
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    pod = specs["Worker"]["template"]["spec"]["containers"][0]
    assert pod["image"] == "me/train:1" and pod["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["command"][:2] == ["torchrun", "train.py"]
    assert config.get_parser().parse_args(pod["command"][2:]).tp == 8
    for more, said in ((["--gpus-per-node", "6"], "not a number of whole nodes"),
                       (["--gpus-per-node", "4"], "tp 8 groups would not lie within nodes")):
        r = subprocess.run([*multiproc.command(0, REPO / "bench.py"), *planned, "--launch", "slurm", *more],
                           capture_output=True, text=True)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and said in r.stderr, r.stderr


HOSTILE = ["/data/my shards", "x; touch ran", "$(touch ran)", "`touch ran`", "it's \"q\" \\ $HOME ${X:-y}",
           "a: b", "[x]", "{a: 1}", "#c", "& *x !y | > % @", "日本語🙂", "x'$'\\n'y", "*", "~/data"]


def slurm_arguments(script: str, folder: Path, env: dict) -> list[str]:
    """What bash, running the batch script in `folder`, hands srun: scontrol and srun are stand-ins, and
    srun writes its arguments NUL-separated."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-1\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {folder / 'srun.args'}\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (folder / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", folder / "job.sh"], check=True)
    subprocess.run(["bash", folder / "job.sh"], cwd=folder, check=True, env={
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[1-4]",
        "SLURM_CPUS_ON_NODE": "64", "SLURM_JOB_ID": "7", **env})
    return (folder / "srun.args").read_text().split("\0")[:-1]


@pytest.mark.parametrize("data", HOSTILE)
def test_launch_quotes_every_value_it_writes(data, capsys, tmp_path):
    """A --data or --image with shell or YAML syntax in it reaches train.py as exactly that text: bash runs the
    Slurm script (srun a stand-in) without running a word of it, and the PyTorchJob loads as YAML to the same
    strings; an OUT_DIR with a space stays one argument. (Values that cannot be written are refused: BAD_FLAGS.)"""
    planned = ["--plan", "--model", "llama3.1-8b", "--gpus", "16", "--tp", "8", "--data", data]
    def launch(*more):
        a = bench.get_parser().parse_args([*planned, *more])
        bench.validate(a)
        plan.run_plan(a)
        return capsys.readouterr().out
    for env, out_dir in (({}, tmp_path / "out-llama3-1-8b"), ({"OUT_DIR": "/runs/a b"}, "/runs/a b")):
        argv = slurm_arguments(launch("--launch", "slurm"), tmp_path, env)
        flags = config.get_parser().parse_args(argv[argv.index("train.py") + 1:])
        assert (flags.data, flags.out_dir, flags.tp, flags.resume) == (data, str(out_dir), 8, True)
    assert not (tmp_path / "ran").exists()
    image = data.replace(" ", "")
    job = yaml.safe_load(launch("--launch", "k8s", "--image", image))
    assert job["metadata"]["name"] == "llama3-1-8b"
    for role in ("Master", "Worker"):
        pod = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        assert pod["containers"][0]["image"] == image
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "llama3-1-8b-shared"
        flags = config.get_parser().parse_args(pod["containers"][0]["command"][2:])
        assert (flags.data, flags.out_dir, flags.tp) == (data, "/shared/out-llama3-1-8b", 8)


def test_compare_hf_builds_their_model_on_the_device_in_the_measured_dtype(monkeypatch):
    """transformers' side was built in fp32 on the CPU and then moved: at 1B that took longer than its timed
    steps. Its parameters are now made where and as they are measured (here on the meta device, which holds
    no values, so nothing can have been built elsewhere first), and the default dtype is left as it was."""
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    hf = compare.built_on(torch.device("meta"), torch.bfloat16, lambda: transformers.LlamaForCausalLM(cfg))
    assert {(p.device.type, p.dtype) for p in hf.parameters()} == {("meta", torch.bfloat16)}
    assert torch.get_default_dtype() == torch.float32
    seen, built_on = [], compare.built_on
    monkeypatch.setattr(compare, "built_on", lambda device, dtype, build: seen.append((device.type, dtype)) or
                        built_on(device, dtype, build))
    a = bench.get_parser().parse_args(["--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps",
                                       "1", "--warmup-steps", "0", "--precision", "bf16", "--compare-hf"])
    assert compare.hf_tokens_per_s(a, bench.model_args(a)) > 0 and seen == [("cpu", torch.bfloat16)]


def test_compare_hf_under_several_processes_is_refused():
    """Under torchrun each rank printed its own ratio (0.19 and 0.27 at tp 2): ours over N processes against
    one transformers copy per rank, every copy on the same device, nothing naming the layout."""
    p = subprocess.run(multiproc.command(2, REPO / "bench.py", "--model", "tiny", "--seq-len", "32", "--tp", "2",
                                         "--compare-hf"), capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and lines and all("--compare-hf times one process of ours" in line and
                                               "this job has 2 processes" in line for line in lines), p.stderr


def test_a_small_budget_is_sized_in_the_unit_that_fits():
    """--budget-flops 1e15 printed "0.0B parameters on 0.00T tokens"."""
    out = subprocess.run([*multiproc.command(0, REPO / "bench.py"), "--plan", "--budget-flops", "1e15"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[0]
    assert out.endswith("2.89M parameters on 57.7M tokens")
    assert [plan.count(n) for n in (12, 950e3, 3.2e6, 405e9, 15.6e12)] == ["12", "950K", "3.2M", "405B", "15.6T"]


def test_a_gpu_day_budget_that_is_not_a_number_is_refused(monkeypatch, capsys):
    """`gpu_check --quick --budget nan` ran with no budget at all: every comparison with NaN is false."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_check
    for budget in ("nan", "0", "-5", "inf"):
        with pytest.raises(SystemExit) as stop:
            gpu_check.main(["--quick", "--budget", budget])
        assert stop.value.code == 2 and "--budget must be a positive number of seconds" in capsys.readouterr().err


def test_a_row_whose_process_was_killed_says_so_and_leaves_no_folder(monkeypatch):
    """A row whose child was killed (as the OOM killer does) reported the child's last line of errors
    ("... already prepared") and left its temporary folder behind: it names the signal now, and the
    child's temporary folders, made inside one the parent removes, are gone."""
    made, run = [], subprocess.run
    child = ("import os, signal, sys, tempfile; d = tempfile.mkdtemp(); open(os.path.join(d, 'ckpt'), 'w').close();"
             " print(d, flush=True); print('shards: already prepared', file=sys.stderr, flush=True);"
             " os.kill(os.getpid(), signal.SIGKILL)")

    def killed(cmd, **kw):
        p = run([sys.executable, "-c", child], **kw)
        made.append(p.stdout.strip())
        return p
    monkeypatch.setattr(bench.subprocess, "run", killed)
    row = bench.measure_apart(["--model", "tiny"], {"mb": 4})
    assert row == {"setting": {"mb": 4}, "error": "the process was killed by SIGKILL (the OOM killer sends it "
                                                  "when memory runs out)"}
    assert made[0] and not os.path.exists(made[0])


def test_a_full_disk_in_a_row_is_one_line_not_a_traceback(monkeypatch, capsys):
    """A row on a full TMPDIR printed a 20-line traceback before its one-line error: a checkpoint or disk
    error is the user's disk, not a bug in bench.py."""
    import checkpoint
    a = bench.get_parser().parse_args(["--model", "tiny"])

    def full(*args, **kw):
        raise checkpoint.CheckpointError("could not write checkpoint /tmp/x/step_000001: No space left on device")
    monkeypatch.setattr(bench, "measure", full)
    assert bench.measure_here(a, {"mb": 2}) == {"setting": {"mb": 2}, "error": "could not write checkpoint "
                                                "/tmp/x/step_000001: No space left on device"}
    assert "Traceback" not in capsys.readouterr().err


def test_the_quick_days_1b_rows_give_floors_and_fp8_against_bf16(tmp_path, monkeypatch):
    """gpu_check's 1B rows, their bench.py runs replaced by a row each: every record's line gives the phases,
    the floors and the ceiling MFU; the fp8 row its tokens/s over the first (compiled bf16) row's."""
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    import gpu_check

    def fake_row(cmd, seconds):
        fp8 = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--precision"][-1] == "fp8"  # (the last wins)
        row = {"tokens_per_s": 60_000.0 if fp8 else 50_000.0, "mfu": {"palm": 0.5}, "attn_kernel": "cudnn",
               "peak_memory_gb": 45.0, "memory_estimate_gb": {"total": 44.6}, "step_s": 0.29, "fp8": fp8,
               "phases_s": {"2 forward": 0.062, "6 optimizer": 0.017}, "ceiling_mfu": {"palm": 0.7},
               "floors_ms": {"2 forward": 40.0, "6 optimizer": 8.6}}
        return True, "", json.dumps(row), 1.0
    monkeypatch.setattr(gpu_check, "timed_run", fake_row)
    day = gpu_check.Report(tmp_path / "r")
    assert gpu_check.llama_rows(day, tmp_path, 1000)
    records = [json.loads(line) for line in (tmp_path / "r" / "report.jsonl").read_text().splitlines()]
    assert len(records) == len(gpu_check.QUICK_ROWS) and all("floors 2:40.0 6:8.6, ceiling MFU 70.0%" in r["detail"]
                                                              for r in records)
    fp8 = [r for r in records if "fp8" in r["name"]]
    assert len(fp8) == 1 and fp8[0]["detail"].endswith("; 1.20x the first row's tokens/s")
