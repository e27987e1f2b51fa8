"""reward.py: the score read at the reply's last token, the Bradley-Terry loss and its metrics against their
closed forms (TRL's RewardTrainer computes the same), training and scoring end to end, parity under tp, dp
and pp, and the round trip through Hugging Face's LlamaForSequenceClassification."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # test-only dependency: requirements-test.txt

import chat
import checkpoint as C
import config
import data
import evaluate
import multiproc
import model as M
import parallel as P
import reward
import sft
import train
import weights as W

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
    assert evaluate.score_positions(y).tolist() == [5, 7, 7]


def test_a_replys_score_is_the_same_alone_batched_and_as_reward_py_score_gives_it():
    """score_replies (reward.py sample, rl.py --reward) reads a reply at its <|eot_id|> alone as beside a
    longer reply, and gives the score reward.py score (score_pairs) gives the same conversation. An example
    of exactly seq_len + 1 tokens has its <|eot_id|> as a target only: all three read it at its last input
    token."""
    tok = data.get_tokenizer("byte")
    model = M.Transformer(reward.as_reward_model(M.PRESETS["tiny"]))
    model.init_weights(0)
    model.eval()
    prompt = [{"role": "user", "content": "Say something."}]
    short, longer = "good 1", "a longer reply than the first one"
    n = len(chat.reply_example(tok, prompt, short, 128)[0][0])  # the short conversation's tokens
    for seq_len in (128, n - 1):
        alone = evaluate.score_replies(model, tok, prompt, [short], seq_len)
        batched = evaluate.score_replies(model, tok, prompt, [short, longer], seq_len)
        pairs = [{"prompt": prompt, "chosen": short, "rejected": longer}]
        loader = chat.PreferenceLoader(chat.preference_examples(tok, pairs, seq_len)[0], 1, seq_len,
                                      pad_id=data.pad_id(tok))
        scored = evaluate.score_pairs(model, loader, 1)["rewards/chosen"]
        assert alone[0].item() == pytest.approx(batched[0].item(), abs=1e-6), seq_len
        assert alone[0].item() == pytest.approx(scored, abs=1e-6), seq_len


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
        want = -F.logsigmoid(rc - rr - margin).mean()
        assert task.loss(logits, y, torch.tensor(B)).item() == pytest.approx(want.item(), rel=1e-6)
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
    assert C.main(["consolidate", str(rm), "--hf", str(hf)]) == 0
    ours, tok = evaluate.load_reward_model(rm, torch.device("cpu"))
    examples, _ = chat.preference_examples(tok, chat.read_preferences(pairs), 128)
    x, y = chat.PreferenceLoader(examples, 4, 128, pad_id=data.pad_id(tok)).pairs(list(range(4)))
    theirs = transformers.LlamaForSequenceClassification.from_pretrained(hf).eval()
    with torch.no_grad():
        want = evaluate.scores(ours(x), y, P.Mesh())
        torch.testing.assert_close(theirs(input_ids=x).logits[:, 0], want, rtol=1e-4, atol=1e-4)
        back, _ = evaluate.load_reward_model(hf, torch.device("cpu"))
        torch.testing.assert_close(evaluate.scores(back(x), y, P.Mesh()), want, rtol=1e-5, atol=1e-5)
    again = tmp_path / "again"
    reward.main(TINY + ["--init", str(hf), "--data", str(pairs), "--max-steps", "1", "--warmup", "1", "--lr",
                        "1e-9", "--micro-batch", "4", "--out-dir", str(again)])
    kept = C.read_full_state(C.read_latest(again))[0]["output.weight"]["master"]
    torch.testing.assert_close(kept, W.read_safetensors(hf / "model.safetensors")["score.weight"], rtol=0,
                               atol=1e-6)  # its own head, moved by lr 1e-9 only


def _torchrun(n, out, *flags):
    cmd = multiproc.command(n, REPO / "reward.py", *flags, "--out-dir", out)
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
        weights = [{k: v["master"] for k, v in C.read_full_state(C.read_latest(out))[0].items()}
                   for out in (tmp_path / name, tmp_path / "one")]
        for k, w in weights[1].items():
            assert ((weights[0][k] - w).norm() / w.norm()).item() <= 5e-5, (name, k)


@pytest.mark.parametrize("argv,message", [
    (["--cp", "2"], "--cp 2: the reward model does not support context parallelism"),
    (["--margin", "nan"], "--margin must be a number"),
])
def test_bad_reward_flags_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        config.run(reward.main, TINY + argv + ["--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_scoring_with_a_language_model_is_refused(tmp_path, capsys):
    base = tmp_path / "base"
    train.main(BASE + ["--max-steps", "1", "--warmup", "1", "--out-dir", str(base)])
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    with pytest.raises(SystemExit) as stop:
        config.run(reward.main, ["score", "--reward", str(base), "--data", str(pairs)])
    assert stop.value.code == 1 and "is not a reward model" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Rejection sampling (reward.py sample)

QUESTIONS = [{"prompt": f"Question {i}: is {i} a number?", "response": f"Yes, {i} is a number."}
             for i in range(32)]


@pytest.fixture(scope="module")
def policy_and_reward(tmp_path_factory):
    """A tiny SFT policy that has learned to answer short and stop (<|eot_id|>), and a reward model trained
    from it that prefers "Yes, i is a number." to "No idea about i."."""
    root = tmp_path_factory.mktemp("rejection")
    sft_data, pairs = write_jsonl(root / "sft.jsonl", QUESTIONS), write_jsonl(root / "p.jsonl", PAIRS * 2)
    policy, rm = root / "sft", root / "rm"
    sft.main(TINY + ["--data", str(sft_data), "--max-steps", "40", "--lr", "3e-3", "--micro-batch", "4",
                     "--sample-prompt", "", "--out-dir", str(policy)])
    reward.main(TINY + ["--init", str(policy), "--data", str(pairs), "--max-steps", "30", "--lr", "3e-3",
                        "--micro-batch", "4", "--out-dir", str(rm)])
    return policy, rm, write_jsonl(root / "prompts.jsonl", QUESTIONS[:16])


def sample(capsys, policy, rm, prompts, out, *flags):
    capsys.readouterr()
    assert reward.main(["sample", "--policy", str(policy), "--reward", str(rm), "--prompts", str(prompts),
                        "--out", str(out), "--max-new-tokens", "40", *flags]) == 0
    printed = capsys.readouterr()
    return json.loads(printed.out), [json.loads(line) for line in out.read_text().splitlines()], printed.err


def test_rejection_sampling_keeps_the_best_finished_reply_as_sft_data(policy_and_reward, tmp_path, capsys):
    """Each kept record: K replies with their scores, the best finished one as the assistant's turn (its
    score the one the reward model gives that conversation); the file is SFT data; a seed gives one file."""
    policy, rm, prompts = policy_and_reward
    summary, recs, _ = sample(capsys, policy, rm, prompts, tmp_path / "a.jsonl", "--k", "4")
    assert summary["prompts"] == 16 and summary["kept"] == len(recs) >= 12
    model, tok = evaluate.load_reward_model(rm, torch.device("cpu"))
    for r in recs:
        assert len(r["replies"]) == len(r["scores"]) == len(r["finished"]) == 4 and r["finished"][r["best"]]
        assert r["scores"][r["best"]] == max(s for s, done in zip(r["scores"], r["finished"]) if done)
        prompt = [{"role": "user", "content": QUESTIONS[r["index"]]["prompt"]}]
        assert r["messages"] == prompt + [{"role": "assistant", "content": r["replies"][r["best"]]}]
        again = evaluate.score_replies(model, tok, prompt, r["replies"], 128)
        assert again.tolist() == pytest.approx(r["scores"], abs=1e-5)
    assert [c[-1]["content"] for c in chat.read_sft(str(tmp_path / "a.jsonl"))] == \
        [r["replies"][r["best"]] for r in recs]
    assert summary["kept_reward_mean"] == pytest.approx(sum(r["scores"][r["best"]] for r in recs) / len(recs))
    _, same, _ = sample(capsys, policy, rm, prompts, tmp_path / "b.jsonl", "--k", "4")
    _, other, _ = sample(capsys, policy, rm, prompts, tmp_path / "c.jsonl", "--k", "4", "--seed", "1")
    assert same == recs and [r["replies"] for r in other] != [r["replies"] for r in recs]


def test_the_kept_reward_rises_with_k(policy_and_reward, tmp_path, capsys):
    """Separate runs at K = 2 and 8 on the same prompts: the mean reward of the kept replies rises with K,
    and both lie above the mean reward of a single sample. The estimate from one run's K scores (the
    expected best of 1, 2, ... K) rises too, and its best of 1 is the mean of all replies."""
    policy, rm, prompts = policy_and_reward
    two, _, _ = sample(capsys, policy, rm, prompts, tmp_path / "k2.jsonl", "--k", "2")
    eight, _, _ = sample(capsys, policy, rm, prompts, tmp_path / "k8.jsonl", "--k", "8")
    assert eight["kept_reward_mean"] > two["kept_reward_mean"] > two["reward_mean"]
    curve = [eight["best_of_k"][k] for k in ("1", "2", "4", "8")]
    assert curve == sorted(curve) and curve[0] == pytest.approx(eight["reward_mean"])
    assert reward.expected_best([3.0, 1.0, 2.0], 2) == pytest.approx((2 + 3 + 3) / 3)  # pairs 12, 13, 23


def test_rejection_sampling_shares_the_prompts_over_ranks(policy_and_reward, tmp_path):
    """Under torchrun, rank r samples prompts r, r + world, ...: two ranks write the replies one process
    writes (each prompt's random stream is its own), scores within float rounding."""
    policy, rm, prompts = policy_and_reward
    outs = {}
    for n in (1, 2):
        outs[n] = tmp_path / f"n{n}.jsonl"
        cmd = multiproc.command(n, REPO / "reward.py", "sample", "--policy", policy, "--reward", rm, "--prompts",
                             prompts, "--out", outs[n], "--k", "3", "--max-new-tokens", "40")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:]
    one, two = ([json.loads(line) for line in outs[n].read_text().splitlines()] for n in (1, 2))
    assert [(r["index"], r["replies"], r["best"]) for r in one] == [(r["index"], r["replies"], r["best"])
                                                                    for r in two]
    assert [r["scores"] for r in two] == [pytest.approx(r["scores"], abs=1e-5) for r in one]


