"""--precision fp8: a block's linears multiply in float8 (model.FP8Linear), on a CPU as on an FP8 GPU:
the scaling arithmetic exact, each matmul within its formats' error of bf16's, training within 2% of bf16's
loss, under other layouts, and refused where the device has no float8 matmul."""

import dataclasses
import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

import checks
import config
import model as M
import multiproc
from conftest import REPO
from test_parallel import job, losses


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g).to(torch.bfloat16).requires_grad_()  # (B, T, in)
    w = (0.05 * torch.randn(96, 64, generator=g)).to(torch.bfloat16).requires_grad_()  # (out, in)
    grad = torch.randn(4, 32, 96, generator=g).to(torch.bfloat16)
    return x, w, grad


def test_each_matmul_is_the_product_of_its_scaled_float8_operands(operands):
    """Forward x8 W8^T, backward g8 W8 and g8^T x8, each undone by its two scales: what fp32 matmuls of
    the dequantized operands give, to the bf16 output's rounding."""
    x, w, grad = operands
    y = M.FP8Linear.apply(x, w)
    y.backward(grad)
    x8, sx = M.to_fp8(x.detach().reshape(-1, 64), M.E4M3)
    w8, sw = M.to_fp8(w.detach(), M.E4M3)
    g8, sg = M.to_fp8(grad.reshape(-1, 96), M.E5M2)
    xd, wd, gd = x8.float() * sx, w8.float() * sw, g8.float() * sg
    assert x8.float().abs().max() == 448.0 and g8.float().abs().max() == 57344.0  # amax on the largest
    assert rel(y.reshape(-1, 96), xd @ wd.t()) < 4e-3
    assert rel(x.grad.reshape(-1, 64), gd @ wd) < 4e-3
    assert rel(w.grad, gd.t() @ xd) < 4e-3


def test_the_cpu_matmul_is_torchs_own_and_leaves_onednn_as_it_was(operands, capfd):
    """model.scaled_mm on a CPU runs _scaled_mm with oneDNN off for the call (its float8 kernel on an AMX
    CPU is a reference loop, ~100x slower): no oneDNN matmul runs (its verbose log says which ran), the
    product is _scaled_mm's with oneDNN on, to the bf16 output's rounding, and oneDNN's switch is back where
    it was, also when the matmul raises."""
    x, w, _ = operands
    x8, sx = M.to_fp8(x.detach().reshape(-1, 64), M.E4M3)
    w8, sw = M.to_fp8(w.detach(), M.E4M3)
    assert torch.backends.mkldnn.enabled
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        ours = M.scaled_mm(x8, w8.t(), sx, sw, torch.bfloat16)
    assert "primitive,exec,cpu,matmul" not in capfd.readouterr().out
    assert torch.backends.mkldnn.enabled
    assert rel(ours, torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)) < 4e-3
    with pytest.raises(RuntimeError):
        M.scaled_mm(x8, w8, sx, sw, torch.bfloat16)  # (64 x 128 by 96 x 64: shapes that do not meet)
    assert torch.backends.mkldnn.enabled


def test_a_float8_linear_is_bf16s_within_its_formats_error(operands):
    """Against bf16's F.linear on the same numbers: the output within 5% (e4m3's 3 mantissa bits), the
    gradients within 8% (the output's gradient in e5m2: 2 bits), as norms of the difference."""
    x, w, grad = operands
    y = M.FP8Linear.apply(x, w)
    y.backward(grad)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = F.linear(x2, w2)
    y2.backward(grad)
    assert rel(y, y2) < 0.05 and rel(x.grad, x2.grad) < 0.08 and rel(w.grad, w2.grad) < 0.08


def test_fp8_takes_the_blocks_linears_and_the_experts_not_the_router_or_head():
    model = M.Transformer(M.PRESETS["moe-tiny"])
    M.set_fp8(model, True)
    on = {n for n, m in model.named_modules() if isinstance(m, M.Linear) and m.fp8}
    off = {n for n, m in model.named_modules() if isinstance(m, M.Linear) and not m.fp8}
    assert off == {"layers.0.feed_forward.gate", "layers.1.feed_forward.gate"}
    assert "layers.1.feed_forward.experts.3.w2" in on and "layers.0.attention.wq" in on
    assert not isinstance(model.output, M.Linear)  # (the head: a plain nn.Linear, in bf16)


def test_fp8_trains_as_bf16_does(tmp_path):
    """The tiny model's training loss over 200 steps in fp8 within 2% of bf16's, every 10th step."""
    for precision in ("bf16", "fp8"):
        job(1, tmp_path / precision, "--precision", precision, steps=200, timeout=600)
    bf16, fp8 = losses(tmp_path / "bf16")[0], losses(tmp_path / "fp8")[0]
    assert len(fp8) == len(bf16) == 200
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(fp8[9::10], bf16[9::10])), (fp8[9::10], bf16[9::10])


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory):
    """The single fp8 process's 20 steps, which every layout below is held to."""
    out = tmp_path_factory.mktemp("fp8_one")
    job(1, out, "--precision", "fp8", steps=20)
    return out


