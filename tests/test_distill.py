"""distill.py: the KL and its gradient against autograd on the written-out formulas (forward and reverse, a
temperature, a head padded past the tokenizer), a student that is its teacher learning nothing, the same run
under tp 2 and dp 2 as on one process, conversations as data, and bad input refused in one line before any
model is built."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import checkpoint as C
import config
import costs
import data
import distill
import model as M
import multiproc
import parallel as P
import weights as W

REPO = Path(__file__).resolve().parents[1]
BYTE = data.get_tokenizer("byte")
BASE = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--max-steps", "3", "--log-every", "1",
        "--eval-every", "3", "--eval-batches", "2", "--ckpt-every", "3", "--lr", "3e-3"]


def steps(out_dir):
    """The metrics of each step and of each validation, in order."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r or "val_loss" in r]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher larger than the tiny student (3 layers of 96), at random, as a Hugging Face folder with the
    byte tokenizer: its head has the student's 320 rows."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("teacher")
    W.save_hf(M.Transformer(M.ModelArgs(dim=96, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320)), folder,
              W.hf_tokens(BYTE, chat=False))
    return folder


# ----------------------------------------------------------------------------------------------------
# The formulas


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_the_kl_and_its_gradient_are_the_formulas(kind):
    """kl_and_grad against autograd on KL written with log_softmax, over the first 10 of 13 columns (a padded
    head's rows never count), at temperature 2."""
    g = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(6, 13, generator=g, dtype=torch.float64) for _ in range(2))
    kl, grad = distill.kl_and_grad(student, teacher, kind, 2.0, 10, 0, 1)
    x = student.clone().requires_grad_(True)
    log_ps, log_pt = (torch.log_softmax(z[:, :10] / 2.0, dim=-1) for z in (x, teacher))
    want = (F.kl_div(log_ps, log_pt, log_target=True, reduction="none") if kind == "forward"
            else F.kl_div(log_pt, log_ps, log_target=True, reduction="none")).sum(dim=-1)
    want.sum().backward()
    torch.testing.assert_close(kl.double(), want.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.double(), x.grad, atol=1e-6, rtol=1e-5)
    assert (grad[:, 10:] == 0).all() and (kl > 0).all()


def test_a_student_that_is_its_teacher_has_nothing_to_learn(tmp_path, teacher):
    """--init the teacher itself: the KL is 0 (to float error) and so is every gradient of a pure KL loss."""
    out = tmp_path / "same"
    distill.main(["--teacher", str(teacher), "--init", str(teacher), *BASE, "--max-steps", "1", "--out-dir",
                  str(out)])
    first = steps(out)[0]
    assert abs(first["kl"]) < 1e-6 and first["grad_norm"] < 1e-5 and first["ce"] > 4


def test_the_memory_check_counts_the_teacher(teacher):
    """The teacher's weights are in the estimate, as so many copies of the student's (checks.check_memory)."""
    args = config.parse(distill.get_parser(), ["--teacher", str(teacher), *BASE])
    recipe = distill.Distill(args)
    student = recipe.model_args(recipe.tokenizer())
    want = costs.count_params(distill.teacher_args(teacher, BYTE)) / costs.count_params(student)
    assert recipe.frozen_copies == pytest.approx(want) and want > 2  # (3 layers of 96 against 2 of 64)


# ----------------------------------------------------------------------------------------------------
# Layouts and data


def _job(n, out, *flags):
    cmd = multiproc.command(n, REPO / "distill.py", *BASE, *flags, "--out-dir", out)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return steps(out)


def test_the_same_distillation_under_tp_and_dp(tmp_path, teacher):
    """tp 2 (the vocabulary-parallel KL: both heads cut alike, two numbers per token across ranks), pp 2 (the
    teacher pipelined as the student is, its logits on the last stage) and dp 2 against one process: the same losses, KL and cross-entropy within 1e-5, the final weights within 1e-4
    of each tensor's norm; the reverse KL (its gradient reads the reduced KL: forward's collectives and
    more), the data's cross-entropy mixed in (--ce-weight) and a temperature."""
    flags = ["--teacher", str(teacher), "--kl", "reverse", "--ce-weight", "0.25", "--temperature", "1.5",
             "--grad-accum", "2"]
    one = _job(1, tmp_path / "one", *flags)
    for name, more in (("tp", ["--tp", "2"]), ("pp", ["--pp", "2"]), ("dp", ["--micro-batch", "2"])):
        got = _job(2, tmp_path / name, *flags, *more)
        assert len(got) == len(one) == 4  # 3 steps and the validation (dp splits its batches otherwise)
        for a, b in zip(got, one) if name != "dp" else zip(got[:3], one[:3]):
            for key in ("loss", "kl", "ce"):
                k = key if key in b else f"val_{key}" if key != "loss" else "val_loss"
                assert a[k] == pytest.approx(b[k], rel=1e-5), (name, key, a, b)
        w, w1 = (C.read_full_state(C.read_latest(tmp_path / d))[0] for d in (name, "one"))
        for k, v in w1.items():
            diff = (w[k]["master"] - v["master"]).norm() / v["master"].norm().clamp(min=1e-12)
            assert diff.item() <= 1e-4, (name, k)


def test_conversations_distill_on_the_assistants_tokens(tmp_path, teacher):
    """Chat data (a .jsonl of conversations): the targets are the assistant's tokens, the checkpoint says chat."""
    convos = tmp_path / "c.jsonl"
    convos.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                                       {"role": "assistant", "content": f"{i + 1}."}]}) + "\n"
                              for i in range(40)))
    out = tmp_path / "chat"
    distill.main(["--teacher", str(teacher), *BASE, "--seq-len", "96", "--data", str(convos), "--val-fraction", "0.2",
                  "--out-dir",
                  str(out)])
    rows = steps(out)
    assert len(rows) == 4 and all(r.get("kl", r.get("val_kl", 0)) > 0 for r in rows)
    assert C.recorded(out)["chat"] is True


# ----------------------------------------------------------------------------------------------------
# Bad input


def refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        config.run(distill.main, argv)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_distillation_input_is_one_line_before_any_model(tmp_path, teacher, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(distill.train, "build_model", lambda *a, **k: built.append(1))
    other = tmp_path / "gpt2"  # a teacher of another tokenizer
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50304)), other,
              W.hf_tokens(data.get_tokenizer("gpt2"), chat=False))
    rm = tmp_path / "rm"  # a reward model
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=320,
                                        num_labels=1)), rm, W.hf_tokens(BYTE, chat=False))
    out = ["--out-dir", str(tmp_path / "o")]
    cases = [([], "distill.py needs --teacher"),
             (["--teacher", str(teacher), "--cp", "2"], "--cp 2: distill.py does not support context parallelism"),
             (["--teacher", str(teacher), "--ce-weight", "2"], "need --temperature > 0 and --ce-weight in [0, 1]"),
             (["--teacher", str(teacher), "--dropout", "0.1"], "--dropout 0.1: the student's distribution"),
             (["--teacher", str(other), "--init", str(teacher)], "reads the tokenizer gpt2, the student"),
             (["--teacher", str(teacher), "--vocab-size", "384"], "has a head of 320 rows, the student 384"),
             (["--teacher", str(rm)], "is a reward model")]
    for flags, message in cases:
        err = refused(capsys, BASE + flags + out)
        assert message in err, (flags, err)
    assert not built and not (tmp_path / "o").exists()
