"""``FusedLinearView``: several ``nn.Linear`` that read one input, computed as one matmul for inference.

A decode step reads each weight once and does little else: on a GPU every GEMM of a step is bound by
its launch latency, not its bytes (an H200 step of a 124M GPT-2: 72 GEMM-shaped kernels of 4.2-4.8 us
moving 1-7 MB each, issue 42), so three projections of one input cost three launches where one would do.
The modules stay what they are (separate ``q_proj``, ``k_proj``, ``v_proj`` that LoRA and PEFT find by
name, one state-dict key each); the view holds a copy of their weights stacked by rows, refreshed
whenever one of them changes, and is used only where no gradient is needed.

Shapes: ``x`` ``(..., in)``; part ``i`` maps ``in -> out_i``; the view maps ``in -> sum(out_i)``, columns
in the parts' order, so ``view(x).split(outs, -1)`` are the parts' outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["FusedLinearView", "fusable"]


def fusable(parts: Sequence[nn.Module]) -> str | None:
    """None when ``parts`` can be fused (plain ``nn.Linear`` s of one input width, all with a bias or none);
    else why not, naming the part."""
    for i, m in enumerate(parts):
        if type(m) is not nn.Linear:  # a LoRA/PEFT wrapper, a quantized layer, a user's module: not a plain matmul
            return f"part {i} is a {type(m).__name__}, not a plain nn.Linear (a wrapper such as LoRA computes more)"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"part {i} has forward hooks, which a fused matmul would skip"
    linears = [m for m in parts if isinstance(m, nn.Linear)]
    if len({m.in_features for m in linears}) != 1:
        return "the parts read inputs of different widths"
    if len({m.bias is None for m in linears}) != 1:
        return "some parts have a bias and some do not"
    return None


class FusedLinearView(nn.Module):
    """``[part_0(x) | part_1(x) | ...]`` as one ``F.linear`` under ``torch.no_grad()``; the parts' own calls when a
    gradient may be needed, so training is untouched.

    The stacked weight is a non-persistent buffer: it moves with ``.to()`` and stays out of the state dict.
    In eager mode every call compares the parts' storage and version counters with those it copied and
    refreshes when one changed (5.9 us for Q|K|V with biases on a Zen 4 core); a compiled step does not check, so call
    :meth:`refresh` before compiled steps run (:func:`attnlab.generate` does, through ``fuse_projections``).
    """

    weight: Tensor
    bias: Tensor | None
    parts: tuple[nn.Linear, ...]  # kept in __dict__, not registered: the parts stay their owner's children

    def __init__(self, parts: Sequence[nn.Linear]) -> None:
        super().__init__()
        why = fusable(parts)
        if why is not None:
            raise ValueError(f"FusedLinearView cannot fuse these modules: {why}; leave them unfused.")
        self.__dict__["parts"] = tuple(parts)  # not submodules: parameters and state dict stay the parts'
        self.__dict__["_seen"] = None
        self.out_features = [m.out_features for m in parts]
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.refresh()

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        """Storage and version counter of every weight and bias: an in-place update bumps the counter, a
        replacement (``.to()``, ``load_state_dict(assign=True)``) brings new storage."""
        return tuple((p.data_ptr(), p._version) for m in self.parts for p in (m.weight, m.bias) if p is not None)

    def stale(self) -> bool:
        """Whether a part's weights changed (in place, or replaced) since the last :meth:`refresh`."""
        return self._seen != self._stamp()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the parts' weights into the stacked ones: in place when shape, dtype and device agree, so that a
        compiled step that reads them sees the new values without recompiling."""
        weight = torch.cat([m.weight for m in self.parts], dim=0)  # (sum out_i, in)
        biases = [m.bias for m in self.parts]
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])  # (sum out_i,)
        if (
            self.weight.shape == weight.shape
            and self.weight.dtype == weight.dtype
            and self.weight.device == weight.device
        ):
            self.weight.copy_(weight)
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)
            else:
                self.bias = bias
        else:
            self.weight, self.bias = weight, bias
        self.__dict__["_seen"] = self._stamp()

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():  # gradients reach the parts' own parameters
            return torch.cat([m(x) for m in self.parts], dim=-1)  # (..., sum out_i)
        if not torch.compiler.is_compiling() and self.stale():
            self.refresh()
        return nn.functional.linear(x, self.weight, self.bias)  # (..., in) -> (..., sum out_i): one matmul

    def extra_repr(self) -> str:
        return f"in_features={self.parts[0].in_features}, out_features={self.out_features}"
