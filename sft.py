"""Supervised fine-tuning (SFT): turn a pretrained next-token predictor into an assistant.

    python sft.py --init out --data alpaca_5000                        # from a train.py checkpoint
    torchrun --nproc_per_node=8 sft.py --init Llama-3.2-1B --tokenizer llama3 --tp 2   # from HF weights

The same training loop as train.py (its seven phases, flags, parallel layouts, checkpoints and --resume);
only its recipe differs (the SFT class):
  - the model: loaded from --init (a train.py/sft.py checkpoint folder, a Hugging Face folder, or a Meta
    folder); a tokenizer with more ids than the model grows its embedding and output rows;
  - the data: conversations in the Llama 3 chat format (data.py), whose targets are the assistant's tokens
    and their <|eot_id|> only (everything else is IGNORE_INDEX), packed several to a sequence with
    attention and positions that never cross from one example into another (--no-pack: one per row);
  - nothing else: the loss is the same sum of token cross-entropies over the global count of target tokens,
    so train and validation losses are the mean loss on response tokens.
At the end it answers --sample-prompt in chat mode.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import checkpoint as C
import data
import model as M
import parallel as P
import train as T


def get_parser() -> argparse.ArgumentParser:
    p = T.get_parser()
    p.description = "Supervised fine-tuning on conversations (targets: the assistant's tokens)."
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--init", default=None,
                   help="start from: a train.py/sft.py --out-dir or step folder, a Hugging Face folder "
                        "(config.json + *.safetensors) or a Meta folder (params.json + consolidated.*.pth)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="pack several examples per sequence (attention never crosses examples)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of conversations held out")
    g.add_argument("--sample-prompt", default="Give three tips for staying healthy.",
                   help="a user message answered in chat mode at the end ('' to skip)")
    p.set_defaults(data="alpaca_5000", out_dir="out-sft", lr=3e-4, warmup=20, max_steps=300, eval_every=100,
                   eval_batches=20, ckpt_every=300, log_every=20, seq_len=256, micro_batch=8)
    return p


# ----------------------------------------------------------------------------------------------------
# The model to start from


def load_init(path, tok, verify: bool = True) -> tuple[M.ModelArgs, dict]:
    """--init -> (model args, full state dict), from any of the three formats. A checkpoint is verified
    against its manifest, as --resume does, unless verify=False: for a job whose rank 0 has verified it."""
    path = Path(path)
    if C.is_checkpoint(path):
        path = C.resolve(path, verify=verify)
    try:
        if C.is_checkpoint(path):
            margs = checkpoint_args(path)
            full, _ = P.read_full_state(path, keys=("master",))  # lazy: assembled when a rank needs it
            master = lambda name: (lambda: full[name]["master"])
            state = M.LazyState({name: master(name) for name in full} |
                                ({"output.weight": master("tok_embeddings.weight")} if margs.tie_embeddings else {}))
        elif (path / "config.json").exists():  # read lazily: each rank reads only the weights it keeps
            margs, state = M.hf_state(path)
        elif (path / "params.json").exists():
            model = M.load_meta(path)
            margs, state = model.args, model.state_dict()
        else:
            raise T.ConfigError(f"--init {path}: not a checkpoint folder, a Hugging Face folder (config.json) "
                                f"or a Meta folder (params.json)")
    except (T.ConfigError, C.CheckpointError):
        raise
    except Exception as e:
        raise T.ConfigError(f"cannot read --init {path}: {type(e).__name__}: {data.one_line(e)}")
    if tok.n_vocab > margs.vocab_size:
        margs, state = grow_vocab(margs, state, tok.n_vocab)
    return margs, state


def checkpoint_args(step: Path) -> M.ModelArgs:
    """A checkpoint's model args, from its meta.json alone."""
    return M.ModelArgs(**C.read_meta(step)["model_args"])


