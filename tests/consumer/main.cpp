// A downstream engine: includes the umbrella header from an installed prefix.
#include <tiledecode/tiledecode.hpp>

#include <cstdio>

int main() {
  const auto cfg = tiledecode::flash_config();
  const tiledecode::bf16 one(1.0f);
  std::printf("tiledecode consumer: %s heads=%d bf16(1)=0x%04x\n", cfg.name.data(), cfg.n_heads,
              one.bits);
  return one.to_float() == 1.0f ? 0 : 1;
}
