// CudaBackend: the Backend ops on one GPU. Kernels live in the .cu files (kernels.h launchers); dense GEMMs go
// through cuBLASLt (bf16 in, fp32 accumulate, bf16 or fp32 out; one heuristic query per shape, cached), the per-head
// MLA projections through cuBLAS strided-batched GEMMs. Everything runs in order on one non-blocking stream; only
// to_host_f32 / download / synchronize wait for it.
//
// Memory (all taken in the constructor, none in the steady state):
//   persistent arena  weights then the KV pool (alloc; bump allocation, never freed)
//   scratch arena     a step's activations (scratch; reset by begin_step, rewound by scratch_release)
//   meta arena        the step's metadata and attention work lists, uploaded from a pinned mirror of the same layout
#include "backend/cuda/cuda_backend.h"

#include <cuda.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cuda/kernels.h"
#include "core/log.h"

namespace mlaserve {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

#define CUDA_OK(expr, what)                                                                            \
  do {                                                                                                 \
    const cudaError_t err_ = (expr);                                                                   \
    if (err_ != cudaSuccess) ::mlaserve::fail("cuda: {}: {} ({})", what, cudaGetErrorString(err_),     \
                                              static_cast<int>(err_));                                 \
  } while (0)

#define CUBLAS_OK(expr, what)                                                               \
  do {                                                                                      \
    const cublasStatus_t st_ = (expr);                                                      \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                       \
      ::mlaserve::fail("cublas: {}: status {} ({})", what, static_cast<int>(st_),           \
                       cublasGetStatusString(st_));                                         \
  } while (0)

// The driver's virtual memory calls, looked up through the runtime (cudaGetDriverEntryPointByVersion), so the
// binaries need no libcuda at link time (they build, and list their tests, on machines without a driver).
struct DriverVmm {
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  static const DriverVmm& get() {
    static const DriverVmm api = [] {
      DriverVmm d;
      auto find = [](const char* name, auto& fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q{};
        const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
        MLA_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && p != nullptr,
                  "cuda: the driver has no '{}' ({})", name, cudaGetErrorString(e));
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      };
      find("cuMemGetAllocationGranularity", d.granularity);
      find("cuMemAddressReserve", d.reserve);
      find("cuMemAddressFree", d.address_free);
      find("cuMemCreate", d.create);
      find("cuMemRelease", d.release);
      find("cuMemMap", d.map);
      find("cuMemUnmap", d.unmap);
      find("cuMemSetAccess", d.set_access);
      find("cuGetErrorString", d.error_string);
      return d;
    }();
    return api;
  }
};

#define CU_OK(expr, what)                                                                          \
  do {                                                                                             \
    const CUresult r_ = (expr);                                                                    \
    if (r_ != CUDA_SUCCESS) {                                                                      \
      const char* s_ = nullptr;                                                                    \
      DriverVmm::get().error_string(r_, &s_);                                                      \
      ::mlaserve::fail("cuda driver: {}: {} ({})", what, s_ ? s_ : "?", static_cast<int>(r_));     \
    }                                                                                              \
  } while (0)

// Device memory whose physical pages can be given back and taken again at the same virtual addresses (CUDA's
// virtual memory management: an address range reserved once, a physical allocation mapped into it and unmapped).
class RemappableMemory {
 public:
  RemappableMemory() = default;
  RemappableMemory(const RemappableMemory&) = delete;
  RemappableMemory& operator=(const RemappableMemory&) = delete;
  ~RemappableMemory() {
    if (mapped_) {
      DriverVmm::get().unmap(ptr_, size_);
      DriverVmm::get().release(handle_);
    }
    if (ptr_) DriverVmm::get().address_free(ptr_, size_);
  }
  // Reserves `bytes` (rounded up to the granularity) on `device` and maps them.
  void create(int device, size_t bytes) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    size_t gran = 0;
    CU_OK(DriverVmm::get().granularity(&gran, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "allocation granularity");
    size_ = (bytes + gran - 1) / gran * gran;
    CU_OK(DriverVmm::get().reserve(&ptr_, size_, 0, 0, 0), "reserving the persistent arena's addresses");
    map();
  }
  void map() {
    CU_OK(DriverVmm::get().create(&handle_, size_, &prop_, 0), "allocating the persistent arena");
    CU_OK(DriverVmm::get().map(ptr_, size_, 0, handle_, 0), "mapping the persistent arena");
    mapped_ = true;
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(DriverVmm::get().set_access(ptr_, size_, &access, 1), "making the persistent arena accessible");
  }
  void unmap() {
    CU_OK(DriverVmm::get().unmap(ptr_, size_), "unmapping the persistent arena");
    CU_OK(DriverVmm::get().release(handle_), "releasing the persistent arena");
    mapped_ = false;
  }
  bool mapped() const { return mapped_; }
  char* base() const { return reinterpret_cast<char*>(ptr_); }
  size_t size() const { return size_; }

 private:
  CUmemAllocationProp prop_{};
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
  CUmemGenericAllocationHandle handle_{};
  bool mapped_ = false;
};

int64_t rows_of(const Tensor& t) { return t.dim() == 0 ? 1 : (t.size(-1) == 0 ? 0 : t.numel() / t.size(-1)); }

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}
// A feature that is on by default, off when the variable is "0".
bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == '0';
}

int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && (a % static_cast<uintptr_t>(al)) != 0) al /= 2;
  return al;
}

struct Arena {
  char* base = nullptr;
  size_t size = 0;
  size_t used = 0;
  // Returns nullptr when full.
  char* take(size_t bytes, size_t align = 256) {
    const size_t start = (used + align - 1) / align * align;
    if (start + bytes > size) return nullptr;
    used = start + bytes;
    return base + start;
  }
};

