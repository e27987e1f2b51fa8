"""Hostile input, as a careless or unlucky user supplies it: every case either works correctly or ends with
one line naming what was refused and why, exit code 1, and nothing on disk lost or half written.

Checkpoints: --overwrite over an older run, step numbers past 999,999, two runs on one --out-dir, a real
write failure mid-checkpoint, a `latest` that points elsewhere, a damaged --init. Data: a failed re-prepare,
a custom tokenizer.model, ids beyond the vocabulary, zero-token shards, an enormous --eval-batches. Flags and
files that must be refused, and messages that must be whole."""

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import chat
import checkpoint
import config
import data
import dpo
import evaluate
import logs
import model as M
import multiproc
import sft
import train
import weights as W

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--lr", "3e-3", "--warmup", "2",
        "--eval-every", "-1", "--log-every", "1", "--sample-tokens", "0"]


def records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def error_line(stderr: str) -> str:
    """The one error line of a refused run (progress lines such as 'already prepared' may precede it)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def refused(capsys, main, argv) -> str:
    """A script's main, run as its command line runs it (config.run): exit code 1 and one error line."""
    with pytest.raises(SystemExit) as stop:
        config.run(main, argv)
    assert stop.value.code == 1
    return error_line(capsys.readouterr().err)


def cli(script, *args, **kwargs):
    return subprocess.run(multiproc.command(0, REPO / script, *args), capture_output=True,
                          text=True, cwd=REPO, timeout=kwargs.pop("timeout", 300), **kwargs)


# ----------------------------------------------------------------------------------------------------
# checkpoints

def test_overwrite_removes_the_old_run_whole(tmp_path):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "20", "--ckpt-every", "10", "--out-dir", str(out)])
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(out), "--overwrite"])
    # the old step_000010 and step_000020 are gone, not rotated in; the new run's two newest remain
    assert sorted(d.name for d in checkpoint.step_dirs(out)) == ["step_000002", "step_000004"]
    assert (out / "latest").read_text().strip() == "step_000004"
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]  # the old run's metrics went with it
    p = cli("train.py", *TINY, "--max-steps", "6", "--out-dir", out, "--resume")
    assert p.returncode == 0 and "at step 4" in p.stdout, p.stderr[-2000:]


def test_rotation_sorts_steps_by_number_and_keeps_the_newest(tmp_path):
    """A run resumed at step 999,999 writes step_1000000 and step_1000001 (--keep-ckpts 1): sorted as names,
    rotation would delete each new checkpoint right after writing it."""
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    old = out / "step_999999"
    (out / "step_000002").rename(old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "step": 999_999}))
    (out / "latest").write_text("step_999999\n")
    train.main(TINY + ["--max-steps", "1000001", "--ckpt-every", "1", "--keep-ckpts", "1", "--out-dir",
                       str(out), "--resume"])
    assert [d.name for d in checkpoint.step_dirs(out)] == ["step_1000001"]
    assert checkpoint.find_latest(out) == (out / "step_1000001", [])


def test_a_dangling_latest_is_said_out_loud(tmp_path):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    (out / "latest").write_text("step_000009\n")
    p = cli("train.py", *TINY, "--max-steps", "3", "--out-dir", out, "--resume")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "checkpoint step_000009 is missing, though `latest` names it; falling back" in p.stdout
    assert "at step 2" in p.stdout


def test_a_second_run_on_the_same_out_dir_is_refused_and_a_stale_lock_taken_over(tmp_path):
    out = tmp_path / "o"
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "--max-steps", "100000",
                              "--ckpt-every", "100000", "--out-dir", str(out)], cwd=REPO,
                              stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(records(out)) >= 2):
        time.sleep(0.2)
    second = cli("train.py", *TINY, "--max-steps", "4", "--out-dir", out, "--overwrite")
    message = error_line(second.stderr)
    assert second.returncode == 1 and f"in use by another run (pid {first.pid} on host" in message
    first.send_signal(signal.SIGTERM)  # the first run is untouched: it stops cleanly with its checkpoint
    stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0 and "stopped by signal SIGTERM" in stdout, stderr[-2000:]
    assert not (out / ".lock").exists()
    # a lock left by a process that is gone (a crash) is taken over, saying so
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    pid = int(dead.stdout)
    (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "since": "x"}))
    p = cli("train.py", *TINY, "--max-steps", "4", "--out-dir", out, "--overwrite")
    assert p.returncode == 0 and f"taken over from pid {pid}" in p.stdout, p.stderr[-2000:]


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))


def test_a_real_write_failure_keeps_the_previous_checkpoint(tmp_path):
    """The child may write no file over 1 MB (RLIMIT_FSIZE): torch.save's writer raises RuntimeError
    ('unexpected pos'), not OSError, as it does when a disk fills up."""
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])  # a shard of this model is ~1.7 MB
    p = cli("train.py", *TINY, "--max-steps", "4", "--ckpt-every", "2", "--out-dir", out, "--resume",
            preexec_fn=_limit_file_size)
    message = error_line(p.stderr)
    assert p.returncode == 1 and "could not write checkpoint" in message and "step_000004" in message
    assert "File too large" in message and "the previous checkpoint (step_000002) is intact" in message
    assert not list(out.glob(".tmp-*")) and checkpoint.find_latest(out) == (out / "step_000002", [])


