"""bf16 weights for the forward and backward, fp32 master weights in the optimizer.

Autocast keeps fp32 weights and casts each one to bf16 on every forward (and the gradient back to fp32): the
matmuls run at the bf16 rate, but every step also reads and writes all the weights twice more. Holding the
model in bf16 removes those casts and halves the weight bytes each matmul streams. Updating bf16 weights
directly would lose every step smaller than half a bf16 ulp (2^-9 relative), so, as in mixed-precision
training (Micikevicius et al. 2018), the optimizer works on fp32 master copies:

    backward (bf16 grads) -> grads_to_masters (accumulated in fp32) -> [norm, clip] -> optimizer.step (fp32)
    -> masters_to_params (each master rounded to nearest bf16)

The optimizer's parameter groups are switched to the masters, so its state (Adam moments) is fp32 and any
``torch.optim`` optimizer, lr scheduler or ``accelerate`` wrapper works unchanged.

The masters' fp32 gradients are views into one flat buffer allocated once: ``zero_grad(set_to_none=True)`` drops
the views, not the memory, so a step allocates no gradient memory (no allocator churn, no fragmentation between
the rollout's and the update's tensors), and the copy / accumulation is one ``foreach`` call over all of them.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """Casts a model's weights to ``dtype`` and keeps the optimizer's parameters as fp32 copies of them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.bfloat16):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        _check_can_take_over(params, optimizer)
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().clone()) for p in params]  # exact fp32 copies, taken first
        master_of = {id(p): m for p, m in zip(params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [master_of[id(p)] for p in group["params"]]
        model.to(dtype)  # in place: the same Parameter objects now hold bf16 data
        self.flat_grad: torch.Tensor | None = None
        """(N,) fp32, N = the masters' numel: their gradients' storage (``grad_views``), allocated at first use."""

    def to(self, device: torch.device) -> None:
        """Move the masters next to the model's weights (after ``accelerate`` placed the model)."""
        for master in self.masters:
            master.data = master.data.to(device)
            master.grad = None
        self.flat_grad = None  # reallocated on the masters' device

    def grad_views(self) -> list[torch.Tensor]:
        """One fp32 view per master, shaped like it, into ``flat_grad`` (allocated once)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros(sum(m.numel() for m in self.masters), dtype=torch.float32,
                                         device=self.masters[0].device)
            self._views = [chunk.view_as(m) for chunk, m in
                           zip(self.flat_grad.split([m.numel() for m in self.masters]), self.masters)]
        return self._views

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Add the bf16 gradients into the masters' fp32 gradients (accumulation stays in fp32) and clear them."""
        fresh: tuple[list, list] = ([], [])  # (master grad views, bf16 grads): a master without a gradient yet
        accumulate: tuple[list, list] = ([], [])
        for param, master, view in zip(self.params, self.masters, self.grad_views()):
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = view
                fresh[0].append(view), fresh[1].append(param.grad)
            else:
                accumulate[0].append(master.grad), accumulate[1].append(param.grad)
        if fresh[0]:
            torch._foreach_copy_(*fresh)  # bf16 -> fp32 exactly
        if accumulate[0]:
            torch._foreach_add_(*accumulate)
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round each updated master to the model's dtype (to nearest even, as ``Tensor.copy_`` does)."""
        torch._foreach_copy_(self.params, [m.detach() for m in self.masters])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): master.detach() for i, master in enumerate(self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the masters (and the bf16 weights from them) from ``state_dict`` output."""
        if sorted(state, key=int) != [str(i) for i in range(len(self.masters))]:
            raise ValueError(f"master weights: expected {len(self.masters)} tensors, got {len(state)}")
        for i, master in enumerate(self.masters):
            saved = state[str(i)]
            if saved.shape != master.shape:
                raise ValueError(f"master weight {i}: saved shape {tuple(saved.shape)} != {tuple(master.shape)}")
            master.copy_(saved)
        self.masters_to_params()


def bf16_by_default(device: torch.device, mixed_precision: str, optimizer: torch.optim.Optimizer) -> bool:
    """What ``bf16_weights=None`` means: bf16 weights on a CUDA device that supports bf16, when the optimizer is
    fresh, its parameters are fp32 and no fp16 loss scaling runs; fp32 everywhere else (a CPU among them)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return (device.type == "cuda" and mixed_precision != "fp16" and not optimizer.state
            and all(p.dtype == torch.float32 for p in params) and torch.cuda.is_bf16_supported())


def _check_can_take_over(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """The masters are copies of fp32 weights, made before the optimizer has any state keyed by them."""
    if optimizer.state:
        raise ValueError("bf16_weights: the optimizer already has state; pass a freshly built optimizer")
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if wrong:
        raise ValueError(f"bf16_weights needs the trainable parameters in float32 to copy into the fp32 masters, "
                         f"found {', '.join(wrong)}; load the model in float32")
