#include "model/deepseek_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_kernels.h"
#include "core/log.h"
#include "core/random.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"

namespace mlaserve {

namespace {
std::string layer_name(int64_t l, const char* rest) { return fmt::format("model.layers.{}.{}", l, rest); }
}  // namespace

LoadOptions::KeepQuantized parse_keep_quantized(const std::string& s, const char* flag) {
  if (s == "auto") return LoadOptions::KeepQuantized::Auto;
  if (s == "on") return LoadOptions::KeepQuantized::On;
  MLA_CHECK(s == "off", "{}: expected auto, on or off, got '{}'", flag, s);
  return LoadOptions::KeepQuantized::Off;
}

// Reads one tensor block [r0, r0 + rows) x [c0, c0 + cols) of a checkpoint tensor (or makes it, for dummy
// weights) into a backend tensor. Shapes are checked against the full shape the config implies.
class DeepseekModel::Loader {
 public:
  enum class Kind { Matrix, Norm, Embedding, Router, Bias, LmHead };

  // held: every persistent tensor of the model, in the order load() takes them; with `reload` they exist already
  // and the new checkpoint is written into them (alloc hands them out in that order, checked).
  // placed: where every block goes is recorded there (null: not recorded, e.g. on a reload into the same tensors).
  Loader(Backend& backend, const Checkpoint* ckpt, const LoadOptions& opts, std::vector<Tensor>& held, bool reload,
         std::unordered_map<std::string, std::vector<Placement>>* placed)
      : be_(backend), ckpt_(ckpt), opts_(opts), held_(held), reload_(reload), placed_(placed) {}

  // A persistent tensor for the weight `what`: allocated (and held), or on a reload the held tensor in its place.
  Tensor alloc(const Shape& shape, DType dtype, const std::string& what) {
    if (!reload_) {
      held_.push_back(be_.alloc(shape, dtype));
      return held_.back();
    }
    MLA_CHECK(next_ < held_.size(), "the new checkpoint has '{}' ({} {}), which the running model does not hold", what,
              dtype_name(dtype), shape_str(shape));
    Tensor t = held_[next_++];
    MLA_CHECK(t.shape() == shape && t.dtype() == dtype,
              "the new checkpoint gives '{}' as {} {} on this rank, but the running model holds {} {} in its place",
              what, dtype_name(dtype), shape_str(shape), dtype_name(t.dtype()), shape_str(t.shape()));
    return t;
  }
  // Every held tensor was written again (a reload).
  void check_all_reloaded() const {
    MLA_CHECK(next_ == held_.size(), "the new checkpoint fills {} of the running model's {} weight tensors", next_,
              held_.size());
  }

  DType matrix_dtype() const { return matrix_dtype_; }
  void set_matrix_dtype(DType d) { matrix_dtype_ = d; }
  const std::set<std::string>& used() const { return used_; }
  int64_t bytes() const { return bytes_; }

  // Allocates a tensor of shape `local` and fills it with the block of `name` starting at (r0, c0).
  Tensor make(const std::string& name, const Shape& full, const Shape& local, int64_t r0, int64_t c0, Kind kind) {
    const bool vec = kind == Kind::Norm || kind == Kind::Bias;
    Tensor t = alloc(local, vec ? DType::F32 : matrix_dtype_, name);
    load_into(t, name, full, r0, c0, kind);
    return t;
  }

  // dst is viewed as [rows, cols] (cols = last dim of `full`'s block).
  void load_into(Tensor& dst, const std::string& name, const Shape& full, int64_t r0, int64_t c0, Kind kind) {
    const int64_t full_cols = full.size() == 1 ? full[0] : full[1];
    const int64_t nc = full.size() == 1 ? full[0] : dst.size(-1);
    const int64_t nr = nc == 0 ? 0 : dst.numel() / nc;
    bytes_ += static_cast<int64_t>(dst.nbytes());
    place(name, full, r0, c0, dst.reshape({nr, nc}));
    if (opts_.dummy) {
      float mean = 0.0f, stddev = 1.0f;
      switch (kind) {
        case Kind::Matrix: stddev = 1.0f / std::sqrt(static_cast<float>(full_cols)); break;
        case Kind::Norm: mean = 1.0f; stddev = 0.05f; break;
        case Kind::Embedding: stddev = 1.0f; break;
        case Kind::Router: stddev = 1.0f / std::sqrt(static_cast<float>(full_cols)); break;
        case Kind::Bias: stddev = 0.01f; break;
        case Kind::LmHead: stddev = 1.0f / std::sqrt(static_cast<float>(full_cols)); break;
      }
      Tensor view = dst.reshape({nr, nc});
      be_.fill_random(view, fnv1a64(name) ^ splitmix64(opts_.seed), mean, stddev, full_cols, r0, c0);
      return;
    }
    if (packed_integer(name)) {
      be_.upload_into(dequantize(int_slice(name.substr(0, name.size() - 7), full, r0, c0, nr, nc)), dst);
      return;
    }
    const TensorInfo& info = ckpt_->get(name);
    used_.insert(name);
    MLA_CHECK(info.shape == full, "{}: tensor '{}' has shape {}, expected {} from config.json", info.file, name,
              shape_str(info.shape), shape_str(full));
    if (info.dtype == DType::I8 && quant_ == QuantMethod::CtInt) {  // int-quantized: the codes as they are
      be_.upload_into(dequantize(int_slice(name.substr(0, name.size() - 7), full, r0, c0, nr, nc)), dst);
      return;
    }
    if (info.dtype == DType::F8_E4M3) {
      be_.upload_into(dequantize_fp8(info, r0, c0, nr, nc), dst);
      return;
    }
    MLA_CHECK(info.dtype == DType::BF16 || info.dtype == DType::F16 || info.dtype == DType::F32,
              "{}: tensor '{}' has dtype {}; only BF16 / F16 / F32 weights are supported, and F8_E4M3 with an FP8 "
              "quantization_config",
              info.file, name, dtype_name(info.dtype));
    const size_t es = dtype_size(info.dtype);
    const auto* base = info.data;
    Tensor host;
    if (nc == full_cols) {  // a run of whole rows: no copy
      host = Tensor::view(const_cast<uint8_t*>(base + static_cast<size_t>(r0 * full_cols) * es), {nr, nc}, info.dtype);
    } else {
      host = Tensor::empty_host({nr, nc}, info.dtype);
      for (int64_t r = 0; r < nr; ++r)
        std::memcpy(static_cast<char*>(host.data()) + static_cast<size_t>(r * nc) * es,
                    base + static_cast<size_t>((r0 + r) * full_cols + c0) * es, static_cast<size_t>(nc) * es);
    }
    be_.upload_into(host, dst);
  }

  // Whether an FP8 block checkpoint's routed experts stay FP8 on this backend (BlockScales on the tensors): the
  // backend takes them, the checkpoint's `gate_name` is F8 (dummy weights: the config's quantization says so), and
  // the rank's slices are whole blocks (`local` rows of gate / up at `offset`, the same columns of down) with columns
  // in 8-element vectors.
  bool keep_fp8_experts(const std::string& gate_name, int64_t local, int64_t offset, int64_t H) const {
    if (!keep_fp8_ || quant_ != QuantMethod::Fp8Block || !be_.takes_fp8_experts()) return false;
    if (!opts_.dummy && (!ckpt_->has(gate_name) || ckpt_->get(gate_name).dtype != DType::F8_E4M3)) return false;
    return local % block_rows_ == 0 && offset % block_rows_ == 0 && local % block_cols_ == 0 &&
           offset % block_cols_ == 0 && block_cols_ % 8 == 0 && H % 8 == 0 && local % 8 == 0;
  }