def test_latest_pointing_outside_the_out_dir_is_refused(tmp_path, capsys):
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "base")])
    out = tmp_path / "o"
    out.mkdir()
    (out / "latest").write_text("../base/step_000002\n")
    message = refused(capsys, train.main, TINY + ["--max-steps", "4", "--out-dir", str(out), "--resume"])
    assert "names '../base/step_000002', which is not a step directory" in message
    assert not (out / "metrics.jsonl").exists()


def flip_a_byte(shard: Path):
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(raw))


def test_init_checks_the_checkpoint_manifest(tmp_path, capsys):
    base = tmp_path / "base"
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(base)])
    flip_a_byte(base / "step_000004" / "shard_pp00_tp00.pt")
    message = refused(capsys, evaluate.main, ["--init", str(base / "step_000004"), "--prompt", "a"])
    assert "checkpoint" in message
    assert "is damaged (shard_pp00_tp00.pt does not match its checksum)" in message
    conversations = tmp_path / "c.jsonl"
    conversations.write_text((json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "hello"}]})
                                                       + "\n") * 10)
    sft_flags = TINY + ["--data", str(conversations), "--val-fraction", "0.2", "--max-steps", "1", "--warmup", "1",
                        "--seq-len", "128", "--micro-batch", "1"]
    message = refused(capsys, sft.main, sft_flags + ["--init", str(base / "step_000004"), "--out-dir",
                                                     str(tmp_path / "s")])
    assert "does not match its checksum" in message
    # an out-dir falls back to its newest intact checkpoint, saying so, as --resume does
    sft.main(sft_flags + ["--init", str(base), "--out-dir", str(tmp_path / "s2")])
    assert ("checkpoint step_000004 is damaged (shard_pp00_tp00.pt does not match its checksum); falling back"
            in capsys.readouterr().out)
    shard = base / "step_000004" / "shard_pp00_tp00.pt"  # a write cut short: torch cannot even open it
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    sft.main(sft_flags + ["--init", str(base), "--out-dir", str(tmp_path / "s3")])
    assert "checkpoint step_000004 is damaged (shard_pp00_tp00.pt has" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- data

def test_a_failed_prepare_leaves_the_prepared_folder_as_it_was(tmp_path):
    prepared = tmp_path / "P"
    assert data.main(["prepare", "--source", "tinyshakespeare", "--out", str(prepared)]) == 0
    before = {f.name: f.read_bytes() for f in prepared.iterdir()}
    for bad in (["--source", "tinyshakespeare", "--val-fraction", "1.5"], ["--source",
                                                                           str(tmp_path / "none.txt")],
                ["--source", "tinyshakespeare", "--shard-tokens", "0"]):
        p = cli("data.py", "prepare", "--out", prepared, *bad, timeout=120)
        assert p.returncode == 1 and error_line(p.stderr), p.stderr
        assert {f.name: f.read_bytes() for f in prepared.iterdir()} == before
    # a good new source replaces the old shards whole: fewer shards leave none of the old behind
    assert data.main(["prepare", "--source", "wiki_demo", "--out", str(prepared), "--shard-tokens",
                      "10000000"]) == 0
    assert sorted(f.name for f in prepared.iterdir()) == ["meta.json", "train_000000.bin", "val_000000.bin"]


def test_a_custom_tokenizer_model_gets_its_own_name_and_cache(tmp_path, mirror):
    lines = (mirror / "llama3" / "tokenizer.model").read_bytes().splitlines()
    same = tmp_path / "reordered.model"  # the official ranks in another order: the same tokenizer
    same.write_bytes(b"\r\n".join(reversed(lines)))
    a, b = lines[279].split(), lines[438].split()  # " the" and "and" swap ranks: another tokenizer
    lines[279], lines[438] = a[0] + b" " + b[1], b[0] + b" " + a[1]
    custom = tmp_path / "custom.model"
    custom.write_bytes(b"\n".join(lines) + b"\n")
    official, mine = data.get_tokenizer("llama3"), data.get_tokenizer(str(custom))
    assert data.get_tokenizer(str(same)).name == official.name == "llama3"
    assert mine.name.startswith("llama3-")
    assert mine.encode_ordinary("and the") != official.encode_ordinary("and the")
    text = tmp_path / "t.txt"
    text.write_text("and the " * 200)
    folders = {data.resolve_data(str(text), tok) for tok in ("llama3", str(custom))}
    assert len(folders) == 2  # not one cache of shards for two encodings


