"""Fault tolerance: preemption, numerical faults, storage faults, malicious checkpoints, determinism. Each
test breaks something on purpose and checks that the run keeps (or refuses to touch) the last good state."""

import errno
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import checkpoint
import config
import data
import loss
import multiproc
import optim as O
import parallel
import launch
import train

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--lr", "3e-3", "--warmup", "2",
        "--eval-every", "-1", "--log-every", "1", "--sample-tokens", "0"]


def records(out):
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def masters(out):
    d, _ = checkpoint.find_latest(Path(out))
    return {k: v["master"] for k, v in checkpoint.read_full_state(d)[0].items()}


CONVERSATION = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant",
                                                                             "content": "Blue."}]}
PAIR = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "I will not."}


@pytest.mark.parametrize("script,record", [("train.py", None), ("sft.py", CONVERSATION), ("dpo.py", PAIR)])
def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path, script, record):
    """Every script that trains: SIGTERM mid-run -> the step finishes, a checkpoint, exit 0; --resume
    goes on."""
    out, flags = tmp_path / "o", list(TINY)
    if record is not None:  # sft.py / dpo.py: a small dataset of their own kind
        (tmp_path / "d.jsonl").write_text((json.dumps(record) + "\n") * 40)
        flags += ["--data", str(tmp_path / "d.jsonl"), "--val-fraction", "0.1", "--seq-len", "64"]
    p = subprocess.Popen([sys.executable, str(REPO / script), *flags, "--max-steps", "100000",
                          "--ckpt-every", "100000", "--out-dir", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(records(out)) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr[-2000:]
    assert "stopped by signal SIGTERM" in stdout
    last = records(out)[-1]["step"]
    assert (out / "latest").read_text().strip() == f"step_{last:06d}"
    code = subprocess.run([*multiproc.command(0, REPO / script), *flags, "--max-steps", str(last + 2),
                           "--out-dir", str(out), "--resume"], cwd=REPO, capture_output=True, text=True)
    assert code.returncode == 0, code.stderr[-2000:]
    assert [r["step"] for r in records(out) if "loss" in r][-2:] == [last + 1, last + 2]


def inject_nan(monkeypatch, calls: set):
    """Make the micro-batch losses numbered in `calls` (1-based) NaN."""
    real, n = loss.LMTask.loss, [0]

    def nan_loss(self, logits, targets, total):
        n[0] += 1
        out = real(self, logits, targets, total)
        return out * float("nan") if n[0] in calls else out
    monkeypatch.setattr(loss.LMTask, "loss", nan_loss)


def test_nan_loss_skips_the_step_and_leaves_nothing_changed(tmp_path, monkeypatch):
    train.main(TINY + ["--max-steps", "6", "--out-dir", str(tmp_path / "clean")])
    inject_nan(monkeypatch, {3})
    train.main(TINY + ["--max-steps", "6", "--out-dir", str(tmp_path / "nan")])
    recs = records(tmp_path / "nan")
    assert [r["step"] for r in recs if "skipped" in r] == [3]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # weights, optimizer state and loader position were untouched by the bad step, and the same batch was
    # retried: the run ends exactly where the clean one does
    assert [r["loss"] for r in recs if "loss" in r] == [r["loss"] for r in records(tmp_path / "clean")]
    wa, wb = masters(tmp_path / "clean"), masters(tmp_path / "nan")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_consecutive_bad_steps_stop_the_run(tmp_path, monkeypatch):
    inject_nan(monkeypatch, set(range(3, 100)))
    with pytest.raises(train.TrainingError, match="3 consecutive steps skipped"):
        train.main(TINY + ["--max-steps", "10", "--max-skips", "3", "--ckpt-every", "2", "--out-dir",
                           str(tmp_path)])
    assert checkpoint.find_latest(tmp_path)[0].name == "step_000002"  # the last good checkpoint
    # with none written yet, the line does not promise one
    with pytest.raises(train.TrainingError, match="no checkpoint was written") as stop:
        train.main(TINY + ["--max-steps", "10", "--max-skips", "3", "--out-dir", str(tmp_path / "none")])
    assert "intact" not in str(stop.value) and not checkpoint.step_dirs(tmp_path / "none")


def test_loss_spike_guard_skips_outliers(tmp_path, monkeypatch):
    real, n = loss.LMTask.loss, [0]

    def spiked_loss(self, logits, targets, total):
        n[0] += 1
        return real(self, logits, targets, total) * (50.0 if n[0] == 15 else 1.0)
    monkeypatch.setattr(loss.LMTask, "loss", spiked_loss)
    train.main(TINY + ["--max-steps", "16", "--skip-spikes", "3", "--out-dir", str(tmp_path)])
    skipped = [r for r in records(tmp_path) if "skipped" in r]
    assert [r["step"] for r in skipped] == [15] and "loss spike" in skipped[0]["skipped"]


@pytest.mark.parametrize("when", ["before", "after"])
def test_nan_gradient_on_one_rank_makes_every_rank_skip(tmp_path, when):
    script = tmp_path / "nan_rank.py"
    # "before": rank 1's local gradients go bad before the all-reduce (it spreads the NaN to every rank);
    # "after": only rank 1's copy of the reduced gradients goes bad (a fault after communication)
    method = "start" if when == "before" else "finish"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import config, train, zero as Z
        real, calls = Z.GradSync.{method}, [0]
        def patched(self):
            real(self)
            calls[0] += 1
            if self.mesh.rank == 1 and calls[0] == 2:  # step 2
                self.opt.grad[0] = float("nan")
        Z.GradSync.{method} = patched
        config.run(train.main, sys.argv[1:])
    """))
    common = [*TINY, "--max-steps", "4", "--grad-accum", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, cmd in (("nan", [str(script)]), ("clean", [str(REPO / "train.py")])):
        p = subprocess.run(multiproc.command(2, *cmd, *common, "--out-dir", tmp_path / name), capture_output=True,
                           text=True, env=env, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path / "nan") if "skipped" in r] == [2]
    wa, wb = masters(tmp_path / "nan"), masters(tmp_path / "clean")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # both ranks skipped the same step, then went on alike


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    real, n = torch.save, [0]

    def full_disk(obj, f, *a, **k):
        n[0] += 1
        if n[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device.*step_000002.*intact"):
        train.main(TINY + ["--max-steps", "6", "--ckpt-every", "2", "--out-dir", str(tmp_path)])
    assert checkpoint.find_latest(tmp_path) == (tmp_path / "step_000002", [])
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_shard_is_detected_and_resume_falls_back(tmp_path):
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(tmp_path)])
    shard = tmp_path / "step_000004" / "shard_pp00_tp00.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    p = subprocess.run([*multiproc.command(0, REPO / "train.py"), *TINY, "--max-steps", "6", "--out-dir",
                        str(tmp_path), "--resume"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "checkpoint step_000004 is damaged (shard_pp00_tp00.pt has 1,000 bytes" in p.stdout
    assert "resumed from" in p.stdout and "at step 2" in p.stdout


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_is_refused_without_running_it(tmp_path):
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(tmp_path)])
    d = tmp_path / "step_000002"
    marker = tmp_path / "pwned"
    shard = d / "shard_pp00_tp00.pt"
    shard.write_bytes(pickle.dumps({"params": Exploit(marker)}))
    meta = json.loads((d / "meta.json").read_text())  # an attacker can rewrite the manifest too
    meta["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": data.sha256_file(shard)}
    (d / "meta.json").write_text(json.dumps(meta))
    p = subprocess.run([*multiproc.command(0, REPO / "train.py"), *TINY, "--max-steps", "4", "--out-dir",
                        str(tmp_path), "--resume"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 1 and "cannot read checkpoint" in p.stderr
    assert not marker.exists()  # weights_only=True refused the pickle before anything ran


def test_deterministic_flag_gives_identical_runs(tmp_path):
    """Fresh processes, as a user runs them: the flag's kernel pinning only acts before the first matmul."""
    for name in ("a", "b"):
        p = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, "--max-steps", "5",
                            "--deterministic",
                            "--out-dir", str(tmp_path / name)], capture_output=True, text=True, cwd=REPO)
        assert p.returncode == 0 and "--deterministic: " in p.stdout, p.stderr[-2000:]
    assert [r["loss"] for r in records(tmp_path / "a")] == [r["loss"] for r in records(tmp_path / "b")]