  // Rows [r0, r0 + codes rows) x columns [c0, c0 + codes cols) of the F8 matrix `name` (whole blocks, or the
  // matrix's last ones) copied as they are into `codes` (F8) and their blocks' scales into `scales` (F32 [rows /
  // block_rows, ceil(cols / block_cols)]).
  // (b: the blocks' size where they are not the checkpoint's, i.e. dummy weights quantized at load)
  void load_fp8_blocks(const std::string& name, const Shape& full, int64_t r0, int64_t c0, Tensor codes,
                       Tensor scales, int64_t b = 0) {
    bytes_ += static_cast<int64_t>(codes.nbytes() + scales.nbytes());
    place(name, full, r0, c0, codes, scales, b ? b : block_rows_, b ? b : block_cols_);
    if (opts_.dummy) {  // random codes (no NaNs), every block scaled to about N(0, 1 / cols) like the bf16 dummies
      Tensor host = Tensor::empty_host(codes.shape(), DType::F8_E4M3);
      const uint64_t seed = fnv1a64(name) ^ splitmix64(opts_.seed) ^ static_cast<uint64_t>(r0 * 131 + c0);
      parallel_for(host.numel(), 1 << 20, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const auto v = static_cast<uint8_t>(splitmix64(seed + static_cast<uint64_t>(i)) & 0xbf);  // |x| <= 1.875
          host.data_as<uint8_t>()[i] = v;
        }
      });
      Tensor hs = Tensor::empty_host(scales.shape(), DType::F32);
      std::fill(hs.data_as<float>(), hs.data_as<float>() + hs.numel(), 1.0f / std::sqrt(static_cast<float>(full[1])));
      be_.upload_into(host, codes);
      be_.upload_into(hs, scales);
      return;
    }
    const TensorInfo& w = ckpt_->get(name);
    used_.insert(name);
    MLA_CHECK(w.shape == full && w.dtype == DType::F8_E4M3, "{}: tensor '{}' is {} {}, expected F8_E4M3 {}", w.file,
              name, dtype_name(w.dtype), shape_str(w.shape), shape_str(full));
    const int64_t C = full[1], nr = codes.size(0), nc = codes.size(1);
    const std::vector<float> all = fp8_scales(w).v;
    const int64_t scols = (C + block_cols_ - 1) / block_cols_, sr = scales.size(0), sc = scales.size(1);
    Tensor host = Tensor::empty_host({nr, nc}, DType::F8_E4M3), hs = Tensor::empty_host({sr, sc}, DType::F32);
    for (int64_t r = 0; r < nr; ++r)
      std::memcpy(host.data_as<uint8_t>() + r * nc, w.data + (r0 + r) * C + c0, static_cast<size_t>(nc));
    const int64_t sr0 = r0 / block_rows_, sc0 = c0 / block_cols_;  // the slice's first block
    for (int64_t r = 0; r < sr; ++r)
      for (int64_t c = 0; c < sc; ++c)
        hs.data_as<float>()[r * sc + c] = all[static_cast<size_t>((sr0 + r) * scols + sc0 + c)];
    be_.upload_into(host, codes);
    be_.upload_into(hs, scales);
  }

  // --quantization fp8 on a checkpoint without quantization: the block size of the routed experts' FP8 form on this
  // rank (the largest power of two from 128 down to 8 dividing its `local` expert rows; 0: not quantized).
  int64_t quantize_block(int64_t local) const {
    if (!opts_.quantize_fp8 || quant_ != QuantMethod::None) return 0;
    for (int64_t b = 128; b >= 8; b /= 2)
      if (local % b == 0) return b;
    return 0;
  }

  // Rows [r0, r0 + nr) x columns [c0, c0 + nc) of the BF16 / F16 / F32 matrix `name` quantized to FP8 in b x b
  // blocks (cpu::quantize_fp8): host codes [nr, nc] and scales [ceil(nr / b), ceil(nc / b)].
  std::pair<Tensor, Tensor> quantize_slice(const std::string& name, const Shape& full, int64_t r0, int64_t c0,
                                           int64_t nr, int64_t nc, int64_t b) {
    const TensorInfo& w = ckpt_->get(name);
    used_.insert(name);
    MLA_CHECK(w.shape == full && (w.dtype == DType::BF16 || w.dtype == DType::F16 || w.dtype == DType::F32),
              "{}: tensor '{}' is {} {}; --quantization fp8 quantizes BF16 / F16 / F32 {} weights", w.file, name,
              dtype_name(w.dtype), shape_str(w.shape), shape_str(full));
    const int64_t C = full[1], es = static_cast<int64_t>(dtype_size(w.dtype));
    Tensor f = Tensor::empty_host({nr, nc}, DType::F32), q = Tensor::empty_host({nr, nc}, DType::F8_E4M3);
    Tensor s = Tensor::empty_host({(nr + b - 1) / b, (nc + b - 1) / b}, DType::F32);
    for (int64_t r = 0; r < nr; ++r)
      cpu::convert(w.data + ((r0 + r) * C + c0) * es, w.dtype, f.data_as<float>() + r * nc, DType::F32, nc);
    cpu::quantize_fp8(f.data_as<float>(), nr, nc, b, b, q.data_as<uint8_t>(), s.data_as<float>());
    return {q, s};
  }

  // quantize_slice of the rows [r0, ...) x columns [c0, ...) that `codes` (F8) holds into it and `scales` (F32);
  // dummy weights: random codes as load_fp8_blocks makes them.
  void quantize_fp8_blocks(const std::string& name, const Shape& full, int64_t r0, int64_t c0, int64_t b, Tensor codes,
                           Tensor scales) {
    if (opts_.dummy) return load_fp8_blocks(name, full, r0, c0, codes, scales, b);
    auto [q, s] = quantize_slice(name, full, r0, c0, codes.size(0), codes.size(1), b);
    bytes_ += static_cast<int64_t>(codes.nbytes() + scales.nbytes());
    place(name, full, r0, c0, codes, scales, b, b);
    be_.upload_into(q, codes);
    be_.upload_into(s, scales);
  }

  // The same block into dst (matrix dtype) as the quantized weights' values (code * scale; a backend keeping no FP8
  // experts runs the same model); dummy weights: load_into's.
  void load_quantized(Tensor dst, const std::string& name, const Shape& full, int64_t r0, int64_t c0, int64_t b) {
    if (opts_.dummy) return load_into(dst, name, full, r0, c0, Kind::Matrix);
    const int64_t nr = dst.size(0), nc = dst.size(1);
    auto [q, s] = quantize_slice(name, full, r0, c0, nr, nc, b);
    Tensor f = Tensor::empty_host({nr, nc}, DType::F32);
    cpu::dequant_fp8(q.data_as<uint8_t>(), s.data_as<float>(), 1, nr, nc, b, b, f.data_as<float>());
    bytes_ += static_cast<int64_t>(dst.nbytes());
    place(name, full, r0, c0, dst);
    be_.upload_into(f, dst);
  }

  int64_t block_rows() const { return block_rows_; }
  int64_t block_cols() const { return block_cols_; }
  void set_keep_fp8(bool keep) { keep_fp8_ = keep; }
  void set_keep_int4(bool keep) { keep_int4_ = keep; }

  void set_quant(const ModelConfig& c) {
    quant_ = c.quant;
    keep_fp8_ = false;
    keep_int4_ = false;
    block_rows_ = c.quant_block_rows;
    block_cols_ = c.quant_block_cols;
    group_ = c.quant_group;
    bits_ = c.quant_bits;
    zero_offset_ = c.quant_zero_offset;
    block_scale_name_ = c.quant_compressed_tensors ? ".weight_scale" : ".weight_scale_inv";
  }

 private:
  // A scale tensor's values as floats (F32, BF16 or F16: cpu::convert).
  static std::vector<float> scales_of(const TensorInfo& s) {
    MLA_CHECK(s.dtype == DType::F32 || s.dtype == DType::BF16 || s.dtype == DType::F16,
              "{}: scale tensor '{}' has dtype {}; expected F32, BF16 or F16", s.file, s.name, dtype_name(s.dtype));
    std::vector<float> v(s.nbytes / dtype_size(s.dtype));
    cpu::convert(s.data, s.dtype, v.data(), DType::F32, static_cast<int64_t>(v.size()));
    return v;
  }

  // The scales of the F8_E4M3 matrix `w` as floats, checked, and the rows x columns each covers: Fp8Block's of each
  // block (`weight_scale_inv`, or compressed-tensors' `weight_scale`; [ceil(R / block_rows), ceil(C / block_cols)]),
  // else `weight_scale` of the tensor (one number: R x C) or of each output channel ([R, 1] or [R]: 1 x C).
  struct Fp8Scales {
    std::vector<float> v;
    int64_t rows = 0, cols = 0;
  };
  Fp8Scales fp8_scales(const TensorInfo& w) {
    const std::string& name = w.name;
    const std::string stem = name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    const int64_t R = w.shape[0], C = w.shape[1];
    const bool block = quant_ == QuantMethod::Fp8Block;
    const std::string sname = stem + (block ? block_scale_name_ : std::string(".weight_scale"));
    MLA_CHECK(ckpt_->has(sname), "{}: FP8 tensor '{}' has no '{}' ({})", w.file, name, sname,
              block ? "block scales" : "its scale");
    const TensorInfo& s = ckpt_->get(sname);
    used_.insert(sname);
    if (ckpt_->has(stem + ".input_scale")) used_.insert(stem + ".input_scale");  // activations stay bf16
    Fp8Scales out{scales_of(s), R, C};
    if (block) {
      out.rows = block_rows_;
      out.cols = block_cols_;
      const Shape want{(R + out.rows - 1) / out.rows, (C + out.cols - 1) / out.cols};
      MLA_CHECK(s.shape == want, "{}: '{}' has shape {}, expected {} for '{}' {} in {}x{} blocks", s.file, sname,
                shape_str(s.shape), shape_str(want), name, shape_str(w.shape), out.rows, out.cols);
    } else if (out.v.size() != 1) {
      MLA_CHECK(static_cast<int64_t>(out.v.size()) == R && (s.shape == Shape{R, 1} || s.shape == Shape{R}),
                "{}: '{}' has shape {}; '{}' {} takes one scale, or one per output channel ([{}, 1])", s.file, sname,
                shape_str(s.shape), name, shape_str(w.shape), R);
      out.rows = 1;
    }
    return out;
  }

  // Rows [r0, r0 + nr) x columns [c0, c0 + nc) of the F8_E4M3 matrix `w`, times the scale of the element's block,
  // channel or tensor (fp8_scales), as an F32 host tensor.
  Tensor dequantize_fp8(const TensorInfo& w, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    const std::string& name = w.name;
    MLA_CHECK(quant_ == QuantMethod::Fp8Block || quant_ == QuantMethod::Fp8Tensor,
              "{}: tensor '{}' is F8_E4M3 but config.json has no FP8 quantization_config", w.file, name);
    MLA_CHECK(w.shape.size() == 2, "{}: F8_E4M3 tensor '{}' has shape {}; only matrices can be FP8", w.file, name,
              shape_str(w.shape));
    const int64_t C = w.shape[1];
    const Fp8Scales fs = fp8_scales(w);
    const std::vector<float>& scales = fs.v;
    const int64_t br = fs.rows, bc = fs.cols;
    const Shape want{(w.shape[0] + br - 1) / br, (C + bc - 1) / bc};
    Tensor out = Tensor::empty_host({nr, nc}, DType::F32);
    float* o = out.data_as<float>();
    parallel_for(nr, 16, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const int64_t gr = r0 + r;
        float* row = o + r * nc;
        cpu::convert(w.data + gr * C + c0, DType::F8_E4M3, row, DType::F32, nc);
        for (int64_t c = c0; c < c0 + nc;) {  // a block's columns at a time
          const int64_t end = std::min(c0 + nc, (c / bc + 1) * bc);
          const float scale = scales[static_cast<size_t>(gr / br * want[1] + c / bc)];
          for (; c < end; ++c) row[c - c0] *= scale;
        }
      }
    });
    return out;
  }

  // A packed integer linear's parts (AWQ, GPTQ): `stem`.qweight and .qzeros (int32 words) and .scales (as floats),
  // checked against the shapes its layout gives (`layout` describes it in errors), and marked used.
  struct Packed {
    const uint32_t* q;
    const uint32_t* z;
    std::vector<float> scales;
  };
  Packed packed_parts(const std::string& stem, const char* method, const Shape& q_shape, const Shape& z_shape,
                      const Shape& s_shape, const std::string& layout) {
    const std::string qn = stem + ".qweight", zn = stem + ".qzeros", sn = stem + ".scales";
    const TensorInfo& qw = ckpt_->get(qn);
    MLA_CHECK(ckpt_->has(zn) && ckpt_->has(sn), "{}: {} tensor '{}' needs '{}' and '{}'", qw.file, method, qn, zn,
              sn);
    const TensorInfo& qz = ckpt_->get(zn);
    const TensorInfo& sc = ckpt_->get(sn);
    for (const auto& [t, want, dt] : {std::tuple{&qw, q_shape, true}, std::tuple{&qz, z_shape, true},
                                      std::tuple{&sc, s_shape, false}}) {
      MLA_CHECK(t->shape == want, "{}: tensor '{}' has shape {}, expected {} for {}", t->file, t->name,
                shape_str(t->shape), shape_str(want), layout);
      MLA_CHECK(!dt || t->dtype == DType::I32, "{}: tensor '{}' has dtype {}, expected I32", t->file, t->name,
                dtype_name(t->dtype));
    }
    used_.insert(qn);
    used_.insert(zn);
    used_.insert(sn);
    return {reinterpret_cast<const uint32_t*>(qw.data), reinterpret_cast<const uint32_t*>(qz.data), scales_of(sc)};
  }

  // Whether the weight `name` (...weight) is a packed integer linear's parts in the checkpoint (AWQ / GPTQ `qweight`,
  // compressed-tensors `weight_packed`).
  bool packed_integer(const std::string& name) const {
    if (!name.ends_with(".weight") || ckpt_->has(name)) return false;
    const std::string stem = name.substr(0, name.size() - 7);
    if (quant_ == QuantMethod::Awq || quant_ == QuantMethod::Gptq) return ckpt_->has(stem + ".qweight");
    return quant_ == QuantMethod::CtInt && ckpt_->has(stem + ".weight_packed");
  }

  // A slice of a packed integer linear: rows (output channels) [r0, r0 + nr) x columns (input channels) [c0, c0 + nc)
  // as integer codes, each element's value (q - z) * s with z and s those of its row and its column's group.
  struct IntSlice {
    IntSlice(int64_t rows, int64_t cols, int64_t groups, int32_t shift = 0)
        : nr(rows), nc(cols), G(groups), code_shift(shift), q(static_cast<size_t>(rows * cols)),
          group(static_cast<size_t>(cols)) {}
    int64_t nr = 0, nc = 0, G = 0;
    int32_t code_shift = 0;      // q + code_shift is the unsigned code of `bits` bits (z + code_shift its zero)
    std::vector<int32_t> q;      // [nr, nc]
    std::vector<int32_t> group;  // [nc]: each column's group in [0, G)
    std::vector<int32_t> z;      // [nr, G]
    std::vector<float> s;        // [nr, G]
  };

  // The slice's values as an F32 host tensor [nr, nc]: float(q - z) * s.
  static Tensor dequantize(const IntSlice& t) {
    Tensor out = Tensor::empty_host({t.nr, t.nc}, DType::F32);
    float* o = out.data_as<float>();
    parallel_for(t.nr, 8, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r)
        for (int64_t c = 0; c < t.nc; ++c) {
          const size_t g = static_cast<size_t>(r * t.G + t.group[static_cast<size_t>(c)]);
          o[r * t.nc + c] = static_cast<float>(t.q[static_cast<size_t>(r * t.nc + c)] - t.z[g]) * t.s[g];
        }
    });
    return out;
  }

 public:
  // Whether a 4-bit checkpoint's (AWQ, GPTQ, compressed-tensors pack-quantized) routed experts stay INT4 on this
  // backend, and the columns per group of their gate / up rows and of their down rows (`group_cols`, 0 if not):
  // the backend takes them, keeping was asked for, and the slices of expert 0 (`local` rows of gate at `offset`, the
  // same columns of down) have groups of whole runs of columns (no act order across them) of a multiple of 8 columns
  // or one group per row, with columns in 8-element vectors.
  bool keep_int4_experts(const std::string& prefix, int64_t full_inter, int64_t local, int64_t offset, int64_t H,
                         std::pair<int64_t, int64_t>& group_cols) {
    const bool format = quant_ == QuantMethod::Awq || quant_ == QuantMethod::Gptq || quant_ == QuantMethod::CtInt;
    if (!keep_int4_ || !format || bits_ != 4 || !be_.takes_int4_experts() || H % 8 || local % 8) return false;
    if (opts_.dummy) {  // the config's groups
      const int64_t g = group_ > 0 ? group_ : 0;
      group_cols = {g > 0 && g < H ? g : H, g > 0 && g < local ? g : local};
      if (g > 0 && (g % 8 || offset % g)) return false;
      return true;
    }
    const std::string gate = prefix + "gate_proj.weight", down = prefix + "down_proj.weight";
    if (!packed_integer(gate) || !packed_integer(down)) return false;
    group_cols = {slice_group_cols(int_slice(gate.substr(0, gate.size() - 7), {full_inter, H}, offset, 0, 8, H)),
                  slice_group_cols(int_slice(down.substr(0, down.size() - 7), {H, full_inter}, 0, offset, 8, local))};
    return group_cols.first > 0 && group_cols.second > 0;
  }

  // Whether the parts [part0, part0 + parts) of `width` intermediate rows each of the 4-bit MLP `prefix` (gate / up
  // [full_inter, H], down [H, full_inter]) load INT4 as a routed expert kept in groups of `group_cols` (gate / up
  // rows', down rows') columns does (load_int4 takes them): a rank's shared experts fused into its routed ones.
  bool int4_parts_fit(const std::string& prefix, int64_t full_inter, int64_t width, int64_t H, int64_t part0,
                      int64_t parts, std::pair<int64_t, int64_t> group_cols) {
    if (opts_.dummy) {  // the config's groups, as keep_int4_experts
      for (int64_t p = part0; p < part0 + parts; ++p)
        if (group_ > 0 && (p * width) % group_) return false;
      return true;
    }
    auto fits = [](const IntSlice& t, int64_t g) {
      const int64_t s = slice_group_cols(t);
      return s > 0 && (s == g || (t.nc <= g && s == t.nc));
    };
    for (const char* m : {"gate_proj", "up_proj", "down_proj"})
      if (!packed_integer(prefix + m + ".weight")) return false;
    for (int64_t p = part0; p < part0 + parts; ++p) {
      for (const char* m : {"gate_proj", "up_proj"})
        if (!fits(int_slice(prefix + m, {full_inter, H}, p * width, 0, 8, H), group_cols.first)) return false;
      if (!fits(int_slice(prefix + "down_proj", {H, full_inter}, 0, p * width, 8, width), group_cols.second))
        return false;
    }
    return true;
  }

  // The columns per group of a slice whose groups are consecutive runs of one length (the last may be shorter), a
  // multiple of 8 or the whole row; 0 otherwise.
  static int64_t slice_group_cols(const IntSlice& t) {
    int64_t g = 1;
    while (g < t.nc && t.group[static_cast<size_t>(g)] == t.group[0]) ++g;
    if (g < t.nc && g % 8) return 0;
    for (int64_t c = 0; c < t.nc; ++c)
      if (t.group[static_cast<size_t>(c)] != t.group[0] + c / g) return 0;
    return g;
  }

  // Rows [r0, r0 + codes rows) x columns [c0, c0 + 2 x codes cols) of the 4-bit linear `name` kept INT4: their codes
  // in pairs into `codes` (U8), each row's groups of `group_cols` columns' scales and zero points into `scale` and
  // `zero` (F32 [rows, ceil(cols / group_cols)]); dummy weights: random codes about zero point 8, scaled to about
  // N(0, 1 / cols) like the bf16 dummies.
  void load_int4(const std::string& name, const Shape& full, int64_t r0, int64_t c0, int64_t group_cols, Tensor codes,
                 Tensor scale, Tensor zero) {
    const int64_t nr = codes.size(0), nc = 2 * codes.size(1), ng = scale.size(1);
    bytes_ += static_cast<int64_t>(codes.nbytes() + scale.nbytes() + zero.nbytes());
    place(name, full, r0, c0, codes, scale, 1, group_cols, zero);
    Tensor hc = Tensor::empty_host(codes.shape(), DType::U8), hs = Tensor::empty_host(scale.shape(), DType::F32);
    Tensor hz = Tensor::empty_host(zero.shape(), DType::F32);
    uint8_t* q = hc.data_as<uint8_t>();
    float *sv = hs.data_as<float>(), *zv = hz.data_as<float>();
    if (opts_.dummy) {
      const uint64_t seed = fnv1a64(name) ^ splitmix64(opts_.seed) ^ static_cast<uint64_t>(r0 * 131 + c0);
      for (int64_t i = 0; i < hc.numel(); ++i) q[i] = static_cast<uint8_t>(splitmix64(seed + static_cast<uint64_t>(i)));
      std::fill(zv, zv + hz.numel(), 8.0f);
      std::fill(sv, sv + hs.numel(), 1.0f / (4.6f * std::sqrt(static_cast<float>(full[1]))));  // codes' std ~4.6
    } else {
      const IntSlice t = int_slice(name.substr(0, name.size() - 7), full, r0, c0, nr, nc);
      MLA_CHECK(slice_group_cols(t) == group_cols || (nc <= group_cols && slice_group_cols(t) == nc),
                "'{}': its rows [{}, {}) x columns [{}, {}) are not in groups of {} columns as expert 0's are; load "
                "the experts dequantized (--int4-experts off)", name, r0, r0 + nr, c0, c0 + nc, group_cols);
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t c = 0; c < nc; c += 2) {
          const int32_t a = t.q[static_cast<size_t>(r * nc + c)] + t.code_shift;
          const int32_t b = t.q[static_cast<size_t>(r * nc + c + 1)] + t.code_shift;
          MLA_CHECK(a >= 0 && a < 16 && b >= 0 && b < 16, "'{}': code {} is not 4-bit", name, a < 0 || a > 15 ? a : b);
          q[r * (nc / 2) + c / 2] = static_cast<uint8_t>(a | (b << 4));
        }
        for (int64_t j = 0; j < ng; ++j) {
          const size_t g = static_cast<size_t>(r * t.G + t.group[static_cast<size_t>(j * group_cols)]);
          sv[r * ng + j] = t.s[g];
          zv[r * ng + j] = static_cast<float>(t.z[g] + t.code_shift);
        }
      }
    }
    be_.upload_into(hc, codes);
    be_.upload_into(hs, scale);
    be_.upload_into(hz, zero);
  }

 private:
  // The packed integer linear `stem` (AWQ, GPTQ or compressed-tensors; full: [out, in]) sliced.
  IntSlice int_slice(const std::string& stem, const Shape& full, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    if (quant_ == QuantMethod::Awq) return awq_slice(stem, full, r0, c0, nr, nc);
    if (quant_ == QuantMethod::Gptq) return gptq_slice(stem, full, r0, c0, nr, nc);
    return ct_int_slice(stem, full, r0, c0, nr, nc);
  }

  // The slice's per-row z and s of groups [0, G): z_of(oc, g), s_of(oc, g) for output channel oc = r0 + r.
  template <class Z, class S>
  static void fill_groups(IntSlice& t, int64_t r0, Z z_of, S s_of) {
    t.z.resize(static_cast<size_t>(t.nr * t.G));
    t.s.resize(t.z.size());
    for (int64_t r = 0; r < t.nr; ++r)
      for (int64_t g = 0; g < t.G; ++g) {
        t.z[static_cast<size_t>(r * t.G + g)] = z_of(r0 + r, g);
        t.s[static_cast<size_t>(r * t.G + g)] = s_of(r0 + r, g);
      }
  }

  // AWQ: w[o][i] = (q[i][o] - z[i / g][o]) * s[i / g][o], where `qweight` [in, out / 8] and `qzeros` [in / g, out /
  // 8] (int32) hold 8 four-bit values each, output channel 8 k + j in the nibble at bits 4 kAwqNibble[j] (AutoAWQ's
  // packing order), and `scales` [in / g, out] (F16, BF16 or F32).
  IntSlice awq_slice(const std::string& stem, const Shape& full, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    static constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    const TensorInfo& qw = ckpt_->get(stem + ".qweight");
    MLA_CHECK(full.size() == 2 && full[0] % 8 == 0 && full[1] % group_ == 0,
              "{}: AWQ tensor '{}' for a {} weight: the output channels must be a multiple of 8 and the input "
              "channels of the group size {}",
              qw.file, qw.name, shape_str(full), group_);
    const int64_t O = full[0], I = full[1], G = I / group_;
    const Packed pk = packed_parts(stem, "AWQ", {I, O / 8}, {G, O / 8}, {G, O},
                                   fmt::format("a [{}, {}] weight in groups of {}", O, I, group_));
    const uint32_t *q = pk.q, *z = pk.z;
    IntSlice t(nr, nc, G);
    for (int64_t c = 0; c < nc; ++c) t.group[static_cast<size_t>(c)] = static_cast<int32_t>((c0 + c) / group_);
    parallel_for(nr, 8, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const int64_t oc = r0 + r, shift = 4 * kAwqNibble[oc % 8];
        for (int64_t c = 0; c < nc; ++c)
          t.q[static_cast<size_t>(r * nc + c)] = static_cast<int32_t>((q[(c0 + c) * (O / 8) + oc / 8] >> shift) & 15);
      }
    });
    fill_groups(
        t, r0,
        [&](int64_t oc, int64_t g) {
          return static_cast<int32_t>((z[g * (O / 8) + oc / 8] >> (4 * kAwqNibble[oc % 8])) & 15);
        },
        [&](int64_t oc, int64_t g) { return pk.scales[static_cast<size_t>(g * O + oc)]; });
    return t;
  }

  // Each of the I input channels' group among G: the act-order tensor `gn` (I32 [I]) when the checkpoint has it
  // (checked, marked used), else consecutive runs of `group_size`.
  std::vector<int32_t> input_groups(const std::string& gn, int64_t I, int64_t group_size, int64_t G) {
    std::vector<int32_t> g_idx(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) g_idx[static_cast<size_t>(i)] = static_cast<int32_t>(i / group_size);
    if (!ckpt_->has(gn)) return g_idx;
    const TensorInfo& gi = ckpt_->get(gn);
    MLA_CHECK(gi.shape == Shape{I} && gi.dtype == DType::I32, "{}: tensor '{}' is {} {}, expected I32 [{}]", gi.file,
              gn, dtype_name(gi.dtype), shape_str(gi.shape), I);
    std::memcpy(g_idx.data(), gi.data, static_cast<size_t>(I) * sizeof(int32_t));
    for (int64_t i = 0; i < I; ++i)
      MLA_CHECK(g_idx[static_cast<size_t>(i)] >= 0 && g_idx[static_cast<size_t>(i)] < G,
                "{}: '{}' gives input channel {} the group {}, outside [0, {})", gi.file, gn, i,
                g_idx[static_cast<size_t>(i)], G);
    used_.insert(gn);
    return g_idx;
  }

  // GPTQ: w[o][i] = (q[i][o] - z[g][o] - zero_offset) * s[g][o], g = g_idx[i] (act order) or i / group; `qweight`
  // [in / p, out] and `qzeros` [groups, out / p] (int32) hold p = 32 / bits values each, value k at bits k * bits
  // (qweight along the input channels, qzeros along the output ones), `scales` [groups, out] (F16, BF16 or F32),
  // `g_idx` [in] (int32, optional).
  IntSlice gptq_slice(const std::string& stem, const Shape& full, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    const std::string gn = stem + ".g_idx";
    const TensorInfo& qw = ckpt_->get(stem + ".qweight");
    const int64_t p = 32 / bits_;
    MLA_CHECK(full.size() == 2 && full[0] % p == 0 && full[1] % p == 0,
              "{}: GPTQ tensor '{}' for a {} weight: the channels must be multiples of {}", qw.file, qw.name,
              shape_str(full), p);
    const int64_t O = full[0], I = full[1], G = group_ > 0 ? (I + group_ - 1) / group_ : 1;
    const Packed pk = packed_parts(stem, "GPTQ", {I / p, O}, {G, O / p}, {G, O},
                                   fmt::format("a [{}, {}] weight of {} bits in {}", O, I, bits_,
                                               group_ > 0 ? fmt::format("groups of {}", group_) : "one group"));
    const std::vector<int32_t> g_idx = input_groups(gn, I, group_ > 0 ? group_ : I, G);
    const uint32_t *q = pk.q, *z = pk.z;
    const uint32_t mask = (1u << bits_) - 1u;
    IntSlice t(nr, nc, G);
    t.group.assign(g_idx.begin() + c0, g_idx.begin() + c0 + nc);
    parallel_for(nr, 8, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r)
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t i = c0 + c;
          t.q[static_cast<size_t>(r * nc + c)] =
              static_cast<int32_t>((q[(i / p) * O + r0 + r] >> (bits_ * (i % p))) & mask);
        }
    });
    fill_groups(
        t, r0,
        [&](int64_t oc, int64_t g) {
          return static_cast<int32_t>((z[g * (O / p) + oc / p] >> (bits_ * (oc % p))) & mask) +
                 static_cast<int32_t>(zero_offset_);
        },
        [&](int64_t oc, int64_t g) { return pk.scales[static_cast<size_t>(g * O + oc)]; });
    return t;
  }

  // compressed-tensors integers: w[o][i] = (q[o][i] - z[o][g]) * s[o][g]. pack-quantized:
  // `weight_packed` [out, ceil(in / p)] (int32 words of p = 32 / bits values along the input channels, value k at
  // bits k * bits, stored plus 2^(bits - 1)); int-quantized: `weight` (I8 [out, in]). `weight_scale` [out, groups]
  // (or [out], one per channel, or one number: the tensor), groups of ceil(in / groups) input channels unless
  // `weight_g_idx` (I32 [in]) assigns them; `weight_zero_point` (asymmetric; absent: 0) [ceil(out / p), groups]
  // packed along the output channels like the weights, or I8 [out, groups]. `weight_shape` ([out, in]) is checked.
  IntSlice ct_int_slice(const std::string& stem, const Shape& full, int64_t r0, int64_t c0, int64_t nr,
                        int64_t nc) {
    const std::string pn = stem + ".weight_packed", wn = stem + ".weight", sn = stem + ".weight_scale",
                      zn = stem + ".weight_zero_point", gn = stem + ".weight_g_idx", shn = stem + ".weight_shape";
    const bool packed = ckpt_->has(pn);
    const TensorInfo& w = ckpt_->get(packed ? pn : wn);
    MLA_CHECK(full.size() == 2, "{}: integer tensor '{}' for a {} weight: only matrices can be quantized", w.file,
              w.name, shape_str(full));
    const int64_t O = full[0], I = full[1], p = packed ? 32 / bits_ : 1;
    const uint32_t mask = (1u << bits_) - 1u, offset = 1u << (bits_ - 1);
    if (packed) {
      const Shape want{O, (I + p - 1) / p};
      MLA_CHECK(w.dtype == DType::I32 && w.shape == want, "{}: tensor '{}' is {} {}, expected I32 {} for a {} weight "
                "of {} bits", w.file, pn, dtype_name(w.dtype), shape_str(w.shape), shape_str(want), shape_str(full),
                bits_);
    } else {
      MLA_CHECK(w.dtype == DType::I8, "{}: tensor '{}' is {}, expected I8", w.file, wn, dtype_name(w.dtype));
    }
    used_.insert(w.name);
    if (ckpt_->has(shn)) {
      const TensorInfo& sh = ckpt_->get(shn);
      std::vector<int64_t> v;
      for (int64_t k = 0; k < static_cast<int64_t>(sh.nbytes / std::max<size_t>(dtype_size(sh.dtype), 1)); ++k)
        v.push_back(sh.dtype == DType::I64   ? reinterpret_cast<const int64_t*>(sh.data)[k]
                    : sh.dtype == DType::I32 ? reinterpret_cast<const int32_t*>(sh.data)[k]
                                             : -1);
      MLA_CHECK(v == std::vector<int64_t>(full.begin(), full.end()), "{}: '{}' says {}, expected {} from config.json",
                sh.file, shn, fmt::format("[{}]", fmt::join(v, ", ")), shape_str(full));
      used_.insert(shn);
    }
    MLA_CHECK(ckpt_->has(sn), "{}: integer tensor '{}' has no '{}'", w.file, w.name, sn);
    const TensorInfo& sc = ckpt_->get(sn);
    const std::vector<float> scales = scales_of(sc);
    const int64_t G = scales.size() == 1 ? 1 : sc.shape.size() == 2 ? sc.shape[1] : 1;
    MLA_CHECK(scales.size() == 1 || (sc.shape.size() == 2 && sc.shape[0] == O && G >= 1 && G <= I) ||
                  sc.shape == Shape{O},
              "{}: '{}' has shape {}; expected [{}, groups], [{}] or one number for '{}' {}", sc.file, sn,
              shape_str(sc.shape), O, O, w.name, shape_str(full));
    used_.insert(sn);
    const bool per_tensor = scales.size() == 1;
    const std::vector<int32_t> g_idx = input_groups(gn, I, (I + G - 1) / G, G);
    // Zero points as signed values per [output channel, group] (0 without them).
    std::vector<int32_t> zeros;
    if (ckpt_->has(zn)) {
      const TensorInfo& zt = ckpt_->get(zn);
      zeros.assign(static_cast<size_t>(O * G), 0);
      if (packed) {
        const Shape want{(O + p - 1) / p, G};
        MLA_CHECK(zt.dtype == DType::I32 && zt.shape == want, "{}: tensor '{}' is {} {}, expected I32 {}", zt.file,
                  zn, dtype_name(zt.dtype), shape_str(zt.shape), shape_str(want));
        const auto* zw = reinterpret_cast<const uint32_t*>(zt.data);
        for (int64_t o = 0; o < O; ++o)
          for (int64_t g = 0; g < G; ++g)
            zeros[static_cast<size_t>(o * G + g)] =
                static_cast<int32_t>((zw[(o / p) * G + g] >> (bits_ * (o % p))) & mask) - static_cast<int32_t>(offset);
      } else {
        MLA_CHECK(zt.dtype == DType::I8 && zt.shape == (Shape{O, G}), "{}: tensor '{}' is {} {}, expected I8 [{}, {}]",
                  zt.file, zn, dtype_name(zt.dtype), shape_str(zt.shape), O, G);
        for (int64_t k = 0; k < O * G; ++k) zeros[static_cast<size_t>(k)] = reinterpret_cast<const int8_t*>(zt.data)[k];
      }
      used_.insert(zn);
    }
    const auto* words = reinterpret_cast<const uint32_t*>(w.data);
    const auto* bytes = reinterpret_cast<const int8_t*>(w.data);
    const int64_t wpr = (I + p - 1) / p;  // words per row
    IntSlice t(nr, nc, G, packed ? static_cast<int32_t>(offset) : 0);
    t.group.assign(g_idx.begin() + c0, g_idx.begin() + c0 + nc);
    parallel_for(nr, 8, [&](int64_t rb, int64_t re) {
      for (int64_t r = rb; r < re; ++r) {
        const int64_t oc = r0 + r;
        for (int64_t c = 0; c < nc; ++c) {
          const int64_t i = c0 + c;
          t.q[static_cast<size_t>(r * nc + c)] =
              packed ? static_cast<int32_t>((words[oc * wpr + i / p] >> (bits_ * (i % p))) & mask) -
                           static_cast<int32_t>(offset)
                     : bytes[oc * I + i];
        }
      }
    });
    fill_groups(
        t, r0, [&](int64_t oc, int64_t g) { return zeros.empty() ? 0 : zeros[static_cast<size_t>(oc * G + g)]; },
        [&](int64_t oc, int64_t g) { return per_tensor ? scales[0] : scales[static_cast<size_t>(oc * G + g)]; });
    return t;
  }

  Backend& be_;
  const Checkpoint* ckpt_;
  LoadOptions opts_;
  DType matrix_dtype_ = DType::BF16;
  QuantMethod quant_ = QuantMethod::None;
  int64_t block_rows_ = 0, block_cols_ = 0, group_ = 0, bits_ = 4, zero_offset_ = 1;
  std::string block_scale_name_ = ".weight_scale_inv";  // Fp8Block's scales (compressed-tensors: .weight_scale)
  bool keep_fp8_ = false;  // routed experts of an FP8 block checkpoint stay FP8 (where keep_fp8_experts allows)
  bool keep_int4_ = false;  // routed experts of a 4-bit checkpoint stay INT4 (where keep_int4_experts allows)
  std::set<std::string> used_;
  int64_t bytes_ = 0;
  std::vector<Tensor>& held_;
  bool reload_ = false;
  size_t next_ = 0;  // reload: the held tensor alloc hands out next
  std::unordered_map<std::string, std::vector<Placement>>* placed_ = nullptr;

  void place(const std::string& name, const Shape& full, int64_t r0, int64_t c0, Tensor dst, Tensor scales = {},
             int64_t br = 0, int64_t bc = 0, Tensor zeros = {}) {
    if (placed_)
      (*placed_)[name].push_back(
          Placement{full, r0, c0, std::move(dst), std::move(scales), br, bc, std::move(zeros)});
  }
};

