// Device-independent half of the flatten ops: argument checks, the overlap
// check, autograd and version counters, the segment plan both device files
// use, and the dispatcher entry points C++ callers use.
//
// [Note: the layers of a flatten op]
// A call passes through these dispatch keys, highest first:
//
//   Autograd         flatten: records FlattenBackward (its backward is an
//                    unflatten: views of the incoming gradient, as
//                    torch.cat's). flatten_into / unflatten_into are not
//                    differentiable: with grad mode on, a tensor of the call
//                    that requires grad is an error (torch.no_grad() copies).
//   ADInplaceOrView  flatten_into / unflatten_into bump the version counter
//                    of every tensor they write, as torch's in-place ops do,
//                    so autograd notices a saved tensor overwritten.
//   (Python)         fake tensors stop here: pydist/ops.py's fake rules.
//   BackendSelect    the argument checks (detail::check_*). BackendSelect is
//                    in every call's key set, so CPU, CUDA and Meta kernels
//                    all see checked arguments. On the Meta key (Python's
//                    fake rule) a CPU tensor mixed with a meta one would
//                    otherwise give an uninitialised result.
//   CPU / CUDA       the copies (flatten_cpu.cpp, flatten_cuda.cpp).
//   Meta             pydist/ops.py's fake rules, through register_fake.
#include "ops/flatten.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

namespace pydist::ops {
namespace {

// Typed dispatcher handles, looked up once.
const auto& flatten_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pydist::flatten", "").typed<at::Tensor(at::TensorList)>();
  return op;
}
const auto& flatten_into_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pydist::flatten_into", "")
                       .typed<void(at::TensorList, const at::Tensor&, double)>();
  return op;
}
const auto& unflatten_into_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pydist::unflatten_into", "")
                       .typed<void(const at::Tensor&, at::TensorList, double)>();
  return op;
}

// --- argument checks --------------------------------------------------------

int64_t check_tensor_list(const char* op, at::TensorList tensors) {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
                "; only dense (strided) tensors flatten");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op, ": tensors[", i, "] has dtype ", t.scalar_type(),
                " but tensors[0] has ", tensors[0].scalar_type(), "; all tensors must share one dtype");
    TORCH_CHECK(t.device() == tensors[0].device(), op, ": tensors[", i, "] is on ", t.device(),
                " but tensors[0] is on ", tensors[0].device(), "; all tensors must share one device");
    total += t.numel();
  }
  return total;
}

void check_flat(const char* op, const char* arg, const at::Tensor& flat, at::TensorList tensors, int64_t total) {
  TORCH_CHECK(flat.defined(), op, ": `", arg, "` is undefined");
  TORCH_CHECK(flat.dim() == 1, op, ": `", arg, "` must be 1-D, got shape ", flat.sizes());
  TORCH_CHECK(flat.is_contiguous(), op, ": `", arg, "` must be contiguous");
  if (flat.numel() != total) {
    // Name the tensor where the sizes stop adding up: the first to run past
    // the end of `flat`, or the last one when `flat` has elements left over.
    int64_t end = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      end += tensors[i].numel();
      TORCH_CHECK(end <= flat.numel(), op, ": tensors[", i, "] (", tensors[i].numel(), " elements) ends at element ",
                  end, ", past the ", flat.numel(), " elements of `", arg, "`; the tensors hold ", total,
                  " elements in all");
    }
    TORCH_CHECK(false, op, ": `", arg, "` has ", flat.numel(), " elements but the tensors hold ", total, "; ",
                flat.numel() - total, " elements are left over after ",
                tensors.empty() ? std::string("the empty list") : "tensors[" + std::to_string(tensors.size() - 1) + "]");
  }
  if (!tensors.empty()) {
    TORCH_CHECK(flat.scalar_type() == tensors[0].scalar_type(), op, ": `", arg, "` has dtype ", flat.scalar_type(),
                " but the tensors (tensors[0] on) have ", tensors[0].scalar_type());
    TORCH_CHECK(flat.device() == tensors[0].device(), op, ": `", arg, "` is on ", flat.device(),
                " but the tensors (tensors[0] on) are on ", tensors[0].device());
  }
}

// A scale other than 1 needs a floating dtype.
void check_scale(const char* op, const at::Tensor& flat, double scale) {
  TORCH_CHECK(scale == 1.0 || at::isFloatingType(flat.scalar_type()), op, ": scale ", scale,
              " needs a floating dtype, got ", flat.scalar_type(), " (integer tensors take scale=1)");
}

