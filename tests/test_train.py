"""train.py end to end on CPU: exact resume, crash-safe checkpoints, precisions, and clear errors."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import checkpoint
import checks
import config
import costs
import data
import launch
import loss
import model as M
import multiproc
import parallel
import ramp
import train

REPO = Path(__file__).resolve().parents[1]
# A tiny model on TinyShakespeare (from the mirror) keeps each run to a second or two.
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--grad-accum", "2", "--lr", "3e-3",
        "--warmup", "2", "--eval-every", "0", "--eval-batches", "2", "--log-every", "1", "--sample-tokens",
        "0"]


def run_cli(*args, check=False):
    """train.py in a subprocess: returns (exit code, stdout, stderr)."""
    p = subprocess.run([*multiproc.command(0, REPO / "train.py"), *args], capture_output=True, text=True,
                       cwd=REPO, timeout=300, env=os.environ.copy())
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.returncode, p.stdout, p.stderr


def error_lines(stderr):
    """The error lines of a failed run (progress lines such as 'already prepared' may precede them)."""
    assert "Traceback" not in stderr, stderr
    return [l for l in stderr.splitlines() if l.startswith("error")]


def records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def final_state(out_dir):
    """{name: {master, exp_avg, exp_avg_sq}} of the latest checkpoint, as full tensors."""
    return checkpoint.read_full_state(checkpoint.find_latest(Path(out_dir))[0])[0]


@pytest.mark.parametrize("flags", [[], ["--dropout", "0.2"]])  # (dropout: each step's masks from its own seed)
def test_resume_is_bit_exact(tmp_path, flags):
    a, b = tmp_path / "straight", tmp_path / "resumed"
    train.main(TINY + flags + ["--max-steps", "8", "--out-dir", str(a), "--ckpt-every", "100"])
    train.main(TINY + flags + ["--max-steps", "8", "--out-dir", str(b), "--ckpt-every", "4"])
    # throw away the second half of the resumed run, then redo it from the step-4 checkpoint
    for f in b.glob("step_000008"):
        import shutil
        shutil.rmtree(f)
    (b / "latest").write_text("step_000004\n")
    (b / "metrics.jsonl").write_text("".join(l + "\n" for l in (b / "metrics.jsonl").read_text().splitlines()
                                             if json.loads(l)["step"] <= 4))
    train.main(TINY + flags + ["--max-steps", "8", "--out-dir", str(b), "--ckpt-every", "4", "--resume"])
    la = [r["loss"] for r in records(a) if "loss" in r]
    lb = [r["loss"] for r in records(b) if "loss" in r]
    assert len(la) == 8 and la == lb  # bit for bit, every step
    sa, sb = final_state(a), final_state(b)
    assert sa.keys() == sb.keys() and len(sa) > 10
    for k, v in sa.items():
        for kk in v:  # master weights and both Adam moments
            assert torch.equal(v[kk], sb[k][kk]), (k, kk)


def test_metrics_and_checkpoint_layout(tmp_path):
    train.main(TINY + ["--max-steps", "6", "--out-dir", str(tmp_path), "--ckpt-every", "2", "--keep-ckpts",
                       "2", "--eval-every", "3"])
    recs = records(tmp_path)
    steps = [r for r in recs if "loss" in r]
    assert all({"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys() for r in steps)
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    assert sorted(d.name for d in tmp_path.glob("step_*")) == ["step_000004", "step_000006"]  # keep last 2
    assert (tmp_path / "latest").read_text().strip() == "step_000006"
    assert not list(tmp_path.glob(".tmp-*"))
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    """A process that dies (os._exit, no cleanup) in the middle of writing its second checkpoint leaves the
    first one loadable, and --resume picks it."""
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import train
        real_save, calls = torch.save, []
        def dying_save(obj, f, *a, **k):
            calls.append(f)
            if len(calls) == 2:  # second checkpoint: write half a file, then die
                f.write(b"partial")
                f.flush()
                os._exit(9)
            return real_save(obj, f, *a, **k)
        torch.save = dying_save
        train.main({TINY + ["--max-steps", "6", "--ckpt-every", "2", "--out-dir", str(out)]!r})
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 9, p.stderr[-2000:]
    assert (out / "latest").read_text().strip() == "step_000002"
    assert checkpoint.find_latest(out)[0].name == "step_000002"
    assert list(out.glob(".tmp-step_000004"))  # the torn write is there, but invisible to resume
    torch.load(out / "step_000002" / "shard_pp00_tp00.pt", weights_only=True)
    code, stdout, stderr = run_cli(*TINY, "--max-steps", "6", "--ckpt-every", "2", "--out-dir", str(out),
                                   "--resume")
    assert code == 0, stderr[-2000:]
    assert "resumed from" in stdout and "at step 2" in stdout
    assert checkpoint.find_latest(out)[0].name == "step_000006"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_paths_train(tmp_path, precision):
    train.main(TINY + ["--max-steps", "12", "--out-dir", str(tmp_path), "--precision", precision, "--lr",
                       "1e-2"])
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert all(map(lambda x: x == x, losses))  # finite (no NaN)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3
    state = final_state(tmp_path)
    assert state["norm.weight"]["master"].dtype == torch.float32  # fp32 master weights and moments
    assert state["layers.0.attention.wq.weight"]["exp_avg_sq"].dtype == torch.float32


def test_activation_checkpointing_gives_the_same_training(tmp_path):
    """Full (the flag alone) and selective checkpointing train as no checkpointing does."""
    train.main(TINY + ["--max-steps", "3", "--out-dir", str(tmp_path / "a")])
    train.main(TINY + ["--max-steps", "3", "--out-dir", str(tmp_path / "b"), "--act-ckpt"])
    train.main(TINY + ["--max-steps", "3", "--out-dir", str(tmp_path / "c"), "--act-ckpt", "selective"])
    la, lb, lc = ([r["loss"] for r in records(tmp_path / d) if "loss" in r] for d in "abc")
    assert la == pytest.approx(lb, rel=1e-6) and la == pytest.approx(lc, rel=1e-6) and len(la) == 3


def test_default_configuration_runs(tmp_path):
    """No model/data flags: the embedded default (TinyShakespeare, byte tokenizer) for a few steps, with the
    sample at the end. Without --compile, --deterministic or --act-ckpt it never imports torch's compiler
    stack (sympy, its symbolic shapes): a second of every process's start."""
    args = ["--max-steps", "3", "--warmup", "1", "--eval-batches", "1", "--out-dir", str(tmp_path),
            "--sample-tokens", "20"]
    code = (f"import runpy, sys; sys.argv = {[str(REPO / 'train.py'), *args]!r}; "
            f"runpy.run_path(sys.argv[0], run_name='__main__'); print('sympy imported:', 'sympy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    stdout = p.stdout
    assert "sympy imported: False" in stdout
    assert "val loss" in stdout and "MFU" in stdout
    assert "device cpu, fp32, attention flash;" in stdout  # the kernel that ran: SDPA's CPU flash kernel
    assert (tmp_path / "latest").exists()


@pytest.mark.parametrize("flags,message", [
    (["--model", "llama-nope"], "unknown model preset 'llama-nope'"),
    (["--seq-len", "100000"], "exceeds the model's max_seq_len"),
    (["--model", "llama3-8b", "--tokenizer", "o200k_base"], "has a vocabulary of 128256"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--micro-batch", "0"], "--micro-batch must be at least 1"),
    (["--trace-step", "3"], "--trace-step must be a step of the run, 1 to --max-steps 2"),
    (["--trace-step", "0"], "--trace-step must be a step of the run"),
])
def test_bad_input_fails_with_one_line(tmp_path, flags, message):
    code, stdout, stderr = run_cli(*TINY, "--max-steps", "2", "--out-dir", str(tmp_path / "o"), *flags)
    assert code == 1
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], stderr
    assert not (tmp_path / "o").exists()  # nothing written


@pytest.mark.parametrize("text,flags,message", [
    ("", [], "no documents"),
    ("To be, or not to be. " * 4, [], "the val split"),  # ~80 bytes: no 33-token sequence once split
    ("To be, or not to be. " * 20, ["--micro-batch", "16"],
     "fewer than one global batch of 32 (--micro-batch 16 x"),
])
def test_empty_or_too_small_dataset_fails_with_one_line(tmp_path, text, flags, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    code, _, stderr = run_cli(*TINY, "--max-steps", "2", "--data", str(corpus), "--out-dir",
                              str(tmp_path / "o"), *flags)
    errors = error_lines(stderr)  # (preparing the shards reports its progress on stderr too)
    assert code == 1 and len(errors) == 1 and message in errors[0], stderr
    assert not (tmp_path / "o").exists()


def test_unreadable_or_foreign_checkpoint_is_refused_and_kept(tmp_path):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    state = out / "step_000002" / "shard_pp00_tp00.pt"
    good = state.read_bytes()
    # another model: refused, naming the mismatch
    code, _, stderr = run_cli(*TINY, "--dim", "96", "--max-steps", "4", "--out-dir", str(out), "--resume")
    assert code == 1 and len(error_lines(stderr)) == 1 and "another model" in stderr and "dim" in stderr
    # another vocabulary (another tokenizer): refused, naming both sizes
    code, _, stderr = run_cli(*TINY, "--tokenizer", "gpt2", "--max-steps", "4", "--out-dir", str(out),
                              "--resume")
    assert code == 1 and len(error_lines(stderr)) == 1 and "'vocab_size': (320, 50304)" in stderr
    # without --resume an existing run is not silently overwritten
    code, _, stderr = run_cli(*TINY, "--max-steps", "4", "--out-dir", str(out))
    assert code == 1 and "--resume" in stderr
    # a corrupt file: refused with the path, and left as it was
    state.write_bytes(good[: len(good) // 2])
    code, _, stderr = run_cli(*TINY, "--max-steps", "4", "--out-dir", str(out), "--resume")
    assert code == 1 and len(error_lines(stderr)) == 1 and "no intact checkpoint" in error_lines(stderr)[0]
    assert "damaged" in error_lines(stderr)[0] and "shard_pp00_tp00.pt has" in error_lines(stderr)[0]
    assert state.read_bytes() == good[: len(good) // 2]
    assert (out / "latest").read_text().strip() == "step_000002"


def test_each_process_binds_its_own_gpu_before_the_first_collective(monkeypatch):
    """No GPU here: the calls a GPU run makes are recorded instead. --device cuda:N is bound like torchrun's
    LOCAL_RANK; NCCL gets the device at init (else it guesses GPU = rank % count for its first barrier)."""
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    args = config.get_parser().parse_args(["--device", "cuda:3"])
    assert config.pick_device_and_precision(args) == (torch.device("cuda", 3), "bf16")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:  # configure_process also turns TF32 on: undone after
        config.configure_process(args)
        monkeypatch.setenv("LOCAL_RANK", "5")
        args.device = None
        assert config.pick_device_and_precision(args)[0] == torch.device("cuda", 5)
        config.configure_process(args)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert bound == [torch.device("cuda", 3), torch.device("cuda", 5)]
    monkeypatch.setenv("LOCAL_RANK", "9")
    with pytest.raises(config.ConfigError, match="GPU 9 asked for .* this process sees 8"):
        config.pick_device_and_precision(args)
    options = launch.process_group_options(torch.device("cuda", 5), 7.0)
    assert options["backend"] == "nccl" and options["device_id"] == torch.device("cuda", 5)
    assert launch.process_group_options(torch.device("cpu"), 7.0)["backend"] == "gloo"


def test_a_checkpoint_keeps_only_its_own_gpus_random_state(monkeypatch):
    """A process saves its own GPU's generator, and resumes where it sees fewer GPUs than the writer did."""
    states = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[device.index])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]),
                                                                                            device)))
    rng = checkpoint.rng_state(torch.device("cuda", 3))
    assert torch.equal(rng["cuda"], states[3])
    checkpoint.restore_rng(rng, torch.device("cuda", 0))  # resumed on another node, this rank driving GPU 0
    checkpoint.restore_rng({**rng, "cuda": states}, torch.device("cuda", 1))  # an older checkpoint: every GPU's
    checkpoint.restore_rng({**rng, "cuda": states[:2]}, torch.device("cuda", 4))  # ... from fewer GPUs: none
    assert restored == [(3, torch.device("cuda", 0)), (1, torch.device("cuda", 1))]
    assert "cuda" not in checkpoint.rng_state(torch.device("cpu"))


