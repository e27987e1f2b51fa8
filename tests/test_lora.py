"""LoRA (model.add_lora and the recipes' --lora-rank): the adapted model computes what its merged weights
compute; only the adapters train, the model they adapt stays as it was; a checkpoint holds the adapters alone
and is a model again merged (--init, evaluate.py, consolidate --hf) or as PEFT's adapters (consolidate
--peft); DPO's reference is the model itself with its adapters off; the memory estimate knows it. Parity
under tp, pp and dp/ZeRO: tests/test_parallel.py."""
import json
import math
import os

import pytest
import torch
import transformers  # test-only dependency: requirements-test.txt

import checkpoint as C
import config
import costs
import data
import dpo
import evaluate
import helpers
import model as M
import parallel as P
import plan
import reward
import rl
import sft
import train
import weights as W

RUN = ["--model", "tiny", "--seq-len", "64", "--warmup", "2", "--log-every", "1", "--eval-every", "0",
       "--eval-batches", "1", "--val-fraction", "0.2", "--ckpt-every", "1000"]
TINY = RUN + ["--sample-prompt", ""]  # (sft.py and dpo.py answer one at the end)
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def adapted(targets=M.LORA_TARGETS, seed=0):
    """A tiny model with adapters of rank 4 whose B is not zero (as after training)."""
    torch.manual_seed(seed)
    model = M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320))
    with torch.device("meta"):
        M.add_lora(model, 4, 8.0, targets)
    for name, p in list(model.named_parameters()):
        if M.is_lora(name):
            module, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            setattr(module, attr, torch.nn.Parameter(torch.randn(p.shape) * 0.1))
    return model


def merged(model):
    """The plain architecture with each adapted weight merged: W + (alpha / r) B A."""
    out = M.Transformer(model.args)
    state = {name: t for name, t in model.state_dict().items() if not M.is_lora(name)}
    for name, linear in M.lora_linears(model):
        if linear.lora_A is not None:
            state[f"{name}.weight"] = M.merge_lora(linear.weight, linear.lora_A, linear.lora_B,
                                                   linear.lora_scale)
    out.load_state_dict(state)
    return out


def test_a_merged_model_computes_what_the_adapted_one_does():
    model, tokens = adapted(), torch.randint(0, 320, (2, 16))
    assert sorted({n.rsplit(".", 1)[1] for n, p in model.named_parameters() if p.requires_grad}) == [
        "lora_A", "lora_B"]  # everything else frozen
    with torch.no_grad():
        ours, theirs = model(tokens), merged(model)(tokens)
        with M.without_lora(model):
            base = model(tokens)
        unadapted = M.Transformer(model.args)
        unadapted.load_state_dict({k: v for k, v in model.state_dict().items() if not M.is_lora(k)})
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base, unadapted(tokens), rtol=0, atol=0)  # adapters off: the model itself
    assert (ours - base).abs().max() > 1e-2  # and the adapters do change it


def test_the_estimate_counts_the_adapters_it_trains():
    """costs.lora_params (r (in + out) per linear, the side tp cuts divided) is what add_lora makes on one tp
    rank of a model cut by parallel.apply_tensor_parallel."""
    margs = M.ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320)
    for tp, targets in [(1, M.LORA_TARGETS), (2, M.LORA_TARGETS), (2, ("wq", "wv", "w2"))]:
        with torch.device("meta"):
            model = P.apply_tensor_parallel(M.Transformer(margs), P.Mesh(P.Layout(tp=tp)))
            M.add_lora(model, 8, 16.0, targets)
        made = sum(p.numel() for n, p in model.named_parameters() if M.is_lora(n))
        assert made == costs.lora_params(margs, 8, targets, tp) * margs.n_layers
    # Llama 3.1 8B SFT with LoRA fits one 24 GB GPU; fully fine-tuned it needs six times that
    big = M.PRESETS["llama3.1-8b"]
    shape = costs.Shape(1, 1024, act_ckpt=True)
    lora = costs.memory_estimate(big, P.Layout(), shape, lora=(16, M.LORA_TARGETS))
    full = costs.memory_estimate(big, P.Layout(), shape)
    assert lora["total"] < 20e9 < 6 * 20e9 < full["total"]
    planned = lambda **kw: plan.plan("llama3.1-8b", 1e8, P.Layout(),
                                     costs.Shape(1, 1024, grad_accum=16, act_ckpt=True, loss_chunk=1024),
                                     "RTX 4090", 0.4, **kw)
    assert planned(lora=(16, M.LORA_TARGETS))["fits"] and not planned()["fits"]