def test_token_ids_beyond_the_vocabulary_are_refused_before_training(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    for split in ("train", "val"):
        data.write_shard(shards / f"{split}_000000.bin", np.arange(2000) % 1000, "byte")  # byte has 268 ids
    (shards / "meta.json").write_text("{}")
    out = tmp_path / "o"
    message = refused(capsys, train.main, TINY + ["--max-steps", "2", "--data", str(shards), "--out-dir",
                                                  str(out)])
    assert "holds token id 999, but the byte tokenizer has 268 ids" in message
    assert not out.exists()


def test_ids_beyond_the_vocabulary_behind_an_intact_header_stop_a_tensor_parallel_run(tmp_path):
    """A shard whose header is intact (its largest id 267, the byte tokenizer's last) but whose tokens hold
    id 300: under --tp 2 the vocab-parallel embedding gave it a zero row and the loss a free target, and
    the run trained on and exited 0. The loader checks the ids it reads, on every layout."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for split in ("train", "val"):
        data.write_shard(shards / f"{split}_000000.bin", np.arange(20_000) % 268, "byte")
    (shards / "meta.json").write_text("{}")
    train_shard = shards / "train_000000.bin"
    tokens = np.memmap(train_shard, dtype="<u2", mode="r+", offset=data.HEADER_BYTES)
    tokens[::20] = 300  # in every window the loader can read (33 tokens)
    tokens.flush()
    del tokens
    assert data.shard_info(train_shard)["max_id"] == 267  # the header says nothing is wrong
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(REPO / "train.py"), *TINY, "--tp", "2", "--max-steps", "3", "--data", str(shards),
                        "--out-dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=240,
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and errors, p.stderr[-3000:]
    refusal = f"{train_shard} holds token id 300, but the byte tokenizer has 268 ids"
    assert all(refusal in line for line in errors)
    assert not checkpoint.step_dirs(tmp_path / "o")


def test_an_enormous_eval_batches_is_one_pass_over_the_validation_split(tmp_path):
    """--eval-batches past the size of the split reads the split once (and a few micro-batches at a time)."""
    flags = TINY + ["--max-steps", "1", "--warmup", "1", "--eval-every", "0", "--ckpt-every", "0",
                    "--micro-batch", "64"]
    p = cli("train.py", *flags, "--out-dir", tmp_path / "a", "--eval-batches", "100000000", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    val = data.Loader(data.resolve_data("tinyshakespeare", "byte"), "val", 64, 32)
    one_pass = -(-len(val) // 64)
    train.main(flags + ["--out-dir", str(tmp_path / "b"), "--eval-batches", str(one_pass)])
    losses = [[r["val_loss"] for r in records(tmp_path / run) if "val_loss" in r] for run in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 1


# ----------------------------------------------------------------------------------------------------
# refusals

@pytest.mark.parametrize("flags,message", [
    (["--min-lr-ratio", "-5"], "--min-lr-ratio must be in [0, 1], got -5.0"),
    (["--beta1", "2"], "--beta1 must be in [0, 1), got 2.0"),
    (["--beta2", "-1"], "--beta2 must be in [0, 1), got -1.0"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--n-heads", "0"], "n_heads must be a positive integer, got 0"),
    (["--n-heads", "-4"], "n_heads must be a positive integer, got -4"),
    (["--dim", "0"], "dim must be a positive integer, got 0"),
    (["--seed", "-1"], "--seed must be in [0, 2^63), got -1"),
    (["--seed", str(10 ** 23)], "--seed must be in [0, 2^63)"),
    (["--dist-timeout", "0"], "--dist-timeout must be a positive number of seconds"),
    (["--device", "foo"], "--device 'foo': use cpu, cuda, cuda:N or mps"),
    (["--pp-layers", "a,b"], "--pp-layers 'a,b': expected the layers of each stage"),
    (["--ckpt-every", "-1"], "--ckpt-every must be at least 0, got -1"),
    (["--eval-every", "-2"], "--eval-every must be -1 (never)"),
    (["--eval-tasks", "piqa,nosuch:10", "--eval-every", "0"],
     "--eval-tasks nosuch: not a benchmark (hellaswag, piqa, arc_easy)"),
    (["--eval-tasks", "piqa:0"], "--eval-tasks 'piqa:0': the number after ':' is how many items, at least 1"),
    (["--skip-spikes", "0.5"], "--skip-spikes must be 0 (off) or a factor above 1"),
    (["--model", "llama3.1-405b"], "model llama3.1-405b (405,853.4M parameters) needs about"),
    (["--virtual-stages", "0"], "--virtual-stages must be at least 1"),
    (["--resume", "--overwrite"], "--resume continues the run in --out-dir and --overwrite deletes it"),
    (["--act-ckpt", "selective", "--compile"], "--act-ckpt selective does not work with --compile"),
    (["--attn-backend", "cudnn"], "--attn-backend cudnn runs on CUDA GPUs only, and this run is on cpu"),
    (["--attn-backend", "efficient"], "--attn-backend efficient runs on CUDA GPUs only, and this run is on cpu"),
    (["--out-dir", ""], "--out-dir '' names no folder"),
    (["--out-dir", "x" * 300], "--out-dir: the name xxxxxxxx"),
    (["--data", "/tmp/" + "y" * 256 + "/a.txt"], "is 256 bytes long; file systems allow 255"),
    # flags that would be accepted and do nothing
    (["--warmup", "5"], "--warmup must be at most --max-steps 2 (a longer warmup never reaches --lr), got 5"),
    (["--eval-tasks", "piqa"], "--eval-tasks piqa is scored at each validation, and --eval-every -1 turns"),
    (["--eval-tasks", "piqa:3,piqa", "--eval-every", "0"], "--eval-tasks names piqa twice"),
    (["--lora-alpha", "4"], "--lora-alpha and --lora-targets shape LoRA's updates: they need --lora-rank R"),
    (["--lora-targets", "wq"], "--lora-alpha and --lora-targets shape LoRA's updates: they need --lora-rank"),
    (["--ramp", "0:32x4"], "--ramp sets the sequence length and the accumulation stage by stage: leave out "
                           "--seq-len 32"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--dropout", "nan"], "--dropout must be in [0, 1), got nan"),
])
def test_bad_flags_are_refused_before_anything_is_written(tmp_path, capsys, flags, message):
    out = tmp_path / "o"
    assert message in refused(capsys, train.main, TINY + ["--max-steps", "2", "--out-dir", str(out), *flags])
    assert not out.exists()


@pytest.mark.parametrize("main,flags,message", [
    (dpo.main, ["--beta", "nan"], "--beta must be > 0"),
    (dpo.main, ["--cp", "2"], "--cp 2: DPO does not support context parallelism"),
    (evaluate.main, ["--prompt", "a", "--temperature", "-1"], "temperature must be >= 0"),
    (evaluate.main, ["--prompt", "a", "--top-p", "0"], "top_p must be in (0, 1]"),
    (evaluate.main, ["--prompt", "a", "--top-k", "0"], "top_k must be at least 1"),
    (evaluate.main, ["--prompt", "a", "--top-k", "-3"], "top_k must be at least 1"),
    (dpo.main, ["--loss", "hinge", "--label-smoothing", "0.1"], "--loss hinge has no use for it"),
    (dpo.main, ["--nll-coef", "-1"], "--nll-coef must be a number >= 0, got -1.0"),
    (dpo.main, ["--dropout", "0.1"], "--dropout 0.1: DPO compares the policy's log-probabilities with"),
    # pretraining's flags, which the fine-tuning recipes would ignore
    (sft.main, ["--doc-mask"], "--doc-mask: fine-tuning gives each example of a row its own document always"),
    (dpo.main, ["--no-doc-mask"], "--no-doc-mask: fine-tuning gives each example"),
    (dpo.main, ["--anneal-data", "c4_demo"], "--anneal-data c4_demo: fine-tuning reads one dataset, --data"),
    (sft.main, ["--ramp", "0:32x8"], "--ramp 0:32x8: --ramp stages pretraining's token stream"),
    (sft.main, ["--val-fraction", "0"], "--val-fraction 0 holds nothing out to validate on: add --eval-every -1"),
    (sft.main, ["--attn-backend", "math"], "this run's is masked in every batch (fine-tuning keeps it within"),
    (evaluate.main, ["--diff", "a", "b", "--task", "piqa"], "--diff compares the weights of two models, --task"),
])
def test_bad_flags_of_the_other_scripts_are_refused(tmp_path, capsys, main, flags, message):
    assert message in refused(capsys, main, ["--init", str(tmp_path), *flags])


def test_sampling_settings_are_checked_by_generate_itself():
    model = M.Transformer(M.ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16))
    for bad in ({"top_p": 0.0}, {"temperature": -1.0}, {"top_k": 0}):
        with pytest.raises(ValueError, match="must be"):
            M.generate(model, [1, 2], 3, **bad)


@contextmanager
def readonly_folder(path: Path):
    """A folder this process cannot write into: chmod where permissions bind; for root, a read-only tmpfs
    mounted at path or, where root may not mount (a container), sysfs's /sys/kernel, in which the kernel
    lets no one create a file."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
    elif subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                        capture_output=True).returncode == 0:
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        yield Path("/sys/kernel")


