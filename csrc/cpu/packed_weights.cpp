// packed_weights.h: one packed copy per live weight and layout, keyed by the weight's storage, where in it
// the weight lies and the layout. (Not by its TensorImpl: every runner the package builds hands the ops
// its own detach()ed tensors of the model's parameters, which share the storage and the version counter.)
#include "packed_weights.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#include "simd/amx.h"

namespace specdec::cpu {
namespace {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;
// (storage, byte offset of the weight in it, rows, columns, row stride, the layout: lanes, pair, bytes,
// group; all zero for the AMX tiles)
using PackedKey = std::tuple<const c10::StorageImpl*, int64_t, int64_t, int64_t, int64_t, int, int, int, int>;

struct PackedEntry {
  WeakStorage owner;  // (a weak reference also keeps the StorageImpl's address from being reused)
  const void* data;
  int64_t version;
  uint64_t fingerprint;  // sampled_fingerprint() of the weight when it was packed
  int64_t checked_epoch;  // the recheck epoch the fingerprint was last compared in
  at::Tensor packed;
};

std::mutex packed_mutex;
std::map<PackedKey, PackedEntry> packed_entries;
std::atomic<int64_t> recheck_epoch{0};

// Elements of a weight that its fingerprint reads: spread over its rows and columns.
constexpr int64_t kFingerprintSamples = 64;

// A hash of kFingerprintSamples elements' bits. A write that the version counter does not see (through
// `.data`: a LoRA merge, a fine-tuning step, a rescale) changes most elements, and so this, almost surely.
uint64_t sampled_fingerprint(const at::Tensor& weight) {
  const auto* bytes = static_cast<const unsigned char*>(weight.data_ptr());
  const int64_t rows = weight.size(0), cols = weight.size(1), size = weight.element_size();
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (int64_t i = 0; i < kFingerprintSamples && rows > 0 && cols > 0; ++i) {
    const int64_t r = i * rows / kFingerprintSamples, c = (i * 40503 + r) % cols;
    uint32_t bits = 0;
    std::memcpy(&bits, bytes + (r * weight.stride(0) + c) * size, static_cast<size_t>(size));
    hash = (hash ^ bits) * 1099511628211ull;
  }
  return hash;
}

// Inference tensors keep no version counter (they cannot change outside inference mode).
int64_t version_of(const at::Tensor& t) { return t.is_inference() ? 0 : static_cast<int64_t>(t._version()); }

DType dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? DType::kBF16 : t.scalar_type() == at::kHalf ? DType::kF16 : DType::kF32;
}

// The cached copy of `weight` under `layout` (the AMX tiles: all zero), made by pack() on a miss.
at::Tensor cached_copy(const at::Tensor& weight, const PanelLayout& layout, const std::function<at::Tensor()>& pack) {
  const c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  const PackedKey key{storage, weight.storage_offset() * static_cast<int64_t>(weight.element_size()), weight.size(0),
                      weight.size(1), weight.stride(0), layout.lanes, layout.pair, layout.bytes, layout.group};
  const int64_t version = version_of(weight);
  const int64_t epoch = recheck_epoch.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(packed_mutex);
    const auto found = packed_entries.find(key);
    if (found != packed_entries.end() && !found->second.owner.expired() && found->second.data == weight.data_ptr() &&
        found->second.version == version) {
      PackedEntry& entry = found->second;
      if (entry.checked_epoch == epoch) return entry.packed;
      if (entry.fingerprint == sampled_fingerprint(weight)) {
        entry.checked_epoch = epoch;
        return entry.packed;
      }
    }
  }
  const uint64_t fingerprint = sampled_fingerprint(weight);
  at::Tensor packed = pack();
  std::lock_guard<std::mutex> lock(packed_mutex);
  for (auto it = packed_entries.begin(); it != packed_entries.end();)  // (sweep_packed_weights, under this lock)
    it = it->second.owner.expired() ? packed_entries.erase(it) : std::next(it);
  packed_entries.insert_or_assign(key, PackedEntry{WeakStorage(weight.storage().getWeakStorageImpl()), weight.data_ptr(),
                                                   version, fingerprint, epoch, packed});
  return packed;
}

}  // namespace

void recheck_packed_weights() { recheck_epoch.fetch_add(1, std::memory_order_relaxed); }

int64_t packed_weight_bytes() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  int64_t bytes = 0;
  for (const auto& entry : packed_entries) bytes += entry.second.packed.nbytes();
  return bytes;
}

void sweep_packed_weights() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  for (auto it = packed_entries.begin(); it != packed_entries.end();)
    it = it->second.owner.expired() ? packed_entries.erase(it) : std::next(it);
}

void forget_packed_weights() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_entries.clear();  // (a caller's returned tensor keeps its copy alive until it lets go)
}

at::Tensor panel_packed_weight(const at::Tensor& weight, const PanelLayout& layout) {
  return cached_copy(weight, layout, [&] {
    const GemmWeight w{weight.data_ptr(), dtype_of(weight), weight.size(0), weight.size(1), weight.stride(0)};
    at::Tensor packed = at::empty({packed_panel_bytes(w, layout)}, at::TensorOptions().dtype(at::kByte));
    pack_panels(w, layout, packed.data_ptr());
    return packed;
  });
}

at::Tensor amx_packed_weight(const at::Tensor& weight) {
  return cached_copy(weight, PanelLayout{}, [&] {
    const GemmWeight w{weight.data_ptr(), DType::kBF16, weight.size(0), weight.size(1), weight.stride(0)};
    at::Tensor packed = at::empty({amx::packed_elements(w)}, at::TensorOptions().dtype(at::kBFloat16));
    amx::pack_weight(w, static_cast<uint16_t*>(packed.data_ptr()));
    return packed;
  });
}

}  // namespace specdec::cpu
