// The ArgmaxHead op (validation, the lazy array), its screen's builder and
// its GPU refusal.
#include "argmax_head.h"

#include <sstream>
#include <stdexcept>
#include <vector>

#include "cpu/argmax_head_screen.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace vllm_metal {

namespace {

void check_screen(const mx::array& weight, const mx::array& wb, const mx::array& table) {
  const int64_t vocab = weight.shape(0), dim = weight.shape(1);
  if (wb.dtype() != mx::uint16 || wb.ndim() != 1 || wb.shape(0) != cpu::screen_weight_values(vocab, dim) ||
      table.dtype() != mx::float32 || table.ndim() != 1 || table.shape(0) != cpu::screen_table_floats(vocab)) {
    std::ostringstream os;
    os << "[argmax_head] the screen is not argmax_head_screen's for a [" << vocab << ", " << dim
       << "] weight: got " << wb.dtype() << " " << wb.shape() << " and " << table.dtype() << " " << table.shape();
    throw std::invalid_argument(os.str());
  }
}

} // namespace

mx::array argmax_head(const mx::array& hidden, const mx::array& weight, const std::optional<mx::array>& screen_weight,
                      const std::optional<mx::array>& screen_table, mx::StreamOrDevice s) {
  if (hidden.ndim() != 2 || weight.ndim() != 2 || hidden.shape(1) != weight.shape(1)) {
    std::ostringstream os;
    os << "[argmax_head] hidden must be [rows, hidden_size] and weight [vocab, hidden_size], got "
       << hidden.shape() << " and " << weight.shape();
    throw std::invalid_argument(os.str());
  }
  if (hidden.dtype() != mx::float32 || weight.dtype() != mx::float32) {
    throw std::invalid_argument("[argmax_head] hidden and weight must be float32");
  }
  if (weight.shape(0) == 0 || weight.shape(0) > (int64_t{1} << 31) - 1) {
    throw std::invalid_argument("[argmax_head] the vocabulary must have 1 to 2^31 - 1 rows");
  }
  if (screen_weight.has_value() != screen_table.has_value()) {
    throw std::invalid_argument("[argmax_head] screen_weight and screen_table come together (argmax_head_screen)");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {mx::contiguous(hidden, false, stream), mx::contiguous(weight, false, stream)};
  if (screen_weight) {
    check_screen(weight, *screen_weight, *screen_table);
    inputs.push_back(*screen_weight);
    inputs.push_back(*screen_table);
  }
  return mx::array({hidden.shape(0)}, mx::int32, std::make_shared<ArgmaxHead>(stream), std::move(inputs));
}

std::pair<mx::array, mx::array> argmax_head_screen(const mx::array& weight) {
  if (weight.ndim() != 2 || weight.dtype() != mx::float32 || weight.shape(0) == 0 ||
      weight.shape(0) > (int64_t{1} << 31) - 1) {
    std::ostringstream os;
    os << "[argmax_head_screen] the weight must be float32 [vocab, hidden_size] with 1 to 2^31 - 1 rows, got "
       << weight.dtype() << " " << weight.shape();
    throw std::invalid_argument(os.str());
  }
  auto w = mx::contiguous(weight, false, mx::Device::cpu);
  mx::eval(w);
  const int64_t vocab = w.shape(0), dim = w.shape(1);
  std::vector<uint16_t> wb(static_cast<size_t>(cpu::screen_weight_values(vocab, dim)));
  std::vector<float> table(static_cast<size_t>(cpu::screen_table_floats(vocab)));
  const std::string why = cpu::build_argmax_screen(w.data<float>(), vocab, dim, wb.data(), table.data());
  if (!why.empty()) {
    throw std::invalid_argument("[argmax_head_screen] this head cannot be screened: " + why);
  }
  return {mx::array(wb.begin(), {static_cast<int>(wb.size())}, mx::uint16),
          mx::array(table.begin(), {static_cast<int>(table.size())}, mx::float32)};
}

std::string argmax_head_screen_build() {
  return cpu::argmax_screen_build();
}

std::vector<int64_t> argmax_head_screen_counters() {
  const auto c = cpu::argmax_screen_counters();
  return {c.calls, c.rows, c.exact, c.declined};
}

void ArgmaxHead::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[argmax_head] the ArgmaxHead primitive runs on MLX's CPU device only; on the GPU, "
      "vllm_metal.native.ops.argmax_head builds MLX's own matmul and argmax");
}

} // namespace vllm_metal
