// Stand-in for make_engine while the engine is not on this branch yet (see CMakeLists.txt).
#include "core/error.h"
#include "engine/engine_api.h"

namespace mlaserve {
std::unique_ptr<EngineClient> make_engine(const EngineArgs&) {
  fail("this build has no serving engine yet (src/engine does not define make_engine)");
}
}  // namespace mlaserve
