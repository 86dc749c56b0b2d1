#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/log.h"

namespace mlaserve {

namespace fs = std::filesystem;
using json = nlohmann::json;

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MLA_CHECK(fd_ >= 0, "{}: cannot open: {}", path, std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      int e = errno;
      ::close(fd_);
      fail("{}: cannot stat: {}", path, std::strerror(e));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
      if (p == MAP_FAILED) {
        int e = errno;
        ::close(fd_);
        fail("{}: cannot mmap: {}", path, std::strerror(e));
      }
      data_ = static_cast<const uint8_t*>(p);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  map_ = std::make_shared<MappedFile>(path);
  const size_t size = map_->size();
  MLA_CHECK(size >= 8, "{}: truncated file: {} bytes, too short for the 8-byte header length", path, size);
  uint64_t header_len = 0;
  std::memcpy(&header_len, map_->data(), 8);  // little-endian host
  MLA_CHECK(header_len <= size - 8, "{}: corrupt header: header length {} exceeds the file size {} (truncated?)",
            path, header_len, size);
  MLA_CHECK(header_len <= (100u << 20), "{}: corrupt header: header length {} is implausibly large", path,
            header_len);
  const char* hp = reinterpret_cast<const char*>(map_->data() + 8);
  json header;
  try {
    header = json::parse(hp, hp + header_len);
  } catch (const json::exception& e) {
    fail("{}: corrupt header: not valid JSON ({})", path, e.what());
  }
  MLA_CHECK(header.is_object(), "{}: corrupt header: expected a JSON object", path);
  const uint8_t* data_start = map_->data() + 8 + header_len;
  const size_t data_size = size - 8 - header_len;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (it->is_object())
        for (auto m = it->begin(); m != it->end(); ++m)
          if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
      continue;
    }
    const json& e = *it;
    MLA_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"),
              "{}: corrupt header: entry for tensor '{}' lacks dtype/shape/data_offsets", path, name);
    MLA_CHECK(e["dtype"].is_string(), "{}: corrupt header: dtype of tensor '{}' is not a string", path, name);
    const std::string dt = e["dtype"].get<std::string>();
    auto dtype = dtype_from_name(dt);
    MLA_CHECK(dtype.has_value(), "{}: tensor '{}' has unknown dtype '{}'", path, name, dt);
    TensorInfo info;
    info.name = name;
    info.file = path;
    info.dtype = *dtype;
    MLA_CHECK(e["shape"].is_array(), "{}: corrupt header: shape of tensor '{}' is not an array", path, name);
    for (const auto& d : e["shape"]) {
      MLA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0,
                "{}: corrupt header: tensor '{}' has an invalid dimension {}", path, name, d.dump());
      info.shape.push_back(d.get<int64_t>());
    }
    const json& off = e["data_offsets"];
    MLA_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
              "{}: corrupt header: data_offsets of tensor '{}' must be two non-negative integers", path, name);
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    MLA_CHECK(b <= en, "{}: corrupt header: tensor '{}' has data_offsets [{}, {}) with begin > end", path, name, b,
              en);
    MLA_CHECK(en <= data_size, "{}: truncated file: tensor '{}' needs bytes [{}, {}) but the data section has {}",
              path, name, b, en, data_size);
    // The byte count, checked: a shape whose count overflows is corrupt (it would wrap to a small count).
    uint64_t expect = dtype_size(info.dtype);
    if (std::find(info.shape.begin(), info.shape.end(), 0) != info.shape.end()) expect = 0;
    for (int64_t d : info.shape) {
      if (d != 0 && expect > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
        fail("{}: corrupt header: tensor '{}' has shape {}, more bytes than any file holds", path, name,
             shape_str(info.shape));
      expect *= static_cast<uint64_t>(d);
    }
    MLA_CHECK(en - b == expect, "{}: corrupt header: tensor '{}' of dtype {} and shape {} needs {} bytes, has {}",
              path, name, dt, shape_str(info.shape), expect, en - b);
    info.data = data_start + b;
    info.nbytes = static_cast<size_t>(en - b);
    tensors_.emplace(name, std::move(info));
  }
}

SafetensorsFile::~SafetensorsFile() = default;

const TensorInfo& SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  MLA_CHECK(it != tensors_.end(), "{}: missing tensor '{}'", path_, name);
  return it->second;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& i = get(name);
  return Tensor::view(const_cast<uint8_t*>(i.data), i.shape, i.dtype, Device::CPU, map_);
}

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  MLA_CHECK(fs::is_directory(dir), "model path '{}' is not a directory", dir);
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::vector<std::string> file_names;
  std::map<std::string, std::string> index_map;  // tensor -> file, from the index
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    json idx;
    try {
      idx = json::parse(in);
    } catch (const json::exception& e) {
      fail("{}: not valid JSON ({})", index_path.string(), e.what());
    }
    MLA_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
              "{}: missing the 'weight_map' object", index_path.string());
    std::set<std::string> uniq;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      MLA_CHECK(it->is_string(), "{}: weight_map entry for '{}' is not a file name", index_path.string(), it.key());
      index_map[it.key()] = it->get<std::string>();
      uniq.insert(it->get<std::string>());
    }
    file_names.assign(uniq.begin(), uniq.end());
    for (const auto& f : file_names)
      MLA_CHECK(fs::exists(fs::path(dir) / f), "{}: shard file '{}' named in the index does not exist",
                index_path.string(), (fs::path(dir) / f).string());
  } else if (fs::exists(single)) {
    file_names.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") file_names.push_back(e.path().filename().string());
    std::sort(file_names.begin(), file_names.end());
    MLA_CHECK(!file_names.empty(),
              "model path '{}' holds no weights: expected model.safetensors.index.json or *.safetensors "
              "(use --load-format dummy for random weights)",
              dir);
  }
  for (const auto& f : file_names) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / f).string()));
    for (const auto& [name, info] : files_.back()->tensors()) {
      auto [it, inserted] = where_.emplace(name, &info);
      MLA_CHECK(inserted, "tensor '{}' appears in both {} and {}", name, it->second->file, info.file);
    }
  }
  for (const auto& [name, file] : index_map) {
    auto it = where_.find(name);
    MLA_CHECK(it != where_.end(), "missing tensor '{}': the index names file '{}' but the tensor is not in it", name,
              (fs::path(dir) / file).string());
  }
}

const TensorInfo& Checkpoint::get(const std::string& name) const {
  auto it = where_.find(name);
  MLA_CHECK(it != where_.end(), "missing tensor '{}' in checkpoint '{}'", name, dir_);
  return *it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [n, _] : where_) out.push_back(n);
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    MLA_CHECK(t.device() == Device::CPU, "write_safetensors: tensor '{}' is not in host memory", name);
    header[name] = {{"dtype", dtype_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {off, off + t.nbytes()}}};
    off += t.nbytes();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MLA_CHECK(out.good(), "{}: cannot open for writing", path);
  uint64_t hl = h.size();
  out.write(reinterpret_cast<const char*>(&hl), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& [name, t] : tensors) out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  MLA_CHECK(out.good(), "{}: write failed", path);
}

}  // namespace mlaserve
