"""rl.py: GRPO's gradient in closed form (test_rl_trl.py holds the GRPO family against TRL itself), PPO's
log-probs and token means against TRL's PPOTrainer's formulas written out here, PPO's GAE and clipped losses
against hand-computed values, rollouts deterministic under a seed, --resume bit-identical (with dynamic
sampling too), the same run under tp 2 and dp 2 as on one process, and bad input refused in one line."""

import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import chat
import checkpoint as C
import config
import data
import dpo
import evaluate
import model as M
import multiproc
import parallel as P
import reward
import rl
import sft
import train

REPO = Path(__file__).resolve().parents[1]
BASE = ["--model", "tiny", "--seq-len", "48", "--max-new-tokens", "8", "--micro-batch", "2", "--group", "4",
        "--lr", "1e-3", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "1000",
        "--val-fraction", "0.2", "--reward-fn", "arithmetic-length"]


def records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def steps(out_dir):
    return [r for r in records(out_dir) if "loss" in r]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("sums") / "prompts.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in rl.sums(40, seed=0, high=10)))
    return path


# ----------------------------------------------------------------------------------------------------
# The formulas


def ours_grpo_loss(logp, ref_logp, rewards, mask, group, beta):
    adv = rl.group_advantages(rewards, group)
    losses, _, _ = rl.grpo_token_losses(logp, logp.detach(), ref_logp, adv, mask, (0.2, 0.2), beta)
    return rl.reply_mean(losses, mask).mean()


def test_grpo_losss_gradient_is_the_closed_form():
    """At ratio 1 (one update per rollout: p_old = p detached) each token's gradient is
    (-A + beta (1 - exp(ref - logp))) / (reply length) / rows."""
    g = torch.Generator().manual_seed(0)
    rows, T, group = 8, 6, 4
    logp = -torch.rand(rows, T, generator=g, dtype=torch.float64) * 3
    ref = logp + 0.5 * torch.randn(rows, T, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4], dtype=torch.float64)
    mask = torch.ones(rows, T, dtype=torch.float64)
    mask[:, 4:] = 0
    mask[3, 2:] = 0
    x = logp.clone().requires_grad_(True)
    ours_grpo_loss(x, ref, rewards, mask, group, 0.04).backward()
    adv = rl.group_advantages(rewards, group)[:, None]
    expected = (-adv + 0.04 * (1 - torch.exp(ref - logp))) * mask / mask.sum(dim=1, keepdim=True) / rows
    assert torch.allclose(x.grad, expected, atol=1e-12)


