"""Bad input to pydist.ops raises RuntimeError naming the argument and, where
one tensor is at fault, its index in the list (issue #2)."""

import re

import pytest
import torch

import pydist.ops as ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def raises(*fragments):
    """pytest.raises(RuntimeError) whose message holds every fragment, literally."""
    return pytest.raises(RuntimeError, match="(?s)" + ".*".join(re.escape(f) for f in fragments))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_name_the_tensor(device):
    tensors = [torch.ones(2, device=device), torch.ones(3, device=device), torch.ones(4, dtype=torch.float64, device=device)]
    with raises("flatten", "tensors[2]", "Double", "tensors[0]", "Float"):
        ops.flatten(tensors)
    with raises("flatten_into", "tensors[2]", "Double"):
        ops.flatten(tensors, out=torch.empty(9, device=device))
    with raises("unflatten_into", "tensors[2]", "Double"):
        ops.unflatten_into(torch.empty(9, device=device), tensors)


@pytest.mark.cuda
def test_mixed_devices_name_the_tensor():
    tensors = [torch.ones(2, device="cuda"), torch.ones(3)]
    with raises("tensors[1]", "cpu", "tensors[0]", "cuda"):
        ops.flatten(tensors, out=torch.empty(5, device="cuda"))
    with raises("`out`", "cpu", "cuda"):
        ops.flatten([torch.ones(2, device="cuda")], out=torch.empty(2))
    with raises("`flat`", "cpu", "cuda"):
        ops.unflatten_into(torch.empty(2), [torch.ones(2, device="cuda")])


def test_meta_tensor_among_cpu_ones_names_the_tensor():
    # The mixed-device case this CPU-only machine can check: a meta tensor at
    # index 1 sends the call to the Meta kernel, which must not run unchecked.
    # More in tests/test_ops_safety.py.
    tensors = [torch.ones(2), torch.empty(3, device="meta")]
    with raises("flatten_into", "tensors[1]", "meta", "tensors[0]", "cpu"):
        ops.flatten(tensors, out=torch.empty(5))


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_wrong_size_dtype_or_layout(device):
    tensors = [torch.ones(2, device=device), torch.ones(3, device=device)]
    with raises("flatten_into", "tensors[1]", "ends at element 5", "past the 4 elements of `out`"):
        ops.flatten(tensors, out=torch.empty(4, device=device))
    with raises("flatten_into", "`out` has 6 elements", "the tensors hold 5", "1 elements are left over after tensors[1]"):
        ops.flatten(tensors, out=torch.empty(6, device=device))
    with raises("flatten_into", "`out` has dtype", "Half", "tensors[0]", "Float"):
        ops.flatten(tensors, out=torch.empty(5, dtype=torch.float16, device=device))
    with raises("flatten_into", "`out` must be contiguous"):
        ops.flatten(tensors, out=torch.empty(10, device=device)[::2])
    with raises("flatten_into", "`out` must be 1-D", "[5, 1]"):
        ops.flatten(tensors, out=torch.empty(5, 1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_sizes_that_do_not_add_up_to_flat(device):
    tensors = [torch.ones(2, device=device), torch.ones(3, device=device), torch.ones(4, device=device)]
    with raises("unflatten_into", "tensors[1]", "ends at element 5", "past the 4 elements of `flat`"):
        ops.unflatten_into(torch.empty(4, device=device), tensors)
    with raises("unflatten_into", "`flat` has 10 elements", "hold 9", "left over after tensors[2]"):
        ops.unflatten_into(torch.empty(10, device=device), tensors)
    with raises("unflatten_into", "`flat` must be contiguous"):
        ops.unflatten_into(torch.empty(18, device=device)[::2], tensors)
    with raises("unflatten", "`flat`", "9 elements"):
        ops.unflatten(torch.empty(10, device=device), tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_on_integer_dtype(device):
    with raises("unflatten_into", "scale 0.5", "Int"):
        ops.unflatten_into(torch.zeros(3, dtype=torch.int32, device=device),
                           [torch.zeros(3, dtype=torch.int32, device=device)], scale=0.5)
