// SwiGLU::eval_cpu: the CPU backend of the SwiGLU primitive; runs the kernel
// variant for this CPU's instruction set.
#include <cstring>
#include <vector>

#include "cpu/elementwise_op.h"
#include "cpu/kernel_dtype.h"
#include "cpu/swiglu_kernel.h"
#include "swiglu.h"

namespace vllm_metal {

namespace {

// The stride between consecutive rows (last-dim runs) of `a` when every row
// is contiguous and the rows are evenly spaced (a row-contiguous array, or
// column slices of one, such as the halves of a fused gate/up product);
// -1 otherwise.
int64_t row_stride(const mx::array& a) {
  const int nd = a.ndim();
  if (nd == 0) return 1;
  const int64_t width = a.shape(nd - 1);
  if (width > 1 && a.strides(nd - 1) != 1) return -1;
  int64_t stride = -1, expect = -1;  // the innermost leading stride, then what the next dim out must have
  for (int d = nd - 2; d >= 0; --d) {
    if (a.shape(d) == 1) continue;
    if (stride < 0) {
      stride = a.strides(d);
      expect = stride * a.shape(d);
    } else {
      if (a.strides(d) != expect) return -1;
      expect *= a.shape(d);
    }
  }
  return stride < 0 ? width : stride;
}

// dst (row-contiguous) = src in any layout, element by element (2- or
// 4-byte elements): the rare operand that is neither of the layouts above.
void copy_any_layout(const mx::array& src, char* dst) {
  const int nd = src.ndim();
  const size_t item = src.itemsize();
  const char* base = src.data<char>();
  std::vector<int64_t> idx(nd, 0);
  int64_t off = 0;
  for (size_t e = 0; e < src.size(); ++e) {
    std::memcpy(dst + e * item, base + off * static_cast<int64_t>(item), item);
    for (int d = nd - 1; d >= 0; --d) {  // the next index, odometer style
      off += src.strides(d);
      if (++idx[d] < src.shape(d)) break;
      off -= src.strides(d) * src.shape(d);
      idx[d] = 0;
    }
  }
}

} // namespace

void SwiGLU::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  static const auto kernel = VLLM_METAL_BEST_KERNEL(swiglu);
  const int64_t width = out.ndim() ? out.shape(-1) : 1;
  const int64_t rows = width ? static_cast<int64_t>(out.size()) / width : 0;
  // Each operand read in place when its rows are contiguous and evenly
  // spaced (the column halves of a fused gate/up product: no copy, which
  // cost ~50 ms of SmolLM2's 1024-token prefill when the op made them
  // contiguous first), else copied to a scratch of rows first.
  int64_t strides[2];
  bool copy[2];
  std::vector<mx::array> buf = inputs;  // what the kernel reads: an input, or its row-contiguous copy
  for (int i = 0; i < 2; ++i) {
    strides[i] = row_stride(inputs[i]);
    copy[i] = strides[i] < 0 || (strides[i] < width && rows > 1);
    if (copy[i]) {
      buf[i] = mx::array(inputs[i].shape(), inputs[i].dtype(), nullptr, {});
      buf[i].set_data(mx::allocator::malloc(inputs[i].nbytes()));
      strides[i] = width;
    }
  }
  auto& encoder = cpu::begin_elementwise(stream(), inputs, out);
  for (int i = 0; i < 2; ++i) {
    if (copy[i]) encoder.add_temporary(buf[i]);
  }
  const auto dtype = cpu::kernel_dtype(out.dtype());
  encoder.dispatch([g = inputs[0], u = inputs[1], g_buf = buf[0], u_buf = buf[1], copy0 = copy[0],
                    copy1 = copy[1], out, dtype, rows, width, gs = strides[0], us = strides[1]]() mutable {
    if (copy0) copy_any_layout(g, g_buf.data<char>());
    if (copy1) copy_any_layout(u, u_buf.data<char>());
    kernel({dtype, g_buf.data<void>(), u_buf.data<void>(), out.data<void>(), rows, width, gs, us});
  });
}

} // namespace vllm_metal
