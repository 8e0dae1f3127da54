"""pydist.ops where a careless call used to give a silent wrong answer
(issue #17, items 2-4), each beside what stock torch does in the same place:

- a tensor on the meta device among real ones (torch.cat raises);
- memory shared between what a call writes and what it reads or writes
  (torch.cat(out=) and copy_ raise);
- autograd: flatten is differentiable as torch.cat is, bitwise; the in-place
  copies bump version counters as copy_ does, and refuse tensors that
  require grad while grad mode is on.
"""

import re

import pytest
import torch
from torch._utils import _flatten_dense_tensors

import pydist.ops as ops


def raises(*fragments):
    """pytest.raises(RuntimeError) whose message holds every fragment, literally."""
    return pytest.raises(RuntimeError, match="(?s)" + ".*".join(re.escape(f) for f in fragments))


def ints(n, start=1):
    """Integer-valued floats: every copy and scale by 0.5 is exact."""
    return torch.arange(start, start + n, dtype=torch.float32)


# --- item 2: the meta device ------------------------------------------------------


def test_torch_refuses_meta_among_cpu():
    with pytest.raises(RuntimeError):
        torch.cat([torch.ones(2), torch.empty(3, device="meta")])


@pytest.mark.parametrize("where", [0, 1])
def test_flatten_refuses_meta_among_cpu(where):
    tensors = [torch.ones(2), torch.ones(3)]
    tensors[where] = torch.empty(tensors[where].shape, device="meta")
    with raises("flatten", "tensors[1]", str(tensors[1].device), "tensors[0]", str(tensors[0].device)):
        ops.flatten(tensors)
    with raises("flatten_into", "tensors[1]"):
        ops.flatten(tensors, out=torch.empty(5))


def test_flatten_into_refuses_meta_out_and_cpu_out_for_meta():
    with raises("flatten_into", "`out` is on meta", "cpu"):
        ops.flatten([torch.ones(2)], out=torch.empty(2, device="meta"))
    with raises("flatten_into", "`out` is on cpu", "meta"):
        ops.flatten([torch.empty(2, device="meta")], out=torch.empty(2))


def test_unflatten_into_refuses_meta_flat_or_target():
    targets = [torch.zeros(2), torch.zeros(3)]
    with raises("unflatten_into", "`flat` is on meta", "cpu"):
        ops.unflatten_into(torch.empty(5, device="meta"), targets)
    with raises("unflatten_into", "tensors[1]", "meta", "tensors[0]", "cpu"):
        ops.unflatten_into(ints(5), [torch.zeros(2), torch.empty(3, device="meta")])
    assert all(torch.equal(t, torch.zeros_like(t)) for t in targets)


def test_all_meta_still_works():
    # Meta in, meta out: shapes only, as torch.cat on meta tensors.
    tensors = [torch.empty(2, 3, device="meta"), torch.empty(4, device="meta")]
    flat = ops.flatten(tensors)
    assert flat.device.type == "meta" and flat.shape == torch.cat([t.reshape(-1) for t in tensors]).shape
    ops.flatten(tensors, out=torch.empty(10, device="meta"), scale=0.5)
    ops.unflatten_into(torch.empty(10, device="meta"), tensors)


# --- item 3: overlapping memory ------------------------------------------------------