SHAPE = r"\(\d+(, \d+)*,?\)"


@pytest.mark.parametrize("layout,failure", [
    (["--grad-accum", "1"], rf"all_reduce of {SHAPE} on the dp group \(global ranks \[0, 1\]\)"),
    # (the cross-entropy's first collective: the ranks' log-sum-exps, gathered)
    (["--tp", "2"], rf"all_gather of {SHAPE} on the tp group \(global ranks \[0, 1\]\)"),
    (["--pp", "2", "--grad-accum", "2"],  # 1F1B's steady state posts a send and a receive together
     r"pipeline (send to stage 1, )?recv from stage 1 on the pp group \(global ranks \[0, 1\]\)"),
])
def test_stalled_rank_makes_the_others_fail_naming_the_collective(tmp_path, layout, failure):
    """Rank 1 sleeps inside its third loss computation. Rank 0 blocks in the next collective that needs
    rank 1 and, --dist-timeout 5 s later, fails with one line naming the op and the group; the job ends."""
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import config, loss, train
        real, n = loss.LMTask.loss, [0]
        def stalled_loss(self, logits, targets, total):
            n[0] += 1
            if self.mesh.rank == 1 and n[0] == 3:
                # A rank stuck in native code runs no Python signal handler, so torchrun's SIGTERM reaches
                # it only as its SIGKILL 30 s later; the default action stands in for that wait here.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(600)
            return real(self, logits, targets, total)
        loss.LMTask.loss = stalled_loss
        config.run(train.main, sys.argv[1:])
    """))
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), *TINY, *layout, "--max-steps", "20", "--dist-timeout", "5",
                        "--out-dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0 and time.time() - t0 < 120
    errors = [l for l in p.stderr.splitlines() if l.startswith("error (rank 0): ")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert re.search(failure, errors[0]), errors[0]
    seconds = float(errors[0].split("failed on rank 0 after ")[1].split(" s")[0])
    assert 4.5 <= seconds < 15 and "--dist-timeout 5 s" in errors[0] and "stalled" in errors[0]


def test_a_second_signal_interrupts_at_once():
    """The first SIGTERM/SIGINT asks for a clean stop at the end of the step; a copy of it arriving at
    once (scheduler and torchrun both signal) changes nothing; a second one 2 s later will not wait. When
    the run ends, the process's handlers are the ones it had before."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = launch.StopFlag()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.signal == "SIGTERM"
        time.sleep(2.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here, at once
    finally:
        stop.release()
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("script,good", [
    ("train.py", {"text": "To be, or not to be."}),
    ("sft.py", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
    ("dpo.py", {"prompt": "hi", "chosen": "hello", "rejected": "go away"}),
])
def test_malformed_jsonl_names_its_line_in_every_training_script(tmp_path, script, good):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20] + "\n")
    p = subprocess.run([*multiproc.command(0, REPO / script), "--model", "tiny", "--data", str(bad),
                        "--max-steps", "2", "--warmup", "1", "--out-dir", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=REPO)
    errors = [l for l in p.stderr.splitlines() if l.startswith("error")]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(errors) == 1 and f"{bad}:2: malformed JSON" in errors[0], p.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_fp16_loss_scale_overflows_do_not_stop_the_run(tmp_path, monkeypatch):
    """Starting from a loss scale far too large, the first steps overflow while the scaler halves it: that is
    its normal search, not a run going bad, so --max-skips does not end the run."""
    real_init = O.LossScaler.__init__
    monkeypatch.setattr(O.LossScaler, "__init__", lambda self: real_init(self, init_scale=2.0 ** 24))
    train.main(TINY + ["--max-steps", "4", "--max-skips", "3", "--precision", "fp16", "--out-dir",
                       str(tmp_path)])
    rows = records(tmp_path)
    overflows = [r for r in rows if "fp16 gradient overflow" in r.get("skipped", "")]
    assert len(overflows) > 3 and [r["step"] for r in rows if "loss" in r][-1] == 4


@pytest.mark.parametrize("io_timeout", [60, 3])
def test_long_disk_work_is_bounded_by_the_io_timeout_not_the_collective_one(tmp_path, io_timeout):
    """Rank 0 takes 6 s to prepare the data, 6 s to delete an earlier run (--overwrite), 6 s to write its
    checkpoint shard (in the background) and 6 s to delete old checkpoints (rotation), while rank 1, with
    nothing to do, waits for it: longer than --dist-timeout 3, which bounds a collective, and within --io-timeout, which bounds
    waits for disk work (deleting a TB-sized run on a parallel file system takes minutes). With
    --io-timeout 3 the wait fails, naming it."""
    script = tmp_path / "slow_disk.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import checkpoint, config, data, parallel, train
        slow = lambda real: (lambda *a, **k: (time.sleep(6) if os.environ["RANK"] == "0" else None,
                                              real(*a, **k))[1])
        data.resolve_data = slow(data.resolve_data)
        checkpoint.write_shard = slow(checkpoint.write_shard)
        checkpoint.clear_run, checkpoint.rotate = slow(checkpoint.clear_run), slow(checkpoint.rotate)
        config.run(train.main, sys.argv[1:])
    """))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), *TINY, "--max-steps", "2", "--ckpt-every", "2", "--dist-timeout", "3",
                        "--io-timeout", str(io_timeout), "--out-dir", str(tmp_path / "o"), "--overwrite"],
                       capture_output=True, text=True, timeout=240, env={**os.environ,
                                                                         "OMP_NUM_THREADS": "1"})
    if io_timeout == 60:
        assert p.returncode == 0, p.stderr[-3000:]
        assert checkpoint.find_latest(tmp_path / "o")[0].name == "step_000002"
    else:
        errors = [l for l in p.stderr.splitlines() if l.startswith("error (rank 1): ")]
        assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
        assert "barrier on the io group (global ranks [0, 1])" in errors[0]
        assert "--io-timeout 3 s" in errors[0]


def test_writers_hash_their_own_shards_and_the_ranks_share_a_resumes_checks(tmp_path, monkeypatch):
    """Saving: no rank reads a shard back to hash it (at 70B that is hundreds of GB, while the others
    wait). Resuming: each shard is hashed once, by one rank, the ranks sharing the files (405B's ~4.9 TB
    hashed by one rank would take longer than --io-timeout): one shard under 2 processes is rank 0's;
    a tp 2 checkpoint's two shards are one each."""
    real = data.sha256_file
    def no_reading_back(path):  # downloads are still hashed: only a checkpoint's shards must not be
        assert not Path(path).name.startswith("shard_"), f"{path} was read back to hash it"
        return real(path)
    monkeypatch.setattr(data, "sha256_file", no_reading_back)
    train.main(TINY + ["--max-steps", "2", "--out-dir", str(tmp_path / "o")])
    monkeypatch.undo()
    assert checkpoint.damage(tmp_path / "o" / "step_000002") is None  # the writer's manifest is right
    p = counting_hashes(tmp_path, "train", TINY + ["--max-steps", "4", "--out-dir", str(tmp_path / "o"),
                                                   "--resume"])
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    assert (tmp_path / "hashed").read_text() == "0\n"  # one shard, hashed once, by rank 0
    tp2 = TINY + ["--tp", "2", "--out-dir", str(tmp_path / "tp2")]
    assert counting_hashes(tmp_path, "train", tp2 + ["--max-steps", "2"]).returncode == 0
    p = counting_hashes(tmp_path, "train", tp2 + ["--max-steps", "3", "--resume"])
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    assert sorted((tmp_path / "hashed").read_text().split()) == ["0", "1"]  # two shards, one each


def counting_hashes(tmp_path, module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`module`.main as a job of 2 processes; each file hash appends the hashing rank to tmp_path/hashed."""
    script, log = tmp_path / "count.py", tmp_path / "hashed"
    log.unlink(missing_ok=True)
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import config, data, train, {module}
        real = data.sha256_file
        def counted(path):
            with open({str(log)!r}, "a") as f:
                f.write(os.environ["RANK"] + "\\n")
            return real(path)
        data.sha256_file = counted
        config.run({module}.main, sys.argv[1:])
    """))
    return subprocess.run(multiproc.command(2, script, *argv), capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_ranks_share_the_checks_of_an_init_checkpoint(tmp_path):
    """--init from a checkpoint in a 2-process sft.py or evaluate.py job: each shard is hashed once, by one
    rank (its one shard here: rank 0's), and every rank reads the step folder they agree is intact; falling
    back past a damaged newest step works the same way."""
    base = tmp_path / "base"
    train.main(TINY + ["--max-steps", "4", "--ckpt-every", "2", "--out-dir", str(base)])
    conversations = tmp_path / "c.jsonl"
    conversations.write_text((json.dumps(CONVERSATION) + "\n") * 40)
    sft_flags = TINY + ["--data", str(conversations), "--val-fraction", "0.2", "--max-steps", "1", "--warmup", "1",
                        "--seq-len", "64", "--micro-batch", "1", "--init", str(base)]
    p = counting_hashes(tmp_path, "sft", sft_flags + ["--out-dir", str(tmp_path / "s")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "hashed").read_text() == "0\n"  # the newest step's one shard, by rank 0
    p = counting_hashes(tmp_path, "evaluate", ["--init", str(base), "--task", "tinyshakespeare", "--limit",
                                               "2"])
    assert p.returncode == 0 and "tinyshakespeare" in p.stdout, p.stderr[-3000:]
    # rank 1 hashed nothing (rank 0 the shard, and the data)
    assert "1" not in (tmp_path / "hashed").read_text()
    shard = base / "step_000004" / "shard_pp00_tp00.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    p = counting_hashes(tmp_path, "sft", sft_flags + ["--out-dir", str(tmp_path / "s2")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert ("checkpoint step_000004 is damaged (shard_pp00_tp00.pt does not match its checksum); falling back"
            in p.stdout)
    assert (tmp_path / "hashed").read_text() == "0\n0\n"  # step 4 (damaged), then step 2: both by rank 0
    named = [f if f != str(base) else str(base / "step_000002") for f in sft_flags]
    assert counting_hashes(tmp_path, "sft", named + ["--out-dir", str(tmp_path / "s3")]).returncode == 0
    losses = lambda out: [(r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm"))
                          for r in records(out)]
    assert losses(tmp_path / "s2") == losses(tmp_path / "s3")  # every rank trained from step 2's weights


def test_changing_a_timeout_is_silent_on_every_rank_and_takes_effect(tmp_path):
    """launch.set_timeout on 2 gloo processes, with _set_pg_timeout deprecated as torch 2.14 does it where
    its replacement (ProcessGroup.set_timeout) exists: no warning on either rank, and a peer 2.5 s late
    fails the all-reduce after the 1 s set, not the 60 s the groups were made with."""
    script = tmp_path / "timeout.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time, warnings
        sys.path.insert(0, {str(REPO)!r})
        import torch, torch.distributed as dist
        import launch, parallel as P
        real = dist.distributed_c10d._set_pg_timeout
        def deprecated(*args, **kwargs):
            warnings.warn("`torch.distributed.distributed_c10d._set_pg_timeout` is deprecated, please use "
                          "`torch.distributed.set_timeout` instead", FutureWarning, stacklevel=2)
            return real(*args, **kwargs)
        if hasattr(dist.ProcessGroup, "set_timeout"):
            dist.distributed_c10d._set_pg_timeout = deprecated
        mesh = P.init_mesh(timeout_s=60.0, io_timeout_s=60.0)
        mesh.timeout_s = 1.0
        launch.set_timeout(mesh, mesh.timeout_s)
        if mesh.rank == 1:
            time.sleep(2.5)
        t0 = time.time()
        try:
            P.all_reduce(torch.ones(4), mesh, "dp")
            failed = None
        except launch.CommError as e:
            failed = str(e)
        with open({str(tmp_path)!r} + f"/rank{{mesh.rank}}.json", "w") as f:
            json.dump({{"seconds": time.time() - t0, "failed": failed}}, f)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    """))
    p = subprocess.run(multiproc.command(2, script), capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "always"})
    assert p.returncode == 0 and "Warning" not in p.stderr and "_set_pg_timeout" not in p.stderr, p.stderr
    waited = json.loads((tmp_path / "rank0.json").read_text())
    assert waited["failed"] and "--dist-timeout 1 s" in waited["failed"] and waited["seconds"] < 2.4, waited


# ----------------------------------------------------------------------------------------------------
# Asynchronous checkpoints: the step waits for a copy in host memory; a thread writes it


def slow_writes(monkeypatch, seconds: float):
    real = checkpoint.write_shard
    monkeypatch.setattr(checkpoint, "write_shard", lambda *a, **k: (time.sleep(seconds), real(*a, **k))[1])


@pytest.mark.parametrize("sync", [False, True])
def test_the_step_waits_for_a_copy_not_for_the_disk(tmp_path, monkeypatch, sync):
    """Each shard write takes 1.5 s here. Asynchronous (the default): the step waits for the copy of the state
    alone, training goes on while the thread writes, and the run ends only once its last checkpoint is on
    disk, with the weights it trained. --ckpt-sync: the step waits for the whole write."""
    slow_writes(monkeypatch, 1.5)
    args = config.get_parser().parse_args(TINY + ["--max-steps", "6", "--ckpt-every", "3", "--out-dir",
                                                  str(tmp_path)] + (["--ckpt-sync"] if sync else []))
    run = train.train(args)
    assert [s["step"] for s in run.saves] == [3, 6] and all(s["write_s"] >= 1.5 for s in run.saves)
    if sync:
        assert all(s["stall_s"] >= 1.5 for s in run.saves)
    else:  # (step 6's save waits for step 3's, still being written: one save at a time)
        assert run.saves[0]["stall_s"] < 0.5  # (1 s of margin below the write)
        # the first save allocates the host buffers; the second copies into the same ones
        first, second = run.saves
        assert 0 <= first["host_alloc_s"] <= first["stall_s"] and second["host_alloc_s"] == 0
    assert checkpoint.find_latest(tmp_path) == (tmp_path / "step_000006", [])
    saved = masters(tmp_path)
    assert all(torch.equal(saved[n], p.detach()) for n, p in run.model.named_parameters())


def test_a_background_write_that_fails_on_one_rank_stops_every_rank(tmp_path):
    """tp 2: both ranks write a shard. Rank 1's second write fails (a full disk) in the background while
    both train on: at the next step every rank learns it (the step's tally) and stops, with one line that
    names the intact checkpoint; nothing hangs, nothing half-written is left, and --resume goes on
    from the intact one."""
    script = tmp_path / "full_disk.py"
    script.write_text(textwrap.dedent(f"""
        import errno, os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import config, train
        real, n = torch.save, [0]
        def save(obj, f, *a, **k):
            n[0] += 1
            if os.environ["RANK"] == "1" and n[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(obj, f, *a, **k)
        torch.save = save
        config.run(train.main, sys.argv[1:])
    """))
    out = tmp_path / "o"
    flags = TINY + ["--tp", "2", "--ckpt-every", "2", "--out-dir", str(out)]
    p = subprocess.run(multiproc.command(2, script, *flags, "--max-steps", "12"), capture_output=True, text=True,
                       timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]  # (rank 0 says it for all)
    assert len(errors) == 1 and all(
        "could not write checkpoint" in e and "step_000004: rank 1: No space left on device" in e
        and "the previous checkpoint (step_000002) is intact" in e for e in errors), p.stderr[-3000:]
    assert max(r["step"] for r in records(out) if "loss" in r) < 12  # it stopped, not at the end
    assert checkpoint.find_latest(out) == (out / "step_000002", []) and not list(out.glob(".tmp-*"))
    again = subprocess.run(multiproc.command(2, REPO / "train.py", *flags, "--max-steps", "6", "--resume"),
                           capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0 and "at step 2" in again.stdout, again.stderr[-3000:]
    assert checkpoint.find_latest(out)[0].name == "step_000006"


def test_sigterm_during_a_background_write_waits_for_it_then_saves(tmp_path):
    """SIGTERM while the thread writes step 3's checkpoint (each write takes 2 s): the step finishes, step 3's
    write completes, the stop step is saved, exit 0; both checkpoints are intact and --resume goes on."""
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        import checkpoint, config, train
        real = checkpoint.write_shard
        checkpoint.write_shard = lambda *a, **k: (time.sleep(2), real(*a, **k))[1]
        config.run(train.main, sys.argv[1:])
    """))
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, str(script), *TINY, "--max-steps", "100000", "--ckpt-every", "3",
                          "--keep-ckpts", "5", "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / ".tmp-step_000003").exists():
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # the write of step 3 has begun (its folder is there) and takes 2 s
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0 and "stopped by signal SIGTERM" in stdout, stderr[-2000:]
    last = max(r["step"] for r in records(out) if "loss" in r)
    assert last > 3 and checkpoint.find_latest(out) == (out / f"step_{last:06d}", [])
    assert checkpoint.damage(out / "step_000003") is None  # the write in flight was finished, not dropped
    code = subprocess.run([*multiproc.command(0, REPO / "train.py"), *TINY, "--max-steps", str(last + 2),
                           "--out-dir", str(out), "--resume"], capture_output=True, text=True, cwd=REPO)
    assert code.returncode == 0 and f"at step {last}" in code.stdout, code.stderr[-2000:]
