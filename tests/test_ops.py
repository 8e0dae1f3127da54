"""pydist.ops against the real thing, bitwise.

Scale 1 is compared with torch's own ``_flatten_dense_tensors`` /
``_unflatten_dense_tensors``; scale != 1 with ``pydist.ops.reference_*``
(copy, then torch's ``mul_`` by the Python scalar). Every comparison is on
the bytes (rtol=0, atol=0, and -0.0 != 0.0). CUDA variants are marked
``cuda`` and skipped without a GPU (tests/conftest.py).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import pydist.ops as ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]
DTYPES = FLOATS + INTS

# Each example is cheap; a bounded count keeps the whole file well under a minute.
EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical order, so comparisons are bitwise."""
    dense = torch.empty(t.numel(), dtype=t.dtype, device=t.device).copy_(t.reshape(-1))  # stride 1, even for size 1
    return dense.view(torch.uint8)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert torch.equal(bits(got).cpu(), bits(want).cpu()), "values differ bitwise"


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=gen).to(dtype)


def make_tensor(shape, dtype, device, contiguous, gen) -> torch.Tensor:
    """A random tensor of ``shape``; when not contiguous, a strided view: a
    transpose for 2-D and up, every other element of a longer tensor for 1-D."""
    shape = tuple(shape)
    if contiguous or not shape:
        return random_tensor(shape, dtype, gen).to(device)
    if len(shape) >= 2:
        dims = tuple(reversed(range(len(shape))))
        return random_tensor(tuple(reversed(shape)), dtype, gen).to(device).permute(dims)
    return random_tensor((2 * shape[0],), dtype, gen).to(device)[::2]


SCALES = st.sampled_from([0.5, 1 / 3, 1 / 7, 0.125, 3.0, -1 / 6])  # exact and inexact in binary
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
big_shapes = st.tuples(st.integers(1, 5000))


@st.composite
def tensor_lists(draw, dtypes=st.sampled_from(DTYPES)):
    """(dtype, [(shape, contiguous)], seed): random shapes incl. zero-size, some strided."""
    dtype = draw(dtypes)
    specs = draw(st.lists(st.tuples(st.one_of(shapes, big_shapes), st.booleans()), min_size=0, max_size=12))
    return dtype, specs, draw(st.integers(0, 2**31 - 1))


def build(dtype, specs, seed, device):
    gen = torch.Generator().manual_seed(seed)
    return [make_tensor(shape, dtype, device, contiguous, gen) for shape, contiguous in specs]


@pytest.mark.parametrize("device", DEVICES)
@EXAMPLES
@given(case=tensor_lists())
def test_flatten_matches_torch(device, case):
    dtype, specs, seed = case
    tensors = build(dtype, specs, seed, device)
    if not tensors:
        assert ops.flatten(tensors).numel() == 0
        return
    want = _flatten_dense_tensors(tensors)
    assert_bitwise(ops.flatten(tensors), want)
    out = torch.full_like(want, 7)  # garbage first: every element must be written
    assert ops.flatten(tensors, out=out) is out
    assert_bitwise(out, want)


@pytest.mark.parametrize("device", DEVICES)
@EXAMPLES
@given(case=tensor_lists())
def test_unflatten_into_matches_torch(device, case):
    dtype, specs, seed = case
    like = build(dtype, specs, seed, device)
    flat = ops.reference_flatten([torch.zeros_like(t) for t in like]) if like else torch.empty(0, dtype=dtype, device=device)
    if like:
        flat = build(dtype, [((flat.numel(),), True)], seed + 1, device)[0]
    targets = [t.clone() if t.is_contiguous() else t for t in like]  # strided ones stay strided
    ops.unflatten_into(flat, targets)
    want = _unflatten_dense_tensors(flat, like) if like else []
    for got, w in zip(targets, want):
        assert_bitwise(got, w)
    views = ops.unflatten(flat, like)
    for view, w in zip(views, want):
        assert_bitwise(view, w)
        assert view.data_ptr() == 0 or flat.data_ptr() <= view.data_ptr() < flat.data_ptr() + flat.nbytes + 1


@pytest.mark.parametrize("device", DEVICES)
@EXAMPLES
@given(case=tensor_lists(dtypes=st.sampled_from(FLOATS)),
       scale=SCALES)
def test_unflatten_into_scaled_matches_reference(device, case, scale):
    dtype, specs, seed = case
    like = build(dtype, specs, seed, device)
    total = sum(t.numel() for t in like)
    flat = build(dtype, [((total,), True)], seed + 1, device)[0]
    got = [torch.full_like(t, 5) for t in like]
    want = [torch.full_like(t, 5) for t in like]
    ops.unflatten_into(flat, got, scale=scale)
    ops.reference_unflatten_into(flat, want, scale=scale)
    for g, w in zip(got, want):
        assert_bitwise(g, w)


