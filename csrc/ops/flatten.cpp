// Device-independent half of the flatten ops: argument checks and the
// dispatcher entry points C++ callers use.
#include "ops/flatten.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace pydist::ops {
namespace detail {

int64_t check_tensor_list(const char* op, at::TensorList tensors, const char* what) {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": ", what, "[", i, "] is undefined");
    TORCH_CHECK(!t.is_sparse(), op, ": ", what, "[", i, "] is sparse; only dense tensors flatten");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op, ": ", what, "[", i,
                "] has dtype ", t.scalar_type(), " but ", what, "[0] has ", tensors[0].scalar_type(),
                "; all tensors must share one dtype");
    TORCH_CHECK(t.device() == tensors[0].device(), op, ": ", what, "[", i, "] is on ", t.device(),
                " but ", what, "[0] is on ", tensors[0].device(), "; all tensors must share one device");
    total += t.numel();
  }
  return total;
}

void check_flat(const char* op, const char* arg, const at::Tensor& flat,
                at::TensorList tensors, int64_t total) {
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
    TORCH_CHECK(flat.scalar_type() == tensors[0].scalar_type(), op, ": `", arg, "` has dtype ",
                flat.scalar_type(), " but the tensors (tensors[0] on) have ", tensors[0].scalar_type());
    TORCH_CHECK(flat.device() == tensors[0].device(), op, ": `", arg, "` is on ", flat.device(),
                " but the tensors (tensors[0] on) are on ", tensors[0].device());
  }
}

void check_scale(const char* op, const at::Tensor& flat, double scale) {
  TORCH_CHECK(scale == 1.0 || at::isFloatingType(flat.scalar_type()), op, ": scale ", scale,
              " needs a floating dtype, got ", flat.scalar_type(), " (integer tensors take scale=1)");
}

}  // namespace detail

// Dispatcher entry points for C++ callers (see flatten.h).
void flatten_into(at::TensorList tensors, const at::Tensor& out, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pydist::flatten_into", "")
                       .typed<void(at::TensorList, const at::Tensor&, double)>();
  op.call(tensors, out, scale);
}

at::Tensor flatten(at::TensorList tensors) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pydist::flatten", "")
                       .typed<at::Tensor(at::TensorList)>();
  return op.call(tensors);
}

void unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pydist::unflatten_into", "")
                       .typed<void(const at::Tensor&, at::TensorList, double)>();
  op.call(flat, tensors, scale);
}

}  // namespace pydist::ops