def trl_logps(logits, ids, temperature):
    """TRL's per-token log-probs (GRPOTrainer and PPOTrainer alike): the logits divided by the sampling
    temperature, then the log-softmax at the completion's ids."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


def rl_task(algo, temperature, vocab_size, value_head=None):
    args = SimpleNamespace(algo=algo, group=4, kl_coef=0.04, temperature=temperature, clip_eps=0.2, seq_len=6,
                           vf_coef=0.1, clip_value=0.2, loss_type="grpo", mask_truncated=False)
    return rl.RLTask(P.Mesh(), args, SimpleNamespace(args=SimpleNamespace(vocab_size=vocab_size)),
                     SimpleNamespace(n_vocab=vocab_size),
                     [{"where": "p:1"}], None, value_head=value_head)


def micro_batches(logits, y, extras, cuts=(slice(0, 4), slice(4, 8))):
    """One global batch of 8 replies as two micro-batches (whole groups of 4, of unequal token counts)."""
    return [(logits[c], (y[c], {k: None if v is None else v[c] for k, v in extras.items()})) for c in cuts]


def test_the_ppo_tasks_log_probs_and_token_metrics_are_trls():
    """PPOTrainer's policy/clipfrac_avg and loss/value_avg are means over the reply tokens (masked_mean), its
    log-probs those of logits / temperature: RLTask's over a global batch of two micro-batches."""
    g = torch.Generator().manual_seed(1)
    rows, T, V, temperature = 8, 6, 11, 0.7
    logits = torch.randn(rows, T, V, generator=g)
    ids = torch.randint(0, V, (rows, T), generator=g)
    mask = (torch.arange(T) < torch.tensor([6, 5, 4, 6, 1, 2, 1, 3])[:, None]).float()
    y = torch.where(mask.bool(), ids, data.IGNORE_INDEX)
    logp = trl_logps(logits, ids, temperature) * mask
    old = (logp + 0.3 * torch.randn(rows, T, generator=g)) * mask  # ratios far from 1: some clipped
    adv, values, old_values, returns = (torch.randn(rows, T, generator=g) * mask for _ in range(4))
    extras = {"reward": torch.zeros(rows), "kl_sum": torch.zeros(rows), "entropy": torch.zeros(rows),
              "length": mask.sum(-1), "correct": None, "old": old, "adv": adv, "values": old_values,
              "returns": returns}
    now = {}
    task = rl_task("ppo", temperature, V, value_head=lambda: now["values"])
    torch.testing.assert_close(task.logps(logits, y), logp)
    for c, (x, target) in zip((slice(0, 4), slice(4, 8)), micro_batches(logits, y, extras)):
        now["values"] = values[c]
        task.loss(x, target, torch.tensor(float(rows)))
    logged = dict(zip(task.metric_names, task.metrics().tolist()))
    ratio = torch.exp(logp - old)
    pg_losses, pg_losses2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)
    masked_mean = lambda v: ((v * mask).sum() / mask.sum()).item()
    clipfrac = masked_mean((pg_losses2 > pg_losses).float())
    assert 0 < clipfrac < 1 and logged["policy/clipfrac_avg"] == pytest.approx(clipfrac, rel=1e-6)
    v_clipped = torch.clamp(values, old_values - 0.2, old_values + 0.2)
    vf_loss = 0.5 * masked_mean(torch.max((values - returns) ** 2, (v_clipped - returns) ** 2))
    assert logged["loss/value_avg"] == pytest.approx(vf_loss, rel=1e-5)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0])
    adv = rl.group_advantages(r[:8], 4)
    s = math.sqrt(1 / 3)  # the std of (1, 0, 0, 1) with Bessel's correction
    a = 0.5 / (s + 1e-4)
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[4:].tolist() == [0.0] * 4  # a group all alike teaches nothing
    assert rl.group_advantages(r[8:], 2).tolist() == pytest.approx([1 / (math.sqrt(2) + 1e-4),
                                                                    -1 / (math.sqrt(2) + 1e-4)])


def test_a_batch_of_prompts_samples_each_prompts_own_replies():
    """model.sample_groups: prompts of unequal lengths left-padded into one batch give each prompt the replies
    it gets alone from its own stream (the same tokens, rows ending at eos at different steps, each prompt cut
    at its own room, no id past the tokenizer's), those of generate's plain loop (whose rows all run to the
    end) although a row leaves the batch at its eos, and each reply token's log-probability is that of a plain
    forward of prompt + reply, softmax over the tokenizer's ids (the left padding moves no position)."""
    torch.manual_seed(0)
    model = M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40))
    prompts, rooms, eos, n_vocab = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]], [6, 9, 9, 3], 7, 32
    streams = lambda: [M.replies_stream(0, i, "cpu") for i in range(len(prompts))]
    together, lps = M.sample_groups(model, prompts, 5, rooms, streams(), eos, n_vocab, temperature=0.8)
    alone = [M.sample_groups(model, [p], 5, [r], [g], eos, n_vocab, temperature=0.8)
             for p, r, g in zip(prompts, rooms, streams())]
    assert together == [replies[0] for replies, _ in alone]
    plain = [[row[:row.index(eos) + 1] if eos in row else row  # generate: a prompt's k rows to the end
              for row in M.generate(model, [p] * 5, r, 0.8, eos_id=eos, n_vocab=n_vocab, generator=g).tolist()]
             for p, r, g in zip(prompts, rooms, streams())]
    assert together == plain
    rows = [(p, r, lp) for p, group, lp_group in zip(prompts, together, lps) for r, lp in zip(group, lp_group)]
    assert {r[-1] == eos for _, r, _ in rows} == {True, False} and len({len(r) for _, r, _ in rows}) > 2
    assert all(len(r) <= room for group, room in zip(together, rooms) for r in group)
    assert max(t for _, r, _ in rows for t in r) < n_vocab
    with torch.no_grad():
        for prompt, reply, lp in rows:
            logits = model(torch.tensor([prompt + reply]))[0, len(prompt) - 1:-1, :n_vocab] / 0.8
            want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(reply)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=0)


