#pragma once
// The op functions of torch.ops.tiledecode (one definition each, in the TU of its family;
// register.cpp declares the schemas). Destination first, as in the library; every op returns
// nothing and writes its outputs / caches in place (the schemas mark them Tensor(a!)).

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "binding.hpp"

namespace tdpy {

// ---- pools as rows (ops_paged.cpp): [blocks, page, (1,) W] → [blocks * page, W] without a copy
td::View<float, 2> state_rows(const at::Tensor& t, std::string_view op, std::string_view arg);
td::View<td::bf16, 2> bf16_rows(const at::Tensor& t, std::string_view op, std::string_view arg);
td::View<std::int8_t, 2> int8_rows(const at::Tensor& t, std::string_view op, std::string_view arg);
td::View<float, 1> scale_rows(const at::Tensor& t, std::string_view op, std::string_view arg);

// ---- ops_paged.cpp
c10::Dict<std::string, at::Tensor> metadata_tensors(const c10::intrusive_ptr<StepMetadata>& md);
std::tuple<at::Tensor, at::Tensor> rope_table(std::int64_t kind, std::int64_t length,
                                              const std::string& config);

// ---- ops_layer.cpp
c10::Dict<std::string, at::Tensor> workspace_tensors(const c10::intrusive_ptr<Workspace>& ws,
                                                     std::int64_t batch, std::int64_t seq);

}  // namespace tdpy
