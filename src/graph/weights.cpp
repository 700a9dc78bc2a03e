#include "graph/weights.h"

#include <cstring>
#include <set>

#include "core/error.h"

namespace plow {

namespace {

// On disk the dense FFN of layer 0 is `mlp.` or `block_sparse_moe.` depending on the writer
// (spec/MODEL.md §4.6, §11); MoE layers likewise. Try the declared name, then the other spelling.
std::vector<std::string> candidate_names(const std::string& name) {
  std::vector<std::string> names = {name};
  for (auto [from, to] : {std::pair<const char*, const char*>{".mlp.", ".block_sparse_moe."}, {".block_sparse_moe.", ".mlp."}}) {
    auto pos = name.find(from);
    if (pos != std::string::npos) names.push_back(name.substr(0, pos) + to + name.substr(pos + std::strlen(from)));
  }
  return names;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += fmt::format("{}{}", i ? "," : "", shape[i]);
  return text + "]";
}

int64_t count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool is_float(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

}  // namespace

BoundWeights::BoundWeights(const Graph& graph, const Checkpoint& checkpoint) {
  std::set<const TensorView*> claimed;
  const std::string& dir = checkpoint.dir();
  for (const WeightDecl& decl : graph.weights()) {
    BoundWeight bound;
    bound.decl = &decl;
    for (const std::string& part : decl.parts) {
      const TensorView* view = nullptr;
      for (const std::string& name : candidate_names(part)) {
        if ((view = checkpoint.find(name))) break;
      }
      if (!view) fail("checkpoint '{}': required tensor '{}' (shape {}) is missing", dir, part, shape_text(decl.shape));
      const bool shape_ok = view->shape == decl.shape || (decl.reshape_ok && view->numel() == count(decl.shape));
      if (!shape_ok) {
        fail("checkpoint '{}': tensor '{}' has shape {}, but config.json implies {}", dir, view->name,
             view->shape_string(), shape_text(decl.shape));
      }
      if (!is_float(view->dtype)) {
        fail("checkpoint '{}': tensor '{}' has dtype {}, expected F32, BF16 or F16", dir, view->name, dtype_name(view->dtype));
      }
      claimed.insert(view);
      bound.parts.push_back(view);
    }
    bound_.push_back(std::move(bound));
  }
  for (const auto& [name, view] : checkpoint.tensors()) {
    if (claimed.count(view)) continue;
    // A tied checkpoint may still carry lm_head.weight; it is harmless only if it equals the embedding.
    if (name.ends_with("lm_head.weight")) {
      const std::string embed = name.substr(0, name.size() - std::strlen("lm_head.weight")) + "model.embed_tokens.weight";
      const TensorView* table = checkpoint.find(embed);
      if (table && claimed.count(table) && table->nbytes == view->nbytes && table->dtype == view->dtype &&
          std::memcmp(table->data, view->data, view->nbytes) == 0) {
        continue;
      }
    }
    fail("checkpoint '{}': tensor '{}' (shape {}) is not used by the model that config.json describes", dir, name,
         view->shape_string());
  }
}

DType BoundWeights::storage_dtype() const {
  PLOW_CHECK(!bound_.empty(), "no weights bound");
  return bound_.front().parts.front()->dtype;
}

}  // namespace plow