def test_bad_rejection_sampling_input_is_one_line_and_writes_nothing(policy_and_reward, tmp_path, capsys):
    policy, rm, prompts = policy_and_reward
    gpt2_rm = tmp_path / "rm-gpt2"
    reward.main(BASE + ["--tokenizer", "gpt2", "--seq-len", "64", "--data", str(write_jsonl(
        tmp_path / "p.jsonl", PAIRS)), "--max-steps", "1", "--warmup", "1", "--micro-batch", "2", "--out-dir",
        str(gpt2_rm)])
    no_user = write_jsonl(tmp_path / "system.jsonl", [{"prompt": "Hi."},
                                                      {"prompt": [{"role": "system", "content": "Be brief."}]}])
    taken = tmp_path / "taken.jsonl"
    taken.write_text("keep me\n")
    out = tmp_path / "out.jsonl"
    cases = [(["--k", "1"], out, "--k 1: rejection sampling keeps the best of at least 2 replies"),
             (["--seq-len", "20"], out, "16 of 16 prompt(s) leave no room for a reply under --seq-len 20 (the "
                                        "first, "),
             (["--reward", str(gpt2_rm)], out, f"reads the tokenizer gpt2, --policy {policy} writes byte"),
             (["--reward", str(policy)], out, "is not a reward model"),
             (["--policy", str(rm)], out, "is a reward model (a head of 1 output, no vocabulary)"),
             (["--prompts", str(no_user)], out, "system.jsonl:2: a prompt needs a user message"),
             ([], taken, f"--out {taken} exists: give another file, or --overwrite"),
             (["--prompts", str(taken), "--overwrite"], taken, "is the --prompts file"),
             (["--top-p", "0"], out, "top_p must be in (0, 1]")]
    for flags, where, message in cases:
        argv = ["sample", "--policy", str(policy), "--reward", str(rm), "--prompts", str(prompts), "--k", "2",
                "--out", str(where), *flags]
        with pytest.raises(SystemExit) as stop:
            config.run(reward.main, argv)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and message in err and "Traceback" not in err, (flags, err)
        assert not out.exists() and taken.read_text() == "keep me\n"