// --- the overlap check ------------------------------------------------------
//
// [Note: overlap]
// A tensor written while another tensor of the same call reads or writes the
// same memory gives a result that depends on the order of the copies, which
// is not fixed (threads, CUDA blocks). torch.cat(out=) and copy_ raise for
// it; so do we, naming the tensors. Only one sharing is allowed: a tensor
// that is exactly its own segment of the flat buffer (contiguous, at that
// address), as a resident gradient is (see [Note: resident gradients] in
// reducer/reducer.h); the kernels scale it in place.
//
// Cost: tensors in different storages cannot overlap, so a tensor is first
// compared by storage and element range [lo, hi), O(1) against the flat
// buffer; the targets of unflatten_into are sorted by (storage, lo) and swept,
// O(n log n). Only when two ranges intersect and one tensor is not dense
// (a strided view may interleave with another without sharing an element)
// are the elements themselves compared.

// A tensor's element range in its storage, in its dtype's elements.
struct Extent {
  const c10::StorageImpl* storage;
  int64_t lo, hi;
  size_t index;
};

// Whether `t` has an extent: tensors without storage (wrapper subclasses)
// and empty ones touch no memory we can see.
bool has_extent(const at::Tensor& t) { return t.numel() > 0 && t.has_storage(); }

Extent extent_of(const at::Tensor& t, size_t index) {
  int64_t hi = t.storage_offset() + 1;
  for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * t.stride(d);
  return {t.storage().unsafeGetStorageImpl(), t.storage_offset(), hi, index};
}

// Whether a and b, whose extents intersect, share an element.
bool share_elements(const at::Tensor& a, const Extent& ea, const at::Tensor& b, const Extent& eb) {
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) return true;  // each fills its range
  // Rare: mark a's elements over the union of the ranges, then look for b's.
  const int64_t base = std::min(ea.lo, eb.lo);
  const int64_t span = std::max(ea.hi, eb.hi) - base;
  at::Tensor index = at::arange(span, at::TensorOptions().dtype(at::kLong));
  at::Tensor mask = at::zeros({span}, at::TensorOptions().dtype(at::kBool));
  mask.index_fill_(0, index.as_strided(a.sizes(), a.strides(), ea.lo - base).reshape(-1), true);
  return mask.index_select(0, index.as_strided(b.sizes(), b.strides(), eb.lo - base).reshape(-1)).any().item<bool>();
}

std::string range_words(const Extent& e) {
  return "elements [" + std::to_string(e.lo) + ", " + std::to_string(e.hi) + ")";
}

// tensors[i] against the flat buffer `arg`, read (flatten_into) or written
// (unflatten_into) by the same call.
void check_against_flat(const char* op, const char* arg, const at::Tensor& flat, at::TensorList tensors) {
  if (!flat.has_storage() || flat.numel() == 0) return;
  const Extent ef = extent_of(flat, 0);
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); offset += tensors[i].numel(), ++i) {
    const at::Tensor& t = tensors[i];
    if (!has_extent(t) || t.storage().unsafeGetStorageImpl() != ef.storage) continue;
    const Extent e = extent_of(t, i);
    if (e.hi <= ef.lo || ef.hi <= e.lo) continue;
    if (t.is_contiguous() && e.lo == ef.lo + offset) continue;  // its own segment: in place
    TORCH_CHECK(!share_elements(t, e, flat, ef), op, ": tensors[", i, "] shares memory with `", arg,
                "` (", range_words(e), " and ", range_words(ef),
                " of one storage) but is not its own segment of it (elements [", offset, ", ", offset + t.numel(),
                ") of `", arg, "`); the result would depend on the order of the copies. Copy it first (.clone())");
  }
}

// The targets of unflatten_into against each other.
void check_targets_disjoint(const char* op, at::TensorList tensors) {
  std::vector<Extent> extents;
  extents.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!has_extent(t)) continue;
    if (!t.is_contiguous()) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensors[", i,
                  "] has elements that share one memory location (an expanded tensor?); it cannot be written");
    }
    extents.push_back(extent_of(t, i));
  }
  if (extents.size() < 2) return;
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return a.storage != b.storage ? std::less<>()(a.storage, b.storage) : a.lo < b.lo;
  });
  // Sweep each storage in order of lo, keeping the extents still open.
  std::vector<Extent> open;
  for (const Extent& e : extents) {
    if (!open.empty() && open.front().storage != e.storage) open.clear();
    open.erase(std::remove_if(open.begin(), open.end(), [&](const Extent& o) { return o.hi <= e.lo; }), open.end());
    for (const Extent& o : open) {
      const size_t first = std::min(o.index, e.index), second = std::max(o.index, e.index);
      const Extent& ef = o.index == first ? o : e;
      const Extent& es = o.index == first ? e : o;
      TORCH_CHECK(!share_elements(tensors[first], ef, tensors[second], es), op, ": tensors[", first, "] and tensors[",
                  second, "] share memory (", range_words(ef), " and ", range_words(es),
                  " of one storage); which value lands there would depend on the order of the copies");
    }
    open.push_back(e);
  }
}

