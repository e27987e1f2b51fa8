"""rl.py's GRPO family against TRL's GRPOTrainer itself (trl 1.16, in the test extras), on identical rollouts:
TRL's generation is replaced by fixed completions (its rollout_func), its reward by fixed rewards, and its
policy and reference are Hugging Face exports of ours. For each loss type and setting, on policy (one update
per rollout, rl.py's) and off policy (the policy moved since the rollout: TRL's num_iterations 2): the
advantages, the per-token log-probs, the loss, every gradient and the logged kl and clip ratio agree within
1e-6. Everything runs in float64, so what is left is the two implementations' float error."""

import os
from types import SimpleNamespace

import datasets
import pytest
import torch
import transformers
import trl

import data
import model as M
import parallel as P
import rl
import weights as W

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # (rollout_func is marked experimental)

BYTE = data.get_tokenizer("byte")
EOT = data.eot_id(BYTE)
G, MAX_NEW = 4, 8
PROMPTS = ["12+3=", "45+6="]  # the same length: TRL pads prompts on the left, rl.py's rows start at 0
# two groups of 4: replies that end at <|eot_id|> and two cut at MAX_NEW (no <|eot_id|>: truncated)
REPLIES = [b"15", b"1x5", b"15!!!!!!", b"3", b"51", b"51", b"5", b"9999999x"]
COMPLETIONS = [list(r) + ([EOT] if len(r) < MAX_NEW else []) for r in REPLIES]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]
ARGS = dict(loss_type="grpo", clip_eps=0.2, epsilon_high=None, scale_rewards="group", importance_sampling="token",
            mask_truncated=False, kl_bias_correction=False, kl_coef=0.04, temperature=1.0)
CASES = [  # (what differs from ARGS)
    dict(),
    dict(loss_type="dr_grpo", scale_rewards="none"),  # Dr. GRPO as its paper has it
    dict(loss_type="dapo", epsilon_high=0.28, kl_coef=0.0),  # TRL's defaults, with DAPO's clip-higher
    dict(loss_type="dapo", kl_bias_correction=True, mask_truncated=True, temperature=0.7),
    dict(loss_type="bnpo", scale_rewards="batch"),
    dict(importance_sampling="sequence", clip_eps=3e-4, epsilon_high=4e-4),  # GSPO's own clip range
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Our policy and reference in float64 (the policy a step away from the reference, so that the KL is not
    0) and the reference's Hugging Face export (TRL loads its reference from the policy's folder)."""
    torch.manual_seed(0)
    # (a head of the tokenizer's width: rl.py's log-probs leave out a padded head's rows, TRL's take them in)
    args = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTE.n_vocab)
    reference = M.Transformer(args).double()
    folder = tmp_path_factory.mktemp("hf")
    W.save_hf(reference, folder, W.hf_tokens(BYTE, chat=True), W.hf_tokenizer_files(BYTE, chat=True))
    return reference, folder


def moved(model, scale: float, seed: int):
    """A copy of model with every weight moved by scale x N(0, 1) (as an optimizer step would)."""
    out = M.Transformer(model.args).double()
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


def load_into(hf, ours):
    """Our weights into the Hugging Face model (the export's names: weights.hf_name)."""
    state = {W.hf_name(k): v for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(state[name])


def trl_run(case, folder, policy, old_policy, cuts):
    """TRL: rollouts and advantages (the policy at old_policy's weights, as when the replies were sampled),
    then the loss over the micro-batches `cuts` at policy's weights, backward. -> (outputs, the loss, the
    gradients under our names, the per-token log-probs, the logged metrics)."""
    c = {**ARGS, **case}
    cfg = trl.GRPOConfig(
        output_dir=str(folder / "trl"), report_to=[], use_cpu=True, bf16=False, disable_dropout=True,
        num_generations=G, per_device_train_batch_size=len(REPLIES) // len(cuts),
        gradient_accumulation_steps=len(cuts), max_completion_length=MAX_NEW, temperature=c["temperature"],
        loss_type=c["loss_type"], beta=c["kl_coef"], epsilon=c["clip_eps"], epsilon_high=c["epsilon_high"],
        scale_rewards=c["scale_rewards"], importance_sampling_level=c["importance_sampling"],
        mask_truncated_completions=c["mask_truncated"], use_bias_correction_kl=c["kl_bias_correction"],
        num_iterations=1 if policy is old_policy else 2)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)
    rollout = lambda prompts, trainer: {"prompt_ids": [list(p.encode()) for p in prompts],
                                        "completion_ids": COMPLETIONS, "logprobs": None}
    reward = lambda prompts, completions, completion_ids, **kw: REWARDS
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=reward, args=cfg, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              rollout_func=rollout)
    trainer.model.train()
    load_into(trainer.model, old_policy)
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    load_into(trainer.model, policy)
    trainer.current_gradient_accumulation_steps = len(cuts)
    loss = sum(trainer.compute_loss(trainer.model, {k: v[cut] if torch.is_tensor(v) and v.dim() else v
                                                     for k, v in out.items()}) for cut in cuts)
    loss.backward()
    grads = {k: dict(trainer.model.named_parameters())[W.hf_name(k)].grad for k, _ in policy.named_parameters()}
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                 out["completion_ids"].shape[1])
    # TRL logs each micro-batch's mean over its reply tokens: weighted by their counts, the global batch's
    tokens = [out["completion_mask"][cut].sum().item() for cut in cuts]
    metrics = {k: sum(m * n for m, n in zip(v, tokens)) / sum(tokens) for k, v in trainer._metrics["train"].items()
               if len(v) == len(cuts)}
    return out, loss, grads, logps, metrics