@pytest.mark.parametrize("case", ["file", "read-only", "latest is a folder", "metrics.jsonl is a folder",
                                  "meta.json wrong types", "manifest not a dict"])
def test_unusable_out_dirs_are_refused_with_one_line(tmp_path, capsys, case):
    out, flags = tmp_path / "o", TINY + ["--max-steps", "4"]
    expected = {"file": "exists and is not a folder", "read-only": "cannot write to --out-dir",
                "latest is a folder": "latest is not a file",
                "metrics.jsonl is a folder": "metrics.jsonl is not a file",
                "meta.json wrong types": "'step' is '2', not an int",
                "manifest not a dict": "'files' is"}[case]
    with ExitStack() as cleanup:
        if case == "file":
            out.write_text("not a folder")
        elif case == "read-only":
            out = cleanup.enter_context(readonly_folder(out))
        elif case.endswith("is a folder"):
            (out / case.split()[0]).mkdir(parents=True)
        else:
            train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
            meta_path = out / "step_000002" / "meta.json"
            meta = json.loads(meta_path.read_text())
            meta.update({"step": "2"} if case == "meta.json wrong types" else {"files": list(meta["files"])})
            meta_path.write_text(json.dumps(meta))
            flags.append("--resume")
        assert expected in refused(capsys, train.main, flags + ["--out-dir", str(out)])


def test_a_fresh_run_does_not_mix_into_an_earlier_runs_metrics(tmp_path, capsys):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--ckpt-every", "0", "--out-dir", str(out)])
    assert "already holds metrics.jsonl of an earlier run" in refused(
        capsys, train.main, TINY + ["--max-steps", "2", "--out-dir", str(out)])
    assert [r["step"] for r in records(out)] == [1, 2]


def test_data_cache_that_is_a_file_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("DATA_CACHE", str(tmp_path / "cache"))
    assert "is not a folder; point DATA_CACHE at a folder" in refused(
        capsys, train.main, TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "o")])


