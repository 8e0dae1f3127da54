"""The hooks one ``fully_shard`` call puts on its module, and what the root
does once per iteration.

[Note: the order of an iteration]
    root pre-forward     lazy init on the first call (the root opens the
                         transport all units share); forget last iteration's order
    unit pre-forward     unshard + wait; record the unit in the forward order;
                         start the all-gathers of set_modules_to_forward_prefetch;
                         wrap the inputs that need grad so the unit learns when
                         its backward is done
    unit post-forward    reshard (reshard_after_forward; never the root, whose
                         parameters are needed again at once); hook the outputs
    unit pre-backward    (first gradient reaching an output) queue the root's
                         final callback once; unshard + wait; start the
                         all-gather of the next unit in backward order (the one
                         before it in forward order, or set_modules_to_backward_prefetch)
                         so it runs while this unit computes
    unit post-backward   (gradients reach the unit's inputs) pack its gradients,
                         start the reduce-scatter, reshard
    final callback       post-backward for the units autograd never told (the
                         root, a first unit whose inputs need no grad), in
                         reverse forward order; then every unit waits for its
                         reduce-scatter and hands the shards their .grad, so the
                         optimizer sees finished gradients when backward() returns
Every rank goes through the same steps in the same order for the same
model, so their collectives match (see [Note: which transport carries a
sharded unit]).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from pydist.fsdp import _fsdp_collectives as collectives
from pydist.fsdp._fsdp_param_group import FSDPParamGroup, TrainingState

__all__ = ["FSDPState", "state_of"]


def state_of(module: nn.Module) -> "FSDPState | None":
    return module.__dict__.get("_pydist_fsdp_state")


class FSDPState:
    """One fully_shard'ed module: its unit (None when it manages no
    parameters) and its hooks. The root's state also drives the iteration."""

    def __init__(self, module: nn.Module, param_group: FSDPParamGroup | None, group, shm: bool | None, mp_policy=None):
        self.module = module
        self.param_group = param_group
        self.group = group  # the process group the unit is sharded over
        self.shm = shm  # the root's choice of transport: see open_transport
        self.mp_policy = mp_policy  # torch's MixedPrecisionPolicy: input and output casts here, the rest in the unit
        # Decided at the first forward: the outermost state that runs forward
        # first is the root, and every state under it points at it.
        self.root: FSDPState | None = None
        self.is_root = False
        # set_modules_to_forward_prefetch / _backward_prefetch; None: implicit
        # (backward: the unit before this one in forward order; forward: none).
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None
        # Root only: the states under it, in module order; the units in the
        # order their forward ran this iteration; whether the final callback
        # is queued for this backward.
        self.all_states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.iteration = 0  # root forwards so far
        # Units: the root iteration whose forward ran this unit with grad
        # enabled (a second run in the same one is refused).
        self.forward_iteration = -1
        self.final_callback_queued = False
        self.backward_end_ns = -1  # when autograd finished this iteration's backward (the final callback began)
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, prepend=False)

    # --- root -----------------------------------------------------------------

    def _lazy_init(self) -> None:
        self.is_root = True
        self.all_states = [s for m in self.module.modules() if (s := state_of(m)) is not None]
        for state in self.all_states:
            if state is not self and state.root is not None:
                raise RuntimeError(
                    f"pydist.fully_shard: {type(state.module).__name__} ran forward on its own before its root "
                    f"{type(self.module).__name__}; run the root's forward first (FSDP2's rule too)"
                )
            if state.group is not self.group:
                raise NotImplementedError(
                    "pydist.fully_shard: every unit under one root must shard over the same group (mesh)"
                )
            state.root = self
        for name, m in self.module.named_modules():
            if (s := state_of(m)) is not None and s.param_group is not None:
                s.param_group.label = name  # records and errors name units by their place
        transport = collectives.open_transport(self.group, self.shm)
        for state in self.all_states:
            if state.param_group is not None:
                state.param_group.transport = transport
        self.transport = transport

    def _root_pre_forward(self) -> None:
        self.iteration += 1
        self.forward_order = []
        self.final_callback_queued = False
        self.backward_end_ns = -1
        for state in self.all_states:
            if state.param_group is not None:
                state.param_group.records = []

    def _root_post_backward_final_callback(self) -> None:
        """See [Note: the order of an iteration]."""
        self.backward_end_ns = time.monotonic_ns()  # autograd is done; what follows is exposed
        seen = set()
        for state in reversed(self.forward_order):
            if id(state) in seen:
                continue
            seen.add(id(state))
            # A unit used in forward whose backward autograd never reported
            # (its inputs need no grad) still reduces, zeros where no
            # gradient came, so every rank issues the same collectives.
            if state.param_group.training_state != TrainingState.POST_BACKWARD:
                state.param_group.post_backward()
        for state in self.all_states:
            if state.param_group is not None:
                state.param_group.finalize_backward()
        self.final_callback_queued = False

    # --- hooks ----------------------------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        if self.root is None:
            self._lazy_init()
        root = self.root
        if self.is_root:
            self._root_pre_forward()
        mp = self.mp_policy
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), mp.param_dtype)
        pg = self.param_group
        if pg is None:
            return args, kwargs
        if torch.is_grad_enabled() and self.forward_iteration == root.iteration:
            raise RuntimeError(
                f"pydist FSDP unit {pg.label!r} ran forward a second time in one forward of its root (a module reused, "
                "e.g. weights shared across layers). Its gradients would be reduced after the first use's backward "
                "only, so this is not supported: fully_shard the module that contains every use instead"
            )
        if torch.is_grad_enabled():
            self.forward_iteration = root.iteration
        pg.pre_forward()
        root.forward_order.append(self)
        for target in self.forward_prefetch:
            if target.param_group is not None:
                target.param_group.unshard("forward_prefetch")
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _post_forward(self, module, args, output):
        pg = self.param_group
        if pg is not None:
            # The root keeps its parameters for backward, unless there is none.
            reshard = pg.reshard_after_forward and (not self.is_root or not torch.is_grad_enabled())
            pg.post_forward(reshard)
        if self.mp_policy is not None and self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        root = self.root
        if not root.final_callback_queued:
            root.final_callback_queued = True
            Variable._execution_engine.queue_callback(root._root_post_backward_final_callback)
        pg = self.param_group
        if pg is not None and pg.pre_backward():
            for target in self._backward_prefetch_targets():
                tpg = target.param_group
                if tpg is not None and tpg.training_state != TrainingState.POST_BACKWARD:
                    tpg.unshard("backward_prefetch")
        return grad

    def _backward_prefetch_targets(self) -> list["FSDPState"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.forward_order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is self:
                return [order[i - 1]]
        return []

    def _register_post_backward(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        outs = RegisterPostBackwardFunction.apply(self.param_group, *[flat[i] for i in positions])
        for i, t in zip(positions, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)


def _cast_floating(tree, dtype: torch.dtype):
    flat, spec = tree_flatten(tree)
    flat = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t for t in flat]
    return tree_unflatten(flat, spec)


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of
    the unit's inputs exist, i.e. once the unit's backward is done."""

    @staticmethod
    def forward(ctx, param_group: FSDPParamGroup, *inputs: torch.Tensor):
        ctx.param_group = param_group
        return inputs

    @staticmethod
    def backward(ctx, *grads: Any):
        ctx.param_group.post_backward()
        return (None,) + grads
