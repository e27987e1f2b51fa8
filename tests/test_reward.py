"""reward.py: the score read at the reply's last token, the Bradley-Terry loss and its metrics against their
closed forms (TRL's RewardTrainer computes the same), training and scoring end to end, parity under tp, dp
and pp, and the round trip through Hugging Face's LlamaForSequenceClassification."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # test-only dependency: requirements-test.txt

import checkpoint as C
import data
import dpo
import model as M
import parallel as P
import reward
import train

REPO = Path(__file__).resolve().parents[1]
BASE = ["--model", "tiny", "--seq-len", "128", "--warmup", "2", "--log-every", "1", "--eval-every", "0",
        "--eval-batches", "1", "--ckpt-every", "1000", "--sample-tokens", "0"]
TINY = BASE + ["--val-fraction", "0.2"]
PAIRS = [{"prompt": f"Question {i}: is {i} a number?", "chosen": f"Yes, {i} is a number.",
          "rejected": f"No idea about {i}."} for i in range(16)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_the_score_is_read_at_the_replys_last_token():
    """Targets are the next tokens: the reply's <|eot_id|> is the last learned target, one position before
    the input position that holds it. A row cut by seq_len is read at its last position."""
    I = data.IGNORE_INDEX
    y = torch.tensor([[I, I, 5, 6, 9, I, I, I],  # eot (9) is the input at position 5
                      [I, 5, 6, 7, 8, 9, 9, 9],  # cut: learned to the end
                      [I, I, I, I, I, I, 9, I]])
    assert reward.score_positions(y).tolist() == [5, 7, 7]


def test_the_loss_and_metrics_are_bradley_terrys():
    """The same numbers TRL's RewardTrainer computes from the two scores: loss -log sigmoid(r_c - r_r - m)
    averaged over pairs, accuracy the share with r_c > r_r (TRL leaves ties out; equal scores count as wrong
    here: with float scores they do not happen), and the mean margin and scores."""
    torch.manual_seed(0)
    B, T = 3, 6
    logits = torch.randn(2 * B, T, 1)
    y = torch.randint(0, 50, (2 * B, T))
    y[:, 4:] = data.IGNORE_INDEX  # every score read at position 4
    r = logits[:, 4, 0]
    rc, rr = r[:B], r[B:]
    for margin in (0.0, 0.5):
        args = reward.get_parser().parse_args(["--margin", str(margin)])
        task = reward.RewardTask(M.ModelArgs(vocab_size=50, num_labels=1), P.Mesh(), args)
        task.total = torch.tensor(B)
        want = -F.logsigmoid(rc - rr - margin).mean()
        assert task.loss(logits, y).item() == pytest.approx(want.item(), rel=1e-6)
        got = dict(zip(task.metric_names, task.metrics().tolist()))
        assert got["accuracy"] == pytest.approx((rc > rr).float().mean().item())
        assert got["margin"] == pytest.approx((rc - rr).mean().item(), rel=1e-6)
        assert got["rewards/chosen"] == pytest.approx(rc.mean().item(), rel=1e-6)
        assert got["rewards/rejected"] == pytest.approx(rr.mean().item(), rel=1e-6)


def test_a_reward_model_learns_its_pairs_and_scores_them(tmp_path, capsys):
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    base, rm = tmp_path / "base", tmp_path / "rm"
    train.main(BASE + ["--max-steps", "2", "--out-dir", str(base)])
    reward.main(TINY + ["--init", str(base), "--data", str(pairs), "--max-steps", "30", "--lr", "3e-3",
                        "--micro-batch", "4", "--out-dir", str(rm)])
    recs = [r for r in records(rm) if "loss" in r]
    assert recs[0]["margin"] == pytest.approx(0.0, abs=0.1)  # a fresh head scores everything alike
    assert recs[-1]["accuracy"] == 1.0 and recs[-1]["loss"] < 0.1
    assert records(rm)[-1]["val_accuracy"] == 1.0
    meta = json.loads((C.read_latest(rm) / "meta.json").read_text())
    assert meta["recipe"] == "reward" and meta["model_args"]["num_labels"] == 1
    capsys.readouterr()
    assert reward.main(["score", "--reward", str(rm), "--data", str(pairs), "--seq-len", "128"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["pairs"] == 16 and scored["accuracy"] == 1.0 and scored["margin"] > 1


def test_a_reward_model_goes_to_hugging_face_and_back(tmp_path):
    """Consolidated, the checkpoint is a LlamaForSequenceClassification whose scores (at the last non-pad
    token, transformers' rule) equal ours on a padded batch; that folder is a --reward, and an --init that
    keeps its head."""
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    rm = tmp_path / "rm"
    reward.main(TINY + ["--data", str(pairs), "--max-steps", "3", "--lr", "3e-3", "--micro-batch", "4",
                        "--out-dir", str(rm)])
    hf = tmp_path / "hf"
    assert P.main(["consolidate", str(rm), "--hf", str(hf)]) == 0
    ours, tok = reward.load_reward_model(rm, torch.device("cpu"))
    examples, _ = dpo.preference_examples(tok, dpo.read_preferences(pairs), 128)
    x, y = dpo.PreferenceLoader(examples, 4, 128, pad_id=data.pad_id(tok)).pairs(list(range(4)))
    theirs = transformers.LlamaForSequenceClassification.from_pretrained(hf).eval()
    with torch.no_grad():
        want = reward.scores(ours(x), y, P.Mesh())
        torch.testing.assert_close(theirs(input_ids=x).logits[:, 0], want, rtol=1e-4, atol=1e-4)
        back, _ = reward.load_reward_model(hf, torch.device("cpu"))
        torch.testing.assert_close(reward.scores(back(x), y, P.Mesh()), want, rtol=1e-5, atol=1e-5)
    again = tmp_path / "again"
    reward.main(TINY + ["--init", str(hf), "--data", str(pairs), "--max-steps", "1", "--lr", "1e-9",
                        "--micro-batch", "4", "--out-dir", str(again)])
    kept = P.read_full_state(C.read_latest(again))[0]["output.weight"]["master"]
    torch.testing.assert_close(kept, M.read_safetensors(hf / "model.safetensors")["score.weight"], rtol=0,
                               atol=1e-6)  # its own head, moved by lr 1e-9 only


def _torchrun(n, out, *flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(REPO / "reward.py"), *flags, "--out-dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return [r for r in records(out) if "loss" in r]


def test_the_reward_models_loss_is_the_same_under_tp_dp_and_pp(tmp_path):
    """tp 2 (the one score on tp rank 0, the other's column padding), dp 2 (the same global batch) and
    pp 2 (1F1B over 2 micro-batches): the losses (1e-5), accuracies and final weights of one process. The
    weights within 5e-5 of each tensor's norm, not the language model's 1e-5: one score per sequence makes
    many gradients tiny, Adam divides each by its own size, and their last-bit differences (another sum
    order) grow to ~1e-5 in three steps."""
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = TINY + ["--data", str(pairs), "--max-steps", "3", "--lr", "3e-3"]
    one = _torchrun(1, tmp_path / "one", *common, "--micro-batch", "4", "--grad-accum", "2")
    for name, flags in (("tp", ["--tp", "2", "--micro-batch", "4", "--grad-accum", "2"]),
                        ("dp", ["--micro-batch", "2", "--grad-accum", "2"]),
                        ("pp", ["--pp", "2", "--micro-batch", "4", "--grad-accum", "2"])):
        got = _torchrun(2, tmp_path / name, *common, *flags)
        assert len(got) == len(one) == 3
        for a, b in zip(got, one):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (name, a, b)
            assert a["accuracy"] == b["accuracy"], (name, a, b)
        weights = [{k: v["master"] for k, v in P.read_full_state(C.read_latest(out))[0].items()}
                   for out in (tmp_path / name, tmp_path / "one")]
        for k, w in weights[1].items():
            assert ((weights[0][k] - w).norm() / w.norm()).item() <= 5e-5, (name, k)


@pytest.mark.parametrize("argv,message", [
    (["--cp", "2"], "--cp 2: the reward model does not support context parallelism"),
    (["--margin", "nan"], "--margin must be a number"),
])
def test_bad_reward_flags_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        train.run(reward.main, TINY + argv + ["--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_scoring_with_a_language_model_is_refused(tmp_path, capsys):
    base = tmp_path / "base"
    train.main(BASE + ["--max-steps", "1", "--out-dir", str(base)])
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    with pytest.raises(SystemExit) as stop:
        train.run(reward.main, ["score", "--reward", str(base), "--data", str(pairs)])
    assert stop.value.code == 1 and "is not a reward model" in capsys.readouterr().err