def test_consolidate_and_info_failures_are_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    flip_a_byte(out / "step_000002" / "shard_pp00_tp00.pt")
    for argv, message in ((["consolidate", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "hf")],
                           "no intact checkpoint"),
                          (["consolidate", str(out), "--hf", str(tmp_path / "hf")],
                           "does not match its checksum")):
        assert checkpoint.main(argv) == 1 and message in error_line(capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()
    for argv, message in ((["info", str(tmp_path / "nowhere.bin")], "no file or folder"),
                          (["info", str(tmp_path)], "holds no token shards")):
        assert data.main(argv) == 1 and message in error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------------------------------
# messages

class Exploit:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_refused_pickle_says_what_was_refused_and_why(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({"params": Exploit()}, bad)  # a checkpoint file whose unpickling would run a command
    with pytest.raises(Exception) as refusal:
        torch.load(bad, weights_only=True)
    message = data.one_line(refusal.value)
    assert message.startswith("refused to unpickle it") and "system" in message and "\n" not in message
    assert "weights_only` set to `False`" not in message  # torch's advice to load it unsafely is left out


def test_long_messages_stay_whole():
    assert data.one_line(ValueError("x" * 500 + "\nthe reason")) == "x" * 500 + " the reason"


def test_pretty_printed_json_is_named_as_such(tmp_path):
    pretty = tmp_path / "p.jsonl"
    pretty.write_text(json.dumps({"text": "hello"}, indent=2))
    with pytest.raises(data.DataError, match="one JSON object spread over several lines.*not JSON Lines"):
        data.read_documents(pretty, "jsonl")
    pretty.write_text("\n".join(json.dumps({"instruction": "a", "output": "b"}, indent=2) for _ in range(2)))
    with pytest.raises(data.DataError, match="JSON records spread over several lines"):
        chat.read_sft(str(pretty))


# ----------------------------------------------------------------------------------------------------
# round three: what a later sweep broke, each as a class

CONVERSATION = {"messages": [{"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Blue."}]}
PAIR = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "I will not."}


def jsonl(path: Path, record: dict, n: int = 40) -> Path:
    path.write_text((json.dumps(record) + "\n") * n)
    return path


def losses(out):
    return [(r["step"], r["loss"]) for r in records(out) if "loss" in r]


def test_only_the_manifests_shards_are_read(tmp_path, capsys):
    """A stray file named like a shard, sorting before the real one, holding a zero model: --resume,
    --init, evaluate and consolidate read the manifest's files only, and say the stray is ignored."""
    straight, out = tmp_path / "straight", tmp_path / "o"
    train.main(TINY + ["--max-steps", "4", "--out-dir", str(straight)])
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    step = out / "step_000002"
    real = torch.load(step / "shard_pp00_tp00.pt", weights_only=True)
    zeros = {**real, "params": {name: {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
                                       for k, v in e.items()} for name, e in real["params"].items()}}
    stray = step / "shard_pp00_tp0.pt"
    torch.save(zeros, stray)
    assert sorted(f.name for f in step.glob("shard_pp*_tp*.pt"))[0] == stray.name  # read first, once
    full, _ = checkpoint.read_full_state(step)
    assert all(torch.equal(full[n]["master"], e["master"]) for n, e in real["params"].items())
    capsys.readouterr()
    train.main(TINY + ["--max-steps", "4", "--out-dir", str(out), "--resume"])
    said = capsys.readouterr().out
    assert "shard_pp00_tp0.pt not in its manifest: ignored" in said
    assert losses(out) == losses(straight)  # the run went on from the real weights, bit for bit
    assert checkpoint.main(["consolidate", str(step), "--hf", str(tmp_path / "hf")]) == 0
    hf = W.read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["lm_head.weight"], real["params"]["output.weight"]["master"])


def test_overwrite_never_deletes_what_the_run_reads(tmp_path, capsys):
    """sft.py --init X --out-dir X --overwrite deleted the model it was to start from, then exited 0."""
    base = tmp_path / "base"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(base)])
    before = checkpoint.find_latest(base)
    sft_flags = TINY + ["--data", str(jsonl(tmp_path / "c.jsonl", CONVERSATION)), "--val-fraction", "0.2",
                        "--max-steps", "1", "--warmup", "1", "--seq-len", "64"]
    for init in (base, base / "step_000002"):
        message = refused(capsys, sft.main, sft_flags + ["--init", str(init), "--out-dir", str(base),
                                                         "--overwrite"])
        assert f"--overwrite would delete what --init {init} reads" in message
    inside = base / "data.txt"
    inside.write_text("to be or not to be " * 500)
    message = refused(capsys, train.main, TINY + ["--max-steps", "2", "--data", str(inside), "--out-dir",
                                                  str(base), "--overwrite"])
    assert "--overwrite would delete what --data" in message
    assert checkpoint.find_latest(base) == before and checkpoint.damage(before[0]) is None


def test_resume_continues_only_its_own_recipe_on_its_own_data(tmp_path, capsys):
    """dpo.py --resume in an SFT run's out-dir went on with SFT's optimizer state and step count; train.py
    --resume with another --data went on at the old position in other data."""
    base = tmp_path / "base"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(base)])
    message = refused(capsys, train.main, TINY + ["--max-steps", "4", "--out-dir", str(base), "--resume",
                                                  "--data", "wiki_demo"])
    assert "was trained on other data (--data 'tinyshakespeare' then, 'wiki_demo' now" in message
    s = tmp_path / "s"
    sft_flags = ["--val-fraction", "0.2", "--seq-len", "64", "--init", str(base), "--out-dir", str(s)]
    sft.main(TINY + sft_flags + ["--data", str(jsonl(tmp_path / "c.jsonl", CONVERSATION)),
                                 "--max-steps", "1", "--warmup", "1"])
    dpo_flags = TINY + sft_flags + ["--data", str(jsonl(tmp_path / "p.jsonl", PAIR)), "--max-steps", "2",
                                    "--resume"]
    message = refused(capsys, dpo.main, dpo_flags)
    assert "was written by sft.py (sft); dpo.py --resume would continue it as dpo" in message
    meta_path = s / "step_000001" / "meta.json"  # a checkpoint from before the recipe was recorded
    meta = json.loads(meta_path.read_text())
    del meta["recipe"], meta["data"]
    meta_path.write_text(json.dumps(meta))
    assert "was written by sft.py" in refused(capsys, dpo.main, dpo_flags)
    assert [r["step"] for r in records(s) if "loss" in r] == [1]  # nothing was added to the SFT run