def with_room_for(margs: M.ModelArgs, n_vocab: int) -> M.ModelArgs:
    """The model args with a row for every id of a tokenizer with n_vocab ids (rounded up to 64 rows)."""
    if n_vocab <= margs.vocab_size:
        return margs
    return M.ModelArgs(**{**margs.__dict__, "vocab_size": 64 * ((n_vocab + 63) // 64)})


def grow_vocab(margs: M.ModelArgs, state: dict, n_vocab: int) -> tuple[M.ModelArgs, dict]:
    """Add embedding and output rows for ids the model has never seen (e.g. chat tokens appended to a base
    vocabulary). New rows start at the mean of the existing rows (Hewitt 2021): a new token begins as an
    'average' token, and its logit as the mean logit, rather than as noise of an unrelated scale."""
    grown = with_room_for(margs, n_vocab)
    state = collections.ChainMap({}, state)  # the grown tensors over the rest (a lazy state stays lazy)
    for name in ("tok_embeddings.weight", "output.weight"):
        if name in state:
            w = state[name]
            state[name] = torch.cat([w, w.mean(dim=0, keepdim=True).expand(grown.vocab_size - w.shape[0], -1)])
    print(f"vocabulary grown from {margs.vocab_size} to {grown.vocab_size} rows (new rows = mean of the old)", flush=True)
    return grown, state


# ----------------------------------------------------------------------------------------------------
# The data


def split_and_report(what: str, n_read: int, examples, counts, args, mesh):
    """Train/val split of tokenized examples, with the length rule's counts printed once."""
    if not examples:
        raise data.DataError(f"{args.data}: no usable {what} (all dropped: {counts})")
    train_ex, val_ex = data.split_examples(examples, args.val_fraction, args.seed)
    if mesh.rank == 0:
        print(f"{args.data}: {n_read:,} {what}s -> {counts['examples']:,} examples ({counts['truncated']:,} "
              f"truncated to {args.seq_len + 1} tokens keeping their first targets, {counts['dropped']:,} dropped "
              f"with no target left), {counts['target_tokens']:,} target tokens; {len(train_ex):,} train / "
              f"{len(val_ex):,} val", flush=True)
    return train_ex, val_ex


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's, with these three answers


class SFT(T.Pretraining):
    """train.py's recipe with the model from --init and conversations as the data."""

    def name(self) -> str:
        return self.args.init or self.args.model

    def model_args(self, tok) -> M.ModelArgs:
        """The shape at once; the weights (below) once the job's processes can talk. From a checkpoint the
        shape comes from meta.json alone, and no shard is opened until rank 0 has checked them all against
        the manifest and told the others which step folder to read (every rank hashing every shard would
        take hours at thousands of ranks); each rank then reads only the weights it keeps, lazily."""
        args, self.state = self.args, None
        if args.init is None:
            print("no --init: fine-tuning a randomly initialized --model (useful for tests only)", flush=True)
            return super().model_args(tok)
        if not C.is_checkpoint(args.init):  # a Hugging Face or Meta folder: no manifest to check
            margs, self.state = load_init(args.init, tok)
            return margs
        self.picked = C.resolve(args.init, say=lambda msg: None, verify=False)  # rank 0 says what it skips, later
        try:
            self.margs = with_room_for(checkpoint_args(self.picked), tok.n_vocab)
        except (TypeError, ValueError) as e:
            raise T.ConfigError(f"cannot read --init {self.picked}: {type(e).__name__}: {data.one_line(e)}") from None
        self.tok = tok
        return self.margs

    def weights(self, mesh) -> dict | None:
        if self.args.init is None or not C.is_checkpoint(self.args.init):
            return self.state
        verified = P.on_rank0(lambda: C.resolve(self.args.init), mesh)  # may fall back past a damaged step
        verified_margs, state = load_init(verified, self.tok, verify=False)
        if verified_margs != self.margs:
            raise T.ConfigError(f"--init {self.args.init}: the intact checkpoint {verified.name} has another model "
                                f"shape than {self.picked.name}; name the step folder to start from")
        return state

    def data(self, tok, mesh):
        args = self.args
        conversations = data.read_sft(args.data, mirror=args.mirror)
        examples, counts = data.sft_examples(tok, conversations, args.seq_len)
        train_ex, val_ex = split_and_report("conversation", len(conversations), examples, counts, args, mesh)
        make = lambda ex, seed: data.SFTLoader(ex, args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank,
                                               dp_size=mesh.dp, seed=seed, pack=args.pack, pad_id=data.pad_id(tok))
        train = make(train_ex, args.seed)
        make(val_ex, 0)  # fail now, not at the first evaluation
        return train, lambda: make(val_ex, 0), f"{len(train):,} {'packed' if args.pack else 'padded'} train rows"


# ----------------------------------------------------------------------------------------------------
# Chatting with the result


@torch.no_grad()
def chat(model, tok, messages: list[dict], max_new_tokens: int = 200, temperature: float = 0.7,
         top_p: float | None = 0.9, seed: int = 0) -> str:
    """The assistant's reply to a conversation: the chat template with the generation prompt, then
    sampling until <|eot_id|>."""
    ids, _ = data.encode_chat(tok, messages, add_generation_prompt=True)
    room = model.args.max_seq_len - len(ids)
    device = model.tok_embeddings.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    new = M.generate(model, ids, min(max_new_tokens, room), temperature=temperature, top_p=top_p,
                     eos_id=data.eot_id(tok), generator=g, n_vocab=tok.n_vocab)[0].tolist()
    if data.eot_id(tok) in new:
        new = new[:new.index(data.eot_id(tok))]
    return tok.decode(new)


def main(argv=None):
    args = get_parser().parse_args(argv)
    T.configure_process(args)
    run = T.train(args, SFT(args))
    model, tok, mesh = run.model, run.tok, run.mesh
    if args.sample_prompt and mesh.tp == 1 and mesh.pp == 1 and mesh.rank == 0:
        reply = chat(model, tok, [{"role": "user", "content": args.sample_prompt}], seed=args.seed)
        print(f"user: {args.sample_prompt}\nassistant: {reply}", flush=True)
    if mesh.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    T.run(main)
