"""Adam through torch's own fused kernel, without loading torch's compiler.

``torch.optim`` imports ``torch._dynamo`` the first time an optimizer is built or stepped, even
when nothing is compiled: 1.6 s on a 2-core machine, a third of the time a CartPole run takes
from the shell prompt to a solved agent. :class:`FusedAdam` calls the very kernel
``torch.optim.Adam(fused=True)`` calls (``torch._fused_adam_``), so the parameters after every
step are bit-identical to it (tests/test_common.py checks this), and keeps its ``state_dict``
format, so checkpoints of either load into the other. It is plain Adam: no weight decay, no
AMSGrad, no gradient scaler (the learners that need those use ``torch.optim.Adam``).

``torch._fused_adam_`` is private to torch: requirements.txt admits torch from the version the tests
ran this against, and tests/test_common.py fails on any torch whose kernel no longer matches.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.torch_file import adam_param_group, load_adam_param_group


class FusedAdam:
    """Adam over ``params`` (one parameter group) with ``torch.optim.Adam``'s interface subset:
    ``param_groups[0]["lr"]`` (anneal it there), ``zero_grad``, ``step``, ``state_dict``,
    ``load_state_dict``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.param_groups = [{"params": self.params, "lr": lr, "betas": betas, "eps": eps}]
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        # The fused kernel wants each step count as a tensor on its parameter's device.
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        active = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not active:
            return
        steps = [self.steps[i] for i in active]
        torch._foreach_add_(steps, 1)  # as torch.optim.Adam: the kernel reads the incremented count
        beta1, beta2 = group["betas"]
        torch._fused_adam_([self.params[i] for i in active], [self.params[i].grad for i in active],
                           [self.exp_avg[i] for i in active], [self.exp_avg_sq[i] for i in active], [], steps,
                           lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=0.0, eps=group["eps"],
                           amsgrad=False, maximize=False)

    def state_dict(self) -> dict:
        """The layout of ``torch.optim.Adam.state_dict()`` (parameters by position)."""
        group = adam_param_group(self.param_groups[0], len(self.params))
        state = {i: {"step": s.clone(), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
                 for i, (s, m, v) in enumerate(zip(self.steps, self.exp_avg, self.exp_avg_sq)) if s.item() > 0}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        indices = load_adam_param_group(state_dict, self.param_groups[0], len(self.params))
        for position, index in enumerate(indices):
            saved = state_dict["state"].get(index)
            if saved is not None:
                self.steps[position] = saved["step"].detach().float().reshape(()).to(self.params[position].device)
                self.exp_avg[position] = saved["exp_avg"].to(self.params[position]).clone()
                self.exp_avg_sq[position] = saved["exp_avg_sq"].to(self.params[position]).clone()