DeepseekModel::DeepseekModel(ModelConfig config, Backend& backend, ParallelPlan plan, Communicator* world_comm,
                             Communicator* attn_comm)
    : config_(std::move(config)), backend_(backend), plan_(plan), world_comm_(world_comm), attn_comm_(attn_comm) {
  const auto& c = config_;
  auto divisible = [](int64_t n, int64_t d, const char* what, const char* group) {
    MLA_CHECK(n % d == 0, "{} ({}) is not divisible by the {} size {}", what, n, group, d);
    return n / d;
  };
  MLA_CHECK(plan_.tp_size >= 1 && plan_.attn_tp_size >= 1 && plan_.tp_rank < plan_.tp_size &&
                plan_.attn_tp_rank < plan_.attn_tp_size,
            "invalid parallel plan");
  local_heads_ = divisible(c.num_attention_heads, plan_.attn_tp_size, "num_attention_heads", "attention tensor-parallel");
  local_inter_ = divisible(c.intermediate_size, plan_.tp_size, "intermediate_size", "tensor-parallel");
  const int64_t moe_slice =
      c.n_routed_experts ? divisible(c.moe_intermediate_size, plan_.tp_size, "moe_intermediate_size", "tensor-parallel")
                         : 0;
  local_shared_inter_ = moe_slice * c.n_shared_experts;  // shared experts: split by width in either case
  if (plan_.expert_parallel && c.n_routed_experts > 0) {
    local_experts_ = divisible(c.n_routed_experts, plan_.tp_size, "n_routed_experts", "expert-parallel");
    expert_begin_ = plan_.tp_rank * local_experts_;
    local_moe_inter_ = c.moe_intermediate_size;
  } else {
    local_experts_ = c.n_routed_experts;
    local_moe_inter_ = moe_slice;
  }
  local_vocab_ = divisible(c.vocab_size, plan_.attn_tp_size, "vocab_size", "attention tensor-parallel");
  MLA_CHECK(plan_.dp_size >= 1 && plan_.tp_size % plan_.dp_size == 0 && plan_.attn_tp_size * plan_.dp_size == plan_.tp_size,
            "inconsistent parallel plan: tp {} dp {} attention tp {}", plan_.tp_size, plan_.dp_size, plan_.attn_tp_size);
  MLA_CHECK(plan_.tp_size == 1 || world_comm_ != nullptr, "tensor parallel size {} needs a communicator", plan_.tp_size);
  MLA_CHECK(plan_.attn_tp_size == 1 || attn_comm_ != nullptr, "attention TP size {} needs a communicator",
            plan_.attn_tp_size);
  backend_.set_rope(c.rope_inv_freq(), static_cast<float>(c.rope_attention_factor()));
}

