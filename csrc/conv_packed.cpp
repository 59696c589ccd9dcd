// A 2-D convolution and its input gradient through oneDNN, with each weight reordered into
// oneDNN's blocked layout once rather than at every call.
//
// The calls are ATen's own oneDNN ops, those Inductor's frozen graphs use:
// mkldnn::_reorder_convolution_weight + _convolution_pointwise for the convolution, and
// mkldnn::_reorder_convolution_transpose_weight + _convolution_transpose_pointwise for its
// input gradient (a transposed convolution with the same weight). What this file adds is the
// cache of reordered weights that lets a graph keep its weights as ordinary tensors: an entry
// is found by the weight's storage (held weakly: its address is not reused while the entry
// lives; a detached view of a parameter, new at every call, has the parameter's storage),
// offset, sizes and strides, and is reordered again where the storage's data or the
// weight's version counter (shared with its views) changed: in-place updates, `.data`
// rebinding. A write through `.data` moves neither: the caller drops the weight's entries
// (forget_packed_weight). Entries of storages that no longer exist are dropped at the next
// lookup.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/intrusive_ptr.h>

#include <list>
#include <mutex>
#include <vector>

#include "omenn_cpu.h"

namespace omenn_cpu {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const void* data = nullptr;
  int64_t version = 0;
  // The weight's offset, sizes and strides in its storage, the direction, the geometry and the
  // input size: what the reorder was for.
  std::vector<int64_t> key;
  at::Tensor packed;
};

std::mutex cache_mutex;
std::list<Entry> cache;  // most recently used first
int64_t reorders = 0;    // weights reordered since the process started

// ATen's oneDNN ops for one direction (forward, or the input gradient's transposed
// convolution): the weight's reorder and the convolution.
struct OneDnnOps {
  c10::OperatorHandle reorder, convolution;
};

c10::OperatorHandle find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Looked up once (they are registered where PyTorch is built with oneDNN).
const OneDnnOps& onednn_ops(bool transposed) {
  static const OneDnnOps forward{find("mkldnn::_reorder_convolution_weight"),
                                 find("mkldnn::_convolution_pointwise")};
  static const OneDnnOps transpose{find("mkldnn::_reorder_convolution_transpose_weight"),
                                   find("mkldnn::_convolution_transpose_pointwise")};
  return transposed ? transpose : forward;
}

at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> arguments) {
  torch::jit::Stack stack(std::move(arguments));
  op.callBoxed(stack);
  return stack.back().toTensor();
}

std::vector<int64_t> as_vector(c10::IntArrayRef values) { return {values.begin(), values.end()}; }

void check_geometry(const char* where, const at::Tensor& x, const at::Tensor& weight,
                    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                    int64_t groups) {
  TORCH_CHECK(x.dim() == 4 && weight.dim() == 4, where,
              ": the input and the weight must be 4-D, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, where,
              ": float32 tensors only, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), where, ": CPU tensors only");
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2, where,
              ": stride, padding and dilation must have two entries");
  TORCH_CHECK(groups >= 1, where, ": groups must be positive, got ", groups);
}

// The weight reordered for this geometry: from the cache, or reordered now (and kept).
at::Tensor packed_weight(const at::Tensor& weight, std::vector<int64_t> key, bool transposed,
                         c10::IntArrayRef stride, c10::IntArrayRef padding,
                         c10::IntArrayRef output_padding, c10::IntArrayRef dilation,
                         int64_t groups, c10::IntArrayRef input_size) {
  auto reorder = [&] {
    const at::Tensor dense = weight.contiguous();
    if (transposed) {
      return call(onednn_ops(true).reorder,
                  {dense, as_vector(padding), as_vector(output_padding), as_vector(stride),
                   as_vector(dilation), groups, as_vector(input_size)});
    }
    return call(onednn_ops(false).reorder,
                {dense, as_vector(padding), as_vector(stride), as_vector(dilation), groups,
                 as_vector(input_size)});
  };
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (weight.is_inference()) {  // no version counter to tell a change by
    ++reorders;
    return reorder();
  }
  key.push_back(weight.storage_offset());
  key.insert(key.end(), weight.sizes().begin(), weight.sizes().end());
  key.insert(key.end(), weight.strides().begin(), weight.strides().end());
  const c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  const void* data = weight.storage().data();
  const int64_t version = weight._version();
  for (auto it = cache.begin(); it != cache.end();) {
    if (it->storage.expired()) {
      it = cache.erase(it);
      continue;
    }
    if (it->storage._unsafe_get_target() == storage && it->key == key) {
      if (it->data != data || it->version != version) {
        ++reorders;
        it->packed = reorder();
        it->data = data;
        it->version = version;
      }
      cache.splice(cache.begin(), cache, it);
      return cache.front().packed;
    }
    ++it;
  }
  ++reorders;
  cache.push_front(
      Entry{weight.storage().getWeakStorageImpl(), data, version, std::move(key), reorder()});
  return cache.front().packed;
}

}  // namespace