cuda::bf16* bf(const Tensor& t) { return static_cast<cuda::bf16*>(t.data()); }
// A latent cache's rows: bf16, or (an FP8 cache: model/kv_cache.h) E4M3 or E5M2 codes; the other pointer is null.
bool is_fp8_cache(const Tensor& c) { return c.dtype() == DType::F8_E4M3 || c.dtype() == DType::F8_E5M2; }
cuda::bf16* cache_bf16(const Tensor& c) { return is_fp8_cache(c) ? nullptr : bf(c); }
uint8_t* cache_fp8(const Tensor& c) { return is_fp8_cache(c) ? static_cast<uint8_t*>(c.data()) : nullptr; }
bool cache_e5m2(const Tensor& c) { return c.dtype() == DType::F8_E5M2; }

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& o) : device_(device) {
    int count = 0;
    CUDA_OK(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    MLA_CHECK(device >= 0 && device < count, "--device cuda: device {} does not exist ({} CUDA devices)", device, count);
    CUDA_OK(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    MLA_CHECK(prop.major == 9, "the CUDA backend is built for Hopper (sm_90a); device {} '{}' is sm_{}{}", device,
              prop.name, prop.major, prop.minor);
    num_sms_ = prop.multiProcessorCount;
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    for (cudaEvent_t& e : meta_events_) CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
    CUBLAS_OK(cublasLtCreate(&lt_), "cublasLtCreate");
    CUBLAS_OK(cublasCreate(&blas_), "cublasCreate");
    CUBLAS_OK(cublasSetStream(blas_, stream_), "cublasSetStream");

    size_t free_b = 0, total_b = 0;
    CUDA_OK(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    const size_t ws_bytes = 64ull << 20, meta_bytes = 64ull << 20, blas_ws_bytes = 32ull << 20;
    const size_t reserve = 1ull << 30;  // CUDA context, cuBLAS handles, kernels
    size_t persistent = o.persistent_bytes > 0 ? static_cast<size_t>(o.persistent_bytes)
                                               : static_cast<size_t>(o.mem_fraction_static * static_cast<double>(total_b));
    MLA_CHECK(o.persistent_bytes > 0 || (o.mem_fraction_static > 0.0 && o.mem_fraction_static < 1.0),
              "--mem-fraction-static must be in (0, 1), got {}", o.mem_fraction_static);
    const size_t fixed = ws_bytes + meta_bytes + blas_ws_bytes + reserve;
    MLA_CHECK(persistent + fixed < free_b,
              "--mem-fraction-static {}: {:.1f} GiB for weights and KV cache plus {:.1f} GiB of buffers exceed the "
              "{:.1f} GiB free on GPU {} ({:.1f} GiB total)",
              o.mem_fraction_static, persistent / kGiB, fixed / kGiB, free_b / kGiB, device, total_b / kGiB);
    size_t scratch = o.scratch_bytes > 0 ? static_cast<size_t>(o.scratch_bytes)
                                         : std::min<size_t>(8ull << 30, free_b - persistent - fixed);
    MLA_CHECK(persistent + fixed + scratch <= free_b,
              "{:.1f} GiB of activation scratch does not fit next to {:.1f} GiB of weights and KV cache on GPU {} "
              "({:.1f} GiB free): lower --mem-fraction-static or --scratch-gb",
              scratch / kGiB, persistent / kGiB, device, free_b / kGiB);
    MLA_CHECK(scratch >= (64ull << 20), "only {:.0f} MiB left for activation scratch: lower --mem-fraction-static",
              scratch / 1048576.0);
    persistent_.size = persistent;
    scratch_.size = scratch;
    meta_.size = meta_bytes;
    persistent_memory_.create(device, persistent);
    persistent_.base = persistent_memory_.base();
    // On this backend's stream (non-blocking: a cudaMemset on the legacy stream would not order before its uploads).
    CUDA_OK(cudaMemsetAsync(persistent_.base, 0, persistent, stream_), "clearing the persistent arena");
    CUDA_OK(cudaMalloc(&scratch_.base, scratch), "allocating the scratch arena");
    CUDA_OK(cudaMalloc(&meta_.base, meta_bytes), "allocating the metadata arena");
    CUDA_OK(cudaMalloc(&lt_ws_, ws_bytes), "allocating the cuBLASLt workspace");
    lt_ws_size_ = ws_bytes;
    CUDA_OK(cudaMalloc(&blas_ws_, blas_ws_bytes), "allocating the cuBLAS workspace");
    CUDA_OK(cudaMalloc(&gate_counter_, sizeof(unsigned)), "allocating the router's counter");
    CUDA_OK(cudaMalloc(&sample_slot_, sizeof(cuda::SampleStep)), "allocating the staged sampling's slot");
    CUDA_OK(cudaMemsetAsync(sample_slot_, 0, sizeof(cuda::SampleStep), stream_), "clearing the sampling slot");
    CUDA_OK(cudaMemsetAsync(gate_counter_, 0, sizeof(unsigned), stream_), "clearing the router's counter");
    CUDA_OK(cudaStreamSynchronize(stream_), "clearing the arenas");
    CUBLAS_OK(cublasSetWorkspace(blas_, blas_ws_, blas_ws_bytes), "cublasSetWorkspace");
    CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&pinned_), 2 * meta_bytes, cudaHostAllocDefault), "pinned buffer");
    // Download slots up front, large enough for any step's ids + logprobs (RankSet keeps at most 65536 rows), so the
    // steady state allocates no pinned memory (cudaFreeHost would synchronise the device).
    for (Download& d : downloads_) {
      CUDA_OK(cudaHostAlloc(&d.host, kDownloadSlotBytes, cudaHostAllocDefault), "pinned download slot");
      d.capacity = kDownloadSlotBytes;
      CUDA_OK(cudaEventCreateWithFlags(&d.done, cudaEventDisableTiming), "download event");
    }
    for (auto prepare : {cuda::mla_decode_prepare, cuda::mla_prefill_prepare, cuda::moe_gemm_gate_up_prepare,
                         cuda::moe_gemm_down_prepare})
      CUDA_OK(prepare(), "setting kernel shared-memory limits");
    allow_fast_ = !(o.simple_kernels || env_flag("MLASERVE_CUDA_SIMPLE"));
    moe_cublas_ = o.moe_cublas || env_flag("MLASERVE_MOE_CUBLAS");
    if (const char* v = std::getenv("MLASERVE_MLA_DECODE_VARIANT")) mla_variant_ = std::atoi(v);
    moe_grouped_only_ = env_flag("MLASERVE_MOE_GROUPED");
    wgmma_decode_ = !env_off("MLASERVE_MLA_WGMMA");
    page_runs_ = !env_off("MLASERVE_MLA_PAGE_RUNS");
    small_batch_ = o.small_batch && !env_off("MLASERVE_SMALL_BATCH");
    fp8_decode_ = small_batch_ && !env_off("MLASERVE_MOE_FP8_DECODE");
    one_token_ = small_batch_ && o.one_token_attention && !env_off("MLASERVE_MLA_ONE_TOKEN");
    if (one_token_) {
      const cudaError_t e = cuda::mla_one_token_max_clusters(&one_token_clusters_);
      MLA_LOG_INFO("cuda: one-token attention in one launch: {} clusters of {} blocks (a head each) fit the GPU at "
                   "once{}",
                   one_token_clusters_, cuda::kOneTokenCluster,
                   e == cudaSuccess ? "" : fmt::format(" (query failed: {})", cudaGetErrorString(e)));
    }
    idle_stats_ = env_flag("MLASERVE_GPU_IDLE_STATS");
    MLA_LOG_INFO("cuda: GPU {} '{}' ({} SMs, {:.1f} GiB): {:.2f} GiB for weights + KV cache, {:.2f} GiB activation "
                 "scratch{}{}",
                 device, prop.name, num_sms_, total_b / kGiB, persistent / kGiB, scratch / kGiB,
                 allow_fast_ ? "" : " (simple kernels)", moe_cublas_ ? " (MoE through cuBLAS)" : "");
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    report_idle();
    release_graphs();
    for (auto& [k, g] : gemms_) {
      cublasLtMatrixLayoutDestroy(g.a);
      cublasLtMatrixLayoutDestroy(g.b);
      cublasLtMatrixLayoutDestroy(g.c);
      cublasLtMatmulDescDestroy(g.desc);
    }
    cublasDestroy(blas_);
    cublasLtDestroy(lt_);
    cudaFree(scratch_.base);
    cudaFree(meta_.base);
    cudaFree(lt_ws_);
    cudaFree(blas_ws_);
    cudaFree(gate_counter_);
    cudaFree(sample_slot_);
    cudaFreeHost(pinned_);
    for (Download& d : downloads_) {
      if (d.host) cudaFreeHost(d.host);
      if (d.done) cudaEventDestroy(d.done);
    }
    for (cudaEvent_t e : meta_events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::CUDA; }
  DType act_dtype() const override { return DType::BF16; }
  DType weight_dtype(DType) const override { return DType::BF16; }

  // ---- memory ----
  Tensor alloc(const Shape& shape, DType dtype) override {
    const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
    char* p = persistent_.take(bytes);
    MLA_CHECK(p != nullptr,
              "out of persistent GPU memory: {} bytes requested, {:.2f} of {:.2f} GiB used (raise "
              "--mem-fraction-static or use fewer KV pages)",
              bytes, persistent_.used / kGiB, persistent_.size / kGiB);
    if (bytes) CUDA_OK(cudaMemsetAsync(p, 0, bytes, stream_), "alloc memset");
    return Tensor::view(p, shape, dtype, Device::CUDA);
  }

  Tensor scratch(const Shape& shape, DType dtype) override {
    const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
    char* p = scratch_.take(bytes);
    MLA_CHECK(p != nullptr,
              "GPU activation scratch exhausted: {} more bytes needed with {:.2f} of {:.2f} GiB in use (raise "
              "--scratch-gb or run fewer tokens per step)",
              bytes, scratch_.used / kGiB, scratch_.size / kGiB);
    scratch_peak_ = std::max(scratch_peak_, scratch_.used);
    return Tensor::view(p, shape, dtype, Device::CUDA);
  }
  size_t scratch_mark() override { return scratch_.used; }
  void scratch_release(size_t mark) override {
    MLA_CHECK(mark <= scratch_.used, "scratch_release: mark {} is past the top {}", mark, scratch_.used);
    scratch_.used = mark;
  }
  void release_persistent() override {
    MLA_CHECK(persistent_memory_.mapped(), "the persistent GPU memory is released already");
    CUDA_OK(cudaDeviceSynchronize(), "synchronize before releasing memory");
    persistent_memory_.unmap();
    MLA_LOG_INFO("cuda: released {:.2f} GiB of weights and KV cache", persistent_memory_.size() / kGiB);
  }
  void resume_persistent() override {
    MLA_CHECK(!persistent_memory_.mapped(), "the persistent GPU memory is not released");
    persistent_memory_.map();
    // Cleared on this backend's stream and waited for: its stream is non-blocking, so a cudaMemset (legacy stream)
    // could still be running when the weights' uploads on the stream land, and zero them.
    CUDA_OK(cudaMemsetAsync(persistent_.base, 0, persistent_.size, stream_), "clearing the persistent arena");
    CUDA_OK(cudaStreamSynchronize(stream_), "clearing the persistent arena");
    // What this backend keeps there itself (the model's tensors are the model's to load again).
    if (inv_freq_.defined()) upload_into(inv_freq_host_, inv_freq_);
    MLA_LOG_INFO("cuda: took {:.2f} GiB for weights and KV cache again", persistent_memory_.size() / kGiB);
  }
  int64_t persistent_bytes_free() const override {
    return static_cast<int64_t>(persistent_.size - std::min(persistent_.size, (persistent_.used + 255) / 256 * 256));
  }
  void synchronize() override { CUDA_OK(cudaStreamSynchronize(stream_), "synchronize"); }
  void bind_thread() override { CUDA_OK(cudaSetDevice(device_), "cudaSetDevice"); }
  void* native_stream() override { return stream_; }

  void zero(Tensor& t) override {
    if (t.nbytes()) CUDA_OK(cudaMemsetAsync(t.data(), 0, t.nbytes(), stream_), "zero");
  }

  void copy(const Tensor& src, Tensor& dst) override {
    MLA_CHECK(src.nbytes() == dst.nbytes() && src.dtype() == dst.dtype(), "copy: {} {} into {} {}",
              dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
    if (src.data() != dst.data() && src.nbytes())
      CUDA_OK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, stream_), "copy");
  }

  Tensor upload(const Tensor& host, DType dtype) override {
    Tensor t = alloc(host.shape(), dtype);
    upload_into(host, t);
    return t;
  }

  void upload_into(const Tensor& host, Tensor& dst) override {
    MLA_CHECK(host.numel() == dst.numel(), "upload_into: {} elements into {}", host.numel(), dst.numel());
    if (host.numel() == 0) return;
    const void* src = host.data();
    std::vector<char> conv;
    if (host.dtype() != dst.dtype()) {
      conv.resize(dst.nbytes());
      cpu::convert(host.data(), host.dtype(), conv.data(), dst.dtype(), host.numel());
      src = conv.data();
    }
    CUDA_OK(cudaMemcpyAsync(dst.data(), src, dst.nbytes(), cudaMemcpyHostToDevice, stream_), "upload");
    CUDA_OK(cudaStreamSynchronize(stream_), "upload");
  }

  void download(const Tensor& t, void* dst) override {
    if (t.nbytes() == 0) return;
    CUDA_OK(cudaMemcpyAsync(dst, t.data(), t.nbytes(), cudaMemcpyDeviceToHost, stream_), "download");
    end_step();  // a step's last download ends its device work (offline runs)
    CUDA_OK(cudaStreamSynchronize(stream_), "download");
  }

  // Asynchronous downloads land in pinned slots (one per download in flight, grown when a larger one comes; a
  // slot is reused only after its download finished) and an event marks each copy's end.
  uint64_t download_start(const Tensor& t) override {
    MLA_CHECK(downloads_in_flight_ < kMaxDownloads, "more than {} downloads in flight", kMaxDownloads);
    Download& d = downloads_[next_download_ % kMaxDownloads];
    if (d.capacity < t.nbytes()) {  // larger than any step's ids: grow (synchronises the device once)
      if (d.host) cudaFreeHost(d.host);
      d.host = nullptr;
      d.capacity = 0;
      const size_t cap = std::max<size_t>(t.nbytes(), 64 << 10);
      CUDA_OK(cudaHostAlloc(&d.host, cap, cudaHostAllocDefault), "pinned download slot");
      d.capacity = cap;
    }
    d.bytes = t.nbytes();
    if (d.bytes) CUDA_OK(cudaMemcpyAsync(d.host, t.data(), d.bytes, cudaMemcpyDeviceToHost, stream_), "download");
    CUDA_OK(cudaEventRecord(d.done, stream_), "download event");
    ++downloads_in_flight_;
    return next_download_++;
  }

  void download_finish(uint64_t ticket, void* dst) override {
    MLA_CHECK(downloads_in_flight_ > 0 && ticket + static_cast<uint64_t>(downloads_in_flight_) == next_download_,
              "download {} finished out of order or twice", ticket);
    Download& d = downloads_[ticket % kMaxDownloads];
    CUDA_OK(cudaEventSynchronize(d.done), "waiting for a download");
    if (d.bytes) std::memcpy(dst, d.host, d.bytes);
    --downloads_in_flight_;
  }

  Tensor to_host_f32(const Tensor& t) override {
    Tensor out = Tensor::empty_host(t.shape(), DType::F32);
    if (t.numel() == 0) return out;
    if (t.dtype() == DType::F32) {
      download(t, out.data());
    } else {
      std::vector<char> raw(t.nbytes());
      download(t, raw.data());
      cpu::convert(raw.data(), t.dtype(), out.data(), DType::F32, t.numel());
    }
    return out;
  }

  void fill_random(Tensor& t, uint64_t seed, float mean, float stddev, int64_t full_cols, int64_t row_offset,
                   int64_t col_offset) override {
    MLA_CHECK(t.dtype() == DType::BF16 || t.dtype() == DType::F32, "fill_random: unsupported dtype {}",
              dtype_name(t.dtype()));
    const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
    const int64_t rows = cols == 0 ? 0 : t.numel() / cols;
    CUDA_OK(cuda::fill_random(t.data(), t.dtype() == DType::BF16, rows, cols, seed, mean, stddev, full_cols,
                              row_offset, col_offset, stream_),
            "fill_random");
  }

  void profiler(bool on) override {
    CUDA_OK(on ? cudaProfilerStart() : cudaProfilerStop(), on ? "cudaProfilerStart" : "cudaProfilerStop");
  }

  // ---- per step ----
  void begin_step(const ForwardBatch& batch) override { start_step(batch, false); }

  // ---- graphs ----
  bool supports_graphs() const override { return true; }

  // One token past cuda::kOneTokenMaxCtx keys runs other attention kernels than one within it (one_token_step).
  int32_t graph_variant(const ForwardBatch& batch) const override {
    return one_token_ && batch.num_tokens() == 1 && !one_token_context(batch) ? 1 : 0;
  }
  std::vector<int32_t> graph_variant_contexts() const override {
    if (!one_token_) return {};
    return {cuda::kOneTokenMaxCtx + 1};
  }
  // Whether the one token of `batch` has at most cuda::kOneTokenMaxCtx keys (the bound of graph_variant and
  // one_token_step).
  static bool one_token_context(const ForwardBatch& batch) { return batch.positions[0] + 1 <= cuda::kOneTokenMaxCtx; }

  void begin_graph_step(const ForwardBatch& batch) override {
    MLA_CHECK(is_graph_batch(batch),
              "a graph step is a decode batch: every sequence in the absorbed form, every token a logit "
              "row ({} tokens, {} sequences)", batch.num_tokens(), batch.num_seqs());
    MLA_CHECK(!plan_keys_.empty(), "a graph step needs an eager step of the model first (attention shapes unknown)");
    start_step(batch, true);
  }

  void graph_capture_begin() override {
    MLA_CHECK(graph_step_ && !capturing_, "graph_capture_begin outside a graph step");
    // Thread-local: other ranks' threads of this process keep issuing their own work while this one records.
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin graph capture");
    capturing_ = true;
  }

  int32_t graph_capture_end() override {
    MLA_CHECK(capturing_, "graph_capture_end without graph_capture_begin");
    capturing_ = false;
    cudaGraph_t g = nullptr;
    CUDA_OK(cudaStreamEndCapture(stream_, &g), "end graph capture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    CUDA_OK(e, "instantiating a graph");
    graphs_.push_back({exec, scratch_.used, step_.moe_rows.size()});
    // The idle statistics cover serving, not the recording phase (its gaps are graph instantiation on the host).
    clear_step_events();
    return static_cast<int32_t>(graphs_.size()) - 1;
  }

  void graph_replay(int32_t id) override {
    MLA_CHECK(graph_step_ && !capturing_, "graph_replay outside a graph step");
    MLA_CHECK(id >= 0 && id < static_cast<int32_t>(graphs_.size()) && graphs_[static_cast<size_t>(id)].exec,
              "graph {} does not exist", id);
    const Graph& g = graphs_[static_cast<size_t>(id)];
    MLA_CHECK(g.moe_rows == step_.moe_rows.size(), "graph {} was recorded with {} moe_rows entries, replayed with {}",
              id, g.moe_rows, step_.moe_rows.size());
    CUDA_OK(cudaGraphLaunch(g.exec, stream_), "graph launch");
    scratch_.used = g.scratch_end;  // the graph's tensors stay valid until the next begin_step
  }

  void release_graphs() override {
    for (Graph& g : graphs_)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  void resolve_prev_ids(const Tensor& prev) override {
    MLA_CHECK(prev.dtype() == DType::I32, "resolve_prev_ids: prev must be I32");
    CUDA_OK(cuda::resolve_prev_ids(d_input_ids_, step_.num_tokens(), static_cast<const int32_t*>(prev.data()),
                                   prev.numel(), stream_),
            "resolve_prev_ids");
  }

  void set_input_ids(std::span<const int32_t> ids) override {
    MLA_CHECK(!capturing_, "set_input_ids while a graph is being recorded");
    MLA_CHECK(ids.size() == step_.input_ids.size(), "set_input_ids: {} ids for a step of {} tokens", ids.size(),
              step_.input_ids.size());
    step_.input_ids.assign(ids.begin(), ids.end());
    MetaUpload up(*this);  // after the step's metadata: what earlier ops of the step read stays as it was
    d_input_ids_ = up.add(step_.input_ids);
    up.flush();
  }

  void begin_substep(const ForwardBatch& batch) override {
    MLA_CHECK(!capturing_, "begin_substep while a graph is being recorded");
    step_ = batch;
    graph_step_ = false;
    slots_checked_ = -1;
    staged_rows_ = -1;
    plans_.clear();  // (the plans' metadata stays where earlier ops of the step read it)
    MetaUpload up(*this);  // after the step's metadata, as set_input_ids; the scratch stays
    d_input_ids_ = up.add(step_.input_ids);
    d_positions_ = up.add(step_.positions);
    d_out_slots_ = up.add(step_.out_slots);
    d_logit_rows_ = up.add(step_.logit_rows);
    d_moe_rows_ = up.add(step_.moe_rows);
    d_page_table_ = up.add(step_.page_table);
    up.flush();
  }

  void end_step() override {
    if (idle_stats_ && !step_events_.empty()) cudaEventRecord(step_events_.back().second, stream_);
  }

  // ---- ops ----
  void embedding(const Tensor& table, int64_t vocab_begin, Tensor& out) override {
    const int64_t H = table.size(1), V = table.size(0), T = step_.num_tokens();
    MLA_CHECK(out.numel() == T * H && out.dtype() == DType::BF16 && table.dtype() == DType::BF16,
              "embedding: output {} {} for {} tokens of width {}", dtype_name(out.dtype()), shape_str(out.shape()), T,
              H);
    CUDA_OK(cuda::embedding(bf(table), V, H, vocab_begin, d_input_ids_, T, bf(out), stream_), "embedding");
  }

  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    const int64_t D = x.size(-1), N = rows_of(x);
    MLA_CHECK(w.numel() == D && out.numel() == x.numel() && w.dtype() == DType::F32 && x.dtype() == DType::BF16 &&
                  out.dtype() == DType::BF16,
              "rmsnorm: x {} {}, w {} {}, out {} {}", dtype_name(x.dtype()), shape_str(x.shape()),
              dtype_name(w.dtype()), shape_str(w.shape()), dtype_name(out.dtype()), shape_str(out.shape()));
    CUDA_OK(cuda::rmsnorm(bf(x), w.data_as<const float>(), N, D, eps, bf(out), stream_), "rmsnorm");
  }

  void add_rmsnorm(const Tensor& x, Tensor& residual, const Tensor& w, float eps, Tensor& out) override {
    const int64_t D = x.size(-1), N = rows_of(x);
    MLA_CHECK(residual.numel() == x.numel() && out.numel() == x.numel() && w.numel() == D &&
                  x.dtype() == DType::BF16 && residual.dtype() == DType::BF16 && out.dtype() == DType::BF16 &&
                  w.dtype() == DType::F32,
              "add_rmsnorm: shape or dtype mismatch");
    CUDA_OK(cuda::add_rmsnorm(bf(x), bf(residual), bf(residual), w.data_as<const float>(), N, D, eps, bf(out), stream_),
            "add_rmsnorm");
  }

  // One token: the norm inside the pair's launch (cuda::gemv_t_pair_norm).
  void add_rmsnorm_linear_pair(const Tensor& x, const Tensor& residual, Tensor& residual_out, const Tensor& norm_w,
                               float eps, Tensor& normed, const Tensor& w1, Tensor& y1, const Tensor& w2,
                               Tensor& y2) override {
    const int64_t D = x.size(-1), N = rows_of(x);
    check_add_norm("add_rmsnorm_linear_pair", x, residual, residual_out, norm_w, normed);
    check_linear("add_rmsnorm_linear_pair (first)", normed, w1, y1);
    check_linear("add_rmsnorm_linear_pair (second)", normed, w2, y2);
    if (small_batch_ && N == 1 && D <= cuda::kPairNormMaxK && cuda::gemv_fits(1, D, x.data(), D, w1.data(), D) &&
        cuda::gemv_fits(1, D, x.data(), D, w2.data(), D)) {
      const cuda::AddNormIn n{bf(x), bf(residual), bf(residual_out), norm_w.data_as<const float>(), eps};
      CUDA_OK(cuda::gemv_t_pair_norm(linear_gemv(normed, w1, y1), linear_gemv(normed, w2, y2), n, num_sms_, stream_),
              "gemv pair + add_rmsnorm");
      return;
    }
    CUDA_OK(cuda::add_rmsnorm(bf(x), bf(residual), bf(residual_out), norm_w.data_as<const float>(), N, D, eps,
                              bf(normed), stream_),
            "add_rmsnorm");
    linear_pair(normed, w1, y1, w2, y2);
  }

  void linear(const Tensor& x, const Tensor& w, Tensor& y) override {
    const int64_t K = x.size(-1), N = rows_of(x), M = check_linear("linear", x, w, y);
    // Up to 8 rows: matrix-vector kernels that read each weight once for all rows (cuBLAS tiles leave most of the
    // GPU idle at one token).
    if (small_batch_ && cuda::gemv_fits(N, K, x.data(), K, w.data(), K)) {
      CUDA_OK(cuda::gemv_t(linear_gemv(x, w, y), 1, num_sms_, stream_), "gemv");
      return;
    }
    gemm(w.data(), K, x.data(), K, y.data(), M, y.dtype(), M, N, K);
  }

  // Where both take the matrix-vector kernels: one launch for the two.
  void linear_pair(const Tensor& x, const Tensor& w1, Tensor& y1, const Tensor& w2, Tensor& y2) override {
    check_linear("linear_pair (first)", x, w1, y1);
    check_linear("linear_pair (second)", x, w2, y2);
    const int64_t K = x.size(-1), N = rows_of(x);
    if (small_batch_ && cuda::gemv_fits(N, K, x.data(), K, w1.data(), K) &&
        cuda::gemv_fits(N, K, x.data(), K, w2.data(), K)) {
      CUDA_OK(cuda::gemv_t_pair(linear_gemv(x, w1, y1), linear_gemv(x, w2, y2), num_sms_, stream_), "gemv pair");
      return;
    }
    linear(x, w1, y1);
    linear(x, w2, y2);
  }

  void silu_mul(const Tensor& gate_up, Tensor& out) override {
    const int64_t I2 = gate_up.size(-1), N = rows_of(gate_up), I = I2 / 2;
    MLA_CHECK(out.numel() == N * I && gate_up.dtype() == DType::BF16 && out.dtype() == DType::BF16,
              "silu_mul: shape mismatch");
    CUDA_OK(cuda::silu_mul(bf(gate_up), N, I, bf(out), stream_), "silu_mul");
  }

  void add(Tensor& a, const Tensor& b) override {
    MLA_CHECK(a.numel() == b.numel() && a.dtype() == DType::BF16 && b.dtype() == DType::BF16, "add: shape mismatch");
    CUDA_OK(cuda::add_inplace(bf(a), bf(b), a.numel(), stream_), "add");
  }

  void gather_logit_rows(const Tensor& x, Tensor& out) override {
    const int64_t C = x.size(-1), R = static_cast<int64_t>(step_.logit_rows.size());
    MLA_CHECK(out.numel() == R * C && out.dtype() == x.dtype(), "gather_logit_rows: shape mismatch");
    CUDA_OK(cuda::gather_rows(x.data(), C * static_cast<int64_t>(dtype_size(x.dtype())), d_logit_rows_, R, out.data(),
                              stream_),
            "gather_logit_rows");
  }

  void gather_rows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) override {
    const int64_t C = x.size(-1), n = static_cast<int64_t>(rows.size());
    MLA_CHECK(out.numel() == n * C && out.dtype() == x.dtype(), "gather_rows: shape mismatch");
    const int64_t have = x.numel() / std::max<int64_t>(C, 1);
    for (int32_t r : rows) MLA_CHECK(r >= 0 && r < have, "gather_rows: row {} of {}", r, have);
    MetaUpload up(*this);
    const int32_t* d_rows = up.add(rows.data(), rows.size());
    up.flush();
    CUDA_OK(cuda::gather_rows(x.data(), C * static_cast<int64_t>(dtype_size(x.dtype())), d_rows, n, out.data(),
                              stream_),
            "gather_rows");
  }

  void interleave_blocks(const Tensor& parts, int64_t n, Tensor& out) override {
    const int64_t C = parts.size(-1), R = n > 0 ? parts.numel() / C / n : 0;
    MLA_CHECK(n > 0 && parts.numel() == n * R * C && out.numel() == parts.numel() && out.dtype() == parts.dtype(),
              "interleave_blocks: parts {} in {} blocks into {}", shape_str(parts.shape()), n, shape_str(out.shape()));
    if (R == 0 || C == 0) return;
    const size_t row = static_cast<size_t>(C) * dtype_size(parts.dtype());
    for (int64_t r = 0; r < n; ++r)
      CUDA_OK(cudaMemcpy2DAsync(static_cast<char*>(out.data()) + r * row, n * row,
                                static_cast<const char*>(parts.data()) + r * R * row, row, row, R,
                                cudaMemcpyDeviceToDevice, stream_),
              "interleave_blocks");
  }

  void set_rope(const std::vector<float>& inv_freq, float attention_factor) override {
    Tensor h = Tensor::empty_host({static_cast<int64_t>(inv_freq.size())}, DType::F32);
    std::copy(inv_freq.begin(), inv_freq.end(), h.data_as<float>());
    inv_freq_ = upload(h, DType::F32);
    inv_freq_host_ = h;  // (uploaded again when the persistent memory comes back: resume_persistent)
    rope_dim_ = static_cast<int64_t>(inv_freq.size()) * 2;
    rope_factor_ = attention_factor;
  }

  void mla_write_latent(Tensor& latent, const Tensor& kv_norm, float eps, Tensor& cache) override {
    const int64_t kvr = check_latent("mla_write_latent", latent, kv_norm, cache);
    CUDA_OK(cuda::write_latent(bf(latent), step_.num_tokens(), static_cast<int32_t>(kvr),
                               static_cast<int32_t>(rope_dim_), kv_norm.data_as<const float>(), eps, d_positions_,
                               d_out_slots_, inv_freq_.data_as<const float>(), rope_factor_, cache_bf16(cache),
                               cache_fp8(cache), cache_e5m2(cache), stream_),
            "mla_write_latent");
  }

  void mla_rope_q(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope) override {
    check_rope_q("mla_rope_q", q, num_heads, qk_nope, qk_rope);
    CUDA_OK(cuda::rope_q(bf(q), step_.num_tokens(), num_heads, qk_nope, qk_rope, d_positions_,
                         inv_freq_.data_as<const float>(), rope_factor_, stream_),
            "mla_rope_q");
  }

  void mla_prepare(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope, Tensor& latent,
                   const Tensor& kv_norm, float eps, Tensor& cache) override {
    CUDA_OK(cuda::rope_q_write_latent(prep_args(q, num_heads, qk_nope, qk_rope, latent, kv_norm, eps, cache), stream_),
            "mla_prepare");
  }

  void mla_attention(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p, Tensor& out) override {
    attend(q, cache, kv_b, p, out, nullptr);
  }

  // At 1-2 decode tokens the preparation runs inside the q_lat product's launch (cuda::gemv_n_prepare).
  void mla_prepare_attention(Tensor& q, Tensor& latent, const Tensor& kv_norm, float eps, Tensor& cache,
                             const Tensor& kv_b, const MlaParams& p, Tensor& out) override {
    const cuda::MlaPrepArgs prep = prep_args(q, p.num_heads, p.qk_nope, p.qk_rope, latent, kv_norm, eps, cache);
    attend(q, cache, kv_b, p, out, &prep);
  }

  void moe_route(const Tensor& logits, const Tensor* bias, const RouterParams& p, Tensor& topk_ids,
                 Tensor& topk_weights) override {
    const int64_t T = rows_of(logits), E = logits.size(-1);
    MLA_CHECK(logits.dtype() == DType::F32, "moe_route: logits must be f32");
    const cuda::RouteArgs a = route_args("moe_route", T, E, p, topk_ids, topk_weights);
    CUDA_OK(cuda::moe_route(logits.data_as<const float>(), bias ? bias->data_as<const float>() : nullptr, T,
                            static_cast<int32_t>(E), a, topk_ids.data_as<int32_t>(), topk_weights.data_as<float>(),
                            stream_),
            "moe_route");
  }

  void count_experts(const Tensor& topk_ids, Tensor& counts) override {
    MLA_CHECK(topk_ids.dtype() == DType::I32 && topk_ids.dim() == 2 && counts.dtype() == DType::I64,
              "count_experts: ids {} {} (I32 [rows, k]), counts {} (I64)", dtype_name(topk_ids.dtype()),
              shape_str(topk_ids.shape()), dtype_name(counts.dtype()));
    const size_t n = step_.moe_rows.size();
    MLA_CHECK(n % 2 == 0, "count_experts: the step's moe_rows has {} entries (pairs)", n);
    CUDA_OK(cuda::count_experts(topk_ids.data_as<const int32_t>(), topk_ids.size(0),
                                static_cast<int32_t>(topk_ids.size(1)), n == 0 ? nullptr : d_moe_rows_,
                                static_cast<int32_t>(n / 2), static_cast<int32_t>(counts.numel()),
                                counts.data_as<long long>(), stream_),
            "count_experts");
  }

  void* alloc_host(size_t bytes) override {
    bind_thread();
    void* p = nullptr;
    CUDA_OK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable),
            fmt::format("allocating {:.2f} GiB of pinned host memory (the hierarchical cache's host tier)",
                        static_cast<double>(bytes) / (1 << 30)));
    void* dev = nullptr;
    CUDA_OK(cudaHostGetDevicePointer(&dev, p, 0), "mapping the host tier");
    MLA_CHECK(dev == p, "the host tier maps at another device address (no unified addressing)");
    return p;
  }
  void free_host(void* p) override { cudaFreeHost(p); }

  void copy_kv_pages(std::span<Tensor* const> layers, int64_t page_bytes, char* host, std::span<const int32_t> saves,
                     std::span<const int32_t> loads) override {
    MLA_CHECK(!capturing_, "copy_kv_pages while a graph is being recorded");
    if (layers.empty() || (saves.empty() && loads.empty())) return;
    std::vector<char*> bases;
    for (Tensor* t : layers) bases.push_back(static_cast<char*>(t->data()));
    MetaUpload up(*this);  // after the step's metadata
    char* const* d_bases = up.add(bases);
    const int32_t* d_saves = up.add(saves.data(), saves.size());
    const int32_t* d_loads = up.add(loads.data(), loads.size());
    up.flush();
    const auto n = static_cast<int32_t>(bases.size());
    CUDA_OK(cuda::copy_kv_pages(d_bases, n, page_bytes, host, d_saves, static_cast<int32_t>(saves.size() / 2), true,
                                stream_),
            "copy_kv_pages (to the host)");
    CUDA_OK(cuda::copy_kv_pages(d_bases, n, page_bytes, host, d_loads, static_cast<int32_t>(loads.size() / 2), false,
                                stream_),
            "copy_kv_pages (to the device)");
  }

  // Whether moe_gate takes cuda::moe_gate for x.
  bool gate_fused(const Tensor& x, const Tensor& router) const {
    const int64_t T = rows_of(x), H = x.size(-1), E = router.size(0);
    return small_batch_ && cuda::moe_gate_fits(T, E) && router.dim() == 2 && router.size(1) == H &&
           x.dtype() == DType::BF16 && router.dtype() == DType::BF16 &&
           cuda::gemv_fits(T, H, x.data(), H, router.data(), H);
  }
  // One row: the router product and the routing in one kernel (cuda::moe_gate).
  void moe_gate(const Tensor& x, const Tensor& router, const Tensor* bias, const RouterParams& p, Tensor& topk_ids,
                Tensor& topk_weights) override {
    const int64_t T = rows_of(x), E = router.size(0);
    if (!gate_fused(x, router)) {
      Backend::moe_gate(x, router, bias, p, topk_ids, topk_weights);
      return;
    }
    const cuda::RouteArgs a = route_args("moe_gate", T, E, p, topk_ids, topk_weights);
    Tensor logits = scratch({T, E}, DType::F32);
    CUDA_OK(cuda::moe_gate(linear_gemv(x, router, logits), bias ? bias->data_as<const float>() : nullptr, a,
                           gate_counter_, topk_ids.data_as<int32_t>(), topk_weights.data_as<float>(), stream_),
            "moe_gate");
  }

  // One row: the norm inside the router's launch (cuda::moe_gate_norm).
  void add_rmsnorm_moe_gate(const Tensor& x, const Tensor& residual, Tensor& residual_out, const Tensor& norm_w,
                            float eps, Tensor& normed, const Tensor& router, const Tensor* bias, const RouterParams& p,
                            Tensor& topk_ids, Tensor& topk_weights) override {
    const int64_t D = x.size(-1), N = rows_of(x), E = router.size(0);
    check_add_norm("add_rmsnorm_moe_gate", x, residual, residual_out, norm_w, normed);
    if (N == 1 && D <= cuda::kPairNormMaxK && gate_fused(normed, router)) {
      const cuda::RouteArgs a = route_args("add_rmsnorm_moe_gate", N, E, p, topk_ids, topk_weights);
      Tensor logits = scratch({N, E}, DType::F32);
      const cuda::AddNormIn n{bf(x), bf(residual), bf(residual_out), norm_w.data_as<const float>(), eps};
      CUDA_OK(cuda::moe_gate_norm(linear_gemv(normed, router, logits), bias ? bias->data_as<const float>() : nullptr, a,
                                  n, bf(normed), gate_counter_, topk_ids.data_as<int32_t>(),
                                  topk_weights.data_as<float>(), stream_),
              "moe_gate + add_rmsnorm");
      return;
    }
    CUDA_OK(cuda::add_rmsnorm(bf(x), bf(residual), bf(residual_out), norm_w.data_as<const float>(), N, D, eps,
                              bf(normed), stream_),
            "add_rmsnorm");
    moe_gate(normed, router, bias, p, topk_ids, topk_weights);
  }

  bool takes_fp8_experts() const override { return true; }
  bool takes_int4_experts() const override { return true; }
  void moe_experts(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                   const Tensor& down, int32_t expert_begin, const Tensor* shared_gate_up, const Tensor* shared_down,
                   int32_t n_fixed, Tensor& out) override;

  void sample(const Tensor& logits, std::span<const RowSampling> params, Tensor& ids, Tensor* logprobs) override;
  void stage_sample(std::span<const RowSampling> params, const Tensor* logprobs) override;
  void sample_staged(const Tensor& logits, Tensor& ids) override;

 private:
  // Whether moe_experts of T tokens, k experts each, Is shared-expert columns takes the small-batch kernels.
  // max_rows: cuda::kMoeSmallTcRows for FP8 experts on tensor cores (cuda::moe_small_tc_fits).
  bool use_moe_small(int64_t T, int64_t k, int64_t Is, int64_t max_rows = cuda::kMoeSmallRows) const {
    return small_batch_ && !moe_cublas_ && T <= max_rows && k <= cuda::kMoeSmallMaxK && Is % 8 == 0;
  }
  // moe_experts through the small-batch kernels (cuda::moe_small); FP8 or INT4 experts (gs, ds: their BlockScales)
  // read as they are.
  // The experts of `w` (kept FP8 or INT4, with its BlockScales) that topk_ids name, dequantized into bf16 scratch
  // [E, rows, cols] (the others left as they are: the bf16 paths read only the experts the ids name).
  Tensor routed_bf16(const Tensor& w, const Tensor& topk_ids, int32_t expert_begin);
  void moe_small_path(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                      const Tensor& down, int32_t expert_begin, const Tensor* shared_gate_up, const Tensor* shared_down,
                      int64_t Is, int32_t n_fixed, Tensor& out, const BlockScales* gs = nullptr,
                      const BlockScales* ds = nullptr);
  // Whether the routed experts of P (token, expert) pairs over E local experts go to per-expert cuBLASLt GEMMs (else
  // the grouped kernels).
  bool moe_uses_cublas(int64_t P, int64_t E) const {
    return !capturing_ && (moe_cublas_ || (!moe_grouped_only_ && P >= kMoeCublasRowsPerExpert * E));
  }
  // The routed experts of moe_experts through the grouped kernels (or per-expert cuBLASLt GEMMs for many rows); FP8
  // or INT4 experts (gs, ds: their BlockScales) only through the grouped kernels.
  // shared_out: the shared experts' output, added to the routed sum by its combine.
  void moe_routed(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                  const Tensor& down, int32_t expert_begin, const cuda::bf16* shared_out, Tensor& out,
                  const BlockScales* gs = nullptr, const BlockScales* ds = nullptr);
  // The shared experts' output of x (bf16 [T, H] scratch, live until the step's scratch is reset); null without them.
  const cuda::bf16* shared_experts_out(const Tensor& x, const Tensor* gate_up, const Tensor* down, const Tensor& out);
  // Host arrays staged in the pinned buffer at the same offsets they get in the meta arena; flush() copies the
  // staged range in one transfer and records the event begin_step waits on before reusing the pinned buffer.
  class MetaUpload {
   public:
    explicit MetaUpload(CudaBackend& be) : be_(be), start_(be.meta_.used) {}
    template <typename T>
    T* add(const std::vector<T>& v) {
      return add(v.data(), v.size());
    }
    template <typename T>
    T* add(const T* data, size_t n) {
      const size_t bytes = std::max<size_t>(n * sizeof(T), 1);
      char* d = be_.meta_.take(bytes, 16);
      MLA_CHECK(d != nullptr, "step metadata exceeds the {} MiB metadata buffer", be_.meta_.size >> 20);
      if (n) std::memcpy(be_.staging() + (d - be_.meta_.base), data, n * sizeof(T));
      return reinterpret_cast<T*>(d);
    }
    void flush() {
      const size_t end = be_.meta_.used;
      if (end > start_)
        CUDA_OK(cudaMemcpyAsync(be_.meta_.base + start_, be_.staging() + start_, end - start_, cudaMemcpyHostToDevice,
                                be_.stream_),
                "metadata upload");
      CUDA_OK(cudaEventRecord(be_.meta_events_[be_.staging_half_], be_.stream_), "metadata event");
    }

   private:
    CudaBackend& be_;
    size_t start_;
  };
  // The rows' parameters and lists, then the SampleStep pointing at them, uploaded into the step's metadata.
  const cuda::SampleStep* upload_sample_step(std::span<const RowSampling> params, const Tensor* logprobs);
  // Samples the first step->R rows of logits' rows (ids [rows]); min_rows: the fewest rows step->R may have.
  void launch_sample(const Tensor& logits, const cuda::SampleStep* step, int64_t min_rows, Tensor& ids);

  struct GemmPlan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  // y[N, M] (ldy) = x[N, K] (ldx) @ w[M, K] (ldw)^T; bf16 inputs, y bf16 or f32.
  void gemm(const void* w, int64_t ldw, const void* x, int64_t ldx, void* y, int64_t ldy, DType ydt, int64_t M,
            int64_t N, int64_t K) {
    if (M == 0 || N == 0) return;
    MLA_CHECK(K > 0, "gemm: empty inner dimension");
    const int aw = alignment_of(w), ax = alignment_of(x), ay = alignment_of(y);
    auto key = std::make_tuple(M, N, K, ldw, ldx, ldy, static_cast<int>(ydt), aw, ax, ay);
    auto it = gemms_.find(key);
    if (it == gemms_.end()) {
      GemmPlan g;
      const cudaDataType_t yt = ydt == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
      CUBLAS_OK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
      const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
      CUBLAS_OK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)), "transa");
      CUBLAS_OK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)), "transb");
      CUBLAS_OK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, K, M, ldw), "layout A");
      CUBLAS_OK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, K, N, ldx), "layout B");
      CUBLAS_OK(cublasLtMatrixLayoutCreate(&g.c, yt, M, N, ldy), "layout C");
      cublasLtMatmulPreference_t pref;
      CUBLAS_OK(cublasLtMatmulPreferenceCreate(&pref), "preference");
      const uint64_t ws = lt_ws_size_;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      const uint32_t ua = aw, ux = ax, uy = ay;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ua, sizeof(ua));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ux, sizeof(ux));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &uy, sizeof(uy));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &uy, sizeof(uy));
      cublasLtMatmulHeuristicResult_t res{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, g.desc, g.a, g.b, g.c, g.c, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      MLA_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
                "cuBLASLt has no algorithm for a bf16 GEMM of M {} N {} K {} (status {})", M, N, K, static_cast<int>(st));
      g.algo = res.algo;
      it = gemms_.emplace(key, g).first;
    }
    const float alpha = 1.0f, beta = 0.0f;
    GemmPlan& g = it->second;
    CUBLAS_OK(cublasLtMatmul(lt_, g.desc, &alpha, w, g.a, x, g.b, &beta, y, g.c, y, g.c, &g.algo, lt_ws_, lt_ws_size_,
                             stream_),
              "cublasLtMatmul");
  }

  // Per-head batched GEMM in cuBLAS column-major terms: C[m, n] (ldc, strideC) = op(A)[m, k] @ B[k, n], bf16.
  void batched_gemm(bool transa, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, int64_t sa,
                    const void* B, int64_t ldb, int64_t sb, void* C, int64_t ldc, int64_t sc, int64_t batch) {
    if (m == 0 || n == 0 || batch == 0) return;
    const float alpha = 1.0f, beta = 0.0f;
    CUBLAS_OK(cublasGemmStridedBatchedEx(blas_, transa ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(m),
                                         static_cast<int>(n), static_cast<int>(k), &alpha, A, CUDA_R_16BF,
                                         static_cast<int>(lda), sa, B, CUDA_R_16BF, static_cast<int>(ldb), sb, &beta,
                                         C, CUDA_R_16BF, static_cast<int>(ldc), sc, static_cast<int>(batch),
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmStridedBatchedEx");
  }

  // mla_write_latent's checks; returns kv_lora.
  int64_t check_latent(const char* op, const Tensor& latent, const Tensor& kv_norm, const Tensor& cache) const {
    const int64_t W = latent.size(-1), kvr = kv_norm.numel(), rope = W - kvr, T = step_.num_tokens();
    MLA_CHECK(cache.size(-1) == W, "{}: cache row width {} != latent width {}", op, cache.size(-1), W);
    MLA_CHECK(rope == rope_dim_, "{}: rope width {} vs {} frequencies", op, rope, rope_dim_ / 2);
    MLA_CHECK(latent.dtype() == DType::BF16 && (cache.dtype() == DType::BF16 || is_fp8_cache(cache)) &&
                  kv_norm.dtype() == DType::F32 &&
                  latent.numel() == T * W,
              "{}: dtype or shape mismatch", op);
    // The step's slots against the cache's size once per step (every layer's cache has the same size).
    const int64_t slots = cache.size(0);
    if (slots != slots_checked_) {
      for (int32_t s : step_.out_slots)
        MLA_CHECK(s >= 0 && s < slots, "{}: slot {} outside the cache of {} slots", op, s, slots);
      slots_checked_ = slots;
    }
    return kvr;
  }
  void check_rope_q(const char* op, const Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope) const {
    MLA_CHECK(q.numel() == step_.num_tokens() * num_heads * (qk_nope + qk_rope) && q.dtype() == DType::BF16,
              "{}: shape mismatch", op);
    MLA_CHECK(qk_rope == rope_dim_, "{}: rope width {} vs {} frequencies", op, qk_rope, rope_dim_ / 2);
  }

  // mla_prepare's checks and kernel arguments.
  cuda::MlaPrepArgs prep_args(Tensor& q, int32_t num_heads, int32_t qk_nope, int32_t qk_rope, Tensor& latent,
                              const Tensor& kv_norm, float eps, Tensor& cache) {
    const int64_t kvr = check_latent("mla_prepare", latent, kv_norm, cache);
    check_rope_q("mla_prepare", q, num_heads, qk_nope, qk_rope);
    cuda::MlaPrepArgs a{};
    a.q = bf(q);
    a.T = step_.num_tokens();
    a.nh = num_heads;
    a.nope = qk_nope;
    a.rope = qk_rope;
    a.latent = bf(latent);
    a.kvr = static_cast<int32_t>(kvr);
    a.norm_w = kv_norm.data_as<const float>();
    a.eps = eps;
    a.positions = d_positions_;
    a.slots = d_out_slots_;
    a.inv_freq = inv_freq_.data_as<const float>();
    a.factor = rope_factor_;
    a.cache = cache_bf16(cache);
    a.cache_f8 = cache_fp8(cache);
    a.cache_e5m2 = cache_e5m2(cache);
    return a;
  }

  // mla_attention, with mla_prepare's work (prep, when given) run first: inside the q_lat launch where that takes
  // the small-batch kernel, else as its own launch.
  void attend(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p, Tensor& out,
              const cuda::MlaPrepArgs* prep);

  // The routing kernels' arguments after checking the shapes and the kernels' limits.
  static cuda::RouteArgs route_args(const char* op, int64_t T, int64_t E, const RouterParams& p, const Tensor& ids,
                                    const Tensor& weights) {
    const int64_t k = p.ids_per_token();
    MLA_CHECK(ids.numel() == T * k && weights.numel() == T * k && ids.dtype() == DType::I32 &&
                  weights.dtype() == DType::F32,
              "{}: ids / weights must be [{}, {}] (i32 / f32)", op, T, k);
    MLA_CHECK(E <= 1024 && p.top_k >= 1 && p.top_k <= E && k <= 32 && p.n_fixed >= 0,
              "{}: {} experts with top-{} and {} fixed exceed the kernel's limits (1024 experts, 32 ids a token)",
              op, E, p.top_k, p.n_fixed);
    MLA_CHECK(p.n_group <= 1 || (p.n_group <= 32 && E % p.n_group == 0), "{}: {} groups over {} experts", op,
              p.n_group, E);
    cuda::RouteArgs a;
    a.method = p.method == TopkMethod::Greedy ? cuda::RouteMethod::Greedy
               : p.method == TopkMethod::GroupLimitedGreedy ? cuda::RouteMethod::GroupLimitedGreedy
                                                             : cuda::RouteMethod::NoauxTc;
    a.sigmoid = p.scoring == ScoringFunc::Sigmoid;
    a.top_k = p.top_k;
    a.n_group = p.n_group;
    a.topk_group = p.topk_group;
    a.norm_topk_prob = p.norm_topk_prob;
    a.routed_scaling_factor = p.routed_scaling_factor;
    a.n_fixed = p.n_fixed;
    a.fixed_base = p.fixed_base;
    return a;
  }

  // The checks of an add_rmsnorm whose sums go to residual_out.
  static void check_add_norm(const char* op, const Tensor& x, const Tensor& residual, const Tensor& residual_out,
                             const Tensor& norm_w, const Tensor& normed) {
    auto apart = [](const Tensor& a, const Tensor& b) {
      const char *pa = static_cast<const char*>(a.data()), *pb = static_cast<const char*>(b.data());
      return pa + a.nbytes() <= pb || pb + b.nbytes() <= pa;
    };
    MLA_CHECK(residual.numel() == x.numel() && residual_out.numel() == x.numel() && normed.numel() == x.numel() &&
                  norm_w.numel() == x.size(-1) && x.dtype() == DType::BF16 && residual.dtype() == DType::BF16 &&
                  residual_out.dtype() == DType::BF16 && normed.dtype() == DType::BF16 && norm_w.dtype() == DType::F32,
              "{}: shape or dtype mismatch", op);
    MLA_CHECK(apart(residual_out, residual) && apart(residual_out, x), "{}: residual_out overlaps residual or x", op);
  }
  // linear's checks; returns the output width.
  static int64_t check_linear(const char* what, const Tensor& x, const Tensor& w, const Tensor& y) {
    const int64_t K = x.size(-1), N = rows_of(x), M = w.size(0);
    MLA_CHECK(w.dim() == 2 && w.size(1) == K, "{}: weight {} does not match input width {}", what,
              shape_str(w.shape()), K);
    MLA_CHECK(y.numel() == N * M, "{}: output has {} elements, expected {}x{}", what, y.numel(), N, M);
    MLA_CHECK(x.dtype() == DType::BF16 && w.dtype() == DType::BF16 && (y.dtype() == DType::BF16 || y.dtype() == DType::F32),
              "{}: x {} w {} y {} (expected bf16, bf16, bf16|f32)", what, dtype_name(x.dtype()), dtype_name(w.dtype()),
              dtype_name(y.dtype()));
    return M;
  }
  // y = x w^T of linear as matrix-vector kernel arguments.
  static cuda::GemvArgs linear_gemv(const Tensor& x, const Tensor& w, Tensor& y) {
    const int64_t K = x.size(-1), N = rows_of(x), M = w.size(0);
    cuda::GemvArgs g = gemv_args(x.data(), K, 0, w.data(), K, 0, y.data(), M, 0, N, M, K);
    g.y_f32 = y.dtype() == DType::F32;
    return g;
  }

  // Small-batch product arguments (bf16 out unless changed): x[b][t] at x + b * sx + t * ldx, W[b] at w + b * sw
  // (rows of ldw), y[b][t] at y + b * sy + t * ldy; T rows, N outputs, K inputs.
  static cuda::GemvArgs gemv_args(const void* x, int64_t ldx, int64_t sx, const void* w, int64_t ldw, int64_t sw,
                                  void* y, int64_t ldy, int64_t sy, int64_t T, int64_t N, int64_t K) {
    cuda::GemvArgs g{};
    g.x = static_cast<const cuda::bf16*>(x);
    g.ldx = ldx;
    g.sx = sx;
    g.w = static_cast<const cuda::bf16*>(w);
    g.ldw = ldw;
    g.sw = sw;
    g.y = y;
    g.ldy = ldy;
    g.sy = sy;
    g.T = static_cast<int32_t>(T);
    g.N = static_cast<int32_t>(N);
    g.K = static_cast<int32_t>(K);
    return g;
  }

  using PlanKey = std::tuple<int, int32_t, int32_t, int32_t, int32_t>;  // form, heads, kv_lora, rope, decode variant
  // The attention work of one step for one form: built on the host from the step, uploaded once.
  struct MlaPlan {
    int32_t num_decode_items = 0, num_partials = 0, num_combine = 0;
    cuda::MlaDecodeItem* d_decode = nullptr;
    cuda::MlaDecodeCombineItem* d_combine = nullptr;
    int32_t num_prefill_items = 0;
    int64_t ctx_rows = 0;
    cuda::MlaPrefillItem* d_prefill = nullptr;
    int32_t* d_row_seq = nullptr;
    int32_t* d_row_pos = nullptr;
    bool row_offsets = false;  // decode items carry page-table row offsets (seq * max_pages), not rows
  };
  const MlaPlan& plan_for(MlaForm form, int32_t nh, int32_t kvr, int32_t rope, int32_t variant);
  // Whether this step's attention takes cuda::mla_one_token: one token in the absorbed form, the newest of its
  // sequence (every earlier row cached), at most kOneTokenMaxCtx keys (graph_variant keys graphs by the same bound),
  // dims and clusters that fit.
  bool one_token_step(const MlaParams& p, const MlaPlan& plan) const {
    return one_token_ && step_.num_tokens() == 1 && step_.num_seqs() == 1 && plan.num_decode_items > 0 &&
           plan.num_prefill_items == 0 && step_.positions[0] == step_.seq_prefix_lens[0] && one_token_context(step_) &&
           cuda::mla_one_token_fits(p.num_heads, p.qk_nope, p.qk_rope, p.v_head, p.kv_lora, one_token_clusters_);
  }
  MlaPlan build_plan(const PlanKey& key, MetaUpload& up, bool fixed_splits);

  // Uploads the step's metadata. Every array whose size depends on more than the token count (the page table) comes
  // last; a graph step also builds the attention plans of the shapes seen so far now, with a fixed number of parts
  // per token and page-table rows as offsets, so a graph recorded for this token count stays valid.
  void start_step(const ForwardBatch& batch, bool graph) {
    MLA_CHECK(!capturing_, "a step begins while a graph is being recorded");
    step_ = batch;
    graph_step_ = graph;
    slots_checked_ = -1;
    staged_rows_ = -1;
    scratch_.used = 0;
    // Steps alternate between the two halves of the pinned staging buffer, so a step issued while the previous one
    // still runs (overlap scheduling) waits only for the uploads of the step before that.
    staging_half_ ^= 1;
    CUDA_OK(cudaEventSynchronize(meta_events_[staging_half_]), "waiting for an earlier step's metadata upload");
    meta_.used = 0;
    plans_.clear();
    MetaUpload up(*this);
    d_input_ids_ = up.add(step_.input_ids);
    d_positions_ = up.add(step_.positions);
    d_out_slots_ = up.add(step_.out_slots);
    d_logit_rows_ = up.add(step_.logit_rows);
    d_moe_rows_ = up.add(step_.moe_rows);  // (before the plans: a graph's batches keep their size)
    if (graph)
      for (const auto& key : plan_keys_)
        if (std::get<0>(key) != static_cast<int>(MlaForm::Expanded)) plans_.emplace(key, build_plan(key, up, true));
    d_page_table_ = up.add(step_.page_table);
    mark_step_start();
    up.flush();
#ifdef MLASERVE_PROBE
    // Probe builds: record the MLASERVE_PROBE_STEP-th graph step (default 40) into MLASERVE_PROBE_OUT.
    if (graph) {
      static const char* step_env = std::getenv("MLASERVE_PROBE_STEP");
      static const long probe_step = step_env ? std::atol(step_env) : 40;
      const char* out = std::getenv("MLASERVE_PROBE_OUT");
      if (probe_graph_steps_ == probe_step) {
        cudaStreamSynchronize(stream_);
        cuda::probe_start();
      } else if (probe_graph_steps_ == probe_step + 1) {
        cuda::probe_dump(out ? out : "/tmp/probe.txt");
      }
      ++probe_graph_steps_;
    }
#endif
  }

  // MLASERVE_GPU_IDLE_STATS=1: events at each step's first GPU work (the metadata upload) and after its last
  // download; at exit, the time the GPU had no step queued between the end of one step and the start of the next,
  // against the wall time from the first step to the last.
  void mark_step_start() {
    if (!idle_stats_ || step_events_.size() >= kMaxStepEvents) return;
    cudaEvent_t a = nullptr, b = nullptr;
    if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return;
    cudaEventRecord(a, stream_);
    cudaEventRecord(b, stream_);  // moved to the step's end (end_step, or its last download)
    step_events_.emplace_back(a, b);
    step_is_graph_.push_back(graph_step_);
  }
  // Gaps of kIdleGapMs or more mean no step was waiting (startup, graph recording, a server without requests):
  // they are counted apart, not as idle time between steps.
  void report_idle() {
    if (step_events_.size() < 2) return;
    constexpr float kIdleGapMs = 50.0f;
    double idle = 0.0, busy = 0.0, idle_graph = 0.0;  // idle_graph: the gaps before graph steps
    int64_t long_gaps = 0, graph_steps = 0;
    float ms = 0.0f;
    for (size_t i = 0; i < step_events_.size(); ++i) {
      graph_steps += step_is_graph_[i];
      if (cudaEventElapsedTime(&ms, step_events_[i].first, step_events_[i].second) == cudaSuccess) busy += ms;
      if (i > 0 && cudaEventElapsedTime(&ms, step_events_[i - 1].second, step_events_[i].first) == cudaSuccess) {
        if (ms >= kIdleGapMs) {
          ++long_gaps;
        } else {
          idle += std::max(ms, 0.0f);
          if (step_is_graph_[i]) idle_graph += std::max(ms, 0.0f);
        }
      }
    }
    // Only gaps between steps are seen: inside an eager step the GPU may also wait for the host to issue kernels.
    MLA_LOG_INFO("cuda {}: GPU idle between steps {:.1f} ms of {:.1f} ms ({:.2f}%) over {} steps ({} gaps of {} ms "
                 "or more with no step waiting left out); {} graph steps with {:.1f} ms idle before them, {} eager "
                 "steps with {:.1f} ms",
                 device_, idle, idle + busy, idle + busy > 0 ? 100.0 * idle / (idle + busy) : 0.0, step_events_.size(),
                 long_gaps, kIdleGapMs, graph_steps, idle_graph,
                 static_cast<int64_t>(step_events_.size()) - graph_steps, idle - idle_graph);
    clear_step_events();
  }
  void clear_step_events() {
    for (auto& [a, b] : step_events_) {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    step_events_.clear();
    step_is_graph_.clear();
  }
  static constexpr size_t kMaxStepEvents = 200000;
  bool idle_stats_ = false;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> step_events_;
  std::vector<bool> step_is_graph_;

  int device_;
  int num_sms_ = 132;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t meta_events_[2] = {nullptr, nullptr};  // last upload from each half of the pinned staging buffer
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* lt_ws_ = nullptr;
  size_t lt_ws_size_ = 0;
  void* blas_ws_ = nullptr;
  RemappableMemory persistent_memory_;  // persistent_'s memory (released and taken again: release_persistent)
  Tensor inv_freq_host_;                 // set_rope's table, kept to upload again after resume_persistent
  Arena persistent_, scratch_, meta_;
  char* pinned_ = nullptr;  // two halves of meta_.size bytes, one per step in turn
  int staging_half_ = 0;
  char* staging() const { return pinned_ + static_cast<size_t>(staging_half_) * meta_.size; }
  struct Download {
    void* host = nullptr;
    size_t capacity = 0, bytes = 0;
    cudaEvent_t done = nullptr;
  };
  static constexpr size_t kDownloadSlotBytes = 1 << 20;
  Download downloads_[kMaxDownloads];
  uint64_t next_download_ = 0;
  int downloads_in_flight_ = 0;
  size_t scratch_peak_ = 0;
  bool allow_fast_ = true, moe_cublas_ = false;
  // measured fastest on H200 (docs/perf.md); MLASERVE_MLA_DECODE_VARIANT overrides
  int32_t mla_variant_ = cuda::kMlaDecodeDefaultVariant;
  bool moe_grouped_only_ = false;
  // 64-head groups decode on the warpgroup-MMA kernel (cuda::mla_decode_wgmma) unless MLASERVE_MLA_WGMMA=0 (then
  // the mma.sync kernel, or the 16-head FP8 kernel over an FP8 cache).
  bool wgmma_decode_ = true;
  bool page_runs_ = true;  // MLASERVE_MLA_PAGE_RUNS=0: that kernel copies a box per page always (for A/B runs)
  bool fp8_decode_ = true;  // FP8 experts at decode sizes through moe_fp8_decode (with small_batch_)
  // Steps of at most cuda::kGemvMaxRows rows use the small-batch kernels (gemv.cu); MLASERVE_SMALL_BATCH=0: cuBLAS and
  // the grouped MoE kernels instead.
  bool small_batch_ = true;
  // A step of one decode token of at most cuda::kOneTokenMaxCtx keys runs its attention as one launch
  // (cuda::mla_one_token) unless CudaBackendOptions::one_token_attention is off or MLASERVE_MLA_ONE_TOKEN=0.
  bool one_token_ = true;
  int32_t one_token_clusters_ = 0;  // how many of its clusters (one per head) the GPU holds at once
  static constexpr int64_t kMoeCublasRowsPerExpert = 384;

  ForwardBatch step_;
  int32_t* d_input_ids_ = nullptr;
#ifdef MLASERVE_PROBE
  long probe_graph_steps_ = 0;
#endif
  int32_t* d_positions_ = nullptr;
  unsigned* gate_counter_ = nullptr;  // cuda::moe_gate's arrival counter (0 between launches)
  // stage_sample's rows (SampleStep) at a fixed address, which sample_staged's launches (recorded in graphs) read.
  cuda::SampleStep* sample_slot_ = nullptr;
  int64_t staged_rows_ = -1;  // the rows staged this step (-1: none)
  int32_t* d_out_slots_ = nullptr;
  int32_t* d_page_table_ = nullptr;
  int32_t* d_logit_rows_ = nullptr;
  int32_t* d_moe_rows_ = nullptr;  // the step's ForwardBatch::moe_rows (count_experts)
  std::map<PlanKey, MlaPlan> plans_;
  std::vector<PlanKey> plan_keys_;  // every attention shape seen, planned up front in graph steps
  bool graph_step_ = false, capturing_ = false;
  mutable int64_t slots_checked_ = -1;  // cache size the step's out_slots were checked against (check_latent)
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    size_t scratch_end = 0;
    size_t moe_rows = 0;  // the recorded step's moe_rows entries (a replay's must match: it reads them in place)
  };
  std::vector<Graph> graphs_;

  Tensor inv_freq_;
  int64_t rope_dim_ = 0;
  float rope_factor_ = 1.0f;

  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int, int>, GemmPlan> gemms_;
};

const CudaBackend::MlaPlan& CudaBackend::plan_for(MlaForm form, int32_t nh, int32_t kvr, int32_t rope,
                                                  int32_t variant) {
  const PlanKey key = std::make_tuple(static_cast<int>(form), nh, kvr, rope, variant);
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second;
  MLA_CHECK(!graph_step_, "graph step: no attention plan for {} heads (form {}) was made up front", nh,
            static_cast<int>(form));
  if (std::find(plan_keys_.begin(), plan_keys_.end(), key) == plan_keys_.end()) plan_keys_.push_back(key);
  // Steps of one new token per sequence, or of decode tokens with their drafts, plan like graph steps (fixed parts per
  // token, chosen from the token count rounded up to a power of two, which a graph's padded size shares): a replayed
  // step computes exactly what the eager one does.
  const bool drafts = form == MlaForm::Auto && all_absorbed_under_auto(step_);
  const bool single =
      form != MlaForm::Expanded && step_.num_tokens() > 0 && (step_.num_tokens() == step_.num_seqs() || drafts);
  MetaUpload up(*this);
  MlaPlan plan = build_plan(key, up, single);
  up.flush();
  return plans_.emplace(key, plan).first->second;
}

CudaBackend::MlaPlan CudaBackend::build_plan(const PlanKey& key, MetaUpload& up, bool fixed_splits) {
  const MlaForm form = static_cast<MlaForm>(std::get<0>(key));
  const int32_t nh = std::get<1>(key), kvr = std::get<2>(key), rope = std::get<3>(key), variant = std::get<4>(key);
  const ForwardBatch& b = step_;
  MlaPlan plan;
  std::vector<cuda::MlaDecodeItem> decode;
  std::vector<cuda::MlaDecodeCombineItem> combine;
  std::vector<cuda::MlaPrefillItem> prefill;
  std::vector<int32_t> row_seq, row_pos;
  std::vector<int32_t> absorbed_seqs, expanded_seqs;
  int64_t total_keys = 0, absorbed_tokens = 0, max_ctx = 1;
  for (int32_t s = 0; s < b.num_seqs(); ++s) {
    const bool absorbed = form == MlaForm::Absorbed || (form == MlaForm::Auto && b.absorbed_under_auto(s));
    (absorbed ? absorbed_seqs : expanded_seqs).push_back(s);
    if (absorbed)
      for (int32_t t = b.seq_q_start[s]; t < b.seq_q_start[s + 1]; ++t) {
        total_keys += b.positions[t] + 1;
        max_ctx = std::max<int64_t>(max_ctx, b.positions[t] + 1);
        ++absorbed_tokens;
      }
  }
  if (fixed_splits) {
    // Graph (or single-token) step: S parts per token, whatever its context (empty parts get weight zero in the
    // combine), and the page-table row as an offset (max_pages varies from step to step; the kernels see 1).
    MLA_CHECK(expanded_seqs.empty(), "graph step with prefill tokens");
    int64_t basis = 1;
    while (basis < absorbed_tokens) basis *= 2;
    const int32_t S = cuda::mla_decode_fixed_splits(basis, nh, kvr, rope, num_sms_, variant);
    int32_t partial = 0;
    for (int32_t s : absorbed_seqs)
      for (int32_t t = b.seq_q_start[s]; t < b.seq_q_start[s + 1]; ++t) {
        const int32_t ctx = b.positions[t] + 1, row = s * b.max_pages, cached = b.seq_prefix_lens[s];
        if (S == 1) {
          decode.push_back({t, row, 0, ctx, -1, cached});
          continue;
        }
        const int32_t len = ((ctx + S - 1) / S + 63) / 64 * 64;
        for (int32_t i = 0; i < S; ++i)
          decode.push_back({t, row, std::min(ctx, i * len), std::min(ctx, (i + 1) * len), partial + i, cached});
        combine.push_back({t, partial, S});
        partial += S;
      }
    plan.num_partials = partial;
    plan.row_offsets = true;
  } else if (!absorbed_seqs.empty()) {
    const int32_t chunk = cuda::mla_decode_split_keys(total_keys, absorbed_tokens, max_ctx, nh, kvr, rope, num_sms_,
                                                        variant);
    int32_t partial = 0;
    for (int32_t s : absorbed_seqs)
      for (int32_t t = b.seq_q_start[s]; t < b.seq_q_start[s + 1]; ++t)
        cuda::plan_decode_token(t, s, b.positions[t] + 1, chunk, decode, combine, partial, b.seq_prefix_lens[s]);
    plan.num_partials = partial;
  }
  int64_t ctx_rows = 0;
  for (int32_t s : expanded_seqs) {
    const int32_t len = b.seq_lens[s];
    for (int32_t j = 0; j < len; ++j) {
      row_seq.push_back(s);
      row_pos.push_back(j);
    }
    const int32_t t0 = b.seq_q_start[s], t1 = b.seq_q_start[s + 1];
    for (int32_t t = t0; t < t1; t += cuda::kPrefillBlockQ) {
      const int32_t n = std::min(cuda::kPrefillBlockQ, t1 - t);
      prefill.push_back({t, n, b.positions[t], static_cast<int32_t>(ctx_rows)});
    }
    ctx_rows += len;
  }
  // Longest causal ranges first: the tail of the grid is short blocks.
  std::stable_sort(prefill.begin(), prefill.end(), [](const cuda::MlaPrefillItem& x, const cuda::MlaPrefillItem& y) {
    return x.pos_begin + x.num_tokens > y.pos_begin + y.num_tokens;
  });
  plan.num_decode_items = static_cast<int32_t>(decode.size());
  plan.num_combine = static_cast<int32_t>(combine.size());
  plan.d_decode = up.add(decode);
  plan.d_combine = up.add(combine);
  plan.num_prefill_items = static_cast<int32_t>(prefill.size());
  plan.ctx_rows = ctx_rows;
  plan.d_prefill = up.add(prefill);
  plan.d_row_seq = up.add(row_seq);
  plan.d_row_pos = up.add(row_pos);
  return plan;
}

void CudaBackend::attend(const Tensor& q, const Tensor& cache, const Tensor& kv_b, const MlaParams& p, Tensor& out,
                         const cuda::MlaPrepArgs* prep) {
  const int64_t T = step_.num_tokens();
  const int64_t nh = p.num_heads, nope = p.qk_nope, rope = p.qk_rope, vh = p.v_head, kvr = p.kv_lora;
  const int64_t hd = nope + rope, W = kvr + rope;
  MLA_CHECK(q.numel() == T * nh * hd && q.dtype() == DType::BF16, "mla_attention: q shape mismatch");
  MLA_CHECK(out.numel() == T * nh * vh && out.dtype() == DType::BF16, "mla_attention: out shape mismatch");
  MLA_CHECK(kv_b.size(0) == nh * (nope + vh) && kv_b.size(1) == kvr && kv_b.dtype() == DType::BF16,
            "mla_attention: kv_b_proj shape {} mismatch", shape_str(kv_b.shape()));
  MLA_CHECK(cache.size(-1) == W, "mla_attention: cache width {} != kv_lora + rope {}", cache.size(-1), W);
  MLA_CHECK(cache.dtype() == DType::BF16 || is_fp8_cache(cache), "mla_attention: a {} cache",
            dtype_name(cache.dtype()));
  if (T == 0) return;
  const bool fp8 = is_fp8_cache(cache);
  const int32_t variant = fp8 ? cuda::kMlaDecodeFp8Variant : mla_variant_;
  const MlaPlan& plan =
      plan_for(p.form, static_cast<int32_t>(nh), static_cast<int32_t>(kvr), static_cast<int32_t>(rope), variant);
  const char* kvb = static_cast<const char*>(kv_b.data());
  const int64_t head_rows = nope + vh;  // rows of kv_b per head: W_UK (nope) then W_UV (v)
  const bool small = small_batch_ && T <= cuda::kGemvMaxRows && kvr % 8 == 0 && nope % 8 == 0 && hd % 8 == 0 &&
                     alignment_of(kvb) >= 16 && alignment_of(q.data()) >= 16;
  if (prep && small && one_token_step(p, plan)) {
    const cuda::MlaOneTokenArgs a{*prep, d_page_table_, step_.page_size, bf(kv_b), p.softmax_scale, bf(out)};
    CUDA_OK(cuda::mla_one_token(a, static_cast<int32_t>(nh), stream_), "mla_one_token");
    return;
  }
  const bool fold_prep = prep && small && T <= cuda::kFewRows && plan.num_decode_items > 0 && plan.num_prefill_items == 0;
  if (prep && !fold_prep) CUDA_OK(cuda::rope_q_write_latent(*prep, stream_), "mla_prepare");
  if (plan.num_decode_items > 0) {
    // q_lat[t, h, :] = q_nope[t, h, :] @ W_UK[h]   (W_UK[h]: [nope, kvr] rows of kv_b)
    Tensor q_lat = scratch({T, nh, kvr}, DType::BF16);
    if (small && T <= cuda::kFewRows) {
      const cuda::GemvArgs g =
          gemv_args(q.data(), nh * hd, hd, kvb, kvr, head_rows * kvr, q_lat.data(), nh * kvr, kvr, T, kvr, nope);
      if (fold_prep)
        CUDA_OK(cuda::gemv_n_prepare(g, static_cast<int32_t>(nh), *prep, stream_), "gemv_n (q_lat) + mla_prepare");
      else
        CUDA_OK(cuda::gemv_n(g, static_cast<int32_t>(nh), stream_), "gemv_n (q_lat)");
    } else {
      batched_gemm(false, kvr, T, nope, kvb, kvr, head_rows * kvr, q.data(), nh * hd, hd, q_lat.data(), nh * kvr, kvr,
                   nh);
    }
    Tensor o_lat = scratch({T, nh, kvr}, DType::BF16);
    Tensor part_o = scratch({std::max(plan.num_partials, 1), nh, kvr}, DType::F32);
    Tensor part_lse = scratch({std::max(plan.num_partials, 1), nh}, DType::F32);
    cuda::MlaDecodeParams dp{};
    dp.q_lat = bf(q_lat);
    dp.q = bf(q);
    dp.cache = cache_bf16(cache);
    dp.cache_f8 = cache_fp8(cache);
    dp.cache_e5m2 = cache_e5m2(cache);
    dp.page_table = d_page_table_;
    dp.num_slots = wgmma_decode_ ? rows_of(cache) : 0;  // (0: not the warpgroup-MMA kernel)
    dp.page_runs = page_runs_;
    dp.items = plan.d_decode;
    dp.num_items = plan.num_decode_items;
    dp.num_heads = static_cast<int32_t>(nh);
    dp.kvr = static_cast<int32_t>(kvr);
    dp.rope = static_cast<int32_t>(rope);
    dp.nope = static_cast<int32_t>(nope);
    dp.page_size = step_.page_size;
    dp.max_pages = plan.row_offsets ? 1 : step_.max_pages;
    dp.softmax_scale = p.softmax_scale;
    dp.out_lat = bf(o_lat);
    dp.partial_o = part_o.data_as<float>();
    dp.partial_lse = part_lse.data_as<float>();
    dp.variant = variant;
    CUDA_OK(cuda::mla_decode(dp, allow_fast_, stream_), "mla_decode");
    // out[t, h, :] = o_lat[t, h, :] @ W_UV[h]^T   (W_UV[h]: [v, kvr] rows of kv_b)
    const cuda::GemvArgs uv = gemv_args(o_lat.data(), nh * kvr, kvr, kvb + nope * kvr * 2, kvr, head_rows * kvr,
                                        out.data(), nh * vh, vh, T, vh, kvr);
    if (small && T == 1 && kvr <= cuda::kCombineUvMaxK) {  // one token: the combine inside the W_UV launch
      CUDA_OK(cuda::mla_combine_uv(uv, static_cast<int32_t>(nh), plan.num_combine > 0 ? plan.d_combine : nullptr,
                                   dp.partial_o, dp.partial_lse, stream_),
              "mla_combine_uv");
    } else {
      CUDA_OK(cuda::mla_decode_combine(plan.d_combine, plan.num_combine, dp.partial_o, dp.partial_lse, dp.num_heads,
                                       dp.kvr, bf(o_lat), stream_),
              "mla_decode_combine");
      if (small)
        CUDA_OK(cuda::gemv_t(uv, static_cast<int32_t>(nh), num_sms_, stream_), "gemv (W_UV)");
      else
        batched_gemm(true, vh, T, kvr, kvb + nope * kvr * 2, kvr, head_rows * kvr, o_lat.data(), nh * kvr, kvr,
                     out.data(), nh * vh, vh, nh);
    }
  }
  if (plan.num_prefill_items > 0) {
    const int64_t L = plan.ctx_rows;
    Tensor ctx = scratch({L, W}, DType::BF16);
    CUDA_OK(cuda::mla_gather_context(cache_bf16(cache), cache_fp8(cache), cache_e5m2(cache), static_cast<int32_t>(W),
                                     d_page_table_, step_.page_size, step_.max_pages, plan.d_row_seq, plan.d_row_pos,
                                     L, bf(ctx), stream_),
            "mla_gather_context");
    Tensor kv = scratch({L, nh * head_rows}, DType::BF16);
    gemm(kv_b.data(), kvr, ctx.data(), W, kv.data(), nh * head_rows, DType::BF16, nh * head_rows, L, kvr);
    cuda::MlaPrefillParams pp{};
    pp.q = bf(q);
    pp.kv = bf(kv);
    pp.ctx_latent = bf(ctx);
    pp.items = plan.d_prefill;
    pp.num_items = plan.num_prefill_items;
    pp.num_heads = static_cast<int32_t>(nh);
    pp.nope = static_cast<int32_t>(nope);
    pp.rope = static_cast<int32_t>(rope);
    pp.v = static_cast<int32_t>(vh);
    pp.kvr = static_cast<int32_t>(kvr);
    pp.softmax_scale = p.softmax_scale;
    pp.out = bf(out);
    pp.num_q_rows = T;
    pp.num_ctx_rows = L;
    CUDA_OK(cuda::mla_prefill(pp, allow_fast_, stream_), "mla_prefill");
  }
}

Tensor CudaBackend::routed_bf16(const Tensor& w, const Tensor& topk_ids, int32_t expert_begin) {
  const BlockScales* s = w.block_scales();
  const int64_t cols = s->int4() ? 2 * w.size(2) : w.size(2);
  Tensor o = scratch({w.size(0), w.size(1), cols}, DType::BF16);
  cuda::DequantArgs a{};
  a.w = w.data_as<const uint8_t>();
  a.scale = s->scale.data_as<const float>();
  if (s->int4()) a.zero = s->zero.data_as<const float>();
  a.B = o.size(0);
  a.R = o.size(1);
  a.C = o.size(2);
  a.block_rows = s->block_rows;
  a.block_cols = s->block_cols;
  a.ids = topk_ids.data_as<const int32_t>();
  a.num_ids = topk_ids.numel();
  a.expert_begin = expert_begin;
  a.out = bf(o);
  CUDA_OK(cuda::dequant_experts(a, stream_), "dequant_experts");
  return o;
}

void CudaBackend::moe_experts(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                              const Tensor& gate_up, const Tensor& down, int32_t expert_begin,
                              const Tensor* shared_gate_up, const Tensor* shared_down, int32_t n_fixed, Tensor& out) {
  const bool int4 = gate_up.dtype() == DType::U8 || down.dtype() == DType::U8;
  if (int4 || gate_up.dtype() == DType::F8_E4M3 || down.dtype() == DType::F8_E4M3) {
    // Kept FP8 / INT4 experts: read as they are by the small-batch kernels (FP8 at 1-4 tokens, on tensor cores at
    // 1-16 where the scale blocks are whole 64-column chunks; INT4 on tensor cores only, groups alike) or by the
    // grouped kernels' quantized tiles (16 FP8 / 32 INT4 codes per copy, each copy in one block, each code word in
    // one group); else (cuBLAS, widths off those chunks) the ones the step's ids name dequantized into bf16 scratch,
    // then the bf16 paths (which read only those experts).
    const DType codes = int4 ? DType::U8 : DType::F8_E4M3;
    const BlockScales *gs = gate_up.block_scales(), *ds = down.block_scales();
    MLA_CHECK(gate_up.dtype() == codes && down.dtype() == codes && gs && ds && gs->int4() == int4 &&
                  ds->int4() == int4 && gate_up.dim() == 3 && down.dim() == 3,
              "moe_experts: {} experts need both matrices in {} with their {}", int4 ? "INT4" : "FP8",
              int4 ? "U8 [E, rows, cols / 2]" : "F8_E4M3 [E, rows, cols]",
              int4 ? "scales and zeros" : "block scales");
    const int64_t T = rows_of(x), k = topk_ids.size(-1), H = x.size(-1), I = gate_up.size(1) / 2;
    const int64_t E = gate_up.size(0), per_code = int4 ? 2 : 1;  // columns per byte
    MLA_CHECK(down.size(0) == E && down.size(1) == H && down.size(2) * per_code == I &&
                  gate_up.size(2) * per_code == H && x.dtype() == DType::BF16 && out.dtype() == DType::BF16,
              "moe_experts: {} experts gate_up {} / down {} do not match x {}", int4 ? "INT4" : "FP8",
              shape_str(gate_up.shape()), shape_str(down.shape()), shape_str(x.shape()));
    const int64_t Is = T == 0 ? 0 : shared_experts_width(x, shared_gate_up, shared_down, out);
    const bool tc = gs->block_cols == ds->block_cols && cuda::moe_small_tc_fits(H, I, Is, gs->block_cols);
    const bool small = int4 ? tc && use_moe_small(T, k, Is, cuda::kMoeSmallTcRows)
                            : use_moe_small(T, k, Is, tc ? cuda::kMoeSmallTcRows : cuda::kMoeSmallRows) &&
                                  gs->block_rows == ds->block_rows && gs->block_cols == ds->block_cols &&
                                  gs->block_cols % 8 == 0 && H % 8 == 0 && I % 8 == 0;
    if (T >= 1 && small) {
      moe_small_path(x, topk_ids, topk_weights, gate_up, down, expert_begin, shared_gate_up, shared_down, Is, n_fixed,
                     out, gs, ds);
      return;
    }
    const int64_t chunk = int4 ? 32 : 16;  // the grouped kernels' columns per copy
    auto blocks_fit = [&](const BlockScales* b, int64_t cols) {
      return int4 ? b->block_cols % 8 == 0 || b->block_cols >= cols : b->block_cols % chunk == 0;
    };
    if (T >= 1 && !moe_uses_cublas(T * k, E) && H % chunk == 0 && I % chunk == 0 && blocks_fit(gs, H) &&
        blocks_fit(ds, I)) {
      const cuda::bf16* shared = shared_experts_out(x, shared_gate_up, shared_down, out);
      moe_routed(x, topk_ids, topk_weights, gate_up, down, expert_begin, shared, out, gs, ds);
      return;
    }
    const Tensor gu = routed_bf16(gate_up, topk_ids, expert_begin), dn = routed_bf16(down, topk_ids, expert_begin);
    moe_experts(x, topk_ids, topk_weights, gu, dn, expert_begin, shared_gate_up, shared_down, n_fixed, out);
    return;
  }
  const int64_t T = rows_of(x), H = x.size(-1), k = topk_ids.size(-1);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  MLA_CHECK(down.dtype() == gate_up.dtype() && down.size(0) == E && down.size(1) == H && down.size(2) == I,
            "moe_experts: down {} does not match gate_up {}", shape_str(down.shape()), shape_str(gate_up.shape()));
  MLA_CHECK(x.dtype() == DType::BF16 && out.dtype() == DType::BF16 && gate_up.dtype() == DType::BF16 &&
                out.numel() == T * H && topk_ids.numel() == T * k && gate_up.size(2) == H,
            "moe_experts: dtype or shape mismatch");
  MLA_CHECK(H % 8 == 0 && I % 8 == 0, "moe_experts: hidden {} and expert width {} must be multiples of 8", H, I);
  if (T == 0) return;
  const int64_t Is = shared_experts_width(x, shared_gate_up, shared_down, out);
  if (Is > 0)
    MLA_CHECK(shared_gate_up->dtype() == DType::BF16 && shared_down->dtype() == DType::BF16,
              "moe_experts: shared experts must be bf16");
  if (use_moe_small(T, k, Is)) {
    moe_small_path(x, topk_ids, topk_weights, gate_up, down, expert_begin, shared_gate_up, shared_down, Is, n_fixed,
                   out);
    return;
  }
  const cuda::bf16* shared = shared_experts_out(x, shared_gate_up, shared_down, out);
  moe_routed(x, topk_ids, topk_weights, gate_up, down, expert_begin, shared, out);
}

const cuda::bf16* CudaBackend::shared_experts_out(const Tensor& x, const Tensor* gate_up, const Tensor* down,
                                                  const Tensor& out) {
  const int64_t Is = shared_experts_width(x, gate_up, down, out);
  if (Is == 0) return nullptr;
  Tensor y = scratch({rows_of(x), out.size(-1)}, DType::BF16);
  shared_experts_mlp(*this, x, *gate_up, *down, Is, y);
  return bf(y);
}

void CudaBackend::moe_small_path(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                                 const Tensor& gate_up, const Tensor& down, int32_t expert_begin,
                                 const Tensor* shared_gate_up, const Tensor* shared_down, int64_t Is,
                                 int32_t n_fixed, Tensor& out, const BlockScales* gs, const BlockScales* ds) {
  const int64_t T = rows_of(x), H = x.size(-1), k = topk_ids.size(-1);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  {
    cuda::MoeSmallArgs a{};
    a.x = bf(x);
    a.ldx = H;
    a.T = static_cast<int32_t>(T);
    a.H = static_cast<int32_t>(H);
    a.ids = topk_ids.data_as<const int32_t>();
    a.weights = topk_weights.data_as<const float>();
    a.k = static_cast<int32_t>(k);
    a.gate_up = static_cast<const cuda::bf16*>(gate_up.data());  // F8 codes with gs / ds
    a.down = static_cast<const cuda::bf16*>(down.data());
    if (gs) {
      a.gate_up_scale = gs->scale.data_as<const float>();
      a.down_scale = ds->scale.data_as<const float>();
      a.block_rows = static_cast<int32_t>(gs->block_rows);
      a.block_cols = static_cast<int32_t>(gs->block_cols);
      if (gs->int4()) {
        a.gate_up_zero = gs->zero.data_as<const float>();
        a.down_zero = ds->zero.data_as<const float>();
      }
    }
    a.E = static_cast<int32_t>(E);
    a.I = static_cast<int32_t>(I);
    a.expert_begin = expert_begin;
    a.shared_gate_up = shared_gate_up ? bf(*shared_gate_up) : nullptr;
    a.shared_down = shared_down ? bf(*shared_down) : nullptr;
    a.Is = static_cast<int32_t>(Is);
    a.n_fixed = n_fixed;
    Tensor act = scratch({T * k, I}, DType::BF16), act_shared = scratch({T, std::max<int64_t>(Is, 1)}, DType::BF16);
    a.act = bf(act);
    a.act_shared = bf(act_shared);
    a.out = bf(out);
    a.ldo = H;
    Tensor plan = scratch({static_cast<int64_t>(cuda::moe_small_plan_bytes())}, DType::U8);
    CUDA_OK(cuda::moe_small(a, plan.data(), num_sms_, stream_), "moe_small");
  }
}

void CudaBackend::moe_routed(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                             const Tensor& gate_up, const Tensor& down, int32_t expert_begin,
                             const cuda::bf16* shared_out, Tensor& out, const BlockScales* gs,
                             const BlockScales* ds) {
  const int64_t T = rows_of(x), H = x.size(-1), k = topk_ids.size(-1);
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  const int64_t P = T * k;
  const int32_t bm = cuda::moe_block_m(P, static_cast<int32_t>(E));
  const int32_t max_tiles = cuda::moe_max_tiles(T, static_cast<int32_t>(k), static_cast<int32_t>(E), bm);
  Tensor expert_end = scratch({E}, DType::I32), counts = scratch({E}, DType::I32);
  Tensor pos_row = scratch({P}, DType::I32), pos_weight = scratch({P}, DType::F32), assign_pos = scratch({P}, DType::I32);
  Tensor tiles = scratch({max_tiles}, DType::I32), num_tiles = scratch({1}, DType::I32);
  Tensor hist = scratch({std::max<int64_t>(cuda::moe_group_hist_ints(T, static_cast<int32_t>(k),
                                                                      static_cast<int32_t>(E)), 1)},
                        DType::I32);
  cuda::MoeGroupOut g{expert_end.data_as<int32_t>(), pos_row.data_as<int32_t>(), pos_weight.data_as<float>(),
                      assign_pos.data_as<int32_t>(), tiles.data_as<int32_t>(), num_tiles.data_as<int32_t>(),
                      counts.data_as<int32_t>(), hist.data_as<int32_t>()};
  CUDA_OK(cuda::moe_group(topk_ids.data_as<const int32_t>(), topk_weights.data_as<const float>(), T,
                          static_cast<int32_t>(k), static_cast<int32_t>(E), expert_begin, bm, g, stream_),
          "moe_group");
  // Many rows per expert (prefill): per-expert cuBLASLt GEMMs (Hopper tensor-core kernels) on gathered rows, one
  // host synchronisation per layer for the counts. Few rows (decode): the grouped kernels, no synchronisation.
  if (moe_uses_cublas(P, E)) {
    MLA_CHECK(!gs, "moe_routed: FP8 / INT4 experts take the grouped kernels only");
    std::vector<int32_t> cnt(static_cast<size_t>(E));
    MLA_LOG_TRACE("cuda {}: MoE counts download (host sync)", device_);
    download(counts, cnt.data());
    // Each expert's GEMM covers its rows rounded up to 128 (bounded number of distinct shapes, so cuBLASLt
    // heuristics are queried a few times, not once per count): the extra rows belong to the next expert, whose
    // GEMM runs later on the stream and overwrites them; the buffers have 128 rows of slack at the end.
    constexpr int64_t kPad = 128;
    auto padded = [](int64_t c) { return (c + kPad - 1) / kPad * kPad; };
    Tensor xs = scratch({P + kPad, H}, DType::BF16), gu = scratch({P + kPad, 2 * I}, DType::BF16);
    Tensor act = scratch({P + kPad, I}, DType::BF16), ybf = scratch({P + kPad, H}, DType::BF16);
    CUDA_OK(cuda::moe_gather_x(bf(x), H, pos_row.data_as<int32_t>(), expert_end.data_as<int32_t>(),
                               static_cast<int32_t>(E), P, bf(xs), stream_),
            "moe_gather_x");
    int64_t off = 0;
    const size_t esz = 2;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t c = cnt[static_cast<size_t>(e)];
      if (c == 0) continue;
      gemm(static_cast<const char*>(gate_up.data()) + e * 2 * I * H * esz, H, bf(xs) + off * H, H, bf(gu) + off * 2 * I,
           2 * I, DType::BF16, 2 * I, padded(c), H);
      off += c;
    }
    CUDA_OK(cuda::silu_mul(bf(gu), off, I, bf(act), stream_), "silu_mul");
    off = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t c = cnt[static_cast<size_t>(e)];
      if (c == 0) continue;
      gemm(static_cast<const char*>(down.data()) + e * H * I * esz, I, bf(act) + off * I, I, bf(ybf) + off * H, H,
           DType::BF16, H, padded(c), I);
      off += c;
    }
    CUDA_OK(cuda::moe_combine_bf16(bf(ybf), pos_weight.data_as<float>(), assign_pos.data_as<int32_t>(), T,
                                   static_cast<int32_t>(k), H, bf(out), stream_, shared_out),
            "moe_combine_bf16");
    return;
  }
  Tensor y = scratch({P, H}, DType::F32);
  {
    Tensor act = scratch({P, I}, DType::BF16);
    cuda::MoeGemmParams gp{};
    gp.x = bf(x);
    gp.pos_row = pos_row.data_as<int32_t>();
    gp.w = static_cast<const cuda::bf16*>(gate_up.data());  // F8 codes with gs
    if (gs) {
      gp.w_scale = gs->scale.data_as<const float>();
      gp.block_rows = static_cast<int32_t>(gs->block_rows);
      gp.block_cols = static_cast<int32_t>(gs->block_cols);
      if (gs->int4()) gp.w_zero = gs->zero.data_as<const float>();
    }
    gp.tiles = tiles.data_as<int32_t>();
    gp.num_tiles = num_tiles.data_as<int32_t>();
    gp.expert_end = expert_end.data_as<int32_t>();
    gp.max_tiles = max_tiles;
    gp.N = static_cast<int32_t>(I);
    gp.K = static_cast<int32_t>(H);
    gp.act = bf(act);
    // FP8 experts with few rows per expert: the weights straight into registers (moe_fp8_decode).
    const bool fp8_decode = gs && ds && !gs->int4() && fp8_decode_ && P <= cuda::kMoeFp8DecodeRowsPerExpert * E &&
                            cuda::moe_fp8_decode_fits(H, I, gs->block_rows, gs->block_cols) &&
                            cuda::moe_fp8_decode_fits(H, I, ds->block_rows, ds->block_cols);
    if (fp8_decode)
      CUDA_OK(cuda::moe_fp8_decode(gp, true, static_cast<int32_t>(E), P, num_sms_, stream_), "moe_fp8_decode gate_up");
    else
      CUDA_OK(cuda::moe_gemm_gate_up(gp, bm, stream_), "moe_gemm_gate_up");
    gp.x = bf(act);
    gp.pos_row = nullptr;
    gp.w = static_cast<const cuda::bf16*>(down.data());
    if (ds) {
      gp.w_scale = ds->scale.data_as<const float>();
      gp.block_rows = static_cast<int32_t>(ds->block_rows);
      gp.block_cols = static_cast<int32_t>(ds->block_cols);
      gp.w_zero = ds->int4() ? ds->zero.data_as<const float>() : nullptr;
    }
    gp.N = static_cast<int32_t>(H);
    gp.K = static_cast<int32_t>(I);
    gp.act = nullptr;
    gp.y = y.data_as<float>();
    gp.pos_weight = pos_weight.data_as<float>();
    if (fp8_decode)
      CUDA_OK(cuda::moe_fp8_decode(gp, false, static_cast<int32_t>(E), P, num_sms_, stream_), "moe_fp8_decode down");
    else
      CUDA_OK(cuda::moe_gemm_down(gp, bm, stream_), "moe_gemm_down");
  }
  CUDA_OK(cuda::moe_combine(y.data_as<float>(), assign_pos.data_as<int32_t>(), T, static_cast<int32_t>(k), H, bf(out),
                            stream_, shared_out),
          "moe_combine");
}