DeepseekModel::~DeepseekModel() = default;

void DeepseekModel::load(const std::string& model_dir, const LoadOptions& opts) {
  MLA_CHECK(held_.empty(), "the model's weights are loaded already (DeepseekModel::reload replaces them)");
  {  // FP8 experts kept? (Auto: when their bf16 form would take more than half of the free weight memory.) INT4
     // ones: wherever they can be (Auto as On: read as codes they are faster than bf16 at every decode size)
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) moe_layers += config_.is_moe_layer(l);
    const int64_t bf16_bytes = moe_layers * local_experts_ * 3 * local_moe_inter_ * config_.hidden_size * 2;
    const int64_t free = backend_.persistent_bytes_free();
    using K = LoadOptions::KeepQuantized;
    const bool large = free >= 0 && bf16_bytes > free / 2;
    keep_fp8_ = opts.fp8_experts == K::On || (opts.fp8_experts == K::Auto && large);
    keep_int4_ = opts.int4_experts != K::Off;
  }
  load_opts_ = opts;
  load_weights(model_dir, config_, opts, false);
  weights_dir_ = model_dir;
  weights_dummy_ = opts.dummy;
}

void DeepseekModel::reload(const std::string& model_dir) {
  MLA_CHECK(!held_.empty(), "DeepseekModel::reload: no weights loaded yet");
  nlohmann::json overrides = nlohmann::json::object();
  if (!load_opts_.config_overrides.empty()) overrides = nlohmann::json::parse(load_opts_.config_overrides);
  ModelConfig next = ModelConfig::from_file(model_dir, overrides);
  const std::string diff = config_.forward_difference(next);
  MLA_CHECK(diff.empty(), "{}/config.json describes another model than the one running ({})", model_dir, diff);
  next.mtp_layers = config_.mtp_layers;
  LoadOptions opts = load_opts_;
  opts.dummy = false;
  load_weights(model_dir, next, opts, true);
  weights_dir_ = model_dir;
  weights_dummy_ = false;
}

