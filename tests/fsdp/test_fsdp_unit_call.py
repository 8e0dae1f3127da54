"""A unit's call (see [Note: a unit's call] in pydist/fsdp/_fully_shard.py):
units carrying the user's own hooks (a forward pre-hook that reads the full
parameters and changes the input, a forward hook that replaces the output,
a full backward hook, a module-global forward hook) take torch's hook
dispatch and train bitwise beside torch's ``fully_shard`` at two ranks;
without them the units take pydist's call, and the same model trains
bitwise too."""

from functools import partial

import pytest
import torch

from fsdp_harness import Nested, Scenario, assert_parity, run_parity


class Hooked(Nested):
    def __init__(self, global_hook: bool = False):
        super().__init__()
        first, second, third = self.blocks
        self.seen_shapes = []

        def shift_and_look(module, args):
            self.seen_shapes.append(tuple(module.proj.weight.shape))  # full while the unit computes
            return (args[0] + 0.25,)

        first.register_forward_pre_hook(shift_and_look)
        second.register_forward_hook(lambda module, args, out: out * 0.5)
        third.inner.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 2.0,))
        if global_hook:
            self._global = torch.nn.modules.module.register_module_forward_hook(self._count)
        self.calls = 0

    def _count(self, module, args, out):
        if module is self.blocks[0]:
            self.calls += 1

    def forward(self, x):
        out = super().forward(x)
        assert self.seen_shapes[-1] == (24, 24), self.seen_shapes[-1]
        if hasattr(self, "_global"):
            assert self.calls > 0
            self._global.remove()  # one model's forward only: the harness builds the next one after it
            del self._global
        return out


@pytest.mark.timeout(150)
def test_units_with_user_hooks_bitwise_with_torch_fully_shard():
    scenarios = [
        Scenario(model="hooked", optimizer="adam", shm=True),
        Scenario(model="hooked", optimizer="sgd", micro_steps=2, shm=False),
        Scenario(model="hooked_global", optimizer="sgd", shm=True),
    ]
    models = {"hooked": Hooked, "hooked_global": partial(Hooked, global_hook=True)}
    results = run_parity(scenarios, 2, timeout=140, models=models)
    assert_parity(results, exact=True, scenarios=scenarios)
