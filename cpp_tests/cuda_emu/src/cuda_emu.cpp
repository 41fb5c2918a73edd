// The emulator's runtime: fibers, the block scheduler, barriers and warp exchanges (cuda_emu.h
// describes the semantics).
#include "cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <vector>

#include "fiber.h"

namespace cuda_emu {
namespace {

enum class State { kReady, kAtBarrier, kAtWarpOp, kDone };

struct Thread {
  Fiber fiber;
  ThreadIndex index;
  unsigned linear = 0;
  State state = State::kDone;
  // At a block barrier
  BarrierKind barrier_kind = BarrierKind::kSync;
  int predicate = 0;
  const char* site = "";
  int barrier_result = 0;
  // At a warp operation
  WarpOpKind op = WarpOpKind::kSync;
  uint32_t mask = 0;
  unsigned src_lane = 0;
  size_t size = 0;
  unsigned char value[16] = {};
  unsigned char result[16] = {};
  uint32_t ballot = 0;
};

const char* kind_name(BarrierKind kind) {
  static constexpr const char* kNames[] = {"__syncthreads", "__syncthreads_and", "__syncthreads_or",
                                           "__syncthreads_count"};
  return kNames[static_cast<int>(kind)];
}

const char* op_name(WarpOpKind kind) {
  static constexpr const char* kNames[] = {"__syncwarp",       "__shfl_sync",     "__shfl_up_sync",
                                           "__shfl_down_sync", "__shfl_xor_sync", "__ballot_sync"};
  return kNames[static_cast<int>(kind)];
}

enum class Order { kShuffle, kForward, kReverse };

Order parse_order(const std::string& order) {
  if (order == "shuffle") return Order::kShuffle;
  if (order == "forward") return Order::kForward;
  if (order == "reverse") return Order::kReverse;
  std::fprintf(stderr, "cuda_emu: the schedule order must be shuffle, forward or reverse, got %s\n", order.c_str());
  std::abort();
}

Order order_from_env() {
  const char* order = std::getenv("CUDA_EMU_ORDER");
  return parse_order(order ? order : "shuffle");
}

uint64_t seed_from_env() {
  const char* seed = std::getenv("CUDA_EMU_SEED");
  return seed ? std::strtoull(seed, nullptr, 10) : 0x5eedu;
}

// Runs the blocks of launches on one OS thread: one fiber per CUDA thread of the block.
class BlockRunner {
 public:
  std::string run(dim3 grid, dim3 block, const std::function<void()>& body) {
    const uint64_t threads = uint64_t{block.x} * block.y * block.z;
    if (threads == 0 || threads > kMaxBlockThreads) return "invalid block size " + std::to_string(threads);
    if (uint64_t{grid.x} * grid.y * grid.z == 0) return "";  // CUDA rejects it; nothing to run here
    body_ = &body;
    if (threads_.size() < threads) {
      const size_t old = threads_.size();
      threads_.resize(threads);
      for (size_t t = old; t < threads; ++t) threads_[t] = std::make_unique<Thread>();
    }
    ++launch_;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          std::string error = run_block(grid, block, uint3{x, y, z}, static_cast<unsigned>(threads));
          if (!error.empty()) {
            std::ostringstream os;
            os << "block (" << x << ", " << y << ", " << z << "): " << error;
            return os.str();
          }
        }
      }
    }
    return "";
  }

  void set_schedule(const std::string& order, uint64_t seed) {
    order_ = parse_order(order);
    seed_ = seed;
  }

  Thread& current() {
    if (current_ == nullptr) {
      std::fprintf(stderr, "cuda_emu: a CUDA builtin was used outside a kernel\n");
      std::abort();
    }
    return *current_;
  }

  int block_barrier(BarrierKind kind, int predicate, const char* site) {
    Thread& self = current();
    self.state = State::kAtBarrier;
    self.barrier_kind = kind;
    self.predicate = predicate;
    self.site = site;
    yield(self);
    return self.barrier_result;
  }

  uint32_t warp_exchange(WarpOpKind kind, uint32_t mask, const void* value, size_t size, unsigned src_lane,
                         void* result, int predicate, const char* site) {
    Thread& self = current();
    self.state = State::kAtWarpOp;
    self.op = kind;
    self.mask = mask;
    self.src_lane = src_lane;
    self.size = size;
    if (size > 0) std::memcpy(self.value, value, size);
    self.predicate = predicate;
    self.site = site;
    yield(self);
    if (result != nullptr && size > 0) std::memcpy(result, self.result, size);
    return self.ballot;
  }

  uint32_t active_mask() {
    const Thread& self = current();
    const unsigned first = self.linear / kWarpSize * kWarpSize;
    uint32_t mask = 0;
    for (unsigned l = 0; l < kWarpSize && first + l < block_threads_; ++l) {
      if (threads_[first + l]->state != State::kDone) mask |= 1u << l;
    }
    return mask;
  }

 private:
  static void thread_main(void* arg) {
    BlockRunner& runner = *static_cast<BlockRunner*>(arg);
    Thread& self = *runner.current_;
    (*runner.body_)();
    self.state = State::kDone;
    self.fiber.exit_to(runner.scheduler_);
  }

  void yield(Thread& self) { self.fiber.switch_to(scheduler_); }

  // Runs one block in epochs between block barriers. In each epoch the warps run one after the
  // other in an order drawn for the epoch (with the lanes of a warp in an order of their own), each
  // as far as it can: a warp operation completes as soon as the lanes of its mask are there, so a
  // warp may finish a phase, write shared memory and reach the barrier before another warp has
  // started the phase. A missing barrier between phases then shows up in some epoch order.
  std::string run_block(dim3 grid, dim3 block, uint3 block_idx, unsigned threads) {
    block_threads_ = threads;
    error_.clear();
    for (unsigned t = 0; t < threads; ++t) {
      Thread& th = *threads_[t];
      th.linear = t;
      th.index.thread_idx = uint3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
      th.index.block_idx = block_idx;
      th.index.block_dim = block;
      th.index.grid_dim = grid;
      th.state = State::kReady;
      th.fiber.start(&BlockRunner::thread_main, this);
    }
    const unsigned warps = (threads + kWarpSize - 1) / kWarpSize;
    std::vector<unsigned> warp_order(warps), lane_order(kWarpSize);
    std::mt19937_64 rng(seed_ ^ (launch_ * 0x9E3779B97F4A7C15ull) ^
                        (uint64_t{block_idx.x} + (uint64_t{block_idx.y} << 21) + (uint64_t{block_idx.z} << 42)));
    for (;;) {
      draw_order(warp_order, rng);
      for (unsigned w : warp_order) {
        draw_order(lane_order, rng);
        if (!run_warp(w * kWarpSize, std::min(kWarpSize, threads - w * kWarpSize), lane_order)) return abandon(threads);
      }
      if (std::all_of(threads_.begin(), threads_.begin() + threads,
                      [](const auto& th) { return th->state == State::kDone; })) {
        return "";
      }
      if (!complete_block_barrier(threads)) {
        if (error_.empty()) error_ = describe_deadlock(threads);
        return abandon(threads);
      }
    }
  }

  void draw_order(std::vector<unsigned>& order, std::mt19937_64& rng) const {
    std::iota(order.begin(), order.end(), 0u);
    if (order_ == Order::kShuffle) std::shuffle(order.begin(), order.end(), rng);
    if (order_ == Order::kReverse) std::reverse(order.begin(), order.end());
  }

  // Runs the lanes of one warp until none can proceed (all at a block barrier, done, or waiting on
  // a lane that is). Returns false on an error.
  bool run_warp(unsigned warp_start, unsigned lanes, const std::vector<unsigned>& lane_order) {
    for (bool ran = true; ran;) {
      ran = false;
      for (unsigned l : lane_order) {
        if (l >= lanes) continue;
        Thread& th = *threads_[warp_start + l];
        if (th.state != State::kReady) continue;
        current_ = &th;
        scheduler_.switch_to(th.fiber);
        current_ = nullptr;
        ran = true;
        if (th.state == State::kAtWarpOp) complete_warp_op(warp_start, lanes, l);
        if (!error_.empty()) return false;
      }
    }
    return true;
  }

  // Threads blocked when the launch failed never resume: their stacks are reset for the next block.
  std::string abandon(unsigned threads) {
    for (unsigned t = 0; t < threads; ++t) {
      if (threads_[t]->state != State::kDone) threads_[t]->fiber.discard();
      threads_[t]->state = State::kDone;
    }
    return error_;
  }

  bool complete_block_barrier(unsigned threads) {
    const Thread* first = nullptr;
    const Thread* exited = nullptr;
    for (unsigned t = 0; t < threads; ++t) {
      const Thread& th = *threads_[t];
      if (th.state == State::kAtWarpOp) return false;
      if (th.state == State::kDone && exited == nullptr) exited = &th;
      if (th.state == State::kAtBarrier && first == nullptr) first = &th;
    }
    if (first == nullptr) return false;
    std::ostringstream os;
    if (exited != nullptr) {
      os << "thread " << exited->linear << " exited while thread " << first->linear << " waits at "
         << kind_name(first->barrier_kind) << " (" << first->site << "): a barrier not every thread reaches";
      error_ = os.str();
      return false;
    }
    int count = 0;
    for (unsigned t = 0; t < threads; ++t) {
      const Thread& th = *threads_[t];
      if (th.barrier_kind != first->barrier_kind || std::strcmp(th.site, first->site) != 0) {
        os << "divergent barrier: thread " << first->linear << " waits at " << kind_name(first->barrier_kind) << " ("
           << first->site << "), thread " << th.linear << " at " << kind_name(th.barrier_kind) << " (" << th.site << ")";
        error_ = os.str();
        return false;
      }
      count += th.predicate != 0;
    }
    int result = 0;
    switch (first->barrier_kind) {
      case BarrierKind::kSync:
        break;
      case BarrierKind::kAnd:
        result = count == static_cast<int>(threads);
        break;
      case BarrierKind::kOr:
        result = count > 0;
        break;
      case BarrierKind::kCount:
        result = count;
        break;
    }
    for (unsigned t = 0; t < threads; ++t) {
      threads_[t]->barrier_result = result;
      threads_[t]->state = State::kReady;
    }
    return true;
  }

  // Completes the warp operation lane `l` waits at once every lane of its mask is there; an
  // inconsistent one (a lane of the mask exited, or at another operation or mask) is an error.
  void complete_warp_op(unsigned warp_start, unsigned lanes, unsigned l) {
    Thread& caller = *threads_[warp_start + l];
    const uint32_t mask = caller.mask;
    const auto fail = [&](const std::string& what) {  // the message is built only on an error
      std::ostringstream os;
      os << op_name(caller.op) << " (" << caller.site << ") in thread " << caller.linear << ": " << what;
      error_ = os.str();
    };
    if ((mask >> l & 1u) == 0) return fail("the mask does not include the calling lane");
    if (lanes < kWarpSize && (mask >> lanes) != 0) return fail("the mask names lanes past the end of the block");
    for (unsigned m = 0; m < lanes; ++m) {
      if ((mask >> m & 1u) == 0) continue;
      const Thread& lane = *threads_[warp_start + m];
      if (lane.state == State::kDone) return fail("lane " + std::to_string(m) + " of the mask has exited");
      if (lane.state == State::kAtWarpOp &&
          (lane.op != caller.op || lane.mask != mask || std::strcmp(lane.site, caller.site) != 0)) {
        std::ostringstream os;
        os << "lane " << m << " waits at " << op_name(lane.op) << " (" << lane.site << ") with mask 0x" << std::hex
           << lane.mask;
        return fail(os.str());
      }
      if (lane.state != State::kAtWarpOp) return;  // still running, or at a block barrier (a deadlock if it stays)
    }
    uint32_t ballot = 0;
    for (unsigned m = 0; m < lanes; ++m) {
      if ((mask >> m & 1u) != 0 && threads_[warp_start + m]->predicate != 0) ballot |= 1u << m;
    }
    for (unsigned m = 0; m < lanes; ++m) {
      if ((mask >> m & 1u) == 0) continue;
      Thread& lane = *threads_[warp_start + m];
      if (lane.size > 0) {
        if (lane.src_lane >= lanes || (mask >> lane.src_lane & 1u) == 0) {
          std::ostringstream os;
          os << "lane " << m << " reads lane " << lane.src_lane << ", which is not in the mask 0x" << std::hex << mask;
          return fail(os.str());
        }
        std::memcpy(lane.result, threads_[warp_start + lane.src_lane]->value, lane.size);
      }
      lane.ballot = ballot;
    }
    for (unsigned m = 0; m < lanes; ++m) {
      if ((mask >> m & 1u) != 0) threads_[warp_start + m]->state = State::kReady;
    }
  }

  std::string describe_deadlock(unsigned threads) {
    std::ostringstream os;
    os << "deadlock: no thread can proceed;";
    int shown = 0;
    for (unsigned t = 0; t < threads && shown < 4; ++t) {
      const Thread& th = *threads_[t];
      if (th.state == State::kAtWarpOp) {
        os << " thread " << t << " waits at " << op_name(th.op) << " (" << th.site << ") with mask 0x" << std::hex
           << th.mask << std::dec << ";";
        ++shown;
      } else if (th.state == State::kAtBarrier) {
        os << " thread " << t << " waits at " << kind_name(th.barrier_kind) << " (" << th.site << ");";
        ++shown;
      }
    }
    return os.str();
  }

  std::vector<std::unique_ptr<Thread>> threads_;
  SchedulerContext scheduler_;
  Thread* current_ = nullptr;
  const std::function<void()>* body_ = nullptr;
  unsigned block_threads_ = 0;
  std::string error_;
  uint64_t launch_ = 0;
  Order order_ = order_from_env();
  uint64_t seed_ = seed_from_env();
};

