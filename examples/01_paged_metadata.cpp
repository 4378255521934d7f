#include <cstdio>
#include "tiledecode/tiledecode.hpp"
int main() { std::puts("placeholder"); }
