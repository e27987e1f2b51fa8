"""Chaos: a 2-process data-parallel run under `torchrun --max-restarts` is killed (SIGKILL, no cleanup)
three times -- at a training step, in the middle of a (background) checkpoint write, and at another step,
on different ranks -- and brought back each time by torchrun alone from its latest complete checkpoint. Its final
weights equal an uninterrupted run's, bit for bit. And when torchrun's agent itself is killed, its workers
end by themselves."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import checkpoint
import parallel

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "4", "--grad-accum", "2", "--lr", "3e-3",
         "--warmup", "2", "--eval-every", "-1", "--log-every", "1", "--sample-tokens", "0", "--max-steps",
         "12", "--ckpt-every", "2", "--resume"]

# attempt (torchrun's restart count) -> (rank to kill, where): "step N" = at the N-th optimizer step of that
# attempt, "save N" = inside the N-th torch.save of that attempt (a checkpoint half written)
CHAOS = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import torch, config, train, zero as Z
    # which kill comes next: one marker file per kill done, so the plan does not depend on how torchrun
    # counts restarts
    done = len([f for f in os.listdir({markers!r}) if f.startswith("killed")])
    plan = {{0: (1, "step", 5), 1: (0, "save", 2), 2: (1, "step", 3)}}.get(done)
    rank = int(os.environ["RANK"])

    def die():
        open(os.path.join({markers!r}, f"killed{{done}}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if plan and plan[0] == rank:
        _, where, n = plan
        count = [0]
        if where == "step":
            real_finish = Z.GradSync.finish
            def finish(self):
                count[0] += 1
                if count[0] == n:
                    die()
                real_finish(self)
            Z.GradSync.finish = finish
        else:
            real_save = torch.save
            def save(obj, f, *a, **k):
                count[0] += 1
                if count[0] == n:
                    f.write(b"half a checkpoint")
                    f.flush()
                    die()
                return real_save(obj, f, *a, **k)
            torch.save = save
    config.run(train.main, sys.argv[1:])
""")


def test_killed_three_times_ends_bit_identical(tmp_path):
    script = tmp_path / "chaos.py"
    (tmp_path / "markers").mkdir()
    script.write_text(CHAOS.format(repo=str(REPO), markers=str(tmp_path / "markers")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, program, restarts in (("chaos", script, 3), ("clean", REPO / "train.py", 0)):
        out = tmp_path / name
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=2",
                            f"--max-restarts={restarts}", str(program), *FLAGS, "--out-dir", str(out)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        runs[name] = out
    steps = [r["step"] for r in map(json.loads, (runs["chaos"] / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    # Each kill sends the job back to its newest complete checkpoint: a write still in the background when
    # its process dies (the save half written, or one begun just before a kill) never counts, so which
    # steps are redone depends on timing. What does not: the torn write sends the log back at least once
    # (a kill before rank 0 logs its step leaves no trace there), every restart is at the step after a
    # checkpoint (an even one: --ckpt-every 2), never from scratch, and the weights end the same.
    restarts = [(before, after) for before, after in zip(steps, steps[1:]) if after <= before]
    assert 1 <= len(restarts) <= 3 and all(after % 2 == 1 and after > 1 for _, after in restarts), steps
    assert steps.count(1) == 1 and steps.count(12) == 1 and steps[-1] == 12
    assert len(list((tmp_path / "markers").iterdir())) == 3
    final = {name: checkpoint.find_latest(out)[0] for name, out in runs.items()}
    assert final["chaos"].name == final["clean"].name == "step_000012"
    a, b = (checkpoint.read_full_state(d)[0] for d in final.values())
    for k in a:
        for kk in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[k][kk], b[k][kk]), (k, kk)


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (from /proc: no psutil)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"  # Z: exited, not yet reaped
    except OSError:
        return False


def test_workers_end_when_their_agent_is_killed(tmp_path):
    """torchrun's agent killed with SIGKILL cannot stop its workers: they must notice and end by
    themselves, well before their collectives would time out (--dist-timeout 120)."""
    out = tmp_path / "o"
    flags = [f for f in FLAGS if f != "--resume"]
    flags[flags.index("--max-steps") + 1] = "100000"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node=2", str(REPO / "train.py"), *flags, "--dist-timeout", "120",
                              "--out-dir", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    workers = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(workers) == 2):
            time.sleep(0.5)
            workers = _children(agent.pid)
        assert len(workers) == 2 and (out / "metrics.jsonl").exists(), "the job never started training"
        agent.kill()  # SIGKILL: the agent cleans nothing up
        agent.wait()
        deadline = time.time() + 60
        while time.time() < deadline and any(map(_alive, workers)):
            time.sleep(0.5)
        left = [pid for pid in workers if _alive(pid)]
        assert not left, f"workers {left} outlived their agent by 60 s"
        assert "torchrun's agent" in agent.stderr.read().decode()
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, 9)