def test_compile_reaches_the_blocks_a_pipeline_stage_runs():
    """--compile compiles each block in place, so a pipeline stage, whose forward runs only the blocks it
    holds, runs them compiled too; the numbers stay those of the eager model."""
    counter = CompileCounter()  # a torch.compile backend that counts the graphs it is given
    stage = parallel.apply_pipeline(M.Transformer(M.PRESETS["tiny"]), parallel.Mesh(parallel.Layout(pp=2), pp_rank=1))
    eager = M.Transformer(M.PRESETS["tiny"])
    parallel.apply_pipeline(eager, parallel.Mesh(parallel.Layout(pp=2), pp_rank=1)).load_state_dict(stage.state_dict())
    train.compile_blocks(stage, backend=counter)
    h = torch.randn(2, 16, M.PRESETS["tiny"].dim)  # the residual stream stage 0 would send
    out = stage(h)
    assert counter.frame_count >= 1 and torch.equal(out, eager(h))
    frames = counter.frame_count
    stage.eval()  # evaluation and generation run the blocks eagerly (a KV cache would recompile each step)
    stage(h)
    assert counter.frame_count == frames


def fake_package(monkeypatch, name, **attrs):
    """A stand-in for an optional package that is not installed here, importable under `name`."""
    import importlib.machinery
    import types
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_and_tensorboard_get_the_records_of_metrics_jsonl(tmp_path, monkeypatch):
    logged, scalars, events = [], [], []

    class Run:  # wandb.init()'s run
        def log(self, values, step):
            logged.append({"step": step, **values})

        def finish(self):
            events.append("wandb finished")

    class SummaryWriter:
        def __init__(self, folder):
            events.append(f"tensorboard in {folder}")

        def add_scalar(self, name, value, step):
            scalars.append((name, value, step))

        def close(self):
            events.append("tensorboard closed")

    fake_package(monkeypatch, "wandb", init=lambda project, config, dir: events.append(project) or Run())
    fake_package(monkeypatch, "tensorboard")
    fake_package(monkeypatch, "torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "4", "--log-every", "2", "--eval-every", "2", "--out-dir", str(out),
                       "--wandb", "my-project", "--tensorboard", str(tmp_path / "tb"),
                       "--eval-tasks", "piqa:8"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    flat = lambda r: {"step": r["step"], **{f"{k}/{s}" if isinstance(v, dict) else k: x for k, v in r.items()
                                            if k != "step" for s, x in (v.items() if isinstance(v, dict)
                                                                        else [(None, v)])}}
    assert len(records) == 4 and logged == [flat(r) for r in records]  # 2 log lines, 2 validations
    assert scalars == [(k, v, r["step"]) for r in records for k, v in flat(r).items() if k != "step"]
    assert ("val_loss", records[1]["val_loss"], 2) in scalars
    assert ("piqa/acc_norm", records[1]["piqa/acc_norm"], 2) in scalars and "piqa/acc" in logged[1]
    assert events == ["my-project", f"tensorboard in {tmp_path / 'tb'}", "wandb finished",
                      "tensorboard closed"]


@pytest.mark.parametrize("flag,package", [("--wandb", "wandb"), ("--tensorboard", "tensorboard")])
def test_a_tracker_without_its_package_is_one_line(tmp_path, monkeypatch, capsys, flag, package):
    real = checks.importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec",
                        lambda name: None if name == package else real(name))
    with pytest.raises(SystemExit) as exit_info:
        config.run(train.main, TINY + ["--out-dir", str(tmp_path / "o"), flag, "x"])
    assert exit_info.value.code == 1
    said = capsys.readouterr().err.strip()
    assert said == f"error: {flag} needs the {package} package: pip install {package}"
    assert not (tmp_path / "o").exists()


