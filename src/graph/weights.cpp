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

// The shape of the whole checkpoint tensor a (possibly tensor-parallel) declaration reads.
std::vector<int64_t> whole_shape(const WeightDecl& decl) {
  std::vector<int64_t> shape = decl.shape;
  if (decl.shard_axis >= 0) shape.at(static_cast<size_t>(decl.shard_axis)) *= decl.shard_count;
  return shape;
}

}  // namespace

const TensorView* BoundWeights::shard_of(const TensorView& whole, const WeightDecl& decl) {
  TensorView view;
  view.name = fmt::format("{} (rank {} of {})", whole.name, decl.shard_rank, decl.shard_count);
  view.dtype = whole.dtype;
  view.shape = decl.shape;
  const auto rank = static_cast<size_t>(decl.shard_rank);
  if (whole.is_mxfp4()) {  // rows of [out, in/2] codes and [out, in/32] scales
    const auto out = static_cast<size_t>(decl.shape.at(0)), in = static_cast<size_t>(decl.shape.at(1));
    const size_t whole_in = static_cast<size_t>(whole.shape.at(1));
    if (decl.shard_axis == 0) {
      view.data = whole.data + rank * out * (in / 2);
      view.mx_scales = whole.mx_scales + rank * out * (in / 32);
      view.nbytes = out * (in / 2);
      shard_views_.push_back(std::move(view));
      return &shard_views_.back();
    }
    std::vector<uint8_t>& bytes = shard_bytes_.emplace_back(out * (in / 2 + in / 32));
    for (size_t r = 0; r < out; ++r) {
      std::memcpy(bytes.data() + r * (in / 2), whole.data + r * (whole_in / 2) + rank * (in / 2), in / 2);
      std::memcpy(bytes.data() + out * (in / 2) + r * (in / 32), whole.mx_scales + r * (whole_in / 32) + rank * (in / 32), in / 32);
    }
    view.data = bytes.data();
    view.mx_scales = bytes.data() + out * (in / 2);
    view.nbytes = out * (in / 2);
    shard_views_.push_back(std::move(view));
    return &shard_views_.back();
  }
  const size_t element = dtype_size(whole.dtype);
  if (decl.shard_axis == 0 || decl.reshape_ok) {  // a contiguous block
    view.nbytes = whole.nbytes / static_cast<size_t>(decl.shard_count);
    view.data = whole.data + rank * view.nbytes;
    shard_views_.push_back(std::move(view));
    return &shard_views_.back();
  }
  PLOW_CHECK(decl.shard_axis == 1 && decl.shape.size() == 2, "weight '{}': column blocks of a {}-d tensor", decl.name, decl.shape.size());
  const auto rows = static_cast<size_t>(decl.shape[0]), row_bytes = static_cast<size_t>(decl.shape[1]) * element;
  std::vector<uint8_t>& bytes = shard_bytes_.emplace_back(rows * row_bytes);
  for (size_t r = 0; r < rows; ++r) std::memcpy(bytes.data() + r * row_bytes, whole.data + r * row_bytes * decl.shard_count + rank * row_bytes, row_bytes);
  view.data = bytes.data();
  view.nbytes = bytes.size();
  shard_views_.push_back(std::move(view));
  return &shard_views_.back();
}

const TensorView* BoundWeights::bind_mxfp4(const WeightDecl& decl, const std::vector<int64_t>& shape, const std::string& part,
                                           const Checkpoint& checkpoint, std::set<const TensorView*>& claimed) {
  const std::string& dir = checkpoint.dir();
  const int64_t out = shape.at(0), in = shape.at(1);
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
  view.shape = shape;
  view.data = tensors[0]->data;
  view.nbytes = tensors[0]->nbytes;
  view.mx_scales = tensors[1]->data;
  mxfp4_views_.push_back(std::move(view));
  return decl.shard_count > 1 ? shard_of(mxfp4_views_.back(), decl) : &mxfp4_views_.back();
}

BoundWeights::BoundWeights(const Graph& graph, const Checkpoint& checkpoint, const std::string& text_prefix) {
  std::set<const TensorView*> claimed;
  const std::string& dir = checkpoint.dir();
  for (const WeightDecl& decl : graph.weights()) {
    BoundWeight bound;
    bound.decl = &decl;
    const std::vector<int64_t> shape = whole_shape(decl);
    for (const std::string& part : decl.parts) {
      if (decl.mxfp4) {
        bound.parts.push_back(bind_mxfp4(decl, shape, part, checkpoint, claimed));
        continue;
      }
      const TensorView* view = nullptr;
      for (const std::string& name : candidate_names(part)) {
        if ((view = checkpoint.find(name))) break;
      }
      if (!view) fail("checkpoint '{}': required tensor '{}' (shape {}) is missing", dir, part, shape_text(shape));
      const bool shape_ok = view->shape == shape || (decl.reshape_ok && view->numel() == count(shape));
      if (!shape_ok) {
        fail("checkpoint '{}': tensor '{}' has shape {}, but config.json implies {}", dir, view->name,
             view->shape_string(), shape_text(shape));
      }
      if (!is_float(view->dtype)) {
        fail("checkpoint '{}': tensor '{}' has dtype {}, expected F32, BF16 or F16", dir, view->name, dtype_name(view->dtype));
      }
      claimed.insert(view);
      bound.parts.push_back(decl.shard_count > 1 ? shard_of(*view, decl) : view);
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