def test_init_keeps_its_shape_and_takes_a_rope_scaling(tmp_path, capsys):
    """--init gives the model; a shape flag beside it was ignored (refused now), and --rope-scaling, which
    changes no weight, takes effect: the context grows to factor x original, recorded in the checkpoint."""
    base = tmp_path / "base"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(base)])  # tiny: max_seq_len 256
    flags = TINY + ["--init", str(base), "--data", str(jsonl(tmp_path / "c.jsonl", CONVERSATION)),
                    "--val-fraction", "0", "--max-steps", "1", "--warmup", "1", "--micro-batch", "1"]
    for shape in (["--dim", "32"], ["--n-layers", "3"], ["--vocab-size", "512"]):
        message = refused(capsys, sft.main, flags + shape + ["--out-dir", str(tmp_path / "s")])
        assert f"{shape[0]}: the model's shape is --init {base}'s; leave the shape flags out" in message
    assert not (tmp_path / "s").exists()
    sft.main(flags + ["--rope-scaling", "4:1:4:256", "--seq-len", "512", "--out-dir", str(tmp_path / "s")])
    saved = json.loads((tmp_path / "s" / "step_000001" / "meta.json").read_text())["model_args"]
    assert saved["max_seq_len"] == 1024 and saved["rope_scaling"] == {
        "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 256}


def test_trace_step_before_a_resumed_runs_first_step_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    before = (out / "metrics.jsonl").read_bytes()
    message = refused(capsys, train.main, TINY + ["--max-steps", "4", "--out-dir", str(out), "--resume",
                                                  "--trace-step", "2"])
    assert "--trace-step 2: this run resumes after step 2; trace one of the steps it will run" in message
    assert (out / "metrics.jsonl").read_bytes() == before and not list(out.glob("trace_*"))


def test_a_start_that_failed_before_its_first_step_does_not_block_the_rerun(tmp_path):
    """A run that stopped before its first step left an empty metrics.jsonl, and the corrected rerun was
    refused as if an earlier run were there; a log with records still is one."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_bytes(b"")
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    assert [r["step"] for r in records(out)] == [1, 2]
    assert checkpoint.earlier_run(out) == "checkpoint step_000002"
    shutil.rmtree(out / "step_000002")
    (out / "latest").unlink()
    assert checkpoint.earlier_run(out) == "metrics.jsonl"


def test_diff_compares_shapes_however_the_ffn_is_spelled(tmp_path):
    """A checkpoint (the preset's FFN rule) and its own export (an explicit intermediate_size) are one model."""
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "o")])
    checkpoint.main(["consolidate", str(tmp_path / "o"), "--hf", str(tmp_path / "hf")])
    r = evaluate.weight_diff(tmp_path / "o", tmp_path / "hf")
    assert all(v["relative_change"] == 0 for v in r["params"].values())


def test_a_file_in_a_step_folders_place_is_replaced_and_failures_name_the_real_checkpoint(tmp_path,
                                                                                          monkeypatch):
    """After --resume fell back past a damaged step_000004 (here a file where the folder was), a failed
    save named that junk as "intact"; saving step 4 again must replace whatever is under its name."""
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(out)])
    shutil.rmtree(out / "step_000004")
    (out / "step_000004").write_text("junk")
    real, calls = torch.save, [0]

    def full_disk(*a, **k):
        calls[0] += 1
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as failed:
        train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(out), "--resume"])
    assert "the previous checkpoint (step_000002) is intact" in str(failed.value) and calls[0] == 1
    monkeypatch.setattr(torch, "save", real)
    train.main(TINY + ["--max-steps", "6", "--ckpt-every", "2", "--out-dir", str(out), "--resume"])
    assert checkpoint.find_latest(out) == (out / "step_000006", [])
    assert (out / "step_000004").is_dir() and checkpoint.damage(out / "step_000004") is None