MIXTURE = ["--data", "c4_demo:0.5,wiki_demo:0.3,tinyshakespeare:0.2", "--anneal-tokens", "768",
           "--anneal-data", "wiki_demo:0.7,tinyshakespeare:0.3"]  # 768 tokens: the last 3 steps of 6


def test_a_mixture_resumes_bit_exact_in_its_mix_and_in_its_annealing(tmp_path):
    """One run of 6 steps, the last 3 annealed on another mixture with the learning rate falling to 0;
    resumed from step 2 (mixing) and from step 5 (annealing) it gives the same losses bit for bit. The log
    carries each source's tokens and validation loss; the run prints the shares it saw."""
    straight = tmp_path / "straight"
    flags = TINY + MIXTURE + ["--max-steps", "6", "--eval-every", "6"]
    code, out, err = run_cli(*flags, "--out-dir", str(straight), "--ckpt-every", "1", "--keep-ckpts", "6",
                             check=True)
    steps = [r for r in records(straight) if "loss" in r]
    assert steps[-1]["lr"] == 0 and steps[2]["lr"] > steps[3]["lr"] > steps[4]["lr"] > 0  # annealed from 4
    seen = {k.split("/")[1]: v for k, v in steps[-1].items() if k.startswith("tokens/")}
    assert sum(seen.values()) == 6 * 8 * 32  # every trained sequence, counted once, by its source
    assert "data seen: c4_demo" in out
    val = [r for r in records(straight) if "val_loss" in r][-1]
    assert {"val_loss/c4_demo", "val_loss/wiki_demo", "val_loss/tinyshakespeare"} <= val.keys()
    for cut in (2, 5):
        resumed = tmp_path / f"from{cut}"
        resumed.mkdir()
        (resumed / f"step_{cut:06d}").symlink_to(straight / f"step_{cut:06d}")
        (resumed / "latest").write_text(f"step_{cut:06d}\n")
        run_cli(*flags, "--out-dir", str(resumed), "--ckpt-every", "100", "--resume", check=True)
        assert [r["loss"] for r in records(resumed) if "loss" in r] == [r["loss"] for r in steps[cut:]], cut


