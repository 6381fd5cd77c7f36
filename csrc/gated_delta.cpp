// The gated_delta op: validates static shapes and dtypes, makes the inputs
// row-contiguous (g and beta float32; the state only for the GPU) and builds the lazy {y, state} pair.
// Backends trust what passes here.
#include "gated_delta.h"

#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/ops.h"

#include "op_util.h"

namespace vllm_metal {

bool is_supported_gated_delta_key_dim(int dk) {
  return dk == 32 || dk == 64 || dk == 128 || dk == 256;
}

namespace {

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[gated_delta] " + msg);
}

void check_shape(const mx::array& a, const char* name, const mx::Shape& want, const char* layout) {
  if (a.shape() != want) {
    std::ostringstream os;
    os << name << " must have shape " << layout << " = (";
    for (size_t i = 0; i < want.size(); ++i) {
      os << (i ? ", " : "") << want[i];
    }
    os << "), got " << shape_str(a);
    fail(os.str());
  }
}

bool is_float(mx::Dtype dt) {
  return dt == mx::float32 || dt == mx::float16 || dt == mx::bfloat16;
}

} // namespace

std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  std::ostringstream os;
  if (q.ndim() != 4) {
    os << "q must have rank 4 [B, T, Hk, Dk], got shape " << shape_str(q);
    fail(os.str());
  }
  if (v.ndim() != 4) {
    os << "v must have rank 4 [B, T, Hv, Dv], got shape " << shape_str(v);
    fail(os.str());
  }
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);
  check_shape(k, "k", {B, T, Hk, Dk}, "[B, T, Hk, Dk] (q's)");
  check_shape(v, "v", {B, T, Hv, Dv}, "[B, T, Hv, Dv] (B, T from q)");
  check_shape(g, "g", {B, T, Hv}, "[B, T, Hv] (scalar gating)");
  check_shape(beta, "beta", {B, T, Hv}, "[B, T, Hv]");
  check_shape(state, "state", {B, Hv, Dv, Dk}, "[B, Hv, Dv, Dk]");
  if (mask) {
    check_shape(*mask, "mask", {B, T}, "[B, T]");
    if (mask->dtype() != mx::bool_) {
      os << "mask must be bool, got " << mask->dtype();
      fail(os.str());
    }
  }
  const auto dt = q.dtype();
  if (!is_float(dt)) {
    os << "q must be float32, float16 or bfloat16, got " << dt;
    fail(os.str());
  }
  for (auto [a, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    if (a->dtype() != dt) {
      os << name << " dtype " << a->dtype() << " does not match q dtype " << dt;
      fail(os.str());
    }
  }
  for (auto [a, name] : {std::pair{&g, "g"}, std::pair{&beta, "beta"}}) {
    if (!is_float(a->dtype())) {
      os << name << " must be a floating-point array, got " << a->dtype();
      fail(os.str());
    }
  }
  if (state.dtype() != mx::float32) {
    os << "state must be float32 (the recurrent state is kept in float32), got " << state.dtype();
    fail(os.str());
  }
  if (!is_supported_gated_delta_key_dim(Dk)) {
    os << "key head dim Dk = " << Dk << " is not supported (one of 32, 64, 128, 256)";
    fail(os.str());
  }
  if (Dv < 1 || Dv > kGatedDeltaMaxValueDim) {
    os << "value head dim Dv = " << Dv << " is not supported (1.." << kGatedDeltaMaxValueDim << ")";
    fail(os.str());
  }
  if (Hk < 1 || Hv < 1 || Hv % Hk != 0) {
    os << "the value heads (" << Hv << ", from v) must be a positive multiple of the key heads ("
       << Hk << ", from q)";
    fail(os.str());
  }

  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(q, false, stream),
      mx::contiguous(k, false, stream),
      mx::contiguous(v, false, stream),
      mx::contiguous(mx::astype(g, mx::float32, stream), false, stream),
      mx::contiguous(mx::astype(beta, mx::float32, stream), false, stream),
      // The CPU backend takes the state as it comes (any layout) so that a
      // step's gathered states, which nothing else holds, are donated to the
      // final state; a contiguous() node here would hold a second reference.
      stream.device == mx::Device::cpu ? state : mx::contiguous(state, false, stream)};
  if (mask) {
    inputs.push_back(mx::contiguous(*mask, false, stream));
  }
  return mx::array::make_arrays(
      {{B, T, Hv, Dv}, {B, Hv, Dv, Dk}},
      {dt, mx::float32},
      std::make_shared<GatedDelta>(stream),
      std::move(inputs));
}

std::vector<mx::Shape> GatedDelta::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& v = inputs[2];
  return {v.shape(), inputs[kStateInput].shape()};
}

void GatedDelta::allocate_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  release_sibling_inputs(inputs, outputs);
  const auto& state_in = inputs[kStateInput];
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  if (state_in.flags().row_contiguous && state_in.is_donatable()) {
    outputs[1].copy_shared_buffer(state_in);
  } else {
    outputs[1].set_data(mx::allocator::malloc(outputs[1].nbytes()));
  }
}

} // namespace vllm_metal
