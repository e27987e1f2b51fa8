"""bench.py: the planner's arithmetic against GUIDE section 2, and the measuring modes run end to end
(their output is checked for content, never for speed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench

REPO = Path(__file__).resolve().parents[1]


def test_plan_reproduces_the_llama3_70b_reference_example():
    r = bench.plan("llama3-70b", 15e12, 8192, "H100", 16384, tp=8, pp=4, micro_batch=4, grad_accum=4, mfu=0.4,
                   act_ckpt=True)
    assert (r["gpus_per_replica"], r["dp"]) == (32, 512)
    assert r["tokens_per_micro_batch"] == 32_768
    assert r["tokens_per_global_batch"] == 67_108_864
    assert r["steps"] == 223_518  # 15T / 67.1M; the GUIDE's ~3.75M steps is for a ~4M-token batch
    assert r["flops"] == pytest.approx(6 * 70_553_706_496 * 15e12)
    assert r["bubble"] == pytest.approx(3 / 7)
    assert r["fits"] and 0 < r["memory_per_gpu_bytes"] < 80e9
    assert not r["memory_variants"]["zero1_ckpt0"]["total"] < 80e9  # 4 micro-batches of activations in flight
    assert r["comm_bytes_per_step"]["dp"] == pytest.approx(2 * 511 / 512 * 70_553_706_496 / 32 * 4)


def test_plan_memory_arithmetic_for_llama31_8b():
    r = bench.plan("llama3.1-8b", 1e12, 8192, "H100", 8, tp=1, pp=1, micro_batch=1, grad_accum=1, mfu=0.4,
                   zero=False)
    m, n = r["memory_per_gpu"], 8_030_261_248
    assert m["weights"] == 2 * n  # bf16 weights: 16 GB
    assert m["optimizer"] == 8 * n  # fp32 Adam m and v: 64 GB
    assert m["grads"] == 4 * n and m["master"] == 4 * n
    assert not r["fits"]  # 8B does not train on one 80 GB GPU without sharding
    z = bench.plan("llama3.1-8b", 1e12, 8192, "H100", 8, tp=1, pp=1, micro_batch=1, grad_accum=1, mfu=0.4, zero=True)
    assert z["memory_per_gpu"]["optimizer"] == 8 * n / 8


def test_plan_json_cli_carries_the_required_keys():
    out = subprocess.run([sys.executable, str(REPO / "bench.py"), "--plan", "--model", "llama3-8b", "--gpus", "64",
                          "--tp", "8", "--json"], capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    for key in ("gpus_per_replica", "dp", "tokens_per_micro_batch", "tokens_per_global_batch", "steps", "flops",
                "memory_per_gpu_bytes", "bubble", "fits"):
        assert key in r
    assert r["dp"] == 8


def test_measure_sweep_and_compare_hf_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "bench.py"), "--model", "tiny", "--seq-len", "32", "--micro-batch", "4",
           "--steps", "2", "--warmup-steps", "1", "--json"]
    rows = json.loads(subprocess.run(cmd + ["--sweep", "mb=4;mb=4,act_ckpt=1"], capture_output=True, text=True,
                                     check=True, env=env).stdout.splitlines()[-1])["rows"]
    assert len(rows) == 2 and rows[1]["act_ckpt"]
    for r in rows:
        assert set(r["phases_s"]) == {"1 data", "2 forward", "3 loss", "4 backward", "5 grad sync", "6 optimizer",
                                      "7 checkpoint"}
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"]["megatron"] < r["mfu"]["palm"]
        assert r["memory_estimate_gb"]["total"] > 0
    hf = json.loads(subprocess.run(cmd + ["--compare-hf"], capture_output=True, text=True, check=True,
                                   env=env).stdout.splitlines()[-1])["compare_hf"]
    assert len(hf["ours_tokens_per_s"]) == len(hf["hf_tokens_per_s"]) == 2 and hf["ratio_ours_over_hf"] > 0