def test_prompts_without_room_for_a_reply_are_left_out_and_counted(policy_and_reward, tmp_path, capsys):
    """As sft.py and dpo.py drop what their length rule cannot keep: a prompt as long as --seq-len is left
    out and said (the others are sampled); records of every layout read_prompts takes are prompts."""
    policy, rm, _ = policy_and_reward
    prompts = write_jsonl(tmp_path / "mixed.jsonl", [
        "Question 1: is 1 a number?", {"prompt": "x" * 300},
        {"messages": [{"role": "user", "content": "Question 2: is 2 a number?"},
                      {"role": "assistant", "content": "Yes."}]},
        PAIRS[3], {"chosen": "\n\nHuman: Question 4: is 4 a number?\n\nAssistant: Yes.",
                   "rejected": "\n\nHuman: Question 4: is 4 a number?\n\nAssistant: No."}])
    summary, recs, err = sample(capsys, policy, rm, prompts, tmp_path / "o.jsonl", "--k", "4")
    assert summary["prompts"] == 4 and "left out: 1 of 5 prompt(s)" in err and "mixed.jsonl:2" in err
    asked = [f"Question {i}: is {i} a number?" for i in (1, 2, 3, 4)]
    assert len(recs) >= 3 and [r["messages"][0]["content"] for r in recs] == asked[:len(recs)]