def test_gae_by_hand():
    """One reply of three tokens after one prompt position: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t
    + gamma lam A_{t+1}, worked out by hand for gamma 1 and 0.9."""
    rewards = torch.tensor([[0.0, -0.1, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.1, 7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # A3 = 1 - 0.1 = 0.9; A2 = (0 + 0.1 - 0.2) + 0.95 * 0.9 = 0.755; A1 = (-0.1 + 0.2 - 0.5) + 0.95 * 0.755
    assert adv.tolist() == [pytest.approx([0.0, 0.31725, 0.755, 0.9, 0.0])]
    assert ret.tolist() == [pytest.approx([0.0, 0.81725, 0.955, 1.0, 0.0])]
    adv, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    a3 = 0.9
    a2 = (0 + 0.9 * 0.1 - 0.2) + 0.45 * a3
    a1 = (-0.1 + 0.9 * 0.2 - 0.5) + 0.45 * a2
    assert adv.tolist() == [pytest.approx([0.0, a1, a2, a3, 0.0])]


def test_ppo_losses_by_hand():
    a = SimpleNamespace(clip_eps=0.2, vf_coef=0.1, clip_value=0.2)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios against old logp 0: 1.5, 0.5, 1.1
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    values, old_values = torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[0.5, 0.0, 0.5]])
    returns = torch.ones(1, 3)
    losses, value_loss, clipped = rl.ppo_token_losses(logp, old, adv, values, old_values, returns, a)
    # policy: max(-A rho, -A clip(rho)): A=1, rho 1.5 -> -1.2 (clipped); rho 0.5 -> -0.5; A=-2, rho 1.1 -> 2.2
    # value: 0.5 max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2): V 1 (clipped to 0.7) -> 0.5 * 0.09; 0 -> 0.5
    assert value_loss.tolist() == [pytest.approx([0.045, 0.5, 0.125])]
    assert losses.tolist() == [pytest.approx([-1.2 + 0.0045, -0.5 + 0.05, 2.2 + 0.0125])]
    assert clipped.tolist() == [[True, False, False]]


def test_the_arithmetic_reward_reads_the_last_number():
    record = {"answer": "12", "where": "p:1"}
    assert rl.arithmetic(record, "7 + 5 = 12") == 1.0
    assert rl.arithmetic(record, "12 is not 7 + 5 = 13") == 0.0
    assert rl.arithmetic(record, "no number") == 0.0
    assert rl.arithmetic_length(record, "7 + 5 = 12") == pytest.approx(1.0 + 0.1 * 10)


@pytest.mark.parametrize("answer,reply,right", [
    ("2.0", "1 + 1 = 2", True), ("3.5", "7 / 2 = 3.50", True), ("1,000", "10 x 100 = 1000", True),
    (1000, "that is 1,000.", True), (2.5, "5 / 2 = 2.5", True), ("-4", "1 - 5 = -4", True),
    ("2", "1 + 1 = 2.5", False), ("0.3", "0.1 + 0.2 = 0.30000000000000004", False), ("12", "1.2", False),
    # a comma is a thousands separator only between a digit and exactly three digits: "3,4" is a list
    ("4", "the factors are 3,4", True), ("34", "the factors are 3,4", False), ("4", "3, 4", True),
    ("12345678", "12,345,678", True), ("34", "3,4", False),
])
def test_the_arithmetic_rule_compares_numbers_as_numbers(answer, reply, right):
    """An answer that is not a plain integer ("2.0", "3.5", "1,000", a JSON number) is compared with the
    reply's last number as a number, exactly (no float rounding)."""
    assert rl.is_correct({"answer": str(answer)}, reply) is right
    assert rl.arithmetic({"answer": str(answer)}, reply) == float(right)


# ----------------------------------------------------------------------------------------------------
# Runs


def run_rl(out, prompts, *flags):
    rl.main(BASE + ["--prompts", str(prompts), "--out-dir", str(out), *flags])
    return steps(out)


def state_of(out):
    """The latest checkpoint's master weights and Adam moments, by parameter."""
    return C.read_full_state(C.read_latest(out))[0]


def half_signal(tmp_path) -> Path:
    """A reward rule under which about half the groups carry no signal: for an odd answer, 0 for every reply;
    for an even one, the parity of the sum of the reply's bytes."""
    path = tmp_path / "half.py"
    path.write_text("def reward(record, reply):\n    return float(sum(reply.encode()) % 2) if int(record['answer']) % 2 == 0 else 0.0\n")
    return path


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dynamic"])
def test_rollouts_are_the_same_under_a_seed_and_resume_is_bit_identical(tmp_path, prompts, algo, capsys):
    """Two runs of one seed give the same rollouts and updates; the second, cut back to its step-2
    checkpoint and resumed, ends bit for bit where the first did (weights, Adam moments, PPO's critic; under
    --dynamic-sampling, the prompt stream's position after its extra draws); `rl.py eval` and an export read
    the policy without the critic."""
    flags = ["--max-steps", "4"] + {"grpo": ["--algo", "grpo"], "ppo": ["--algo", "ppo", "--group", "2"],
                                    "dynamic": ["--dynamic-sampling", "3", "--reward-fn",
                                                f"{half_signal(tmp_path)}:reward"]}[algo]
    algo = "grpo" if algo == "dynamic" else algo
    one = run_rl(tmp_path / "one", prompts, *flags)
    cut = tmp_path / "cut"
    again = run_rl(cut, prompts, *flags, "--ckpt-every", "2")
    keys = ("loss", "grad_norm", "reward", "completion_length")
    assert len(one) == 4 and [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in again]
    assert all(r["grad_norm"] > 0 for r in one)  # the policy moved at every step: a real update to resume
    shutil.rmtree(cut / C.step_name(4))
    (cut / "latest").write_text(C.step_name(2) + "\n")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 2))
    other = "grpo" if algo == "ppo" else "ppo"  # (its checkpoints hold another set of parameters)
    err = bad_run(capsys, tmp_path, BASE + ["--prompts", str(prompts), "--max-steps", "4", "--algo", other,
                                            "--out-dir", str(cut), "--resume"])
    assert f"was trained with --algo {algo}, this run has --algo {other}: resume it with --algo {algo}" in err
    run_rl(cut, prompts, *flags, "--ckpt-every", "2", "--resume")
    assert [[r[k] for k in keys] for r in steps(cut)] == [[r[k] for k in keys] for r in one]
    s1, s2 = state_of(tmp_path / "one"), state_of(cut)
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k][kk], s2[k][kk]) for k in s1 for kk in s1[k])
    if algo == "ppo":
        assert "value_head.proj.weight" in s1  # the critic is part of the run's state, not of the model:
        exported = C.consolidate(C.read_latest(tmp_path / "one"), tmp_path / "hf")  # an export leaves it out
        assert not any(name.startswith("value_head") for name in exported.state_dict())
        assert {"objective/kl", "objective/entropy", "policy/clipfrac_avg", "loss/value_avg"} <= one[0].keys()
    else:
        assert {"reward", "reward_std", "kl", "completion_length", "clip_ratio", "accuracy"} <= one[0].keys()
    if "--dynamic-sampling" in flags:  # groups were dropped and refilled, and none without a signal trained
        assert sum(r["dropped_groups"] for r in one) > 0 and sum(r["refills"] for r in one) > 0
        assert all(r["reward_std"] > 0 for r in one)
    assert rl.main(["eval", "--init", str(tmp_path / "one"), "--prompts", str(prompts), "--reward-fn",
                    "arithmetic", "--max-new-tokens", "4", "--seq-len", "48"]) == 0