int64_t packed_weight_reorders() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return reorders;
}

int64_t clear_packed_weights() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  const auto kept = static_cast<int64_t>(cache.size());
  cache.clear();
  return kept;
}

int64_t forget_packed_weight(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  const c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  const auto before = static_cast<int64_t>(cache.size());
  cache.remove_if([&](const Entry& entry) { return entry.storage._unsafe_get_target() == storage; });
  return before - static_cast<int64_t>(cache.size());
}

at::Tensor conv2d_packed(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                         c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                         bool channels_last) {
  check_geometry("conv2d_packed_cpu", x, weight, stride, padding, dilation, groups);
  std::vector<int64_t> key{0, groups};
  for (auto values : {stride, padding, dilation, x.sizes()}) {
    key.insert(key.end(), values.begin(), values.end());
  }
  const at::Tensor packed = packed_weight(weight, std::move(key), false, stride, padding, {},
                                          dilation, groups, x.sizes());
  c10::IValue b = bias.has_value() && bias->defined() ? c10::IValue(bias->contiguous())
                                                      : c10::IValue();
  return call(onednn_ops(false).convolution,
              {x, packed, b, as_vector(padding), as_vector(stride), as_vector(dilation), groups,
               std::string("none"), c10::List<std::optional<at::Scalar>>(),
               std::optional<std::string>("")})
      .contiguous(channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

at::Tensor conv2d_input_grad_packed(const at::Tensor& grad, const at::Tensor& weight,
                                    c10::IntArrayRef input_size, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    int64_t groups, bool channels_last) {
  check_geometry("conv2d_input_grad_packed_cpu", grad, weight, stride, padding, dilation, groups);
  TORCH_CHECK(input_size.size() == 2, "conv2d_input_grad_packed_cpu: input_size must be (H, W)");
  // The transposed convolution's output padding: the rows and columns of the input that no
  // window reached past the last one.
  std::vector<int64_t> output_padding(2);
  for (int d = 0; d < 2; ++d) {
    const int64_t reached = (grad.size(d + 2) - 1) * stride[d] - 2 * padding[d] +
                            dilation[d] * (weight.size(d + 2) - 1) + 1;
    output_padding[d] = input_size[d] - reached;
    TORCH_CHECK(output_padding[d] >= 0 && output_padding[d] < std::max(stride[d], dilation[d]),
                "conv2d_input_grad_packed_cpu: input size ", input_size,
                " does not fit a gradient of shape ", grad.sizes(), " with this geometry");
  }
  std::vector<int64_t> key{1, groups};
  for (auto values : {stride, padding, dilation, grad.sizes(), input_size}) {
    key.insert(key.end(), values.begin(), values.end());
  }
  const at::Tensor packed = packed_weight(weight, std::move(key), true, stride, padding,
                                          output_padding, dilation, groups, grad.sizes());
  return call(onednn_ops(true).convolution,
              {grad, packed, c10::IValue(), as_vector(padding), output_padding, as_vector(stride),
               as_vector(dilation), groups, std::string("none"),
               c10::List<std::optional<at::Scalar>>(), std::optional<std::string>("")})
      .contiguous(channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

}  // namespace omenn_cpu