void DeepseekModel::refill() {
  MLA_CHECK(!held_.empty(), "DeepseekModel::refill: no weights loaded yet");
  if (!weights_dummy_) return reload(weights_dir_);
  LoadOptions opts = load_opts_;
  opts.dummy = true;
  load_weights(weights_dir_, config_, opts, true);
}

void DeepseekModel::load_weights(const std::string& model_dir, const ModelConfig& from, const LoadOptions& opts,
                                 bool reload) {
  using Kind = Loader::Kind;
  const auto t_start = std::chrono::steady_clock::now();
  std::unique_ptr<Checkpoint> ckpt;
  if (!opts.dummy) ckpt = std::make_unique<Checkpoint>(model_dir);
  if (!reload) placements_.clear();
  Loader ld(backend_, ckpt.get(), opts, held_, reload, reload ? nullptr : &placements_);
  // How the weights are stored is the checkpoint's own (a reload may bring another quantization); what they are
  // is config_'s.
  ld.set_quant(from);
  ld.set_keep_fp8(keep_fp8_);
  ld.set_keep_int4(keep_int4_);
  if (ckpt) {
    const TensorInfo& e = ckpt->get("model.embed_tokens.weight");
    ld.set_matrix_dtype(backend_.weight_dtype(e.dtype));
  } else {
    ld.set_matrix_dtype(backend_.weight_dtype(DType::BF16));
  }
  const auto& c = config_;
  const int64_t H = c.hidden_size, nh = c.num_attention_heads, lh = local_heads_;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim, qk = nope + rope;
  const int64_t kvr = c.kv_lora_rank, h0 = plan_.attn_tp_rank * lh;
  const int64_t tr = plan_.tp_rank;
  const int64_t v0 = plan_.attn_tp_rank * local_vocab_;

  embed_ = ld.make("model.embed_tokens.weight", {c.vocab_size, H}, {local_vocab_, H}, v0, 0, Kind::Embedding);
  final_norm_ = ld.make("model.norm.weight", {H}, {H}, 0, 0, Kind::Norm);
  if (c.tie_word_embeddings && (!ckpt || !ckpt->has("lm_head.weight"))) {
    lm_head_ = embed_;
  } else {
    lm_head_ = ld.make("lm_head.weight", {c.vocab_size, H}, {local_vocab_, H}, v0, 0, Kind::LmHead);
  }

  // Loads gate rows then up rows of an MLP into one [2 * local, H] block (dst may be an expert's slice): slice `part`
  // of the intermediate dimension (this rank's; 0 for a whole expert under expert parallelism).
  auto load_gate_up = [&](Tensor dst, const std::string& prefix, int64_t full_inter, int64_t local, int64_t part) {
    Tensor g = dst.rows(0, local), u = dst.rows(local, 2 * local);
    ld.load_into(g, prefix + "gate_proj.weight", {full_inter, H}, part * local, 0, Kind::Matrix);
    ld.load_into(u, prefix + "up_proj.weight", {full_inter, H}, part * local, 0, Kind::Matrix);
  };
  auto load_down = [&](Tensor dst, const std::string& prefix, int64_t full_inter, int64_t local, int64_t part) {
    ld.load_into(dst, prefix + "down_proj.weight", {H, full_inter}, 0, part * local, Kind::Matrix);
  };
  const int64_t er = plan_.expert_parallel ? 0 : tr;  // the routed experts' slice

  MLA_CHECK(c.mtp_layers >= 0 && c.mtp_layers <= std::min<int64_t>(c.num_nextn_predict_layers, 1),
            "the model has {} MTP layers (num_nextn_predict_layers in config.json); {} asked for",
            c.num_nextn_predict_layers, c.mtp_layers);
  if (c.mtp_layers > 0) {
    // The MTP layer (model.layers.{num_hidden_layers}): its norms and eh_proj, replicated on every rank; it shares
    // the model's embedding and lm_head (its own copies, embed_tokens and shared_head.head, are not loaded).
    const int64_t L = c.num_hidden_layers;
    mtp_enorm_ = ld.make(layer_name(L, "enorm.weight"), {H}, {H}, 0, 0, Kind::Norm);
    mtp_hnorm_ = ld.make(layer_name(L, "hnorm.weight"), {H}, {H}, 0, 0, Kind::Norm);
    mtp_eh_embed_ = ld.make(layer_name(L, "eh_proj.weight"), {H, 2 * H}, {H, H}, 0, 0, Kind::Matrix);
    mtp_eh_hidden_ = ld.make(layer_name(L, "eh_proj.weight"), {H, 2 * H}, {H, H}, 0, H, Kind::Matrix);
    mtp_norm_ = ld.make(layer_name(L, "shared_head.norm.weight"), {H}, {H}, 0, 0, Kind::Norm);
  }
  // Each MoE layer's routed experts' form (FP8 kept from the checkpoint or quantized at load, INT4 kept, else bf16),
  // then whether every such layer's shared experts fuse into them (LoadOptions::shared_experts_fusion).
  struct RoutedForm {
    bool keep_ckpt = false, keep_quantized = false, keep_int4 = false;
    std::pair<int64_t, int64_t> int4_groups{0, 0};  // columns per group: gate / up rows, down rows
  };
  std::vector<RoutedForm> forms(static_cast<size_t>(c.num_cache_layers()));
  const int64_t qb = c.n_routed_experts > 0 ? ld.quantize_block(local_moe_inter_) : 0;  // --quantization fp8
  for (int64_t l = 0; l < c.num_cache_layers(); ++l) {
    if (!c.is_moe_layer(l)) continue;
    RoutedForm& f = forms[static_cast<size_t>(l)];
    const std::string e0 = layer_name(l, "mlp.experts.") + std::to_string(expert_begin_) + ".";
    const int64_t Im = local_moe_inter_;
    f.keep_ckpt = ld.keep_fp8_experts(e0 + "gate_proj.weight", Im, er * Im, H);
    f.keep_quantized =
        qb && backend_.takes_fp8_experts() && opts.fp8_experts != LoadOptions::KeepQuantized::Off && H % 8 == 0;
    f.keep_int4 = !f.keep_ckpt && !qb && ld.keep_int4_experts(e0, c.moe_intermediate_size, Im, er * Im, H,
                                                                 f.int4_groups);
  }
  {
    using K = LoadOptions::KeepQuantized;
    const int64_t ns = c.n_shared_experts, Im = local_moe_inter_;
    // (at most 16 ids a token: the small-batch MoE kernels' limit)
    bool fuse = opts.shared_experts_fusion != K::Off && ns > 0 && c.n_routed_experts > 0 && !plan_.expert_parallel &&
                local_shared_inter_ == ns * Im && c.num_experts_per_tok + ns <= 16;
    for (int64_t l = 0; fuse && l < c.num_cache_layers(); ++l) {
      const RoutedForm& f = forms[static_cast<size_t>(l)];
      if (!c.is_moe_layer(l)) continue;
      const std::string sp = layer_name(l, "mlp.shared_experts.");
      if (f.keep_int4) {
        fuse = ld.int4_parts_fit(sp, ns * c.moe_intermediate_size, Im, H, tr * ns, ns, f.int4_groups);
      } else if (f.keep_ckpt) {  // FP8 blocks (on only: slower past 16 tokens, docs/perf.md): each part's gate / up /
                                 // down F8 in whole blocks
        fuse = opts.shared_experts_fusion == K::On;
        for (int64_t p = tr * ns; fuse && p < (tr + 1) * ns; ++p)
          for (const char* m : {"gate_proj", "up_proj", "down_proj"})
            fuse = fuse && ld.keep_fp8_experts(sp + m + ".weight", Im, p * Im, H);
      } else {  // bf16 experts; not those quantized at load (fused, the shared experts would be quantized too)
        fuse = opts.shared_experts_fusion == K::On && !f.keep_quantized;
      }
    }
    if (opts.shared_experts_fusion == K::On && !fuse && ns > 0 && c.n_routed_experts > 0 && !reload)
      MLA_LOG_INFO("--shared-experts-fusion on: the shared experts stay apart ({})",
                   plan_.expert_parallel ? "expert parallelism"
                                         : "more than 16 experts a token, experts quantized at load, or shared "
                                           "experts in other groups / blocks than the routed ones'");
    if (reload)
      MLA_CHECK((fuse ? ns : 0) == fused_shared_,
                "{}: the running model {} its shared experts into the routed ones and this checkpoint's {} be (its "
                "experts' format differs)", model_dir, fused_shared_ ? "fused" : "did not fuse",
                fuse ? "would" : "cannot");
    fused_shared_ = fuse ? ns : 0;
    if (fuse && !reload)
      MLA_LOG_INFO("shared experts fused into the routed ones: {} more experts per MoE layer{}", ns,
                   std::any_of(forms.begin(), forms.end(), [](const RoutedForm& f) { return f.keep_int4; })
                       ? " (INT4)" : "");
  }
  layers_.clear();
  layers_.resize(static_cast<size_t>(c.num_cache_layers()));
  bool logged_quantization = false;
  for (int64_t l = 0; l < c.num_cache_layers(); ++l) {
    LayerWeights& w = layers_[static_cast<size_t>(l)];
    w.input_norm = ld.make(layer_name(l, "input_layernorm.weight"), {H}, {H}, 0, 0, Kind::Norm);
    w.post_norm = ld.make(layer_name(l, "post_attention_layernorm.weight"), {H}, {H}, 0, 0, Kind::Norm);
    if (c.q_lora_rank > 0) {
      const int64_t qr = c.q_lora_rank;
      w.q_a_proj = ld.make(layer_name(l, "self_attn.q_a_proj.weight"), {qr, H}, {qr, H}, 0, 0, Kind::Matrix);
      w.q_a_norm = ld.make(layer_name(l, "self_attn.q_a_layernorm.weight"), {qr}, {qr}, 0, 0, Kind::Norm);
      w.q_b_proj = ld.make(layer_name(l, "self_attn.q_b_proj.weight"), {nh * qk, qr}, {lh * qk, qr}, h0 * qk, 0, Kind::Matrix);
    } else {
      w.q_proj = ld.make(layer_name(l, "self_attn.q_proj.weight"), {nh * qk, H}, {lh * qk, H}, h0 * qk, 0, Kind::Matrix);
    }
    w.kv_a_proj = ld.make(layer_name(l, "self_attn.kv_a_proj_with_mqa.weight"), {kvr + rope, H}, {kvr + rope, H}, 0, 0,
                          Kind::Matrix);
    w.kv_a_norm = ld.make(layer_name(l, "self_attn.kv_a_layernorm.weight"), {kvr}, {kvr}, 0, 0, Kind::Norm);
    w.kv_b_proj = ld.make(layer_name(l, "self_attn.kv_b_proj.weight"), {nh * (nope + vd), kvr}, {lh * (nope + vd), kvr},
                          h0 * (nope + vd), 0, Kind::Matrix);
    w.o_proj = ld.make(layer_name(l, "self_attn.o_proj.weight"), {H, nh * vd}, {H, lh * vd}, 0, h0 * vd, Kind::Matrix);

    w.is_moe = c.is_moe_layer(l);
    if (!w.is_moe) {
      const int64_t I = local_inter_;
      w.mlp_gate_up = ld.alloc({2 * I, H}, ld.matrix_dtype(), layer_name(l, "mlp.gate_proj / up_proj"));
      load_gate_up(w.mlp_gate_up, layer_name(l, "mlp."), c.intermediate_size, I, tr);
      w.mlp_down = ld.alloc({H, I}, ld.matrix_dtype(), layer_name(l, "mlp.down_proj.weight"));
      load_down(w.mlp_down, layer_name(l, "mlp."), c.intermediate_size, I, tr);
      continue;
    }
    const int64_t Im = local_moe_inter_, Eall = c.n_routed_experts;
    const int64_t E = local_experts_ + fused_shared_;  // the routed experts, then the fused shared ones
    w.router = ld.make(layer_name(l, "mlp.gate.weight"), {Eall, H}, {Eall, H}, 0, 0, Kind::Router);
    const std::string bias_name = layer_name(l, "mlp.gate.e_score_correction_bias");
    if (c.topk_method == TopkMethod::NoauxTc || (ckpt && ckpt->has(bias_name)))
      w.router_bias = ld.make(bias_name, {Eall}, {Eall}, 0, 0, Kind::Bias);
    // Local expert e < local_experts_ is the checkpoint's expert expert_begin_ + e, rows [er Im, (er + 1) Im) of its
    // intermediate dimension; a fused shared one e - local_experts_ = j rows [(tr ns + j) Im, ...) of the shared
    // experts' (all ns of them: ns times as wide).
    const std::string experts = layer_name(l, "mlp.experts."), shared_prefix = layer_name(l, "mlp.shared_experts.");
    auto expert_prefix = [&](int64_t e) {
      return e < local_experts_ ? experts + std::to_string(expert_begin_ + e) + "." : shared_prefix;
    };
    auto expert_full = [&](int64_t e) {
      return e < local_experts_ ? c.moe_intermediate_size : c.moe_intermediate_size * c.n_shared_experts;
    };
    auto expert_part = [&](int64_t e) {
      return e < local_experts_ ? er : tr * c.n_shared_experts + e - local_experts_;
    };
    const RoutedForm& form = forms[static_cast<size_t>(l)];
    const bool keep_ckpt = form.keep_ckpt, keep_quantized = form.keep_quantized;
    if (qb && !logged_quantization) {
      MLA_LOG_INFO("quantizing the routed experts to FP8 in {}x{} blocks ({})", qb, qb,
                   keep_quantized ? "kept FP8" : "dequantized again: this backend keeps no FP8 experts");
      logged_quantization = true;
    } else if (opts.quantize_fp8 && !qb && !logged_quantization) {
      MLA_LOG_INFO("--quantization fp8: {}", from.quant != QuantMethod::None
                                                  ? "the checkpoint is quantized already; loading its own weights"
                                                  : "no block size divides the experts' width; they stay bf16");
      logged_quantization = true;
    }
    if (form.keep_int4) {
      // INT4 kept: code pairs, each row's groups' scales and zero points beside them (gate rows', then up rows').
      const auto [gg, dg] = form.int4_groups;
      w.experts_gate_up = ld.alloc({E, 2 * Im, H / 2}, DType::U8, experts + "*.gate_proj / up_proj (INT4)");
      w.experts_down = ld.alloc({E, H, Im / 2}, DType::U8, experts + "*.down_proj (INT4)");
      const Shape gshape{E, 2 * Im, (H + gg - 1) / gg}, dshape{E, H, (Im + dg - 1) / dg};
      Tensor gs = ld.alloc(gshape, DType::F32, experts + "*.gate_proj / up_proj scales");
      Tensor gz = ld.alloc(gshape, DType::F32, experts + "*.gate_proj / up_proj zero points");
      Tensor ds = ld.alloc(dshape, DType::F32, experts + "*.down_proj scales");
      Tensor dz = ld.alloc(dshape, DType::F32, experts + "*.down_proj zero points");
      auto at = [](const Tensor& t, int64_t e, int64_t r0, int64_t r1) {
        return t.rows(e, e + 1).reshape({t.size(1), t.size(2)}).rows(r0, r1);
      };
      for (int64_t e = 0; e < E; ++e) {
        const std::string prefix = expert_prefix(e);
        const int64_t full = expert_full(e), r0 = expert_part(e) * Im;
        ld.load_int4(prefix + "gate_proj.weight", {full, H}, r0, 0, gg, at(w.experts_gate_up, e, 0, Im),
                     at(gs, e, 0, Im), at(gz, e, 0, Im));
        ld.load_int4(prefix + "up_proj.weight", {full, H}, r0, 0, gg, at(w.experts_gate_up, e, Im, 2 * Im),
                     at(gs, e, Im, 2 * Im), at(gz, e, Im, 2 * Im));
        ld.load_int4(prefix + "down_proj.weight", {H, full}, 0, r0, dg, at(w.experts_down, e, 0, H),
                     at(ds, e, 0, H), at(dz, e, 0, H));
      }
      w.experts_gate_up.set_block_scales(std::make_shared<const BlockScales>(BlockScales{gs, 1, gg, gz}));
      w.experts_down.set_block_scales(std::make_shared<const BlockScales>(BlockScales{ds, 1, dg, dz}));
    } else if (keep_ckpt || keep_quantized) {
      // FP8 kept: the checkpoint's codes as they are (or the bf16 weights quantized), each block's scale beside
      // them (gate rows' blocks, then up rows').
      const int64_t br = keep_ckpt ? ld.block_rows() : qb, bc = keep_ckpt ? ld.block_cols() : qb;
      auto fill = [&](const std::string& name, const Shape& shape, int64_t r0, int64_t c0, Tensor codes, Tensor sc) {
        if (keep_ckpt) ld.load_fp8_blocks(name, shape, r0, c0, codes, sc);
        else ld.quantize_fp8_blocks(name, shape, r0, c0, qb, codes, sc);
      };
      w.experts_gate_up = ld.alloc({E, 2 * Im, H}, DType::F8_E4M3, experts + "*.gate_proj / up_proj (FP8)");
      w.experts_down = ld.alloc({E, H, Im}, DType::F8_E4M3, experts + "*.down_proj (FP8)");
      Tensor gs = ld.alloc({E, 2 * Im / br, (H + bc - 1) / bc}, DType::F32, experts + "*.gate_proj / up_proj scales");
      Tensor ds = ld.alloc({E, (H + br - 1) / br, Im / bc}, DType::F32, experts + "*.down_proj scales");
      for (int64_t e = 0; e < E; ++e) {
        const std::string prefix = expert_prefix(e);
        Tensor gu = w.experts_gate_up.rows(e, e + 1).reshape({2 * Im, H});
        Tensor gus = gs.rows(e, e + 1).reshape({2 * Im / br, gs.size(2)});
        const int64_t full = expert_full(e), r0 = expert_part(e) * Im;
        fill(prefix + "gate_proj.weight", {full, H}, r0, 0, gu.rows(0, Im), gus.rows(0, Im / br));
        fill(prefix + "up_proj.weight", {full, H}, r0, 0, gu.rows(Im, 2 * Im), gus.rows(Im / br, 2 * Im / br));
        fill(prefix + "down_proj.weight", {H, full}, 0, r0, w.experts_down.rows(e, e + 1).reshape({H, Im}),
             ds.rows(e, e + 1).reshape({ds.size(1), Im / bc}));
      }
      w.experts_gate_up.set_block_scales(std::make_shared<const BlockScales>(BlockScales{gs, br, bc, {}}));
      w.experts_down.set_block_scales(std::make_shared<const BlockScales>(BlockScales{ds, br, bc, {}}));
    } else {
      w.experts_gate_up = ld.alloc({E, 2 * Im, H}, ld.matrix_dtype(), experts + "*.gate_proj / up_proj");
      w.experts_down = ld.alloc({E, H, Im}, ld.matrix_dtype(), experts + "*.down_proj");
      for (int64_t e = 0; e < E; ++e) {
        const std::string prefix = expert_prefix(e);
        Tensor gu = w.experts_gate_up.rows(e, e + 1).reshape({2 * Im, H});
        Tensor dn = w.experts_down.rows(e, e + 1).reshape({H, Im});
        if (e >= local_experts_) {  // a fused shared expert (never quantized at load)
          load_gate_up(gu, prefix, expert_full(e), Im, expert_part(e));
          load_down(dn, prefix, expert_full(e), Im, expert_part(e));
        } else if (qb) {  // quantized, then dequantized again
          const int64_t full = c.moe_intermediate_size;
          ld.load_quantized(gu.rows(0, Im), prefix + "gate_proj.weight", {full, H}, er * Im, 0, qb);
          ld.load_quantized(gu.rows(Im, 2 * Im), prefix + "up_proj.weight", {full, H}, er * Im, 0, qb);
          ld.load_quantized(dn, prefix + "down_proj.weight", {H, full}, 0, er * Im, qb);
        } else {
          load_gate_up(gu, prefix, c.moe_intermediate_size, Im, er);
          load_down(dn, prefix, c.moe_intermediate_size, Im, er);
        }
      }
    }
    if (c.n_shared_experts > 0 && fused_shared_ == 0) {
      const int64_t Is = local_shared_inter_, full = c.moe_intermediate_size * c.n_shared_experts;
      w.shared_gate_up =
          ld.alloc({2 * Is, H}, ld.matrix_dtype(), layer_name(l, "mlp.shared_experts.gate_proj / up_proj"));
      load_gate_up(w.shared_gate_up, layer_name(l, "mlp.shared_experts."), full, Is, tr);
      w.shared_down = ld.alloc({H, Is}, ld.matrix_dtype(), layer_name(l, "mlp.shared_experts.down_proj.weight"));
      load_down(w.shared_down, layer_name(l, "mlp.shared_experts."), full, Is, tr);
    }
    if (l % 8 == 7 || l + 1 == c.num_cache_layers())
      MLA_LOG_INFO("loading weights: layer {}/{}{}", l + 1, c.num_hidden_layers,
                   l >= c.num_hidden_layers ? " (the MTP layer)" : "");
  }
  if (reload) {
    ld.check_all_reloaded();
    config_.quant = from.quant;
    config_.quant_block_rows = from.quant_block_rows;
    config_.quant_block_cols = from.quant_block_cols;
    config_.quant_compressed_tensors = from.quant_compressed_tensors;
    config_.quant_group = from.quant_group;
    config_.quant_bits = from.quant_bits;
    config_.quant_zero_offset = from.quant_zero_offset;
  }
  weight_bytes_ = ld.bytes();
  if (ckpt) {
    // (Under expert parallelism the other ranks' experts are theirs, not extra.)
    auto others_expert = [&](const std::string& n) {
      const size_t at = n.find(".mlp.experts.");
      if (!plan_.expert_parallel || at == std::string::npos) return false;
      const int64_t e = std::atoll(n.c_str() + at + std::strlen(".mlp.experts."));
      return e < expert_begin_ || e >= expert_begin_ + local_experts_;
    };
    std::vector<std::string> extra;
    for (const auto& n : ckpt->names())
      if (!ld.used().count(n) && !others_expert(n)) extra.push_back(n);
    if (!extra.empty())
      MLA_LOG_INFO("ignoring {} checkpoint tensors the model does not use (e.g. '{}'{})", extra.size(), extra.front(),
                   extra.size() > 1 ? fmt::format(", '{}'", extra.back()) : std::string());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  MLA_LOG_INFO("{} {} weights: {:.2f} GiB on {} in {:.1f} s", reload ? "reloaded" : "loaded",
               opts.dummy ? "dummy" : "checkpoint",
               static_cast<double>(weight_bytes_) / (1 << 30), backend_.name(), secs);
}

void DeepseekModel::attention(int64_t l, const Tensor& x, const Tensor& residual, Tensor& residual_out, Tensor& normed,
                              KvCache& cache, MlaForm form, Tensor& out) {
  const auto& c = config_;
  const LayerWeights& w = layers_[static_cast<size_t>(l)];
  const int64_t T = x.size(0);
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim, kvr = c.kv_lora_rank;
  const DType ad = backend_.act_dtype();
  const float eps = static_cast<float>(c.rms_norm_eps);
  Tensor q = backend_.scratch({T, local_heads_ * (nope + rope)}, ad);
  Tensor latent = backend_.scratch({T, kvr + rope}, ad);
  if (c.q_lora_rank > 0) {
    Tensor qa = backend_.scratch({T, c.q_lora_rank}, ad);
    backend_.add_rmsnorm_linear_pair(x, residual, residual_out, w.input_norm, eps, normed, w.q_a_proj, qa, w.kv_a_proj,
                                     latent);
    backend_.rmsnorm(qa, w.q_a_norm, eps, qa);
    backend_.linear(qa, w.q_b_proj, q);
  } else {
    backend_.add_rmsnorm_linear_pair(x, residual, residual_out, w.input_norm, eps, normed, w.q_proj, q, w.kv_a_proj,
                                     latent);
  }
  MlaParams p;
  p.num_heads = static_cast<int32_t>(local_heads_);
  p.qk_nope = static_cast<int32_t>(nope);
  p.qk_rope = static_cast<int32_t>(rope);
  p.v_head = static_cast<int32_t>(vd);
  p.kv_lora = static_cast<int32_t>(kvr);
  p.softmax_scale = static_cast<float>(c.softmax_scale());
  p.form = form;
  Tensor attn = backend_.scratch({T, local_heads_ * vd}, ad);
  backend_.mla_prepare_attention(q, latent, w.kv_a_norm, eps, cache.layer(l), w.kv_b_proj, p, attn);
  backend_.linear(attn, w.o_proj, out);
  if (plan_.attn_tp_size > 1) backend_.collective([c = attn_comm_, out]() mutable { c->all_reduce_sum(out); });
}

void DeepseekModel::mlp(int64_t l, const Tensor& x, Tensor& out) {
  const LayerWeights& w = layers_[static_cast<size_t>(l)];
  const int64_t T = x.size(0);
  const DType ad = backend_.act_dtype();
  if (!w.is_moe) {
    Tensor gu = backend_.scratch({T, 2 * local_inter_}, ad);
    backend_.linear(x, w.mlp_gate_up, gu);
    Tensor act = backend_.scratch({T, local_inter_}, ad);
    backend_.silu_mul(gu, act);
    backend_.linear(act, w.mlp_down, out);
    reduce_mlp(l, out);
    return;
  }
  Tensor ids, weights;
  routing_scratch(T, ids, weights);
  backend_.moe_gate(x, w.router, router_bias(w), router_params(), ids, weights);
  experts(l, x, ids, weights, out);
}

RouterParams DeepseekModel::router_params() const {
  RouterParams p = RouterParams::from_config(config_);
  p.n_fixed = static_cast<int32_t>(fused_shared_);
  p.fixed_base = static_cast<int32_t>(config_.n_routed_experts);  // (no expert parallelism: local = global ids)
  return p;
}

void DeepseekModel::routing_scratch(int64_t T, Tensor& ids, Tensor& weights) {
  const int64_t k = router_params().ids_per_token();
  ids = backend_.scratch({T, k}, DType::I32);
  weights = backend_.scratch({T, k}, DType::F32);
}

void DeepseekModel::norm_mlp(int64_t l, const Tensor& x, Tensor& residual, Tensor& spare, Tensor& normed, Tensor& out) {
  const LayerWeights& w = layers_[static_cast<size_t>(l)];
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (!w.is_moe) {
    backend_.add_rmsnorm(x, residual, w.post_norm, eps, normed);
    mlp(l, normed, out);
    return;
  }
  Tensor ids, weights;
  routing_scratch(x.size(0), ids, weights);
  backend_.add_rmsnorm_moe_gate(x, residual, spare, w.post_norm, eps, normed, w.router, router_bias(w),
                                router_params(), ids, weights);
  std::swap(residual, spare);
  experts(l, normed, ids, weights, out);
}

std::optional<DeepseekModel::WeightRows> DeepseekModel::read_weight(const std::string& name, int64_t rows) {
  auto it = placements_.find(name);
  if (it == placements_.end() && name == "lm_head.weight" && lm_head_.data() == embed_.data())
    it = placements_.find("model.embed_tokens.weight");  // tied embeddings
  if (it == placements_.end() || it->second.empty()) return std::nullopt;
  MLA_CHECK(rows >= 0, "read_weight: {} rows", rows);
  WeightRows out;
  out.full = it->second.front().full;
  const bool vec = out.full.size() == 1;
  out.rows = vec ? 1 : std::min(rows, out.full[0]);
  out.cols = vec ? std::min(rows, out.full[0]) : out.full[1];
  MLA_CHECK(out.rows * out.cols <= kMaxReadValues, "'{}' ({}): {} rows are {} values; at most {} are read at once "
            "(ask for fewer rows)", name, shape_str(out.full), out.rows, out.rows * out.cols, kMaxReadValues);
  out.values.assign(static_cast<size_t>(out.rows * out.cols), 0.0f);
  out.held.assign(out.values.size(), 0);
  for (const Placement& p : it->second) {
    const bool int4 = p.dst.dtype() == DType::U8 && p.zeros.defined();  // code pairs: twice the columns
    const int64_t pr = p.dst.size(0), pc = int4 ? 2 * p.dst.size(1) : p.dst.size(1);
    const int64_t a = p.r0, b = std::min(p.r0 + pr, out.rows);  // the block's rows asked for
    const int64_t nc = std::min(pc, out.cols - p.c0);            // and columns
    if (b <= a || nc <= 0) continue;
    const Tensor part = p.dst.rows(0, b - a);
    std::vector<float> v(static_cast<size_t>((b - a) * pc));
    if (p.dst.dtype() == DType::F8_E4M3) {  // bf16(code * its block's scale), as the experts compute with them
      std::vector<uint8_t> codes(v.size());
      backend_.download(part, codes.data());
      const Tensor sc = backend_.to_host_f32(p.scales);
      cpu::dequant_fp8(codes.data(), sc.data_as<float>(), 1, b - a, pc, p.br, p.bc, v.data());
      for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    } else if (int4) {  // bf16((code - zero) * scale), likewise
      std::vector<uint8_t> codes(v.size() / 2);
      backend_.download(part, codes.data());
      const Tensor sc = backend_.to_host_f32(p.scales.rows(0, b - a)), z = backend_.to_host_f32(p.zeros.rows(0, b - a));
      cpu::dequant_int4(codes.data(), sc.data_as<float>(), z.data_as<float>(), 1, b - a, pc, p.bc, v.data());
      for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    } else {
      const Tensor h = backend_.to_host_f32(part);
      std::copy_n(h.data_as<float>(), v.size(), v.begin());
    }
    for (int64_t r = a; r < b; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        const size_t o = static_cast<size_t>(r * out.cols + p.c0 + c);
        out.values[o] = v[static_cast<size_t>((r - a) * pc + c)];
        out.held[o] = 1;
      }
  }
  return out;
}

void DeepseekModel::enable_expert_counts() {
  MLA_CHECK(config_.n_routed_experts > 0, "expert distribution recording: the model has no routed experts");
  if (!expert_counts_.defined())
    expert_counts_ = backend_.alloc({config_.num_hidden_layers, config_.n_routed_experts}, DType::I64);
  backend_.zero(expert_counts_);
}

void DeepseekModel::enable_route_capture() {
  MLA_CHECK(config_.n_routed_experts > 0, "return_routed_experts: the model has no routed experts");
  MLA_CHECK(graphs_.empty(), "enable_route_capture: graphs were recorded without it");
  capture_routes_ = true;
}

void DeepseekModel::experts(int64_t l, const Tensor& x, const Tensor& ids, const Tensor& weights, Tensor& out) {
  const LayerWeights& w = layers_[static_cast<size_t>(l)];
  if (routes_.defined() && routes_.size(1) > 0 && l < config_.num_hidden_layers) {  // the group's own rows' ids
    const int64_t m = config_.moe_index(l), T = routes_.size(1);
    Tensor dst = routes_.rows(m, m + 1);
    backend_.copy(ids.rows(routes_offset_, routes_offset_ + T), dst);
  }
  if (expert_counts_.defined() && l < config_.num_hidden_layers) {
    Tensor row = expert_counts_.rows(l, l + 1);
    backend_.count_experts(ids, row);
  }
  const bool shared = config_.n_shared_experts > 0 && fused_shared_ == 0;
  backend_.moe_experts(x, ids, weights, w.experts_gate_up, w.experts_down, static_cast<int32_t>(expert_begin_),
                       shared ? &w.shared_gate_up : nullptr,
                       shared ? &w.shared_down : nullptr, static_cast<int32_t>(fused_shared_), out);
  reduce_mlp(l, out);
}

void DeepseekModel::reduce_mlp(int64_t l, Tensor& out) {
  if (plan_.tp_size <= 1) return;
  MLA_LOG_TRACE("rank {}: layer {} MLP all-reduce", plan_.tp_rank, l);
  backend_.collective([c = world_comm_, out]() mutable { c->all_reduce_sum(out); });
}

bool DeepseekModel::check_ids(const ForwardBatch& batch) const {
  MLA_CHECK(!layers_.empty(), "model weights are not loaded");
  const int64_t prev = prev_ids_.defined() ? prev_ids_.numel() : 0;
  bool any_prev = false;
  for (int32_t id : batch.input_ids) {
    if (id < 0) {
      any_prev = true;
      MLA_CHECK(-static_cast<int64_t>(id) <= prev, "input id {} names row {} of the previous step's samples, which "
                "has {} rows on this rank", id, -static_cast<int64_t>(id) - 1, prev);
      continue;
    }
    MLA_CHECK(id < config_.vocab_size, "token id {} is outside the vocabulary [0, {})", id, config_.vocab_size);
  }
  return any_prev;
}

Tensor DeepseekModel::forward(const ForwardBatch& batch, KvCache& cache, MlaForm form, const DpStepInfo* dp) {
  const bool prev_ids = check_ids(batch);
  MLA_LOG_TRACE("rank {}: forward of {} tokens", plan_.tp_rank, batch.num_tokens());
  backend_.begin_step(batch);
  cache.copy_pages(batch.kv_saves, batch.kv_loads);  // the hierarchical cache's, before the step reads the pages
  return forward_body(batch, cache, form, dp, prev_ids);
}

Tensor DeepseekModel::forward_graph(const ForwardBatch& batch, KvCache& cache, const DpStepInfo* dp,
                                    const GraphSampling* sampling) {
  check_ids(batch);
  MLA_LOG_TRACE("rank {}: graph forward of {} tokens", plan_.tp_rank, batch.num_tokens());
  const std::tuple<int64_t, int32_t, int32_t> key{batch.num_tokens(), backend_.graph_variant(batch),
                                                  sampling ? sampling->kind() : 0};
  if (sampling) {
    MLA_CHECK(sampling->ids.defined() && sampling->ids.numel() == batch.num_tokens(),
              "graph sampling: ids must hold the step's {} tokens", batch.num_tokens());
    MLA_CHECK(sampling->sample || sampling->rows.empty(), "graph sampling: rows given to a rank that does not sample");
  }
  backend_.begin_graph_step(batch);
  cache.copy_pages(batch.kv_saves, batch.kv_loads);  // eagerly, before the graph
  if (sampling && sampling->sample)  // (before the recording or replay, which samples these rows)
    backend_.stage_sample(sampling->rows, sampling->logprobs.defined() ? &sampling->logprobs : nullptr);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    Graph g;
    backend_.graph_capture_begin();
    try {
      g.logits = forward_body(batch, cache, MlaForm::Auto, dp, /*prev_ids=*/true);
      g.hidden = last_hidden_;
      g.routes = last_routes_;
      if (sampling) {
        Tensor ids = sampling->ids;
        if (sampling->sample) backend_.sample_staged(g.logits, ids);
        if (sampling->after) sampling->after();
        g.ids = ids.data();
      }
    } catch (...) {
      try {
        backend_.graph_capture_end();  // leave the stream usable; the recording is dropped
      } catch (const std::exception&) {
      }
      throw;
    }
    g.id = backend_.graph_capture_end();
    it = graphs_.emplace(key, g).first;
  }
  MLA_CHECK(!sampling || it->second.ids == sampling->ids.data(),
            "graph sampling: the graph of {} tokens writes its ids elsewhere than this step asks", batch.num_tokens());
  backend_.graph_replay(it->second.id);
  last_hidden_ = it->second.hidden;
  last_routes_ = it->second.routes;
  return it->second.logits;
}