def test_a_full_disk_under_the_log_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """Some file systems report a full disk only when data is flushed to them: metrics.jsonl is fsynced
    record by record, and the first failure stops the run at the next step, with a checkpoint and one line
    (here fsync fails for metrics.jsonl from step 3's record on, as it does on such a disk)."""
    out, real = tmp_path / "o", os.fsync
    full = {"now": False}

    def fsync(fd):
        if full["now"] and os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    real_step = logs.Meter.step

    def step(self, n, result):
        full["now"] = n >= 3
        return real_step(self, n, result)
    monkeypatch.setattr(logs.Meter, "step", step)
    message = refused(capsys, train.main, TINY + ["--max-steps", "20", "--ckpt-every", "100", "--out-dir",
                                                  str(out)])
    assert "stopped after step 4: cannot write" in message and "metrics.jsonl" in message
    assert "No space left on device" in message and "checkpoint step_000004 written" in message
    assert [r["step"] for r in records(out)] == [1, 2]  # whole records only: step 3's was cut off
    monkeypatch.undo()
    train.main(TINY + ["--max-steps", "6", "--out-dir", str(out), "--resume"])
    assert [r["step"] for r in records(out)] == [1, 2, 5, 6]


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "folder"])
def test_a_fifo_in_a_shards_place_is_refused_not_waited_on(tmp_path, make):
    """A FIFO would block open() forever; a folder would raise IsADirectoryError: both are damage, and the
    run goes on from the step before."""
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(out)])
    shard = out / "step_000004" / "shard_pp00_tp00.pt"
    shard.unlink()
    make(shard)
    p = cli("train.py", *TINY, "--max-steps", "5", "--out-dir", out, "--resume", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "checkpoint step_000004 is damaged (shard_pp00_tp00.pt is not a regular file)" in p.stdout
    assert "at step 2" in p.stdout


def test_an_interrupted_consolidate_leaves_no_half_model(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])

    def half_then_full(tensors, path):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(W, "write_safetensors", half_then_full)
    assert checkpoint.main(["consolidate", str(out), "--hf", str(tmp_path / "hf")]) == 1
    assert "No space left on device" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no model folder, half or whole


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
    ({"WORLD_SIZE": "2"}, "do not name a process of a job"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "do not name a process of a job"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "needs MASTER_ADDR (a host) and MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "99999"},
     "needs MASTER_ADDR (a host) and MASTER_PORT (1-65535)"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"},
     "MASTER_ADDR='no-such-host.invalid' is not a host this machine can find"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_RANK=0 and LOCAL_WORLD_SIZE=0 do not name a process of this node"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 and LOCAL_WORLD_SIZE=2 do not name a process"),
])
def test_a_process_not_started_as_part_of_a_job_says_so(tmp_path, capsys, monkeypatch, env, message):
    """(LOCAL_WORLD_SIZE=0 was a ZeroDivisionError in the memory check.)"""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refused(capsys, train.main, TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "o")])
    assert "cannot join the job" in line and message in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case,expected", [
    ("negative consumed", "the loader's 'consumed' is not a count"),
    ("unknown model args", "model args have unknown keys 'sliding_window'"),
    ("meta.json nested too deep", "meta.json unreadable: RecursionError"),
])
def test_a_tampered_meta_json_is_one_line(tmp_path, capsys, case, expected):
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    path = out / "step_000002" / "meta.json"
    meta = json.loads(path.read_text())
    if case == "negative consumed":
        meta["loader"]["consumed"] = -8
    elif case == "unknown model args":
        meta["model_args"]["sliding_window"] = 4096
    path.write_text("[" * 100_000 + "]" * 100_000 if case.endswith("too deep") else json.dumps(meta))
    assert expected in refused(capsys, train.main, TINY + ["--max-steps", "4", "--out-dir", str(out),
                                                           "--resume"])
    if case == "unknown model args":  # the same line wherever the checkpoint is read
        assert expected in refused(capsys, evaluate.main, ["--init", str(out), "--prompt", "a"])
        assert checkpoint.main(["consolidate", str(out), "--hf", str(tmp_path / "hf")]) == 1
        assert expected in error_line(capsys.readouterr().err)


def tiny_weight_folders(tmp_path) -> dict[str, Path]:
    """A tiny model as a Hugging Face folder and as a Meta folder (params.json, consolidated.00.pth)."""
    margs = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                        max_seq_len=128)
    model = M.Transformer(margs)
    W.save_hf(model, tmp_path / "hf")
    (tmp_path / "meta").mkdir()
    torch.save(model.state_dict(), tmp_path / "meta" / "consolidated.00.pth")  # (values unused here)
    (tmp_path / "meta" / "params.json").write_text(json.dumps(dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, norm_eps=1e-5)))
    return {"hf": tmp_path / "hf", "meta": tmp_path / "meta"}


@pytest.mark.parametrize("fmt,name", [("hf", "model.safetensors"), ("hf", "config.json"),
                                      ("meta", "consolidated.00.pth"), ("meta", "params.json")])