def test_torch_cat_refuses_an_input_that_is_a_view_of_out():
    buf = ints(10)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.cat([buf[5:10], buf[0:5]], out=buf)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_flatten_into_refuses_a_view_of_out_elsewhere(scale):
    buf = ints(10)
    before = buf.clone()
    with raises("flatten_into", "tensors[0] shares memory with `out`", "elements [5, 10)", "[0, 5) of `out`"):
        ops.flatten([buf[5:10], buf[0:5]], out=buf, scale=scale)
    assert torch.equal(buf, before), "nothing is written before the check"
    # A strided view of out, overlapping it.
    with raises("flatten_into", "tensors[1] shares memory with `out`"):
        ops.flatten([torch.ones(5), buf[::2]], out=buf, scale=scale)
    # A view of out's storage outside out: no overlap, and the copy is right.
    big = ints(20)
    out, src = big[:10], big[10:]
    want = _flatten_dense_tensors([src[5:], src[:5]]) * scale
    ops.flatten([src[5:], src[:5]], out=out, scale=scale)
    assert torch.equal(out, want)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_flatten_into_accepts_tensors_in_their_own_place(scale):
    # The resident-gradient case the reducer relies on: a tensor that is
    # exactly its own segment of out, beside one that lives elsewhere.
    buf = ints(10)
    other = ints(5, start=100)
    want = torch.cat([buf[:5], other]) * scale
    ops.flatten([buf[:5], other], out=buf, scale=scale)
    assert torch.equal(buf, want)


def test_flatten_into_strided_view_interleaved_but_disjoint_is_fine():
    # Ranges intersect but no element is shared: out is every other element
    # of a storage, the input the elements between. torch.cat refuses the out
    # (not contiguous) so the reference is computed apart.
    base = ints(12)
    out = base[:6]
    src = base[6:].view(3, 2).t()  # strided, outside out
    want = _flatten_dense_tensors([src])
    ops.flatten([src], out=out)
    assert torch.equal(out, want)


def test_unflatten_into_refuses_targets_that_share_memory():
    x = torch.zeros(10)
    flat = ints(8)
    with raises("unflatten_into", "tensors[0] and tensors[2] share memory"):
        ops.unflatten_into(flat, [x[0:3], torch.zeros(3), x[2:4]])
    with raises("unflatten_into", "tensors[0] and tensors[1] share memory"):
        ops.unflatten_into(flat, [x[0:4], x[0:4]])
    m = torch.zeros(4, 4)
    with raises("unflatten_into", "tensors[0] and tensors[1] share memory"):
        ops.unflatten_into(ints(8), [m[:, 0], m[1]])  # a column and a row cross at m[1, 0]
    with raises("unflatten_into", "tensors[0] has elements that share one memory location"):
        ops.unflatten_into(ints(4), [torch.zeros(1).expand(4)])
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.zeros(1).expand(4).copy_(ints(4))  # torch's copy_ refuses the same
    assert torch.equal(x, torch.zeros(10)), "nothing is written before the check"


def test_unflatten_into_accepts_interleaved_disjoint_targets():
    # Columns of one matrix: their ranges intersect, their elements do not.
    m = torch.zeros(3, 4)
    cols = [m[:, j] for j in range(4)]
    flat = ints(12)
    ops.unflatten_into(flat, cols, scale=0.5)
    assert torch.equal(m, (flat * 0.5).view(4, 3).t())


def test_unflatten_into_refuses_a_target_that_is_a_view_of_flat_elsewhere():
    buf = ints(10)
    before = buf.clone()
    with raises("unflatten_into", "tensors[1] shares memory with `flat`", "[5, 10) of `flat`"):
        ops.unflatten_into(buf, [torch.zeros(5), buf[0:5]])
    assert torch.equal(buf, before)
    # Its own segment is fine (scaled in place), as is a view of flat's storage outside flat.
    big = ints(20)
    flat, rest = big[:10], big[10:]
    want = torch.cat([flat[:5] * 0.5, flat[5:] * 0.5])
    ops.unflatten_into(flat, [flat[:5], rest[:5]], scale=0.5)
    assert torch.equal(torch.cat([flat[:5], rest[:5]]), want)


# --- item 4: autograd ---------------------------------------------------------------