DeepseekModel::DpRows DeepseekModel::dp_rows(int64_t T, const DpStepInfo* dp) {
  DpRows d;
  d.total = T;
  if (plan_.dp_size <= 1) return d;
  // DP attention: this group's rows [offset, offset + T) of the world's total tokens.
  MLA_CHECK(dp && static_cast<int32_t>(dp->num_tokens.size()) == plan_.dp_size,
            "DP attention step without the token counts of all {} groups", plan_.dp_size);
  MLA_CHECK(dp->num_tokens[static_cast<size_t>(plan_.dp_rank)] == T, "DP group {} runs {} tokens but the step says {}",
            plan_.dp_rank, T, dp->num_tokens[static_cast<size_t>(plan_.dp_rank)]);
  d.on = true;
  d.total = 0;
  for (int32_t g = 0; g < plan_.dp_size; ++g) {
    if (g == plan_.dp_rank) d.offset = d.total;
    d.total += dp->num_tokens[static_cast<size_t>(g)];
  }
  const int64_t H = config_.hidden_size;
  d.gathered = backend_.scratch({d.total, H}, backend_.act_dtype());
  d.gathered_out = backend_.scratch({d.total, H}, backend_.act_dtype());
  return d;
}

void DeepseekModel::decoder_layer(int64_t l, Tensor& hidden, Tensor& residual, Tensor& residual_next, Tensor& normed,
                                  KvCache& cache, MlaForm form, DpRows& d) {
  const LayerWeights& w = layers_[static_cast<size_t>(l)];
  const int64_t T = hidden.size(0);
  const size_t mark = backend_.scratch_mark();  // this layer's temporaries are released at its end
  attention(l, hidden, residual, residual_next, normed, cache, form, hidden);
  std::swap(residual, residual_next);
  if (!d.on) {
    norm_mlp(l, hidden, residual, residual_next, normed, hidden);
  } else {
    backend_.add_rmsnorm(hidden, residual, w.post_norm, static_cast<float>(config_.rms_norm_eps), normed);
    // Gather every group's rows (one copy per group: its attention-TP rank 0 writes, the others add zeros),
    // run the world-parallel MLP on all of them, keep this group's rows.
    backend_.zero(d.gathered);
    if (plan_.attn_tp_rank == 0 && T > 0) {
      Tensor mine = d.gathered.rows(d.offset, d.offset + T);
      backend_.copy(normed, mine);
    }
    MLA_LOG_TRACE("rank {}: layer {} DP gather ({} of {} rows)", plan_.tp_rank, l, T, d.total);
    backend_.collective([c = world_comm_, g = d.gathered]() mutable { c->all_reduce_sum(g); });
    mlp(l, d.gathered, d.gathered_out);
    backend_.copy(d.gathered_out.rows(d.offset, d.offset + T), hidden);
  }
  backend_.scratch_release(mark);
}