def test_pairs_whose_reply_ends_a_reward_model_would_not_see_are_left_out(tmp_path, capsys):
    """A pair with a side longer than --seq-len has no <|eot_id|> input, where the score is learned and read
    (exactly seq_len + 1 tokens: it is a target only). reward.py and reward.py score leave such pairs out in
    one line with the count and a --seq-len that keeps them; when none is left, they refuse in one line and
    write nothing."""
    tok = data.get_tokenizer("byte")
    sides = lambda p: [len(chat.reply_example(tok, [{"role": "user", "content": p["prompt"]}], p[k], 512)[0][0])
                       for k in ("chosen", "rejected")]
    longest = [max(sides(p)) for p in PAIRS]
    top, n_long = max(longest), longest.count(max(longest))
    assert 0 < n_long < len(PAIRS) / 2  # (the pairs of two-digit numbers are the longest)
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    flags = ["--data", str(pairs), "--max-steps", "1", "--warmup", "1", "--micro-batch", "2",
             "--val-fraction", "0.25"]
    reward.main(BASE + flags + ["--seq-len", str(top - 1), "--out-dir", str(tmp_path / "some")])
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("left out")]
    assert len(said) == 1 and f"{n_long} of 16 preference pairs have a side longer than --seq-len " \
        f"{top - 1} tokens" in said[0] and f"--seq-len {top} keeps every pair's end" in said[0]
    n_val = (len(PAIRS) - n_long) // 4  # the kept pairs, split
    assert any(f"{len(PAIRS) - n_long - n_val} train / {n_val} val" in line for line in out), out
    assert records(tmp_path / "some")[-1]["step"] == 1
    reward.main(["score", "--reward", str(tmp_path / "some"), "--data", str(pairs), "--seq-len", str(top - 1)])
    got = capsys.readouterr()
    assert json.loads(got.out)["pairs"] == len(PAIRS) - n_long and f"left out: {n_long} of 16" in got.err
    short = str(min(longest) - 1)
    for main, argv in ((reward.main, BASE + flags + ["--seq-len", short, "--out-dir", str(tmp_path / "o")]),
                       (reward.main, ["score", "--reward", str(tmp_path / "some"), "--data", str(pairs),
                                      "--seq-len", short])):
        with pytest.raises(SystemExit) as stop:
            config.run(main, argv)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and "Traceback" not in err, err
        assert f"16 of 16 preference pairs have a side longer than --seq-len {short} tokens" in err
        assert f"none is left; --seq-len {top} keeps every pair's end" in err
    assert not (tmp_path / "o").exists()
    examples, _ = chat.preference_examples(tok, chat.read_preferences(pairs), int(short))
    with pytest.raises(data.DataError, match=f"beyond the model's context \\({top - 1}\\), which keeps "
                                             f"{16 - n_long}$"):
        reward.keep_reply_ends(tok, chat.read_preferences(pairs), examples, int(short), top - 1, print)


def test_rejection_samplings_seed_and_out_are_checked_before_any_model_is_loaded(tmp_path, capsys, monkeypatch):
    """A negative --seed, an --out in a folder that does not exist or cannot be written: one line before the
    models are loaded (sampling takes long, and was thrown away when these were found after it)."""
    from test_hostile import readonly_folder
    loaded = []
    monkeypatch.setattr(reward.evaluate, "load_model", lambda *a, **k: loaded.append(a))
    prompts = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:2])
    with readonly_folder(tmp_path / "ro") as ro:
        cases = [(["--seed", "-1", "--out", str(tmp_path / "a.jsonl")], "--seed must be 0 or more, got -1"),
                 (["--out", str(tmp_path / "no" / "a.jsonl")], f"the folder {tmp_path / 'no'} does not exist"),
                 (["--out", str(ro / "a.jsonl")], f"cannot write into {ro}")]
        for flags, message in cases:
            with pytest.raises(SystemExit) as stop:
                config.run(reward.main, ["sample", "--policy", "p", "--reward", "r", "--prompts", str(prompts),
                                         *flags])
            err = capsys.readouterr().err
            assert stop.value.code == 1 and message in err and "Traceback" not in err, (flags, err)
        assert not loaded and not list(ro.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl",
                                                                                                       "ro"]