def _job(n, out, prompts, *flags):
    cmd = multiproc.command(n, REPO / "rl.py", *BASE, "--prompts", prompts, *flags, "--out-dir", out)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return steps(out)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo"])
def test_the_same_rollouts_and_losses_under_tp_and_dp(tmp_path, prompts, algo):
    """tp 2 (each tp pair samples from the gathered vocabulary) and dp 2 (each replica its own prompts, PPO's
    whitening over both; DAPO's token count and the batch's reward std over both) against one process: the
    same replies (rewards and lengths), losses and token means (kl, loss/value_avg: over the reply tokens of
    both replicas) within 1e-5, the final weights within 1e-4 of each tensor's norm."""
    family = ["--loss-type", "dapo", "--scale-rewards", "batch", "--epsilon-high", "0.28", "--kl-bias-correction",
              "--importance-sampling", "sequence"]
    common = ["--algo", "grpo" if algo == "dapo" else algo, "--max-steps", "3", "--grad-accum", "2",
              *(family if algo == "dapo" else [])]
    one = _job(1, tmp_path / "one", prompts, *common)
    for name, flags in (("tp", ["--tp", "2"]), ("dp", ["--micro-batch", "1"])):
        got = _job(2, tmp_path / name, prompts, *common, *flags)
        assert len(got) == len(one) == 3
        for a, b in zip(got, one):
            # the same replies: metric means equal up to fp32 sums taken in another order
            assert (a["reward"], a["completion_length"]) == pytest.approx((b["reward"], b["completion_length"]),
                                                                          rel=1e-6), (name, a, b)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (name, a, b)
            token_mean = "loss/value_avg" if algo == "ppo" else "kl"
            assert a[token_mean] == pytest.approx(b[token_mean], rel=1e-5, abs=1e-7), (name, a, b)
        w, w1 = state_of(tmp_path / name), state_of(tmp_path / "one")
        for k, v in w1.items():
            diff = (w[k]["master"] - v["master"]).norm() / v["master"].norm().clamp(min=1e-12)
            assert diff.item() <= 1e-4, (name, k)