Tensor DeepseekModel::embed_tokens(int64_t T) {
  Tensor hidden = backend_.scratch({T, config_.hidden_size}, backend_.act_dtype());
  backend_.embedding(embed_, plan_.attn_tp_rank * local_vocab_, hidden);
  if (plan_.attn_tp_size > 1) backend_.collective([c = attn_comm_, hidden]() mutable { c->all_reduce_sum(hidden); });
  return hidden;
}

Tensor DeepseekModel::logits_of(const ForwardBatch& batch, const Tensor& normed) {
  const auto& c = config_;
  const int64_t T = batch.num_tokens(), H = c.hidden_size;
  const int64_t R = static_cast<int64_t>(batch.logit_rows.size());
  // Every token a logit row, in order (decode steps, graph steps, whole-prompt logits): lm_head reads them in place.
  bool in_order = R == T;
  for (int64_t i = 0; in_order && i < R; ++i) in_order = batch.logit_rows[static_cast<size_t>(i)] == i;
  Tensor rows = normed;
  if (!in_order) {
    rows = backend_.scratch({R, H}, backend_.act_dtype());
    backend_.gather_logit_rows(normed, rows);
  }
  Tensor logits_local = backend_.scratch({R, local_vocab_}, DType::F32);
  backend_.linear(rows, lm_head_, logits_local);
  if (plan_.attn_tp_size == 1) return logits_local;
  // Vocab-parallel lm_head: gather [attn_tp, R, V/attn_tp] and interleave into [R, V].
  const int64_t n = plan_.attn_tp_size;
  Tensor gathered_logits = backend_.scratch({n * R, local_vocab_}, DType::F32);
  MLA_LOG_TRACE("rank {}: logits all-gather", plan_.tp_rank);
  backend_.collective(
      [c = attn_comm_, logits_local, gathered_logits]() mutable { c->all_gather(logits_local, gathered_logits); });
  Tensor out = backend_.scratch({R, c.vocab_size}, DType::F32);
  backend_.interleave_blocks(gathered_logits, n, out);
  return out;
}