def make_inputs():
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.randn(4, 2, generator=gen, dtype=torch.float64).t(),  # strided
    ]


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_flatten_backward_matches_torch_cat_bitwise(scale):
    ours = [t.clone().requires_grad_() for t in make_inputs()]
    theirs = [t.clone().requires_grad_() for t in make_inputs()]
    weight = torch.randn(sum(t.numel() for t in ours), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = ops.flatten(ours, scale=scale)
    want = torch.cat([t.reshape(-1) for t in theirs])
    if scale != 1.0:
        want = want.mul(scale)
    assert got.requires_grad and got.grad_fn is not None
    assert torch.equal(got.detach(), want.detach())
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_flatten_gradcheck_and_gradgradcheck():
    inputs = [t.clone().requires_grad_() for t in make_inputs()]
    fn = lambda *ts: ops.flatten(list(ts))  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_flatten_of_some_inputs_requiring_grad():
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3)
    ops.flatten([a, b]).sum().backward()
    assert torch.equal(a.grad, torch.ones(2)) and b.grad is None


def test_flatten_without_grad_has_no_graph():
    a = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        assert ops.flatten([a]).grad_fn is None
    assert ops.flatten([torch.ones(2)]).grad_fn is None


def test_torch_copy_into_leaf_requiring_grad():
    # The reference behaviour: refused with grad mode on, allowed (and
    # version-bumped) under no_grad.
    leaf = torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.copy_(torch.ones(3))
    with torch.no_grad():
        v = leaf._version
        leaf.copy_(torch.ones(3))
    assert leaf._version == v + 1


def test_in_place_ops_refuse_grad_with_grad_mode_on():
    leaf = torch.zeros(5, requires_grad=True)
    with raises("flatten_into", "`out` requires grad", "torch.no_grad()"):
        ops.flatten([torch.ones(5)], out=leaf)
    with raises("flatten_into", "tensors[1] requires grad"):
        ops.flatten([torch.ones(2), torch.ones(3, requires_grad=True)], out=torch.zeros(5))
    with raises("unflatten_into", "tensors[0] requires grad"):
        ops.unflatten_into(torch.ones(5), [leaf])
    with raises("unflatten_into", "`flat` requires grad"):
        ops.unflatten_into(torch.ones(5, requires_grad=True), [torch.zeros(5)])
    assert torch.equal(leaf.detach(), torch.zeros(5))


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_in_place_ops_bump_versions(scale):
    out = torch.zeros(5)
    targets = [torch.zeros(2), torch.zeros(3)]
    v = out._version
    ops.flatten([ints(2), ints(3)], out=out, scale=scale)
    assert out._version > v
    vs = [t._version for t in targets]
    ops.unflatten_into(ints(5), targets, scale=scale)
    assert all(t._version > w for t, w in zip(targets, vs))
    # Under no_grad a leaf that requires grad is written, and bumped.
    leaf = torch.zeros(5, requires_grad=True)
    with torch.no_grad():
        v = leaf._version
        ops.unflatten_into(ints(5), [leaf], scale=scale)
        assert leaf._version > v
        ops.flatten([ints(5)], out=leaf, scale=scale)
        assert leaf._version > v + 1
    assert torch.equal(leaf.detach(), ints(5) * scale)


@pytest.mark.parametrize("write", ["flatten_into", "unflatten_into"])
def test_overwriting_a_saved_tensor_is_caught_at_backward(write):
    # x * w saves w; overwriting w in place (under no_grad) must make the
    # backward fail, as it does after copy_, not silently use the new values.
    def run(overwrite):
        x = torch.ones(5, requires_grad=True)
        w = ints(5)
        y = (x * w).sum()
        with torch.no_grad():
            overwrite(w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()

    run(lambda w: w.copy_(torch.zeros(5)))  # torch
    if write == "flatten_into":
        run(lambda w: ops.flatten([torch.zeros(5)], out=w))
    else:
        run(lambda w: ops.unflatten_into(torch.zeros(5), [w]))


def test_opcheck_flatten_requiring_grad():
    tensors = [t.float().requires_grad_() for t in make_inputs()]
    torch.library.opcheck(torch.ops.pydist.flatten.default, (tensors,))