@pytest.fixture(scope="module")
def lora_sft(tmp_path_factory):
    """A base model exported (a Hugging Face folder), then SFT with LoRA from it: (base, the run, out)."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(1)
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)),
              root / "base", W.hf_tokens(data.get_tokenizer("byte"), chat=False))
    args = sft.get_parser().parse_args(TINY + LORA + ["--init", str(root / "base"), "--max-steps", "12",
                                                      "--lr", "1e-2", "--out-dir", str(root / "out")])
    run = train.post_train(args, sft.SFT)
    return root / "base", run, root / "out"


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(lora_sft):
    base, run, out = lora_sft
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.05
    assert all(M.is_lora(name) for name in run.opt.names) and len(run.opt.names) == 2 * 7 * 2
    initial = helpers.load_hf(base).state_dict()
    for name, p in run.model.named_parameters():
        if not M.is_lora(name):
            assert not p.requires_grad and torch.equal(p.detach(), initial[name]), name  # untouched
    step = C.read_latest(out)
    full, _ = C.read_full_state(step)
    assert sorted(full) == sorted(run.opt.names)  # the adapters alone, with their Adam moments
    assert C.read_meta(step)["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(M.LORA_TARGETS), "seed": 1337,
                                         "base": str(base.resolve()), "base_fingerprint": C.fingerprint(base),
                                         "base_files": C.weight_files(base)}


def test_a_lora_checkpoint_is_a_model_again_merged(lora_sft, tmp_path, capsys):
    """--init, evaluate.py and consolidate --hf read it as the model it adapts with the adapters merged: the
    logits of transformers' LlamaForCausalLM on the export are those of the adapted model in training."""
    base, run, out = lora_sft
    tokens = torch.randint(0, 260, (2, 24))
    with torch.no_grad():
        ours = run.model.eval()(tokens)
    tok = data.get_tokenizer("byte")
    loaded = evaluate.load_model(out, tok, torch.device("cpu"), torch.float32, P.Mesh())
    assert C.main(["consolidate", str(out), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-5, atol=1e-5)


def with_adapters(model, folder):
    """What PEFT makes of a transformers model and `folder`'s adapters, merged: each targeted module's weight
    plus (lora_alpha / r) lora_B @ lora_A."""
    config_ = json.loads((folder / "adapter_config.json").read_text())
    adapters = W.read_safetensors(folder / "adapter_model.safetensors")
    with torch.no_grad():
        for key, A in adapters.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                B = adapters[key.replace("lora_A", "lora_B")]
                model.get_submodule(name).weight += config_["lora_alpha"] / config_["r"] * B @ A
    return model.eval()


def test_the_adapters_alone_in_peft_layout(lora_sft, tmp_path):
    """consolidate --peft: PEFT's file names, keys and shapes, and its meaning: the base export's weights
    plus (lora_alpha / r) lora_B @ lora_A, module by module, give the merged export's logits. The base, a
    Hugging Face folder, is named where transformers loads it."""
    base, run, out = lora_sft
    assert C.main(["consolidate", str(out), "--peft", str(tmp_path / "peft")]) == 0
    assert C.main(["consolidate", str(out), "--hf", str(tmp_path / "hf")]) == 0
    config_ = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config_["peft_type"] == "LORA" and config_["base_model_name_or_path"] == str(base.resolve())
    assert sorted(config_["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapters = W.read_safetensors(tmp_path / "peft" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapters
    assert adapters["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    model = transformers.AutoModelForCausalLM.from_pretrained(config_["base_model_name_or_path"])
    tokens = torch.randint(0, 260, (2, 24))
    with torch.no_grad():
        merged_logits = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
        logits = with_adapters(model, tmp_path / "peft")(tokens).logits
    torch.testing.assert_close(logits, merged_logits, rtol=1e-5, atol=1e-5)


def test_adapters_of_a_checkpoint_load_on_its_export(tmp_path):
    """A base that is a checkpoint of ours, which PEFT cannot load, is named nowhere (null); the way the README
    gives, the base exported with --hf and the adapters put on it, computes the merged export's logits."""
    train.main(["--model", "tiny", "--seq-len", "32", "--max-steps", "1", "--warmup", "1", "--eval-every", "-1",
                "--sample-tokens", "0", "--out-dir", str(tmp_path / "pre")])
    sft.main(TINY + LORA + ["--init", str(tmp_path / "pre"), "--max-steps", "3", "--lr", "1e-2",
                            "--out-dir", str(tmp_path / "o")])
    for command in (["pre", "--hf", "base-hf"], ["o", "--peft", "peft"], ["o", "--hf", "hf"]):
        assert C.main(["consolidate", str(tmp_path / command[0]), command[1], str(tmp_path / command[2])]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    tokens = torch.randint(0, 260, (2, 24))
    with torch.no_grad():
        merged_logits = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf")
        torch.testing.assert_close(with_adapters(base, tmp_path / "peft")(tokens).logits, merged_logits,
                                   rtol=1e-5, atol=1e-5)


def test_dpo_with_lora_has_no_second_model(lora_sft, tmp_path):
    """The reference is the policy itself with its adapters off: at the first step the two agree (loss
    log 2), the run holds one model, and the reference stays the model it started from."""
    _, _, sft_out = lora_sft
    pairs = [{"prompt": f"Question {i}?", "chosen": f"Yes {i}.", "rejected": f"No idea {i}."}
             for i in range(16)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    args = dpo.get_parser().parse_args(TINY + LORA + ["--init", str(sft_out), "--data", str(path),
                                                      "--max-steps", "4", "--out-dir", str(tmp_path / "o")])
    run = train.post_train(args, dpo.DPO)
    # it adapts the step --init named, not the out-dir, whose newest step may change
    assert C.read_meta(C.read_latest(tmp_path / "o"))["lora"]["base"] == str(C.read_latest(sft_out))
    first = json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert run.task.reference is run.model and dpo.DPO(args).frozen_copies == 0
    tokens = torch.randint(0, 260, (1, 16))
    start = evaluate.load_model(sft_out, data.get_tokenizer("byte"), torch.device("cpu"), torch.float32,
                                P.Mesh())
    with torch.no_grad(), M.without_lora(run.model):
        torch.testing.assert_close(run.model.eval()(tokens), start(tokens), rtol=1e-5, atol=1e-5)


def test_a_reward_model_and_rl_with_lora(lora_sft, tmp_path, capsys):
    """reward.py trains its new head whole beside the adapters, and scores pairs from the merged checkpoint;
    rl.py's reference (GRPO) is the policy's own model with its adapters off, beside PPO's value head."""
    base, _, _ = lora_sft
    pairs = [{"prompt": f"Question {i}: is {i} a number?", "chosen": f"Yes, {i} is a number.",
              "rejected": f"No idea about {i}."} for i in range(16)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    rm = tmp_path / "rm"
    reward.main(RUN + LORA + ["--seq-len", "128", "--init", str(base), "--data", str(tmp_path / "p.jsonl"),
                               "--max-steps", "30", "--lr", "3e-2", "--micro-batch", "4", "--out-dir", str(rm)])
    trained = sorted(C.read_full_state(C.read_latest(rm))[0])
    assert "output.weight" in trained and all(M.is_lora(n) for n in trained if n != "output.weight")
    capsys.readouterr()
    assert reward.main(["score", "--reward", str(rm), "--data", str(tmp_path / "p.jsonl"),
                        "--seq-len", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == 1.0
    prompts = tmp_path / "sums.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in rl.sums(40, seed=0, high=10)))
    for algo in ("grpo", "ppo"):
        args = rl.get_parser().parse_args(
            ["--init", str(base), "--seq-len", "48", "--max-new-tokens", "8", "--micro-batch", "2",
             "--group", "4", "--log-every", "1", "--eval-every", "0", "--val-fraction", "0.2",
             "--reward-fn", "arithmetic-length", "--prompts", str(prompts), "--max-steps", "2", "--algo", algo,
             "--kl-coef", "0.05", "--out-dir", str(tmp_path / algo), *LORA])
        rl.check_flags(args)
        run = train.train(args, rl.RL(args))
        assert run.task.reference is run.model and rl.RL(args).frozen_copies == 0
        assert all(M.is_lora(n) or n.startswith("value_head.") for n in run.opt.names)
    assert C.main(["consolidate", str(tmp_path / "ppo"), "--peft", str(tmp_path / "peft")]) == 0  # (no critic)
    assert all(".lora_" in k for k in W.read_safetensors(tmp_path / "peft" / "adapter_model.safetensors"))


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "0"], "--lora-rank 0: must be at least 1 and at most the smallest side of a targeted"),
    (["--lora-rank", "33"], "--lora-rank 33: must be at least 1 and at most the smallest side of a targeted "
                            "matrix (32)"),  # wk's and wv's: 2 heads of 16 out
    (["--lora-rank", "4", "--lora-targets", "wq,query"], "--lora-targets 'wq,query': query matches no linear"),
    (["--lora-rank", "4", "--lora-alpha", "-1"], "--lora-alpha -1.0: must be a positive number"),
    (["--lora-rank", "4", "--zero", "3"], "--zero 3 shards the weights the optimizer trains"),
])
def test_bad_lora_flags_are_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        config.run(sft.main, TINY + ["--out-dir", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err[-1].startswith("error: ") and message in err[-1], err
    assert not (tmp_path / "o").exists()


def test_resume_keeps_the_adapters_settings(lora_sft, tmp_path, capsys):
    """--resume of a LoRA run without LoRA (or with another rank) would find no weights to load: one line."""
    base, _, out = lora_sft
    run = tmp_path / "o"
    sft.main(TINY + LORA + ["--init", str(base), "--max-steps", "2", "--out-dir", str(run)])
    for flags in ([], ["--lora-rank", "8"]):
        with pytest.raises(SystemExit):
            config.run(sft.main, TINY + flags + ["--init", str(base), "--max-steps", "3", "--out-dir", str(run),
                                                 "--resume"])
        assert "was trained with LoRA {'rank': 4" in capsys.readouterr().err
    sft.main(TINY + LORA + ["--init", str(base), "--max-steps", "3", "--out-dir", str(run), "--resume"])
    assert C.read_latest(run).name == "step_000003"


def test_the_model_a_checkpoint_adapts_must_be_the_one_it_was_trained_on(tmp_path, capsys):
    """Rewritten since (another model exported to the same folder), the base would give a merged model
    that nobody trained: reading the checkpoint as a model is refused in one line."""
    torch.manual_seed(2)
    tiny = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)
    tokens = W.hf_tokens(data.get_tokenizer("byte"), chat=False)
    W.save_hf(M.Transformer(tiny), tmp_path / "base", tokens)
    sft.main(TINY + LORA + ["--init", str(tmp_path / "base"), "--max-steps", "1", "--warmup", "1",
                            "--out-dir", str(tmp_path / "o")])
    W.save_hf(M.Transformer(tiny), tmp_path / "base", tokens)  # another model under the same name
    for export in ("--hf", "--peft"):  # (the adapters alone too: they would be applied to that other model)
        assert C.main(["consolidate", str(tmp_path / "o"), export, str(tmp_path / "export")]) == 1
        err = capsys.readouterr().err  # (same files, same sizes: no byte is read to tell it from a touch)
        assert len(err.splitlines()) == 1 and "whose weight files may have changed since it was trained" in err
        assert not (tmp_path / "export").exists()
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320)),
              tmp_path / "base", tokens)  # a larger model there: changed, for certain
    assert C.main(["consolidate", str(tmp_path / "o"), "--hf", str(tmp_path / "export")]) == 1
    assert "whose weight files have changed since it was trained" in capsys.readouterr().err


def test_a_touched_base_is_said_to_may_have_changed_and_its_times_back_resume(tmp_path, capsys):
    """A base only touched (or copied back with the same bytes) was refused as "changed": what is known
    without reading the weights is said as it is, for --resume too, and its old times back, it resumes."""
    tiny = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)
    W.save_hf(M.Transformer(tiny), tmp_path / "base", W.hf_tokens(data.get_tokenizer("byte"), chat=False))
    flags = TINY + LORA + ["--init", str(tmp_path / "base"), "--warmup", "1", "--out-dir", str(tmp_path / "o")]
    sft.main(flags + ["--max-steps", "1"])
    weights = tmp_path / "base" / "model.safetensors"
    then = weights.stat()
    os.utime(weights, ns=(then.st_atime_ns, then.st_mtime_ns + 10 ** 9))  # touched
    with pytest.raises(SystemExit):
        config.run(sft.main, flags + ["--max-steps", "2", "--resume"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "may have changed since it was trained" in err and "cp -p" in err
    os.utime(weights, ns=(then.st_atime_ns, then.st_mtime_ns))
    sft.main(flags + ["--max-steps", "2", "--resume"])
    assert C.read_latest(tmp_path / "o").name == "step_000002"


def test_lora_is_refused_where_it_cannot_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config.run(train.main, ["--model", "tiny", "--lora-rank", "4", "--out-dir", str(tmp_path / "o")])
    assert "LoRA adapts a trained model; use it with sft.py" in capsys.readouterr().err
    train.main(["--model", "tiny", "--seq-len", "32", "--max-steps", "1", "--warmup", "1", "--eval-every", "-1",
                "--sample-tokens", "0", "--out-dir", str(tmp_path / "plain")])
    assert C.main(["consolidate", str(tmp_path / "plain"), "--peft", str(tmp_path / "p")]) == 1
    assert "is not a LoRA checkpoint (no --lora-rank): export it whole with --hf" in capsys.readouterr().err
    # a tokenizer with ids the base has no rows for: the new rows would stay frozen at their start
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256)),
              tmp_path / "small", W.hf_tokens(data.get_tokenizer("byte"), chat=False))
    with pytest.raises(SystemExit):
        config.run(sft.main, TINY + LORA + ["--init", str(tmp_path / "small"),
                                            "--out-dir", str(tmp_path / "s")])
    assert "the rows added for them could never learn" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a reward model's head has one output: no choices to score
        config.run(reward.main, RUN + ["--data", "hh_rlhf_harmless_test", "--eval-tasks", "piqa:4",
                                       "--out-dir", str(tmp_path / "r")])
    assert "--eval-tasks scores the choices of a language model" in capsys.readouterr().err