@pytest.mark.parametrize("flags", [["--tp", "2", "--sp"], ["--zero", "1"], ["--zero", "3"], ["--pp", "2"],
                                   ["--cp", "2"]])
def test_fp8_trains_under_other_layouts(tmp_path, fp8_reference, flags):
    """tp 2 with sp, dp 2 under ZeRO-1 and ZeRO-3, pp 2 and cp 2 train the fp8 model, each shard's scales
    its own (a tp rank's weights, a dp or cp rank's activations: amax over what the rank holds), so their
    losses are the single process's within fp8's rounding, not bit for bit: 2% over 20 steps."""
    job(2, tmp_path / "two", "--precision", "fp8", *flags, steps=20)
    a, b = losses(fp8_reference)[0], losses(tmp_path / "two")[0]
    assert len(a) == len(b) == 20 and all(abs(x - y) <= 0.02 * y for x, y in zip(b, a)), (a, b)


def test_a_gpu_without_float8_matmuls_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(config.ConfigError, match=r"--precision fp8: NVIDIA A100-SXM4-80GB \(sm_80\) has no "
                                                 "float8 matmul"):
        config.check_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    config.check_fp8(torch.device("cuda", 0))  # an H100: no refusal


def test_bench_measures_fp8_beside_bf16_in_one_run():
    """--sweep "precision=bf16;precision=fp8": two rows of one run, the fp8 one marked, both counted against
    the bf16 peak (the heading of a --precision fp8 run says so)."""
    base = [*multiproc.command(0, "bench.py"), "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "2",
            "--warmup-steps", "1"]
    out = subprocess.run(base + ["--sweep", "precision=bf16;precision=fp8", "--json"], capture_output=True,
                         text=True, check=True, cwd=REPO)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["setting"], r["fp8"], r["precision"]) for r in rows] == [
        ({"precision": "bf16"}, False, "bf16"), ({"precision": "fp8"}, True, "bf16")]
    assert all("the best bf16 nn.Linear matmul" in r["peak_flops_source"] and r["tokens_per_s"] > 0 for r in rows)
    text = subprocess.run(base + ["--precision", "fp8"], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout
    assert "(fp8 matmuls in the blocks: MFU against the bf16 peak)" in text and "  fp8  attn" in text


def test_an_fp8_checkpoint_resumes_in_bf16_and_back(tmp_path):
    """fp8 keeps what bf16 keeps (fp32 masters and moments, bf16 weights): its checkpoint continues in bf16,
    and that one in fp8 again."""
    out = tmp_path / "o"
    for steps, precision in ((2, "fp8"), (4, "bf16"), (6, "fp8")):
        p = job(1, out, "--precision", precision, "--ckpt-every", "2", *(["--resume"] if steps > 2 else []),
                steps=steps)
        assert steps == 2 or f"at step {steps - 2}" in p.stdout + p.stderr
    assert len(losses(out)[0]) == 6


def test_cuda_shapes_that_are_not_multiples_of_16_are_refused_in_one_line():
    """_scaled_mm on CUDA takes sides that are multiples of 16 (a CPU takes any): said before any model."""
    import parallel as P
    checks.check_fp8_shapes(M.PRESETS["llama3.2-1b"], P.Layout(tp=2), 4 * 4096)
    with pytest.raises(config.ConfigError, match=r"needs multiples of 16, and tokens in a micro-batch on a rank "
                                                 r"\(--micro-batch x --seq-len / cp\) 100 are not"):
        checks.check_fp8_shapes(M.PRESETS["llama3.2-1b"], P.Layout(), 100)
    odd = dataclasses.replace(M.PRESETS["llama3.2-1b"], dim=2056, n_heads=4, n_kv_heads=4)
    with pytest.raises(config.ConfigError, match="needs multiples of 16, and dim 2056, "):
        checks.check_fp8_shapes(odd, P.Layout(), 4096)


def test_an_expert_parallel_mixture_trains_in_fp8(tmp_path):
    """moe-tiny at dp 2 x ep 2 in fp8 (the experts' linears in float8, the router in bf16): the single fp8
    process's losses within 2% over 10 steps."""
    moe = ["--model", "moe-tiny", "--precision", "fp8"]
    job(1, tmp_path / "one", *moe, steps=10)
    job(2, tmp_path / "two", *moe, "--ep", "2", steps=10)
    a, b = losses(tmp_path / "one")[0], losses(tmp_path / "two")[0]
    assert len(a) == len(b) == 10 and all(abs(x - y) <= 0.02 * y for x, y in zip(b, a)), (a, b)
