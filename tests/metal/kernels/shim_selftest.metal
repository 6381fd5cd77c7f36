// Kernels that test the executor itself (test_executor.py): that barriers and
// simdgroup operations really synchronise, that divergence is caught, and that
// the shim's types, ids and threadgroup memory behave as in Metal.
#include <metal_stdlib>

using namespace metal;

// Thread i returns the value thread n-1-i stored: needs the barrier.
[[kernel]] void reverse_with_barrier(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 ntg [[threads_per_threadgroup]]) {
  threadgroup float shared[1024];
  shared[tid] = in[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[ntg.x - 1 - tid];
}

// The same without the barrier: a race the executor must expose.
[[kernel]] void reverse_without_barrier(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 ntg [[threads_per_threadgroup]]) {
  threadgroup float shared[1024];
  shared[tid] = in[tid];
  out[tid] = shared[ntg.x - 1 - tid];
}

// Every simd operation of the shim; out holds 12 results per thread.
[[kernel]] void simd_operations(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const float x = in[tid];
  const int xi = int(x);
  device float* o = out + tid * 12;
  o[0] = simd_sum(x);
  o[1] = simd_max(x);
  o[2] = simd_min(x);
  o[3] = simd_prefix_exclusive_sum(x);
  o[4] = simd_prefix_inclusive_sum(x);
  o[5] = simd_shuffle(x, ushort((lane * 7) % 32));
  o[6] = simd_shuffle_xor(x, ushort(5));
  o[7] = simd_shuffle_down(x, ushort(3));
  o[8] = simd_shuffle_up(x, ushort(3));
  o[9] = simd_broadcast(x, ushort(9));
  o[10] = float(simd_or(xi)) + (simd_any(x > 30.0f) ? 1000.0f : 0.0f) +
      (simd_all(x > -1.0f) ? 2000.0f : 0.0f);
  simdgroup_barrier(mem_flags::mem_none);
  o[11] = simd_broadcast_first(x);
}

// Thread-position attributes, flattened: 3+3+3+3+3+3 + 5 values per thread.
[[kernel]] void thread_ids(
    device uint* out [[buffer(0)]],
    uint3 gpos [[thread_position_in_grid]],
    uint3 tgpos [[threadgroup_position_in_grid]],
    uint3 tpos [[thread_position_in_threadgroup]],
    uint3 ntg [[threads_per_threadgroup]],
    uint3 ngroups [[threadgroups_per_grid]],
    uint3 ngrid [[threads_per_grid]],
    uint tindex [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint width [[threads_per_simdgroup]]) {
  const uint linear = (gpos.z * ngrid.y + gpos.y) * ngrid.x + gpos.x;
  device uint* o = out + linear * 23;
  const uint3 v[6] = {gpos, tgpos, tpos, ntg, ngroups, ngrid};
  for (int i = 0; i < 6; ++i) {
    o[3 * i] = v[i].x;
    o[3 * i + 1] = v[i].y;
    o[3 * i + 2] = v[i].z;
  }
  o[18] = tindex;
  o[19] = sg;
  o[20] = lane;
  o[21] = nsg;
  o[22] = width;
}

// half/bfloat conversions and float4 arithmetic, via a template instantiated
// with [[host_name]] like the real kernels.
template <typename T>
[[kernel]] void round_trip(
    const device float* in [[buffer(0)]],
    device T* stored [[buffer(1)]],
    device float4* vectors [[buffer(2)]],
    uint tid [[thread_position_in_grid]]) {
  stored[tid] = static_cast<T>(in[tid]);
  const float back = static_cast<float>(stored[tid]);
  float4 v = vectors[tid];
  v = v * 2.0f + float4{back, 0.0f, 1.0f, 2.0f};
  v.w = dot(v, float4{1.0f, 1.0f, 1.0f, 0.0f});
  vectors[tid] = v;
}
template [[host_name("round_trip_half")]] [[kernel]] decltype(round_trip<half>) round_trip<half>;
template [[host_name("round_trip_bfloat")]] [[kernel]] decltype(round_trip<bfloat>) round_trip<bfloat>;

// Faults the executor must report.
[[kernel]] void divergent_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

[[kernel]] void exit_before_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 3) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

[[kernel]] void divergent_simd(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  if (lane < 16) {
    x = simd_sum(x);
  }
  out[lane] = x;
}

[[kernel]] void too_much_threadgroup_memory(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[8192];
  threadgroup float more[64];
  big[tid] = 1.0f;
  more[tid % 64] = 2.0f;
  out[tid] = big[tid] + more[tid % 64];
}

// Reads one element past the end of `in`: the guard page must fault.
[[kernel]] void read_past_end(
    const device float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant int& n [[buffer(2)]],
    uint tid [[thread_position_in_grid]]) {
  out[tid] = in[n + int(tid)];
}