BlockRunner& runner() {
  thread_local BlockRunner instance;
  return instance;
}

std::mutex error_mutex;
std::string launch_error;

}  // namespace

const ThreadIndex& current_thread() { return runner().current().index; }

int block_barrier(BarrierKind kind, int predicate, const char* site) {
  return runner().block_barrier(kind, predicate, site);
}

uint32_t warp_exchange(WarpOpKind kind, uint32_t mask, const void* value, size_t size, unsigned src_lane,
                       void* result, int predicate, const char* site) {
  return runner().warp_exchange(kind, mask, value, size, src_lane, result, predicate, site);
}

uint32_t active_mask() { return runner().active_mask(); }

unsigned lane_id() {
  const ThreadIndex& t = current_thread();
  const unsigned linear = t.thread_idx.x + t.block_dim.x * (t.thread_idx.y + t.block_dim.y * t.thread_idx.z);
  return linear % kWarpSize;
}

void set_schedule(const std::string& order, uint64_t seed) { runner().set_schedule(order, seed); }

std::string run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  return runner().run(grid, block, body);
}

void record_launch_error(const std::string& error) {
  const std::lock_guard<std::mutex> lock(error_mutex);
  if (launch_error.empty()) launch_error = error;
}

std::string take_launch_error() {
  const std::lock_guard<std::mutex> lock(error_mutex);
  std::string error;
  error.swap(launch_error);
  return error;
}

}  // namespace cuda_emu