# ----------------------------------------------------------------------------------------------------
# Bad input


def bad_run(capsys, tmp_path, argv):
    with pytest.raises(SystemExit) as stop:
        config.run(rl.main, argv)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags,message", [
    (["--group", "1"], "--group 1: GRPO's advantage compares the replies to one prompt"),
    (["--seq-len", "20"], "40 of 40 prompt(s) leave no room for a reply under --seq-len 20"),
    (["--pp", "2"], "--pp 2: rl.py does not support it (generation runs the whole model"),
    (["--zero", "3"], "--zero 3: rl.py does not support it"),
    (["--dropout", "0.1"], "--dropout 0.1: rl.py does not support it (the replies are sampled"),
    (["--reward-fn", "nope"], "--reward-fn nope: not one of arithmetic, arithmetic-length"),
    (["--temperature", "0"], "--temperature 0: every reply of a group would be the same"),
    (["--data", "x.jsonl"], "--data x.jsonl: rl.py reads its prompts from --prompts"),
    (["--doc-mask"], "--doc-mask: fine-tuning gives each example of a row its own document always"),
    (["--algo", "ppo", "--epsilon-high", "0.28"], "--epsilon-high: a setting of GRPO's loss, which --algo ppo "
                                                  "does not use"),
    (["--algo", "ppo", "--mask-truncated"], "--mask-truncated: a setting of GRPO's loss, which --algo ppo"),
    (["--kl-coef", "0", "--kl-bias-correction"], "--kl-bias-correction weights the KL penalty, and --kl-coef 0"),
    (["--epsilon-high", "0"], "need --epsilon-high > 0 and --dynamic-sampling >= 0"),
])
def test_bad_rl_input_is_one_line(tmp_path, prompts, capsys, flags, message):
    err = bad_run(capsys, tmp_path, BASE + ["--prompts", str(prompts), "--out-dir", str(tmp_path / "o"),
                                            *flags])
    assert message in err, err
    assert not (tmp_path / "o").exists()