const cuda::SampleStep* CudaBackend::upload_sample_step(std::span<const RowSampling> params, const Tensor* logprobs) {
  const size_t R = params.size();
  std::vector<cuda::SampleRow> rows(R);
  std::vector<int32_t> ptok, pcnt, btok;
  std::vector<float> bval;
  std::vector<uint32_t> masks;
  for (size_t r = 0; r < R; ++r) {
    const RowSampling& s = params[r];
    cuda::SampleRow& o = rows[r];
    o.temperature = s.temperature;
    o.top_k = s.top_k;
    o.top_p = s.top_p;
    o.min_p = s.min_p;
    o.frequency_penalty = s.frequency_penalty;
    o.presence_penalty = s.presence_penalty;
    o.repetition_penalty = s.repetition_penalty;
    o.seed = s.seed;
    o.step = s.step;
    o.penalty_begin = static_cast<int32_t>(ptok.size());
    for (const auto& [tok, cnt] : s.penalty_counts) {
      ptok.push_back(tok);
      pcnt.push_back(cnt);
    }
    o.penalty_end = static_cast<int32_t>(ptok.size());
    o.pending_input = s.pending_input;
    o.bias_begin = static_cast<int32_t>(btok.size());
    for (const auto& [tok, bias] : s.logit_bias) {
      btok.push_back(tok);
      bval.push_back(bias);
    }
    o.bias_end = static_cast<int32_t>(btok.size());
    o.mask_begin = s.allowed ? static_cast<int32_t>(masks.size()) : -1;
    o.mask_words = s.allowed ? static_cast<int32_t>(s.allowed->size()) : 0;
    if (s.allowed) masks.insert(masks.end(), s.allowed->begin(), s.allowed->end());
  }
  MetaUpload up(*this);
  cuda::SampleStep st{};
  st.R = static_cast<int64_t>(R);
  st.rows = up.add(rows);
  st.penalty_tokens = up.add(ptok);
  st.penalty_counts = up.add(pcnt);
  st.bias_tokens = up.add(btok);
  st.bias_values = up.add(bval);
  st.allowed = up.add(masks);
  st.input_ids = d_input_ids_;
  st.logprobs = logprobs ? logprobs->data_as<float>() : nullptr;
  const cuda::SampleStep* d_st = up.add(&st, 1);
  up.flush();
  return d_st;
}

