"""The mixture-of-experts layer: a router picks n_active_experts of n_experts gated MLPs for each token
and sums their outputs, weighted by its probabilities (Mixtral, Qwen3-MoE, OLMoE). model.py builds it for
the layers config.moe_layers names; quantize.py subclasses ExpertLinears for int8 and int4 experts."""

import torch
import torch.nn as nn
from torch import Tensor


class MoEFeedForward(nn.Module):
    """n_experts gated MLPs, of which each token goes through the n_active_experts that its router
    rates highest; their outputs are summed, weighted by the router's probabilities."""

    def __init__(self, config: "ModelArgs", activation):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.n_active_experts
        self.normalize = config.normalize_expert_weights
        hidden = config.moe_intermediate_size
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.w13 = ExpertLinears(config.n_experts, config.dim, 2 * hidden)  # rows of each: gate, then up
        self.w2 = ExpertLinears(config.n_experts, hidden, config.dim)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])  # (N, dim)
        probs = self.router(x).float().softmax(-1)  # (N, n_experts)
        weights, experts = probs.topk(k, dim=-1)  # (N, k) each
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        experts = experts.view(-1)  # (N * k,): one (token, expert) pair each, token p // k
        if experts.shape[0] <= self.n_experts:  # a few tokens (decoding): each pair reads its expert's weights
            y = self.mlp(x[torch.arange(experts.shape[0], device=x.device) // k], experts)
        else:  # the pairs sorted by expert, so that a grouped product reads each expert's weights once
            order = experts.argsort(stable=True)
            ends = (experts.unsqueeze(1) == torch.arange(self.n_experts, device=x.device)).sum(0).cumsum(0)
            y = self.mlp(x[order // k], experts[order], ends.int())
            y = torch.empty_like(y).index_copy_(0, order, y)  # back to pair order
        return (y.view(-1, k, shape[-1]).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype).view(shape)

    def mlp(self, x: Tensor, experts: Tensor, ends: Tensor | None = None) -> Tensor:
        """Each row of x (P, dim) through the expert of its pair (P,) -> (P, dim)."""
        gate, up = self.w13(x, experts, ends).chunk(2, dim=-1)
        return self.w2(self.activation(gate) * up, experts, ends)


class ExpertLinears(nn.Module):
    """One linear layer of every expert, stacked: weight (n_experts, out_features, in_features)."""

    # In compiled code, rows (P, in) times their experts' weights (P, out, in) -> (P, out) as a
    # multiply-and-sum: one pass that gathers the weights as it reads them, never a copy of them.
    # cpu_decode.py swaps in its CPU form of the same.
    product = staticmethod(lambda x, w: (x.unsqueeze(-2).float() * w.float()).sum(-1))

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        super().__init__()
        bound = in_features ** -0.5  # nn.Linear's initial range, for a model that is built, not loaded
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features).uniform_(-bound, bound))

    def forward(self, x: Tensor, experts: Tensor, ends: Tensor | None = None) -> Tensor:
        """x (P, in) -> (P, out), row p through the layer of expert experts[p]. With ends (n_experts,),
        the rows are sorted by expert, expert e's ending at row ends[e], and one grouped product reads
        each expert's weights once; without, each row reads its own expert's (for a few rows)."""
        if ends is not None:
            w = self.expert_weights(None, x.dtype).transpose(1, 2)  # (n_experts, in, out)
            if x.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
                return torch._grouped_mm(x, w, offs=ends)
            # compiled code traces grouped products in bf16 only: in another dtype (fp32, in tests) every
            # expert's product over all rows, of which each row keeps its own expert's
            return (x @ w)[experts, torch.arange(x.shape[0], device=x.device)]
        w = self.expert_weights(experts, x.dtype)  # (P, out, in)
        if torch.compiler.is_compiling():
            return self.product(x, w).to(x.dtype)
        return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)

    def expert_weights(self, experts: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The weights of experts (P,), or of all of them for None, in dtype: (P or n_experts, out, in).
        Quantized layers (quantize.py) dequantize here."""
        return (self.weight if experts is None else self.weight[experts]).to(dtype)
