"""Helpers the tests share that the project itself has no use for: a Hugging Face folder read as a model (the
project reads one as an --init, through checkpoint.load_init), and the inverse of Meta's RoPE permutation (to
write a Meta checkpoint from a model)."""

import torch

import model as M
import weights as W


def load_hf(path, dtype=torch.float32) -> M.Transformer:
    """A Hugging Face Llama directory (config.json + *.safetensors) -> Transformer."""
    args, state = W.hf_state(path)
    model = W.empty_model(args, dtype)
    tied = {"output.weight"} if args.tie_embeddings else set()  # the head is the embedding: read it once
    return W._load_state(model, {k: state[k].to(dtype) for k in state if k not in tied}, str(path))


def hf_to_meta_rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def clip_grad_norm(opt, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Scale all of AdamW's gradients by min(1, max_norm / norm), as a separate pass (the project clips inside
    the update: optim.clip_scale); returns the norm before clipping."""
    norm = opt.grad_norm() if norm is None else norm
    if max_norm > 0:
        opt.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
