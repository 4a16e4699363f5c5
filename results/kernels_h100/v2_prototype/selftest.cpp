// Host-only check (no GPU): the new layout + per-lane window extraction + sign-folded 32-copy
// table give exactly the reference decode of today's format, for KV = 4, 6, 8.
// g++ -O2 -std=c++17 -o selftest selftest.cpp && ./selftest
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tcq_common.cuh"

using namespace kv2;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return static_cast<uint32_t>(rng >> 11);
}

template <int KV>
static int check(int groups) {
  uint32_t T[512];
  for (auto& t : T) t = rnd();
  std::vector<uint32_t> lut(32768);
  for (int e = 0; e < 1024; ++e)
    for (int c = 0; c < 32; ++c) lut[e * 32 + c] = T[e & 511] ^ ((e & 512) ? 0x8000u : 0u);
  int bad = 0;
  for (int g = 0; g < groups; ++g) {
    std::vector<uint32_t> tiles(8 * 4 * KV);
    for (auto& w : tiles) w = rnd();
    // pack the block as the GPU sees it
    std::vector<uint32_t> block(32 * KV);
    for (int l = 0; l < 32; ++l) {
      uint32_t own[8], w[8];
      for (int u = 0; u < 8; ++u) own[u] = own_bits(&tiles[u * 4 * KV], KV, l);
      pack_lane(KV, own, w);
      for (int q = 0; q < KV; ++q) block[block_word(KV, l, q)] = w[q];
    }
    for (int l = 0; l < 32; ++l) {
      uint32_t c[KV], n[KV];
      for (int q = 0; q < KV; ++q) {
        c[q] = block[block_word(KV, l, q)];
        n[q] = block[block_word(KV, (l + 1) & 31, q)];
      }
      uint32_t w[8][4];
      Lay<KV>::windows(c, n, w);
      for (int u = 0; u < 8; ++u)
        for (int k = 0; k < 4; ++k) {
          const uint32_t s = ref_state(&tiles[u * 4 * KV], KV, 4 * l + k);
          const uint32_t v = lut[lut_off(w[u][k], static_cast<uint32_t>(l) << 2) >> 2];
          const uint32_t vr = ref_value(s, T);
          if ((w[u][k] & 0xFFFFu) != s || v != vr) {
            if (bad < 10)
              printf("KV=%d group %d lane %d tile %d step %d: window %04x state %04x value %08x ref %08x\n",
                     KV, g, l, u, k, w[u][k] & 0xFFFFu, s, v, vr);
            ++bad;
          }
        }
    }
  }
  printf("KV=%d: %d groups x 8 tiles x 128 steps checked, %d mismatches\n", KV, groups, bad);
  return bad;
}

int main() {
  int bad = check<4>(200) + check<6>(200) + check<8>(200);
  printf(bad ? "SELFTEST FAILED\n" : "SELFTEST OK\n");
  return bad ? 1 : 0;
}