def test_a_bad_mixture_is_one_line_and_writes_nothing(tmp_path):
    gpt2 = data.resolve_data("tinyshakespeare", "gpt2")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for spec, message in ((f"tinyshakespeare:1,{gpt2}:1", "tokenized with 'gpt2', but 'byte' is expected"),
                          ("tinyshakespeare:1,no_such_source:1", "no data found at 'no_such_source'"),
                          ("tinyshakespeare:1,wiki_demo:0", "wiki_demo has weight 0"),
                          (f"{empty}:1,tinyshakespeare:1", "no documents")):
        out = tmp_path / "o"
        code, _, err = run_cli(*TINY, "--max-steps", "1", "--warmup", "1", "--data", spec, "--out-dir", str(out))
        assert code == 1 and len(error_lines(err)) == 1 and message in error_lines(err)[0], err[-2000:]
        assert not out.exists()


def test_the_memory_check_counts_dpo_pairs_and_its_reference(monkeypatch):
    """DPO holds two rows per pair and a frozen reference beside the trained model: a device with room for
    the model trained on single rows but not for that is refused before anything is allocated."""
    args = config.get_parser().parse_args(["--model", "small", "--micro-batch", "8", "--seq-len", "256"])
    margs = config.model_args_from(args, 320)
    kept = costs.kept_by("cpu", "fp32", "auto", False, False)  # what the check counts as saved for backward
    one = parallel.Layout()
    rows = costs.memory_estimate(margs, one, costs.Shape(8, 256, "fp32"), kept=kept)["total"]
    pairs = costs.memory_estimate(margs, one, costs.Shape(16, 256, "fp32"), kept=kept)["total"] + 4 * costs.stage_params(
        margs)
    dpo = dict(rows_per_example=2, frozen_copies=1)
    monkeypatch.setattr(costs, "available_memory", lambda device: (rows + pairs) / 2)
    checks.check_memory(margs, args, one, torch.device("cpu"), "fp32")  # pretraining fits
    with pytest.raises(config.ResourceError, match=r"model small \(9.7M parameters\) needs about"):
        checks.check_memory(margs, args, parallel.Layout(), torch.device("cpu"), "fp32", **dpo)
    monkeypatch.setattr(costs, "available_memory", lambda device: pairs + 1)
    checks.check_memory(margs, args, parallel.Layout(), torch.device("cpu"), "fp32", **dpo)  # exactly what it counts