void CudaBackend::launch_sample(const Tensor& logits, const cuda::SampleStep* step, int64_t min_rows, Tensor& ids) {
  const int64_t rows = logits.size(0), V = logits.size(-1);
  const size_t mark = scratch_mark();
  Tensor work = scratch({rows, V}, DType::F32);
  cuda::SampleParams sp{};
  sp.logits = logits.data_as<const float>();
  sp.rows = rows;
  sp.V = V;
  sp.min_rows = min_rows;
  sp.work = work.data_as<float>();
  sp.ids = ids.data_as<int32_t>();
  sp.step = step;
  CUDA_OK(cuda::sample(sp, stream_), "sample");
  scratch_release(mark);
}

void CudaBackend::sample(const Tensor& logits, std::span<const RowSampling> params, Tensor& ids, Tensor* logprobs) {
  const int64_t R = check_sample(logits, params, ids, logprobs, step_.num_tokens());
  if (R == 0) return;
  MLA_CHECK(!capturing_, "sample while a graph is being recorded (a graph samples with stage_sample + sample_staged)");
  const cuda::SampleStep* d_st = upload_sample_step(params, logprobs);
  launch_sample(logits.reshape({R, logits.size(-1)}), d_st, R, ids);
}

void CudaBackend::stage_sample(std::span<const RowSampling> params, const Tensor* logprobs) {
  const int64_t R = check_staged_sample(params, logprobs, step_.num_tokens());
  MLA_CHECK(!capturing_, "stage_sample while a graph is being recorded (stage before graph_capture_begin)");
  const cuda::SampleStep* d_st = upload_sample_step(params, logprobs);
  // Into the slot, in stream order: the previous step's launches (issued earlier) have read theirs.
  CUDA_OK(cudaMemcpyAsync(sample_slot_, d_st, sizeof(cuda::SampleStep), cudaMemcpyDeviceToDevice, stream_),
          "staging the sampling rows");
  staged_rows_ = R;
}

void CudaBackend::sample_staged(const Tensor& logits, Tensor& ids) {
  check_sample_staged(logits, ids, staged_rows_);
  if (logits.size(0) == 0) return;
  launch_sample(logits, sample_slot_, capturing_ ? 1 : staged_rows_, ids);
}
}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(device_index, options);
}

}  // namespace mlaserve
