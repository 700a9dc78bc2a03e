// Sampling defaults from a checkpoint's generation_config.json, as vLLM applies them: a request that
// omits temperature, top_p, top_k, min_p or repetition_penalty gets the model's value; its
// eos_token_id (an id or a list) joins the config's stop ids. A missing file changes nothing; a
// malformed one is a plow::Error naming the file, the field and the value.
#pragma once

#include <string>

#include "serve/openai_params.h"

namespace plow {

void apply_generation_config(const std::string& model_dir, ServedModel& model);

}  // namespace plow
