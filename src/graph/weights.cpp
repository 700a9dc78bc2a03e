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

const TensorView* BoundWeights::bind_mxfp4(const WeightDecl& decl, const std::string& part, const Checkpoint& checkpoint,
                                           std::set<const TensorView*>& claimed) {
  const std::string& dir = checkpoint.dir();
  const int64_t out = decl.shape.at(0), in = decl.shape.at(1);
  if (in % 32 != 0) fail("checkpoint '{}': MXFP4 weight '{}' has input width {}, not a multiple of the 32-element block", dir, part, in);
  const TensorView* tensors[2] = {nullptr, nullptr};
  const char* suffixes[2] = {"_packed", "_scale"};
  const std::vector<int64_t> shapes[2] = {{out, in / 2}, {out, in / 32}};
  for (int j = 0; j < 2; ++j) {
    for (const std::string& name : candidate_names(part + suffixes[j])) {
      if ((tensors[j] = checkpoint.find(name))) break;
    }
    if (!tensors[j]) fail("checkpoint '{}': required tensor '{}{}' (U8 {}) is missing", dir, part, suffixes[j], shape_text(shapes[j]));
    if (tensors[j]->dtype != DType::U8 || tensors[j]->shape != shapes[j]) {
      fail("checkpoint '{}': tensor '{}' is {} {}, but config.json implies U8 {} (MXFP4 of [{},{}])", dir, tensors[j]->name,
           dtype_name(tensors[j]->dtype), tensors[j]->shape_string(), shape_text(shapes[j]), out, in);
    }
    claimed.insert(tensors[j]);
  }
  TensorView view;
  view.name = part;
  view.dtype = DType::U8;
  view.shape = decl.shape;
  view.data = tensors[0]->data;
  view.nbytes = tensors[0]->nbytes;
  view.mx_scales = tensors[1]->data;
  mxfp4_views_.push_back(std::move(view));
  return &mxfp4_views_.back();
}

BoundWeights::BoundWeights(const Graph& graph, const Checkpoint& checkpoint, const std::string& text_prefix) {
  std::set<const TensorView*> claimed;
  const std::string& dir = checkpoint.dir();
  for (const WeightDecl& decl : graph.weights()) {
    BoundWeight bound;
    bound.decl = &decl;
    for (const std::string& part : decl.parts) {
      if (decl.mxfp4) {
        bound.parts.push_back(bind_mxfp4(decl, part, checkpoint, claimed));
        continue;
      }
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
    if (claimed.count(view) || !name.starts_with(text_prefix)) continue;
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