def test_dynamic_sampling_that_finds_no_signal_stops_in_one_line(tmp_path, prompts, capsys):
    """Every reply rewarded alike: after its tries, the run stops naming the step and the rewards seen."""
    rule = tmp_path / "flat.py"
    rule.write_text("def reward(record, reply):\n    return 0.5\n")
    err = bad_run(capsys, tmp_path, BASE + ["--prompts", str(prompts), "--out-dir", str(tmp_path / "o"),
                                            "--reward-fn", f"{rule}:reward", "--dynamic-sampling", "2"])
    assert ("error: step 1: --dynamic-sampling 2: 1 dp rank(s) found no group of replies whose rewards differ "
            "in 3 micro-batches of prompts (the rewards here: 0.5)") in err, err


def test_sums_out_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me\n")
    assert f"--out-dir {taken} exists and is not a folder" in refused(capsys, rl.main, ["sums", "--out-dir",
                                                                                     str(taken)])
    assert f"cannot write into {taken / 'sub'}" in refused(capsys, rl.main, ["sums", "--out-dir",
                                                                            str(taken / "sub")])
    assert taken.read_text() == "keep me\n"


@pytest.mark.parametrize("body,message", [
    ("def f(record, reply):\n    raise ValueError('no')\n", "raised ValueError: no (on the prompt "),
    ("def f(record, reply):\n    return float('nan')\n", "returned nan for a reply to "),
    ("def f(record, reply):\n    return 1e39\n", "returned 1e+39 for a reply to "),  # inf in fp32
])
def test_a_failing_reward_stops_the_run_in_one_line_and_keeps_its_checkpoint(tmp_path, prompts, capsys, body,
                                                                            message):
    """The rule fails at step 3; the checkpoint of step 2 stays the good one, and --resume goes on from it
    once the rule works."""
    fn = tmp_path / "fn.py"
    fn.write_text("calls = 0\n" + body.replace("def f(record, reply):\n", "def f(record, reply):\n"
                                               "    global calls\n    calls += 1\n    if calls <= 16:\n"
                                               "        return float(len(reply))\n"))
    out = tmp_path / "o"
    argv = BASE + ["--prompts", str(prompts), "--out-dir", str(out), "--max-steps", "3", "--ckpt-every", "1",
                   "--reward-fn", f"{fn}:f"]
    err = bad_run(capsys, tmp_path, argv)
    assert f"--reward-fn {fn}:f {message}" in err
    assert C.read_latest(out).name == C.step_name(2)
    fn.write_text("def f(record, reply):\n    return float(len(reply))\n")
    rl.main(argv + ["--resume"])
    assert C.read_latest(out).name == C.step_name(3)


def test_a_reward_model_scores_rollouts_and_one_of_another_tokenizer_is_refused(tmp_path, prompts, capsys):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"}) + "\n"
                             for i in range(8)))
    rms = {}
    for tokenizer in ("byte", "gpt2"):
        rms[tokenizer] = tmp_path / f"rm-{tokenizer}"
        reward.main(["--model", "tiny", "--tokenizer", tokenizer, "--seq-len", "32", "--data", str(pairs),
                     "--max-steps", "1", "--warmup", "1", "--micro-batch", "2", "--eval-every", "0",
                     "--val-fraction", "0.25",
                     "--out-dir", str(rms[tokenizer])])
    argv = [a for a in BASE if a not in ("--reward-fn", "arithmetic-length")] + ["--prompts", str(prompts)]
    rl.main(argv + ["--max-steps", "2", "--reward", str(rms["byte"]), "--out-dir", str(tmp_path / "ok")])
    got = steps(tmp_path / "ok")
    assert len(got) == 2 and all(math.isfinite(r["reward"]) and r["reward"] != 0 for r in got)
    err = bad_run(capsys, tmp_path, argv + ["--reward", str(rms["gpt2"]), "--out-dir", str(tmp_path / "o")])
    assert f"--reward {rms['gpt2']} reads the tokenizer gpt2, the policy writes byte" in err


