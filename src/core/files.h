// Files the server writes for its callers (expert distribution dumps, profiles).
#pragma once

#include <filesystem>
#include <string_view>

namespace mlaserve {

// Writes `text` to `path` whole: its folder made if absent, the text written beside it and renamed into place (a
// reader never sees a part). Throws mlaserve::Error naming the file or folder that failed.
void write_file(const std::filesystem::path& path, std::string_view text);

}  // namespace mlaserve
