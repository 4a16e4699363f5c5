// Host emulation of the GEMV's decode (qpalette/runtime/cuda/qpalette_lanes.cuh, compiled here by
// g++ without CUDA): every lane of every group reads its words where the kernel's loads put them
// (block_word), takes lanes ℓ+1 and ℓ+2's words as the halo, decodes the 8 tiles with the kernel's own
// decoder and table geometry, and writes the unscaled values at the A-fragment positions.
// test_lanes.py compares the result with the PyTorch reference decode.
//
//   lanes_emulator FAMILY P0 P1 ROWS COLS DIR
// DIR holds lut.bin (uint32 entries), codes_a.bin [, codes_b.bin] (int32, lane-major);
// writes DIR/values.bin: (ROWS, COLS) uint16 value bits.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "qpalette_lanes.cuh"

using namespace qp;

static std::vector<uint32_t> read_words(const std::string& path) {
  std::vector<uint32_t> v;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return v;
  uint32_t w;
  while (std::fread(&w, 4, 1, f) == 1) v.push_back(w);
  std::fclose(f);
  return v;
}

template <class D>
static void decode_segment(const std::vector<uint32_t>& codes, const std::vector<uint32_t>& src, int rows,
                           int tiles, int col0, int cols, bool second_half, std::vector<uint16_t>& out) {
  using L = typename D::L;
  std::vector<uint32_t> lut(L::WORDS);
  for (int i = 0; i < L::WORDS; ++i) lut[i] = L::word(src.data(), i);
  const int cg = (tiles + GROUP_TILES - 1) / GROUP_TILES;
  const size_t blk = size_t(32) * D::WPG;
  for (int i = 0; i < rows / 16; ++i)
    for (int g = 0; g < cg; ++g) {
      const uint32_t* b = codes.data() + (size_t(i) * cg + g) * blk;
      for (int lane = 0; lane < 32; ++lane) {
        uint32_t c[D::WPG], nb[2 * D::WPG];
        for (int q = 0; q < D::WPG; ++q) {
          c[q] = b[block_word(D::WPG, lane, q, second_half)];
          for (int h = 0; h < 2; ++h) nb[h * D::WPG + q] = b[block_word(D::WPG, (lane + 1 + h) & 31, q, second_half)];
        }
        const uint32_t lanebits = L::lane_offset(lane);
        auto one = [&](auto u_const) {
          constexpr int U = decltype(u_const)::value;
          const int lt = g * GROUP_TILES + U;
          if (lt >= tiles) return;
          uint32_t a[4];
          D::template tile<U>(c, nb, lut.data(), lanebits, a);
          for (int k = 0; k < 4; ++k) {
            const int r = i * 16 + (lane >> 2) + 8 * (k & 1);
            const int col = col0 + lt * 16 + 2 * (lane & 3) + 8 * (k >> 1);
            out[size_t(r) * cols + col] = static_cast<uint16_t>(a[k] & 0xFFFFu);
            out[size_t(r) * cols + col + 1] = static_cast<uint16_t>(a[k] >> 16);
          }
        };
        one(std::integral_constant<int, 0>{}); one(std::integral_constant<int, 1>{});
        one(std::integral_constant<int, 2>{}); one(std::integral_constant<int, 3>{});
        one(std::integral_constant<int, 4>{}); one(std::integral_constant<int, 5>{});
        one(std::integral_constant<int, 6>{}); one(std::integral_constant<int, 7>{});
      }
    }
}

template <class DA, class DB>
static int run(bool half, int rows, int cols, const std::string& dir) {
  const auto lut = read_words(dir + "/lut.bin");
  const auto a = read_words(dir + "/codes_a.bin");
  std::vector<uint16_t> out(size_t(rows) * cols, 0);
  const int tiles = half ? cols / 32 : cols / 16;
  decode_segment<DA>(a, lut, rows, tiles, 0, cols, false, out);
  if (half) decode_segment<DB>(read_words(dir + "/codes_b.bin"), lut, rows, tiles, tiles * 16, cols, true, out);
  FILE* f = std::fopen((dir + "/values.bin").c_str(), "wb");
  if (!f) return 1;
  std::fwrite(out.data(), 2, out.size(), f);
  std::fclose(f);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: lanes_emulator FAMILY P0 P1 ROWS COLS DIR\n");
    return 2;
  }
  const std::string fam = argv[1];
  const int p0 = std::atoi(argv[2]), p1 = std::atoi(argv[3]), rows = std::atoi(argv[4]), cols = std::atoi(argv[5]);
  const std::string dir = argv[6];
#define PAIR(CB) if (fam == "pair" && p0 == CB) return run<PairLanes<CB>, PairLanes<CB>>(false, rows, cols, dir);
#define SCALAR(B) if (fam == "scalar" && p0 == B) return run<ScalarLanes<B>, ScalarLanes<B>>(false, rows, cols, dir);
#define TCQ(KV, Q) if (fam == "tcq" && p0 == KV && p1 == Q) return run<TcqLanes<KV, Q>, TcqLanes<KV, Q>>(false, rows, cols, dir);
#define HALF(KV, Q) \
  if (fam == "half-tcq" && p0 == KV && p1 == Q) return run<TcqLanes<KV, Q>, TcqLanes<KV + 1, Q>>(true, rows, cols, dir);
  PAIR(3) PAIR(4) PAIR(5) PAIR(6) PAIR(7) PAIR(8) PAIR(9) PAIR(10) PAIR(11) PAIR(12)
  SCALAR(6) SCALAR(7) SCALAR(8)
  TCQ(2, 9) TCQ(3, 9) TCQ(4, 9) TCQ(5, 9) TCQ(6, 9) TCQ(7, 9) TCQ(8, 9) TCQ(9, 10) TCQ(10, 11)
  HALF(2, 9) HALF(3, 9) HALF(4, 9) HALF(5, 9) HALF(6, 9) HALF(7, 9) HALF(8, 10) HALF(9, 11)
  std::fprintf(stderr, "no decoder for %s %d %d\n", fam.c_str(), p0, p1);
  return 3;
}