def test_a_weight_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, fmt, name):
    """Every reader of a Hugging Face or Meta folder (--init, evaluate.py, consolidate) waited forever on a
    FIFO in a weight file's place, as it once did on a token shard: open() blocks until a writer comes. It
    is one line now, naming the file and what it is."""
    folder = tiny_weight_folders(tmp_path)[fmt]
    (folder / name).unlink()
    os.mkfifo(folder / name)
    outcome = []

    def read():
        try:
            checkpoint.load_init(folder, None)
        except checkpoint.CheckpointError as e:
            outcome.append(str(e))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # let the stuck reader go (a writer that closes at once: it reads end of file)
        os.close(os.open(folder / name, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome and f"{folder / name} is a FIFO (named pipe), not a regular file" in outcome[0], outcome


RANK_1_DIFFERS = """
import os, sys
sys.path.insert(0, {repo!r})
import config, train
argv = sys.argv[1:]
if os.environ["RANK"] == "1":  # a multi-node launch: each node its own command line
    argv += {extra!r}  # (given last, these win)
config.run(train.main, argv)
"""


@pytest.mark.parametrize("extra,layout,message", [
    (["--micro-batch", "2"], [], "differ in --micro-batch: 4 on rank 0 and 2 on rank 1"),
    (["--lr", "1e-3"], [], "differ in --lr: 0.003 on rank 0 and 0.001 on rank 1"),
    (["--tp", "2"], [], "differ in --tp: 1 on rank 0 and 2 on rank 1"),
    (["--data", "OTHER"], ["--tp", "2"], "differ in the data's contents (their fingerprint)"),
    (["--data", "SAME"], ["--tp", "2"], None)])
def test_ranks_launched_with_different_settings_are_refused(tmp_path, extra, layout, message):
    """torchrun gives every rank one command, but a multi-node launch runs one per node: a rank given another
    micro-batch trained and logged the others' batch, one given another --lr drifted from its replica, a tp
    pair on different data trained on a mixture of both. Every rank's run-shaping flags, and what its data
    holds, are compared at start-up; a path that differs while the contents agree is fine."""
    source = tmp_path / "a.txt"
    source.write_text("To be, or not to be, that is the question.\n" * 400)
    (tmp_path / "b").mkdir()
    extra = [{"OTHER": str(tmp_path / "other.txt"), "SAME": str(tmp_path / "b" / "a.txt")}.get(x, x) for x in extra]
    (tmp_path / "other.txt").write_text("Now is the winter of our discontent.\n" * 400)
    shutil.copy(source, tmp_path / "b" / "a.txt")
    script = tmp_path / "per_node.py"
    script.write_text(RANK_1_DIFFERS.format(repo=str(REPO), extra=extra))
    out = tmp_path / "o"
    p = subprocess.run(multiproc.command(2, script, *TINY, *layout, "--data", source, "--max-steps", "2",
                                         "--out-dir", out), capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if message is None:
        assert p.returncode == 0, p.stderr[-3000:]
        return
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert p.returncode != 0 and len(errors) == 1 and message in errors[0], p.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists() or not records(out)  # nothing trained


@pytest.mark.parametrize("main,flags,message", [
    (train.main, ["--ramp", "0:128x8", "--seq-len", "128"], "leave out --seq-len 128"),
    (train.main, ["--ramp", "0:128x8", "--grad-accum", "1"], "leave out --grad-accum 1"),
    (sft.main, ["--lora-targets", ",".join(M.LORA_TARGETS)], "--lora-targets shape LoRA's updates: they need "
                                                              "--lora-rank R"),
])
def test_a_flag_given_at_its_default_value_is_still_given(tmp_path, capsys, main, flags, message):
    """Whether a flag was given was decided by comparing its value with the default: --ramp beside an
    explicit --seq-len 128 or --grad-accum 1 replaced them without a word, and --lora-targets spelled as its
    default list without --lora-rank ran a full fine-tune. Given is given, whatever the value."""
    out = tmp_path / "o"
    assert message in refused(capsys, main, ["--model", "tiny", "--max-steps", "2", "--out-dir", str(out), *flags])
    assert not out.exists()


def test_the_memory_check_names_the_init_model(tmp_path, capsys, monkeypatch):
    """sft.py, dpo.py and rl.py's memory refusal named the default --model ("model mini needs about ..."),
    not the model --init holds: it names --init and that model's size."""
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "base")])
    import costs
    monkeypatch.setattr(costs, "available_memory", lambda device: 1e6)
    message = refused(capsys, sft.main, ["--init", str(tmp_path / "base"), "--max-steps", "2", "--out-dir",
                                         str(tmp_path / "o")])
    assert message.startswith(f"error: --init {tmp_path / 'base'} (") and "M parameters) needs about" in message
    assert "model mini" not in message


def test_two_exports_into_one_new_folder_do_not_both_succeed(tmp_path, capsys, monkeypatch):
    """Two `consolidate --hf` into one new folder at once: both printed success while the folder held the
    second export. The second to finish now finds the first's folder there, leaves it, and says so."""
    out, hf = tmp_path / "o", tmp_path / "hf"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    real = W.write_safetensors

    def the_other_export_lands_first(tensors, path):
        hf.mkdir()
        (hf / "config.json").write_text('{"the other": "export"}')
        return real(tensors, path)
    monkeypatch.setattr(W, "write_safetensors", the_other_export_lands_first)
    assert checkpoint.main(["consolidate", str(out), "--hf", str(hf)]) == 1
    assert "appeared while this export was written" in error_line(capsys.readouterr().err)
    assert [p.name for p in hf.iterdir()] == ["config.json"] and "the other" in (hf / "config.json").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_one_file_of_eval_tasks_under_two_spellings_is_named_twice(tmp_path, monkeypatch):
    """`--eval-tasks mc.jsonl,./mc.jsonl` scored one file twice, under two names."""
    (tmp_path / "mc.jsonl").write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "mc.jsonl")
    monkeypatch.chdir(tmp_path)
    for spec in ("mc.jsonl,./mc.jsonl", f"mc.jsonl,{tmp_path}/mc.jsonl", "mc.jsonl:5,link.jsonl"):
        with pytest.raises(config.ConfigError, match=r"--eval-tasks names mc.jsonl and .*, one file, twice"):
            config.eval_tasks(spec)
    assert config.eval_tasks("mc.jsonl,piqa:3") == [("mc.jsonl", None), ("piqa", 3)]


def test_resuming_another_model_says_which_flags_shaped_the_checkpoint(tmp_path, capsys):
    """`train.py --resume --max-steps 4000` after a GPU-default run dropped the GPU default (--max-steps sizes
    a run) and was refused as "another model" with no word why: the refusal names the checkpoint's flags."""
    out = tmp_path / "o"
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(out)])
    message = refused(capsys, train.main, ["--max-steps", "4", "--resume", "--out-dir", str(out)])
    assert "is for another model" in message and "it was trained with --model tiny --seq-len 32 --micro-batch 4, " \
                                                  "this run has --model mini: repeat the flags" in message