def our_task(case, policy, reference):
    c = {**ARGS, **case}
    a = SimpleNamespace(algo="grpo", group=G, seq_len=32, max_new_tokens=MAX_NEW, **c)
    a.epsilon_high = c["epsilon_high"] or c["clip_eps"]
    tiny = SimpleNamespace(args=policy.args)
    return rl.RLTask(P.Mesh(), a, tiny, BYTE, [{"where": "p:1"}], None,
                     reference=reference if c["kl_coef"] > 0 else None)


def our_rollouts(task, cuts):
    """The same replies as rl.py's roll_out lays them out: rows of prompt + reply, targets the reply."""
    x, y = rl.reply_rows([list(p.encode()) for p in PROMPTS for _ in range(G)], COMPLETIONS, task.args.seq_len,
                         data.pad_id(BYTE), EOT if task.args.mask_truncated else None)
    rewards = torch.tensor(REWARDS)  # (fp32, as rl.py and TRL hold them)
    e = {"reward": rewards, "length": torch.tensor([float(len(c)) for c in COMPLETIONS]), "correct": None,
         "reward_std": rewards.view(-1, G).std(dim=1).repeat_interleave(G),
         "ref": task.reference_logps(x, y) if task.reference is not None else None}
    rolled = [(x[cut], (y[cut], {k: v if v is None else v[cut] for k, v in e.items()})) for cut in cuts]
    return rl.GRPO.targets(task, rolled)


def completion_logps(logp, y):
    """Our (rows, seq_len) log-probs at the reply tokens -> TRL's (rows, longest reply) layout."""
    start = len(PROMPTS[0]) - 1
    return logp[:, start:start + max(map(len, COMPLETIONS))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "grpo")
@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy"])
def test_the_grpo_family_is_trls(models, case, on_policy):
    reference, folder = models
    old_policy = moved(reference, 0.02, seed=1)
    policy = old_policy if on_policy else moved(old_policy, 0.02, seed=2)  # ratios 0.6-1.5
    cuts = [slice(0, 4), slice(4, 8)]  # two micro-batches of one group each (bnpo's mean is per micro-batch)
    out, want, grads, want_logps, logged = trl_run(case, folder, policy, old_policy, cuts)

    task = our_task(case, policy, reference)
    rolled = our_rollouts(task, cuts)
    torch.testing.assert_close(torch.cat([e["adv"] for _, (_, e) in rolled]), out["advantages"], atol=1e-6,
                               rtol=0)
    policy.zero_grad()
    if on_policy:  # rl.py's path: RLTask.loss from the policy's logits
        loss = sum(task.loss(policy(x, seq_len=task.args.seq_len), target, torch.tensor(8.0, dtype=torch.float64))
                   for x, target in rolled)
    else:  # the same pieces with p_old from the policy that sampled
        shares = [off_policy_loss(task, policy, old_policy, x, y, e) for x, (y, e) in rolled]
        loss, clipped, tokens = (sum(s) for s in zip(*shares))
        assert 0 < logged["clip_ratio/region_mean"] < 1 and 0 < clipped < tokens  # (the clipping is exercised)
        if task.args.importance_sampling == "token":  # (per reply, TRL logs the share of replies clipped)
            assert abs(clipped / tokens - logged["clip_ratio/region_mean"]) < 1e-6
    loss.backward()
    assert abs(loss.item() - want.item()) < 1e-6 and loss.item() != 0
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=0, msg=name)
    x, y = rl.reply_rows([list(p.encode()) for p in PROMPTS for _ in range(G)], COMPLETIONS, 32, data.pad_id(BYTE))
    with torch.no_grad():
        ours_logps = completion_logps(task.token_logps(policy, x, y), y)
    torch.testing.assert_close(ours_logps[out["completion_mask"].bool()],
                               want_logps[out["completion_mask"].bool()], atol=1e-6, rtol=0)
    if on_policy:
        ours_logged = dict(zip(task.metric_names, task.metrics().tolist()))
        assert abs(ours_logged["kl"] - logged.get("kl", 0.0)) < 1e-6
        assert abs(ours_logged["clip_ratio"] - logged["clip_ratio/region_mean"]) < 1e-6


def off_policy_loss(task, policy, old_policy, x, y, e):
    """GRPO's loss from its pieces (rl.grpo_token_losses, rl.LOSS_TYPES) with p_old the sampling policy's;
    also the count of reply tokens where the clipped term won, and of all reply tokens."""
    a, mask = task.args, (y != data.IGNORE_INDEX).double()
    logp = task.token_logps(policy, x, y)
    with torch.no_grad():
        old = task.token_logps(old_policy, x, y)
    losses, _, clipped = rl.grpo_token_losses(logp, old, e["ref"], e["adv"], mask, (a.clip_eps, a.epsilon_high),
                                              task.beta, a.importance_sampling, a.kl_bias_correction)
    return (rl.LOSS_TYPES[a.loss_type](losses, mask, e, a, torch.tensor(8.0, dtype=torch.float64)),
            (clipped * mask).sum().item(), mask.sum().item())