Tensor DeepseekModel::forward_body(const ForwardBatch& batch, KvCache& cache, MlaForm form, const DpStepInfo* dp,
                                   bool prev_ids) {
  const auto& c = config_;
  const int64_t T = batch.num_tokens(), H = c.hidden_size;
  const DType ad = backend_.act_dtype();
  const float eps = static_cast<float>(c.rms_norm_eps);
  // The residual stream alternates between two buffers: the input norm and a MoE layer's post-attention norm write
  // the sums to the other one (their fused kernels read the old sums in every block).
  Tensor residual = backend_.scratch({T, H}, ad), residual_next = backend_.scratch({T, H}, ad);
  Tensor normed = backend_.scratch({T, H}, ad);
  if (prev_ids && prev_ids_.defined()) backend_.resolve_prev_ids(prev_ids_);
  Tensor hidden = embed_tokens(T);
  DpRows d = dp_rows(T, dp);
  if (capture_routes_) {  // (each MoE layer copies its rows' expert ids here: experts())
    routes_ = backend_.scratch({c.num_moe_layers(), T, router_params().ids_per_token()}, DType::I32);
    routes_offset_ = d.on ? d.offset : 0;
  }
  backend_.zero(residual);  // the first sum is the embedding itself
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    decoder_layer(l, hidden, residual, residual_next, normed, cache, form, d);
  last_routes_ = routes_;
  routes_ = Tensor();  // (the MTP layer's routing is not kept)
  backend_.add_rmsnorm(hidden, residual, final_norm_, eps, normed);
  last_hidden_ = normed;  // the MTP layer's input (forward_draft), valid until the next step
  return logits_of(batch, normed);
}

Tensor DeepseekModel::forward_draft(const ForwardBatch& batch, std::span<const int32_t> next_ids, KvCache& cache,
                                    const DpStepInfo* dp) {
  const auto& c = config_;
  check_draft_layer("forward_draft", cache);
  const int64_t T = batch.num_tokens();
  MLA_CHECK(static_cast<int64_t>(next_ids.size()) == T, "forward_draft: {} next ids for {} tokens", next_ids.size(), T);
  MLA_CHECK(last_hidden_.defined() && last_hidden_.size(0) == T,
            "forward_draft: the step's forward over the same {} tokens must come first", T);
  const int64_t prev = prev_ids_.defined() ? prev_ids_.numel() : 0;
  bool any_prev = false;
  for (int32_t id : next_ids) {
    MLA_CHECK(id < c.vocab_size && -static_cast<int64_t>(id) <= prev, "forward_draft: next id {} is out of range", id);
    any_prev |= id < 0;
  }
  MLA_LOG_TRACE("rank {}: MTP forward of {} tokens", plan_.tp_rank, T);
  backend_.set_input_ids(next_ids);
  if (any_prev) backend_.resolve_prev_ids(prev_ids_);
  return draft_layer(batch, last_hidden_, cache, dp);
}

Tensor DeepseekModel::forward_draft_chain(const ForwardBatch& batch, std::span<const int32_t> hidden_rows,
                                          const Tensor& drafts, KvCache& cache, const DpStepInfo* dp) {
  check_draft_layer("forward_draft_chain", cache);
  const int64_t T = batch.num_tokens(), H = config_.hidden_size;
  MLA_CHECK(T == 0 || draft_hidden_.defined(), "forward_draft_chain: forward_draft must come first in the step");
  MLA_CHECK(static_cast<int64_t>(hidden_rows.size()) == T && batch.num_seqs() == T &&
                static_cast<int64_t>(batch.logit_rows.size()) == T,
            "forward_draft_chain: {} tokens, {} sequences, {} logit rows and {} hidden rows (one of each per token)", T,
            batch.num_seqs(), batch.logit_rows.size(), hidden_rows.size());
  for (int32_t id : batch.input_ids)
    MLA_CHECK(id < 0 && -static_cast<int64_t>(id) <= drafts.numel(), "forward_draft_chain: input id {} names no draft",
              id);
  MLA_LOG_TRACE("rank {}: chained MTP forward of {} tokens", plan_.tp_rank, T);
  const Tensor previous = draft_hidden_;
  backend_.begin_substep(batch);
  Tensor hidden_in = backend_.scratch({T, H}, backend_.act_dtype());
  if (T > 0) {
    backend_.gather_rows(previous, hidden_rows, hidden_in);
    backend_.resolve_prev_ids(drafts);
  }
  return draft_layer(batch, hidden_in, cache, dp);
}

void DeepseekModel::check_draft_layer(const char* what, const KvCache& cache) const {
  MLA_CHECK(config_.mtp_layers > 0 && !layers_.empty(), "{}: the model was loaded without its MTP layer", what);
  MLA_CHECK(cache.num_layers() > config_.num_hidden_layers, "{}: the latent cache has no layer for the MTP layer",
            what);
}

Tensor DeepseekModel::draft_layer(const ForwardBatch& batch, const Tensor& hidden_in, KvCache& cache,
                                  const DpStepInfo* dp) {
  const auto& c = config_;
  const int64_t T = batch.num_tokens(), H = c.hidden_size, L = c.num_hidden_layers;
  const DType ad = backend_.act_dtype();
  const float eps = static_cast<float>(c.rms_norm_eps);
  // hidden = eh_proj([enorm(embed(next token)); hnorm(the input hidden state)]), the two halves of eh_proj as two
  // products summed; then one decoder layer and the shared head (the model's lm_head behind the MTP's own norm).
  Tensor residual = backend_.scratch({T, H}, ad), residual_next = backend_.scratch({T, H}, ad);
  Tensor normed = backend_.scratch({T, H}, ad), hidden = backend_.scratch({T, H}, ad);
  {
    const size_t mark = backend_.scratch_mark();
    Tensor e = embed_tokens(T);
    backend_.rmsnorm(e, mtp_enorm_, eps, normed);
    backend_.linear(normed, mtp_eh_embed_, hidden);
    backend_.rmsnorm(hidden_in, mtp_hnorm_, eps, normed);
    Tensor h2 = backend_.scratch({T, H}, ad);
    backend_.linear(normed, mtp_eh_hidden_, h2);
    backend_.add(hidden, h2);
    backend_.scratch_release(mark);
  }
  DpRows d = dp_rows(T, dp);
  backend_.zero(residual);
  decoder_layer(L, hidden, residual, residual_next, normed, cache, MlaForm::Auto, d);
  backend_.add_rmsnorm(hidden, residual, mtp_norm_, eps, normed);
  draft_hidden_ = normed;  // a chained draft's input (forward_draft_chain), valid until the next step
  return logits_of(batch, normed);
}

}  // namespace mlaserve
