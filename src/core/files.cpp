#include "core/files.h"

#include <fstream>

#include "core/error.h"

namespace mlaserve {

void write_file(const std::filesystem::path& path, std::string_view text) {
  std::error_code ec;
  if (path.has_parent_path()) {
    std::filesystem::create_directories(path.parent_path(), ec);
    MLA_CHECK(!ec, "cannot make the folder '{}': {}", path.parent_path().string(), ec.message());
  }
  std::filesystem::path tmp = path;
  tmp += ".part";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    MLA_CHECK(out.good(), "cannot write '{}'", tmp.string());
  }
  std::filesystem::rename(tmp, path, ec);
  MLA_CHECK(!ec, "cannot write '{}': {}", path.string(), ec.message());
}

}  // namespace mlaserve