# ----------------------------------------------------------------------------------------------------
# Document masking (--doc-mask)


def test_a_packed_sequence_under_the_document_mask_scores_each_document_as_if_alone():
    """Three documents packed in one row (the third cut by the row's end), their ids from the BOS tokens:
    every target inside a document gets the loss it gets in that document's own sequence, within float
    rounding. Without the mask the later documents read the earlier ones, and their losses differ."""
    torch.manual_seed(0)
    args = M.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)
    model = M.Transformer(args).eval()
    bos = 1
    docs = [[bos] + torch.randint(2, 64, (n,)).tolist() for n in (9, 14, 20)]
    row = torch.tensor(sum(docs, []))[None, :40]  # (1, 40): the last document runs past the row's end
    x, y = row[:, :-1], row[:, 1:]
    batch = data.with_documents((x, y), bos)
    doc_ids = batch[2]
    assert doc_ids.tolist() == [[1] * 10 + [2] * 15 + [3] * 14]
    with torch.no_grad():
        packed = loss.token_losses(model(x, doc_ids), y, 64, parallel.Mesh())[0]
        unmasked = loss.token_losses(model(x), y, 64, parallel.Mesh())[0]
    start = 0
    for doc in docs:
        alone = torch.tensor(doc[:40 - start])[None]
        n = alone.shape[1] - 1  # targets inside the document (its last input's target is the next BOS)
        with torch.no_grad():
            want = loss.token_losses(model(alone[:, :-1]), alone[:, 1:], 64, parallel.Mesh())[0]
        assert torch.allclose(packed[start:start + n], want, atol=1e-5), doc
        if start:
            assert not torch.allclose(unmasked[start:start + n], want, atol=1e-3)
        start += len(doc)