// --- BackendSelect: the checks ----------------------------------------------

// Every key below BackendSelect: the backend's kernel.
constexpr c10::DispatchKeySet kAfterBackendSelect(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);

at::Tensor flatten_checked(c10::DispatchKeySet ks, at::TensorList tensors) {
  detail::check_flatten(tensors);
  return flatten_op().redispatch(ks & kAfterBackendSelect, tensors);
}

void flatten_into_checked(c10::DispatchKeySet ks, at::TensorList tensors, const at::Tensor& out, double scale) {
  detail::check_flatten_into(tensors, out, scale);
  flatten_into_op().redispatch(ks & kAfterBackendSelect, tensors, out, scale);
}

void unflatten_into_checked(c10::DispatchKeySet ks, const at::Tensor& flat, at::TensorList tensors, double scale) {
  detail::check_unflatten_into(flat, tensors, scale);
  unflatten_into_op().redispatch(ks & kAfterBackendSelect, flat, tensors, scale);
}

// --- ADInplaceOrView: version counters --------------------------------------

void flatten_into_bump(c10::DispatchKeySet ks, at::TensorList tensors, const at::Tensor& out, double scale) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    flatten_into_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, tensors, out, scale);
  }
  torch::autograd::impl::bump_version(out);
}

void unflatten_into_bump(c10::DispatchKeySet ks, const at::Tensor& flat, at::TensorList tensors, double scale) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    unflatten_into_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, flat, tensors, scale);
  }
  for (const at::Tensor& t : tensors) torch::autograd::impl::bump_version(t);
}

// --- Autograd ---------------------------------------------------------------

// flatten's backward: the gradient of each input is its segment of the
// flat gradient, viewed in the input's shape (what torch.cat's backward does).
struct FlattenFunction : torch::autograd::Function<FlattenFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors, c10::DispatchKeySet ks) {
    std::vector<int64_t> dims, shapes;  // each input's number of dims, and its sizes back to back
    dims.reserve(tensors.size());
    for (const at::Tensor& t : tensors) {
      dims.push_back(t.dim());
      shapes.insert(shapes.end(), t.sizes().begin(), t.sizes().end());
    }
    ctx->saved_data["dims"] = std::move(dims);
    ctx->saved_data["shapes"] = std::move(shapes);
    at::AutoDispatchBelowADInplaceOrView guard;
    return flatten_op().redispatch(ks & c10::after_autograd_keyset, tensors);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<int64_t> dims = ctx->saved_data["dims"].toIntVector();
    const std::vector<int64_t> shapes = ctx->saved_data["shapes"].toIntVector();
    torch::autograd::variable_list out(dims.size() + 1);  // the last: ks, not a tensor
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    int64_t offset = 0;
    size_t at = 0;
    for (size_t i = 0; i < dims.size(); ++i) {
      const at::IntArrayRef sizes(shapes.data() + at, dims[i]);
      const int64_t n = c10::multiply_integers(sizes);
      if (ctx->needs_input_grad(i)) out[i] = grad.narrow(0, offset, n).view(sizes);
      offset += n;
      at += dims[i];
    }
    return out;
  }
};

at::Tensor flatten_autograd(c10::DispatchKeySet ks, at::TensorList tensors) {
  if (torch::autograd::compute_requires_grad(tensors)) return FlattenFunction::apply(tensors, ks);
  at::AutoDispatchBelowADInplaceOrView guard;
  return flatten_op().redispatch(ks & c10::after_autograd_keyset, tensors);
}

// With grad mode on, a tensor of a non-differentiable copy that requires
// grad is an error: the copy would cut its graph (or, for a leaf, overwrite
// what autograd treats as an input).
void refuse_grad(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK(!t.requires_grad(), op, ": ", what, " requires grad, but ", op,
              " is not differentiable; call it under torch.no_grad() (a copy outside autograd, as DDP's gradient "
              "copies are), or use pydist.ops.flatten, which is");
}

void refuse_grads(const char* op, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].requires_grad()) refuse_grad(op, ("tensors[" + std::to_string(i) + "]").c_str(), tensors[i]);
  }
}

