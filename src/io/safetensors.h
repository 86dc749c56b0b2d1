// Safetensors: memory-mapped reading of one file or a sharded checkpoint (model.safetensors.index.json),
// and writing of small files (eval-logits output, tests). Layout of a file:
//   [u64 little-endian header_len][header_len bytes of JSON][data]; each JSON entry is
//   name -> {"dtype", "shape", "data_offsets": [begin, end)} relative to the start of data.
// Every error names the file and, where there is one, the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mlaserve {

struct TensorInfo {
  std::string name;
  std::string file;  // path of the file holding it
  DType dtype = DType::F32;
  Shape shape;
  const uint8_t* data = nullptr;  // into the mapping; valid while the owning file is open
  size_t nbytes = 0;
};

class MappedFile;

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorInfo& get(const std::string& name) const;
  // A host tensor view of the mapped data (kept alive by the returned tensor).
  Tensor tensor(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<MappedFile> map_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A whole checkpoint directory: model.safetensors.index.json with its shards, or one model.safetensors
// (or, failing both, every *.safetensors file in the directory).
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  // Throws naming the tensor and the checkpoint when it is absent.
  const TensorInfo& get(const std::string& name) const;
  std::vector<std::string> names() const;
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> where_;
};

// Writes tensors (host memory) to a safetensors file, sorted by name.
void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace mlaserve
