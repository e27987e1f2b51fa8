"""Supervised fine-tuning (SFT): turn a pretrained next-token predictor into an assistant.

    python sft.py --init out --data alpaca_5000                        # from a train.py checkpoint
    torchrun --nproc_per_node=8 sft.py --init Llama-3.2-1B --tokenizer llama3 --tp 2   # from HF weights
    python sft.py --init out --lora-rank 16                            # LoRA: the model frozen, adapters

train.py's training loop (its seven phases, flags, parallel layouts, checkpoints and --resume) with
its own recipe (the SFT class):
  - the model: loaded from --init (a train.py/sft.py checkpoint folder, a Hugging Face or a Meta
    folder); a tokenizer with more ids than the model grows its embedding and output rows;
  - the data: conversations in the Llama 3 chat format (chat.py), whose targets are the assistant's
    tokens and their <|eot_id|> (all else is IGNORE_INDEX), packed several to a row with attention
    and positions that never cross examples (--no-pack: one per row);
  - the loss: unchanged (token cross-entropies summed over the global count of target tokens), so
    train and validation losses are the mean loss on response tokens.
With --lora-rank (here and in dpo.py, reward.py, rl.py) only LoRA's low-rank updates train
(model.add_lora); checkpoints hold them alone and are merged in when read as a model.
At the end it answers --sample-prompt in chat mode.
"""

from __future__ import annotations

import argparse

import chat
import config
import data
import train


# ----------------------------------------------------------------------------------------------------
# The recipe


class SFT(train.FromInit):
    """The next-token loss (LMTask) on the assistant's tokens only."""

    kind = "sft"

    def masked_attention(self) -> str | None:
        return "fine-tuning keeps it within each example of a row"

    def data(self, tok, mesh):
        args = self.args
        conversations = chat.read_sft(args.data, mirror=args.mirror)
        examples, counts = chat.sft_examples(tok, conversations, args.seq_len)
        train_ex, val_ex = chat.split_and_report("conversation", len(conversations), examples, counts, args, mesh)
        make = lambda ex, seed: chat.SFTLoader(ex, args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank,
                                               dp_size=mesh.dp, seed=seed, pack=args.pack,
                                               pad_id=data.pad_id(tok))
        loader = make(train_ex, args.seed)
        if val_ex:  # (none with --val-fraction 0, which turns validation off)
            make(val_ex, 0)  # fail now, not at the first evaluation
        desc = f"{len(loader):,} {'packed' if args.pack else 'padded'} train rows"
        return loader, lambda: make(val_ex, 0), desc


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
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
    p.set_defaults(tokenizer=None, data="alpaca_5000", out_dir="out-sft", lr=3e-4, warmup=20, max_steps=300,
                   eval_every=100, eval_batches=20, ckpt_every=300, log_every=20, seq_len=256, micro_batch=8)
    return p


def main(argv=None):
    train.post_train(config.parse(get_parser(), argv), SFT)


if __name__ == "__main__":
    config.run(main)