def test_a_batch_without_a_document_boundary_gets_no_mask(tmp_path, capfd):
    """--doc-mask gives document ids only to a batch where a row has a boundary after its first token:
    elsewhere the plain causal attention is the same, so no mask (nor a mask kernel) is used, and an
    --attn-backend is taken (TinyShakespeare is one document); the run says which kernel each kind of
    batch gets."""
    bos, x = 1, torch.tensor([[1, 5, 6, 7], [8, 9, 10, 11]])  # a document opening a row, one going on
    assert len(data.with_documents((x, x), bos)) == len(data.with_documents((x, x), None)) == 2
    x[1, 2] = bos
    assert data.with_documents((x, x), bos)[2].tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    loader = lambda: data.Loader(data.resolve_data("tinyshakespeare", "byte"), "train", 4, 32,
                                 tokenizer="byte", bos=data.bos_id(data.get_tokenizer("byte")))
    assert all(len(loader().next()) == 2 for _ in range(3))
    train.main(TINY + ["--doc-mask", "--attn-backend", "math", "--max-steps", "2", "--out-dir",
                       str(tmp_path)])
    assert re.search(r"attention math \((flash|math) where documents meet\)", capfd.readouterr().out)


def test_doc_mask_is_on_by_default_for_the_llama_presets_only():
    parse = config.get_parser().parse_args
    assert train.doc_mask_on(parse(["--model", "llama3.2-1b"]))
    assert not train.doc_mask_on(parse([]))
    assert train.doc_mask_on(parse(["--doc-mask"])) and not train.doc_mask_on(
        parse(["--model", "llama3.2-1b", "--no-doc-mask"]))


# ----------------------------------------------------------------------------------------------------
# The batch and sequence-length ramp (--ramp)

# --ramp sets --seq-len and --grad-accum stage by stage: given beside it, they are refused
RAMP_BASE = [f for i, f in enumerate(TINY) if not {f, TINY[i - 1]} & {"--seq-len", "--grad-accum"}]
RAMP = RAMP_BASE + ["--ramp", "0:32x8,512:64x16", "--max-steps", "5"]


def test_the_ramp_of_llama3_405b_steps_as_the_paper_counts():
    """4M tokens of 4,096-token sequences a step until 252M tokens, 8M of 8,192 until 2.87T, then 16M."""
    a, b, c = ramp.parse("0:4096x1024,252M:8192x1024,2.87T:8192x2048")
    assert (a.start, a.seen) == (0, 0)
    assert (b.start, b.seen) == (61, 61 * 4096 * 1024)  # ceil(252M / 4,194,304) = 61 steps
    steps = math.ceil((2.87e12 - b.seen) / (8192 * 1024))
    assert (c.start, c.seen) == (61 + steps, b.seen + steps * 8192 * 1024)
    assert ramp.tokens_before([a, b, c], 62) == b.seen + 8192 * 1024
    assert ramp.parse_count("1.5K") == 1500 and ramp.parse_count("7") == 7


@pytest.mark.parametrize("chunk", [[], ["--loss-chunk", "128"]])
def test_a_run_resumed_across_a_ramp_stage_is_bit_identical(tmp_path, chunk):
    """Two steps of 8 sequences of 32 tokens, then 16 of 64 (4 micro-batches of 4): the logged tokens follow
    the ramp, and a run cut at the stage's first step, or inside the stage, and resumed gives the same
    losses and the same final weights and Adam moments bit for bit. With --loss-chunk 128 the first
    stage's micro-batches (128 tokens) would not need chunks and the second's (256) would: the loss is
    chunked for the whole run, decided once, whichever stage it starts or resumes in."""
    straight = tmp_path / "straight"
    train.main(RAMP + chunk + ["--out-dir", str(straight), "--ckpt-every", "1", "--keep-ckpts", "10"])
    recs = [r for r in records(straight) if "loss" in r]
    assert [r["tokens"] for r in recs] == [256, 512, 1536, 2560, 3584]
    for cut in (2, 3):
        out = tmp_path / f"cut{cut}"
        shutil.copytree(straight, out)
        for d in out.glob("step_*"):
            if int(d.name.split("_")[1]) > cut:
                shutil.rmtree(d)
        (out / "latest").write_text(f"step_{cut:06d}\n")
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(out)
                                                   if r["step"] <= cut))
        train.main(RAMP + chunk + ["--out-dir", str(out), "--ckpt-every", "1", "--keep-ckpts", "10", "--resume"])
        assert [r["loss"] for r in records(out) if "loss" in r] == [r["loss"] for r in recs]
        want, got = final_state(straight), final_state(out)
        assert all(torch.equal(want[k][kk], got[k][kk]) for k in want for kk in want[k]), cut