@pytest.mark.parametrize("device", DEVICES)
@EXAMPLES
@given(case=tensor_lists(dtypes=st.sampled_from(FLOATS)),
       scale=SCALES)
def test_flatten_into_scaled_matches_reference(device, case, scale):
    # What the reducer does to gradients on their way into a bucket: torch's
    # DDP multiplies by 1/world_size while copying (at::mul_out).
    dtype, specs, seed = case
    tensors = build(dtype, specs, seed, device)
    want = ops.reference_flatten(tensors, scale=scale).to(device=device, dtype=dtype)
    out = torch.full_like(want, 7)
    ops.flatten(tensors, out=out, scale=scale)
    assert_bitwise(out, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_tensors_already_in_place(device, scale):
    # A resident gradient is its own bucket slot (csrc/reducer/reducer.h,
    # [Note: resident gradients]): flatten_into and unflatten_into then scale
    # it in place, or leave it alone at scale 1. Mixed with tensors elsewhere.
    gen = torch.Generator().manual_seed(5)
    sizes = [(3, 4), (7,), (5, 5), (1,)]
    flat = torch.randn(sum(torch.Size(sz).numel() for sz in sizes), generator=gen).to(device)
    before = flat.clone()
    views = ops.unflatten(flat, [torch.empty(sz) for sz in sizes])
    outside = torch.randn(7, generator=gen).to(device)
    sources = [views[0], outside, views[2], views[3]]
    want = ops.reference_flatten([before[:12], outside, before[19:44], before[44:]], scale=scale)
    ops.flatten(sources, out=flat, scale=scale)
    assert_bitwise(flat, want.to(device))
    targets = [views[0], outside, views[2], views[3]]
    expected = [t.clone() for t in targets]
    ops.reference_unflatten_into(flat.clone(), expected, scale=scale)
    ops.unflatten_into(flat, targets, scale=scale)
    for got, w in zip(targets, expected):
        assert_bitwise(got, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_bucket_takes_the_streaming_path(device, dtype):
    # 2000 tensors, ~24 MB: above kStreamingMinBytes (8 MiB), odd sizes so the
    # streamed stores start at unaligned addresses.
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 6000, (2000,), generator=gen).tolist()
    tensors = [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]
    want = _flatten_dense_tensors(tensors)
    assert want.nbytes >= 8 << 20 or dtype != torch.float32
    out = torch.empty_like(want)
    ops.flatten(tensors, out=out)
    assert_bitwise(out, want)
    back = [torch.empty_like(t) for t in tensors]
    ops.unflatten_into(out, back)
    for b, t in zip(back, tensors):
        assert_bitwise(b, t)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_list_and_zero_size(device):
    out = torch.empty(0, device=device)
    ops.flatten([], out=out)
    ops.unflatten_into(out, [])
    ops.unflatten_into(out, [], scale=0.5)
    zeros = [torch.empty(0, 3, device=device), torch.empty(0, device=device)]
    assert ops.flatten(zeros).shape == (0,)
    ops.unflatten_into(out, zeros, scale=0.25)


def test_integer_dtypes_take_only_scale_one():
    flat = torch.arange(6, dtype=torch.int32)
    targets = [torch.empty(2, dtype=torch.int32), torch.empty(4, dtype=torch.int32)]
    ops.unflatten_into(flat, targets)
    assert targets[1].tolist() == [2, 3, 4, 5]
    with pytest.raises(RuntimeError, match=r"unflatten_into: scale 0\.5 needs a floating dtype"):
        ops.unflatten_into(flat, targets, scale=0.5)
    with pytest.raises(RuntimeError, match=r"flatten_into: scale 0\.5 needs a floating dtype"):
        ops.flatten(targets, out=flat, scale=0.5)


# --- torch.library.opcheck: schema, fake tensors, dispatch ----------------------


def opcheck_inputs(device):
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen), torch.randn(2, 3, generator=gen).t()]
    tensors = [t.to(device) for t in tensors]
    return tensors, sum(t.numel() for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_flatten(device):
    tensors, _ = opcheck_inputs(device)
    torch.library.opcheck(torch.ops.pydist.flatten.default, (tensors,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_opcheck_flatten_into(device, scale):
    tensors, total = opcheck_inputs(device)
    out = torch.empty(total, device=device)
    torch.library.opcheck(torch.ops.pydist.flatten_into.default, (tensors, out, scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_opcheck_unflatten_into(device, scale):
    tensors, total = opcheck_inputs(device)
    flat = torch.randn(total, device=device)
    torch.library.opcheck(torch.ops.pydist.unflatten_into.default, (flat, tensors, scale))