# ----------------------------------------------------------------------------------------------------
# A reward model where a language model belongs, and the reverse


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny language model (a train.py checkpoint) and a tiny reward model (a checkpoint and its Hugging
    Face export, a LlamaForSequenceClassification), both of the byte tokenizer; and preference pairs."""
    root = tmp_path_factory.mktemp("models")
    pairs = write_jsonl(root / "pairs.jsonl", [{"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"}
                                               for i in range(8)])
    lm, rm = root / "lm", root / "rm"
    train.main(["--model", "tiny", "--tokenizer", "byte", "--seq-len", "48", "--max-steps", "1", "--warmup", "1",
                "--eval-every", "-1", "--sample-tokens", "0", "--out-dir", str(lm)])
    reward.main(["--model", "tiny", "--tokenizer", "byte", "--seq-len", "48", "--data", str(pairs),
                 "--max-steps", "1", "--micro-batch", "2", "--eval-every", "0", "--val-fraction", "0.25",
                 "--warmup", "1", "--out-dir", str(rm)])
    assert C.main(["consolidate", str(rm), "--hf", str(root / "rm-hf")]) == 0
    return SimpleNamespace(lm=lm, rm=rm, rm_hf=root / "rm-hf", pairs=pairs)


def refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        config.run(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert stop.value.code == 1 and "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_a_reward_model_is_refused_where_a_language_model_belongs_and_the_reverse(tmp_path, prompts, models,
                                                                                   capsys, monkeypatch):
    """A reward model's head has one output: sampled as a policy every token would be id 0, and the run would
    train on empty replies. Wherever a language model is expected (rl.py and rl.py eval --init, sft.py and
    dpo.py --init, evaluate.py's perplexity, benchmarks and --prompt) and wherever a reward model is (rl.py
    and rl.py eval --reward), the other kind is one line from what the folder records, before any model is
    built, and nothing is written. evaluate.py --diff, which compares weights, takes a reward model."""
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(a))
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: built.append(a))
    out = tmp_path / "o"
    rules = ["--reward-fn", "arithmetic", "--prompts", str(prompts)]
    eval_rl = ["eval", "--prompts", str(prompts), "--seq-len", "48"]
    fine_tune = ["--model", "tiny", "--seq-len", "48", "--max-steps", "1", "--warmup", "1",
                 "--out-dir", str(out)]
    lm_for_rm = [(rl.main, BASE + ["--prompts", str(prompts), "--out-dir", str(out), "--init", str(models.rm)]),
                 (rl.main, eval_rl + ["--init", str(models.rm), "--reward-fn", "arithmetic"]),
                 (sft.main, fine_tune + ["--init", str(models.rm), "--data", str(out.with_suffix(".jsonl"))]),
                 (dpo.main, fine_tune + ["--init", str(models.rm), "--data", str(models.pairs)]),
                 (evaluate.main, ["--init", str(models.rm), "--task", "tinyshakespeare"]),
                 (evaluate.main, ["--init", str(models.rm), "--prompt", "Hello"]),
                 (evaluate.main, ["--init", str(models.rm), "--task", "needle"])]
    for main, argv in lm_for_rm:
        assert f"--init {models.rm} is a reward model (a head of 1 output, no vocabulary)" in \
            refused(capsys, main, argv), argv
    assert f"--init {models.rm_hf} is a reward model" in refused(capsys, rl.main, BASE[:-2] + rules + [
        "--out-dir", str(out), "--init", str(models.rm_hf)])
    no_rule = [a for a in BASE if a not in ("--reward-fn", "arithmetic-length")]
    for main, argv in [(rl.main, no_rule + ["--prompts", str(prompts), "--out-dir", str(out), "--init",
                                            str(models.lm), "--reward", str(models.lm)]),
                       (rl.main, eval_rl + ["--init", str(models.lm), "--reward", str(models.lm)])]:
        assert f"--reward {models.lm} is not a reward model (a language model)" in refused(capsys, main, argv)
    assert not out.exists() and not built
    monkeypatch.undo()
    assert evaluate.main(["--diff", str(models.rm), str(models.rm), "--json"]) is None
    assert json.loads(capsys.readouterr().out)["a"] == str(models.rm)


def test_rules_that_can_never_hold_are_refused_before_the_model_is_built(tmp_path, prompts, models, capsys,
                                                                         monkeypatch):
    """rl.py and rl.py eval: a rule that checks the "answer" on prompts without one (or with one that is no
    number: every reward 0, a run that learns nothing), a FILE.py:FUNCTION that is missing, not callable or
    does not take (record, reply), and a rule file that calls sys.exit on import (which ended the run with
    exit 0 and nothing written): one line, exit 1, before any model is built, nothing written."""
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(a))
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: built.append(a))
    questions = [{"prompt": f"What is {i} + 1?"} for i in range(10)]
    no_answer = write_jsonl(tmp_path / "q.jsonl", questions)
    words = write_jsonl(tmp_path / "w.jsonl", [{**q, "answer": "three"} for q in questions])

    def rule(name, body):
        (tmp_path / f"{name}.py").write_text(body)
        return f"{tmp_path / name}.py:f"

    cases = [([no_answer, "arithmetic"], f'10 of 10 prompt(s) have none that is a number (the first, '
                                         f'{no_answer}:1: it has no "answer")'),
             ([words, "arithmetic-length"], "(the first, " + f"{words}:1: its answer 'three' is not a number)"),
             ([prompts, rule("none", "def g(record, reply):\n    return 1.0\n")], "none.py defines no f"),
             ([prompts, rule("value", "f = 3\n")], "f is a int, not a function"),
             ([prompts, rule("one", "def f(reply):\n    return 1.0\n")], "f must take (prompt record, reply "
                                                                           "text): too many positional"),
             ([prompts, rule("leaves", "import sys\nsys.exit()\n")], "leaves.py raised sys.exit(None)"),
             ([prompts, rule("quits", "raise SystemExit(0)\n")], "quits.py raised sys.exit(0)")]
    out = tmp_path / "o"
    for (where, fn), message in cases:
        flags = ["--prompts", str(where), "--reward-fn", fn]
        for argv in (BASE[:-2] + flags + ["--out-dir", str(out)],
                     ["eval", "--init", str(models.lm), "--seq-len", "48"] + flags):
            assert message in refused(capsys, rl.main, argv), argv
    assert not out.exists() and not built


def test_a_rollout_that_fills_the_room_is_scored_at_its_end(models):
    """A rollout is up to seq_len + 1 tokens (prompt + reply, the room rl.py leaves): the reward model reads
    such a reply at its <|eot_id|>, as it reads a shorter one, not at the token before."""
    model, tok = evaluate.load_reward_model(models.rm, torch.device("cpu"))
    prompt, reply = [{"role": "user", "content": "What is 1 + 2?"}], "1 + 2 = 3"
    n = len(chat.reply_example(tok, prompt, reply, 100)[0][0])  # prompt + reply, with its <|eot_id|>
    a = SimpleNamespace(reward=str(models.rm), mirror=None)
    score = rl.make_scorer(a, None, tok, torch.device("cpu"), torch.float32, P.Mesh(), n - 1)
    at_eot = evaluate.score_replies(model, tok, prompt, [reply], n)
    assert score({"messages": prompt}, [reply]) == pytest.approx(at_eot.tolist(), abs=1e-6)
    assert at_eot.item() != pytest.approx(evaluate.score_replies(model, tok, prompt, [reply], n - 1).item(),
                                          abs=1e-6)