@pytest.mark.parametrize("flags,env,message", [
    (["--ramp", "10:32x8"], {}, "--ramp must start at 0 tokens; its first stage starts at 10"),
    (["--ramp", "0:32x8,1K:64x8,1K:64x16"], {}, "--ramp stages must be in order of tokens"),
    (["--ramp", "0:32x8,1K:64"], {}, "expected TOKENS:SEQ_LENxSEQUENCES"),
    (["--ramp", "0:32x8,512:64x6"], {}, "6 sequences a step do not divide into micro-batches of 4"),
    (["--ramp", "0:32x8,1M:64x8"], {}, "would start at step 3907, not within the run's --max-steps 5"),
    (["--ramp", "0:32x8", "--anneal-tokens", "100"], {}, "with --ramp, end the run with a last stage"),
    (["--ramp", "0:32x8,512:34x8", "--cp", "2"], {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
     "at --ramp's stage of 34-token sequences: context parallelism needs --seq-len 34 divisible by 2*cp"),
    (["--ramp", "0:32x8", "--seq-len", "64"], {}, "--ramp sets the sequence length and the accumulation stage "
     "by stage: leave out --seq-len 64"),
])
def test_bad_ramps_are_one_line(tmp_path, flags, env, message):
    p = subprocess.run([*multiproc.command(0, REPO / "train.py"), *RAMP_BASE, "--max-steps", "5", *flags,
                        "--out-dir", str(tmp_path / "o")], capture_output=True, text=True, cwd=REPO, timeout=60,
                       env={**os.environ, "RANK": "0", "LOCAL_RANK": "0", **env})
    assert p.returncode == 1 and message in p.stderr, p.stderr[-2000:]
    assert len(error_lines(p.stderr)) == 1 and not (tmp_path / "o").exists()


def test_rope_scaling_is_a_flag_checked_for_sense():
    """The presets keep theirs; the flag sets Llama 3.1's four numbers or none; nonsense is one line."""
    margs = lambda *flags: config.model_args_from(config.get_parser().parse_args(list(flags)), 256)
    assert margs("--model", "llama3.1-8b").rope_scaling == M.LLAMA31_ROPE
    assert margs("--model", "llama3.1-8b", "--rope-scaling", "none").rope_scaling is None
    assert margs("--model", "tiny", "--rope-scaling", "4:1:4:64").rope_scaling == {
        "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 64}
    for bad, message in (("4:4:1:64", "high_freq_factor (1.0) must be larger than low_freq_factor (4.0)"),
                         ("0:1:4:64", "rope_scaling factor must be a positive number"),
                         ("4:1:4", "expected FACTOR:LOW:HIGH:ORIGINAL")):
        with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            margs("--model", "tiny", "--rope-scaling", bad)


def test_with_no_size_flag_a_gpu_run_is_sized_for_the_gpu():
    """The default run is the CPU's (mini, 8 x 128 tokens a step); on a CUDA device with none of the flags
    that size a run given (abbreviated or with '=' alike), it is config.GPU_DEFAULT; one such flag keeps
    every default as it is."""
    parser = config.get_parser()
    parse = lambda argv: (parser.parse_args(argv), config.given_flags(parser, argv))
    args, given = parse(["--out-dir", "o", "--eval-every=0"])
    assert given == {"out_dir", "eval_every"}
    assert config.sized_for_the_device(args, given, "cpu") is None and args.model == "mini"
    line = config.sized_for_the_device(args, given, "cuda")
    assert line.endswith("--model small, --seq-len 256, --micro-batch 64, --lr 0.001, --warmup 60, "
                         "--max-steps 900, --dropout 0.2, --weight-decay 0.5")
    assert (args.model, args.seq_len, args.micro_batch, args.max_steps, args.dropout, args.weight_decay,
            args.out_dir) == ("small", 256, 64, 900, 0.2, 0.5, "o")
    assert set(config.GPU_DEFAULT) <= config.SIZE_FLAGS  # (a value the user gave is never overwritten)
    for argv in (["--micro-b", "4"], ["--model=tiny"], ["--max-steps", "10", "--warmup", "1"],
                 ["--dropout", "0"], ["--weight-decay", "0.1"]):
        args, given = parse(argv)
        before = vars(args).copy()
        assert config.sized_for_the_device(args, given, "cuda") is None and vars(args) == before


@pytest.mark.parametrize("script,nominal", [("train", 100), ("sft", 20), ("dpo", 10), ("reward", 10)])
def test_a_default_warmup_fits_a_short_run_and_a_given_one_is_still_checked(script, nominal):
    """`python train.py --max-steps 20` was refused for a --warmup of 100 the user never gave. A warmup not
    given is at most a tenth of --max-steps (each script's default run keeps its own); one given longer
    than the run is refused, however it is spelled."""
    parser = (config if script == "train" else __import__(script)).get_parser()
    assert config.parse(parser, []).warmup == nominal  # the default runs are as they were
    assert config.parse(parser, ["--max-steps", "20"]).warmup == 2
    assert config.parse(parser, ["--max-steps", "5"]).warmup == 0
    for given in (["--warmup", "30"], ["--warmup=30"], ["--warm", "30"]):
        args = config.parse(parser, ["--max-steps", "20", *given])
        with pytest.raises(config.ConfigError, match="--warmup must be at most --max-steps 20"):
            config.validate(args)


def test_a_short_run_needs_no_other_flag(tmp_path):
    code, stdout, stderr = run_cli("--model", "tiny", "--seq-len", "32", "--max-steps", "3", "--eval-every", "0",
                                   "--eval-batches", "2", "--sample-tokens", "0", "--log-every", "1",
                                   "--out-dir", str(tmp_path))
    assert code == 0, stderr[-2000:]
    assert [r["lr"] for r in records(tmp_path) if "loss" in r][0] == 3e-3  # no warmup: --lr from the start


@pytest.mark.parametrize("chunk", ["0", "64"])
def test_phases_2_and_3_of_a_single_process_step_enter_only_the_model_and_the_loss(tmp_path, monkeypatch, chunk):
    """Followed on one process (tp = cp = pp = 1), with whole logits and with the loss in chunks: from the
    end of phase 1 to the end of phase 3, train_step calls code of model.py and loss.py only (and its own
    scaled_loss), never parallel.py: the step reads without the parallelism chapter."""
    entered, window, real_mark = set(), set(), costs.PhaseTimer.mark

    def trace(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.parent == REPO:
            window.add(path.name)

    def mark(self, phase):  # a window opens after phase 1 or a micro-batch's backward, counts if phase 3 ends it
        sys.settrace(None)
        if phase == "3 loss":
            entered.update(window)
        if phase != "2 forward":
            window.clear()
        real_mark(self, phase)
        if phase in ("1 data", "2 forward", "4 backward"):
            sys.settrace(trace)

    monkeypatch.setattr(costs.PhaseTimer, "mark", mark)
    try:
        train.main(TINY + ["--max-steps", "2", "--loss-chunk", chunk, "--out-dir", str(tmp_path / "o")])
    finally:
        sys.settrace(None)
    assert entered == {"model.py", "loss.py", "train.py"}, entered


@pytest.mark.parametrize("script, argv, shown", [
    ("train", [], "(default: 2400)"), ("bench", [], "(default: 3)"), ("evaluate", [], "(default: "),
    ("rl", ["rollouts"], "replies a prompt (default: 8)"), ("rl", ["sums"], "(default: 300)"),
    ("rl", ["eval"], "the longest reply (default: 64)"), ("reward", ["score"], "(default: 8)"),
    ("reward", ["sample"], "(default: 4)"), ("checkpoint", ["consolidate"], "(default: 1)"),
    ("data", ["prepare"], "held out (default: 0.1)"), ("data", ["download"], "(default: $DATA_MIRROR)")])
def test_help_gives_each_default_once(script, argv, shown, capsys):
    """Every script's --help (subcommands too) gives the defaults there are, once: a flag whose help already
    says its default, or whose default is None or a switch's False, gets no "(default: ...)" appended."""
    main = __import__(script).main
    with pytest.raises(SystemExit) as exit:
        main(argv + ["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: one line of words
    assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"default[^()]*\) \(default:", text), text  # said twice