void flatten_into_autograd(c10::DispatchKeySet ks, at::TensorList tensors, const at::Tensor& out, double scale) {
  if (c10::GradMode::is_enabled()) {
    refuse_grads("flatten_into", tensors);
    refuse_grad("flatten_into", "`out`", out);
  }
  at::AutoDispatchBelowAutograd guard;
  flatten_into_op().redispatch(ks & c10::after_autograd_keyset, tensors, out, scale);
}

void unflatten_into_autograd(c10::DispatchKeySet ks, const at::Tensor& flat, at::TensorList tensors, double scale) {
  if (c10::GradMode::is_enabled()) {
    refuse_grad("unflatten_into", "`flat`", flat);
    refuse_grads("unflatten_into", tensors);
  }
  at::AutoDispatchBelowAutograd guard;
  unflatten_into_op().redispatch(ks & c10::after_autograd_keyset, flat, tensors, scale);
}

}  // namespace

namespace detail {

int64_t check_flatten(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "flatten: `tensors` is empty; pydist.ops.flatten returns an empty tensor for it");
  return check_tensor_list("flatten", tensors);
}

int64_t check_flatten_into(at::TensorList tensors, const at::Tensor& out, double scale) {
  const int64_t total = check_tensor_list("flatten_into", tensors);
  check_flat("flatten_into", "out", out, tensors, total);
  check_scale("flatten_into", out, scale);
  check_against_flat("flatten_into", "out", out, tensors);
  return total;
}

int64_t check_unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const int64_t total = check_tensor_list("unflatten_into", tensors);
  check_flat("unflatten_into", "flat", flat, tensors, total);
  check_scale("unflatten_into", flat, scale);
  check_against_flat("unflatten_into", "flat", flat, tensors);
  check_targets_disjoint("unflatten_into", tensors);
  return total;
}

SegmentPlan plan_segments(at::TensorList tensors, bool stage_strided) {
  SegmentPlan plan;
  plan.segments.reserve(tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); offset += tensors[i].numel(), ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    if (t.is_contiguous()) {
      plan.segments.push_back({static_cast<char*>(t.data_ptr()), offset, t.numel()});
      continue;
    }
    plan.strided.emplace_back(i, offset);
    if (stage_strided) {
      plan.staging.push_back(at::empty({t.numel()}, t.options().memory_format(at::MemoryFormat::Contiguous)));
      plan.segments.push_back({static_cast<char*>(plan.staging.back().data_ptr()), offset, t.numel()});
    }
  }
  return plan;
}

void copy_strided_into(const SegmentPlan& plan, at::TensorList tensors, const at::Tensor& out) {
  for (auto [index, offset] : plan.strided) {
    const at::Tensor& t = tensors[index];
    out.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
  }
}

void write_back_staged(const SegmentPlan& plan, at::TensorList tensors) {
  for (size_t k = 0; k < plan.strided.size(); ++k) {
    const at::Tensor& t = tensors[plan.strided[k].first];
    at::Tensor target = t;  // a handle: writes land in the caller's tensor
    target.copy_(plan.staging[k].view(t.sizes()));
  }
}

}  // namespace detail

TORCH_LIBRARY_IMPL(pydist, BackendSelect, m) {
  m.impl("flatten", TORCH_FN(flatten_checked));
  m.impl("flatten_into", TORCH_FN(flatten_into_checked));
  m.impl("unflatten_into", TORCH_FN(unflatten_into_checked));
}

TORCH_LIBRARY_IMPL(pydist, ADInplaceOrView, m) {
  m.impl("flatten_into", TORCH_FN(flatten_into_bump));
  m.impl("unflatten_into", TORCH_FN(unflatten_into_bump));
}

TORCH_LIBRARY_IMPL(pydist, Autograd, m) {
  m.impl("flatten", TORCH_FN(flatten_autograd));
  m.impl("flatten_into", TORCH_FN(flatten_into_autograd));
  m.impl("unflatten_into", TORCH_FN(unflatten_into_autograd));
}

// Dispatcher entry points for C++ callers (see flatten.h). Grad mode is off:
// the reducer copies gradients, which may require grad under create_graph,
// and its copies were never part of the graph.
void flatten_into(at::TensorList tensors, const at::Tensor& out, double scale) {
  at::NoGradGuard no_grad;
  flatten_into_op().call(tensors, out, scale);
}

at::Tensor flatten(at::TensorList tensors) { return flatten_op().call(tensors); }

void unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale) {
  at::NoGradGuard no_grad;
  unflatten_into_op().call(flat, tensors, scale);
}

}  // namespace pydist::ops
