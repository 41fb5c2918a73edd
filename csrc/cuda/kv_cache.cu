// The host side of the paged KV cache kernels (kv_cache.cuh): the entry points that launches.h
// declares. No torch: nvcc compiles this file with the kernels alone, and the torch wrapper
// (kv_cache_ops.cpp) is the host compiler's; the emulated-kernel tests (cpp_tests/emulated) compile
// this same file under the CPU emulator.
#include <cstdint>

#include "../common/op_views.h"
#include "kv_cache.cuh"
#include "launch.cuh"
#include "launches.h"

namespace specdec::cuda {

// Threads per block for a loop over `elems` elements: a power of two in [32, 256].
static int kv_threads_for(int64_t elems) {
  int threads = 32;
  while (threads < 256 && threads < elems) threads *= 2;
  return threads;
}

void launch_kv_write(const KvWriteView& v, cudaStream_t stream) {
  with_word_type(v.word_bytes, [&](auto word) {
    using W = typename decltype(word)::type;
    const int64_t* ks = v.key_strides;
    const int64_t* vs = v.value_strides;
    launch_kernel(kv_write_kernel<W>, grid_of(v.batch * v.tokens), dim3(kv_threads_for(v.heads * v.head_dim)),
                  stream, static_cast<const W*>(v.key), static_cast<const W*>(v.value), v.slot_mapping,
                  static_cast<W*>(v.pool), v.tokens, v.heads, v.head_dim, ks[0], ks[1], ks[2], ks[3], vs[0], vs[1],
                  vs[2], vs[3], v.num_slots);
  });
}

void launch_kv_compact(const KvCompactView& v, cudaStream_t stream) {
  with_word_type(v.word_bytes, [&](auto word) {
    using W = typename decltype(word)::type;
    launch_kernel(kv_compact_kernel<W>, grid_of(v.batch * v.planes), dim3(kv_threads_for(v.slot_elems)), stream,
                  static_cast<W*>(v.pool), v.block_tables, v.src_positions, v.dst_start, v.planes, v.num_pages,
                  v.page_size, v.slot_elems, v.max_pages, v.positions);
  });
}

}  // namespace specdec::cuda
