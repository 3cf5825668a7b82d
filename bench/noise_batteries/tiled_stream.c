/* The tiled impl's noise (torch_pallas/kernels/prng.py; docs/noise.md, The generators) as a
 * stream of 32-bit words on stdout, for PractRand's `RNG_test stdin32`, written from the
 * specification; bench/noise_batteries/run.py checks it bit for bit against the kernels first.
 *
 * The stream is a tensor of (rows, 1024) read in element order: its (64, 1024) tiles one after
 * another, each Threefry-2x32-13 keyed by the seed's mixed key words over the counter (tile index,
 * position in the tile's hash grid). With 32-bit uniforms a tile's grid is (32, 1024) and its rows
 * are word 0's then word 1's; with 16-bit uniforms (dropout's) the grid is (16, 1024), the four
 * slabs word 0's low half, its high half, word 1's low half, its high half, and two consecutive
 * elements' uniforms make one output word (the first in the high half).
 *
 * usage: tiled_stream [--unmixed] [--rounds R] [--uniform-bits 16|32] [--check N] SEED [SEED2 [SHIFT]]
 *   one seed: its stream; two: their words interleaved (seed 1's element i, seed 2's element
 *   i + SHIFT, ...); --check N prints the first N words of seed 1 in hex and stops;
 *   --unmixed keys the hash by the seed's words themselves (the tiled impl until 2026-12-02).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LANES 1024
#define TILE_ROWS 64
#define TILE_WORDS (TILE_ROWS * LANES)

static const int rotations[8] = {13, 15, 26, 6, 17, 29, 16, 24};

static inline uint32_t rotate_left(uint32_t x, int distance) { return x << distance | x >> (32 - distance); }

/* Random123's threefry2x32_R(rounds, counter = (*x0, *x1), key = (k0, k1)), in place. */
static inline void threefry2x32(uint32_t k0, uint32_t k1, uint32_t *x0, uint32_t *x1, int rounds) {
    const uint32_t schedule[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    uint32_t a = *x0 + k0, b = *x1 + k1;
    for (int r = 0; r < rounds; r++) {
        a += b;
        b = rotate_left(b, rotations[r % 8]) ^ a;
        if (r % 4 == 3) {
            int injection = r / 4 + 1;
            a += schedule[injection % 3];
            b += schedule[(injection + 1) % 3] + (uint32_t)injection;
        }
    }
    *x0 = a;
    *x1 = b;
}

typedef struct {
    uint32_t k0, k1;
    int rounds, uniform_bits;
    uint64_t tile;          /* the next tile to draw */
    uint32_t words[TILE_WORDS];
    int next;               /* the next unread word of `words` */
} Stream;

static void stream_init(Stream *s, uint64_t seed, int mixed, int rounds, int uniform_bits) {
    uint32_t high = (uint32_t)(seed >> 32), low = (uint32_t)seed;
    if (mixed) threefry2x32(0x13198A2Eu, 0x03707344u, &high, &low, 20);
    s->k0 = high;
    s->k1 = low;
    s->rounds = rounds;
    s->uniform_bits = uniform_bits;
    s->tile = 0;
    s->next = TILE_WORDS;
}

/* One tile's elements in row-major order: 32 bits each, or 16-bit uniforms packed in pairs (a
 * tile of them then fills half of `words`, read as the output words). */
static void draw_tile(Stream *s) {
    uint32_t tile = (uint32_t)s->tile++;  /* a tile index wraps modulo 2**32 as in the kernels */
    if (s->uniform_bits == 32) {
        const int positions = TILE_WORDS / 2;
        for (int p = 0; p < positions; p++) {
            uint32_t y0 = tile, y1 = (uint32_t)p;
            threefry2x32(s->k0, s->k1, &y0, &y1, s->rounds);
            s->words[p] = y0;
            s->words[positions + p] = y1;
        }
        s->next = 0;
        return;
    }
    const int positions = TILE_WORDS / 4;
    static uint16_t uniforms[TILE_WORDS];
    for (int p = 0; p < positions; p++) {
        uint32_t y0 = tile, y1 = (uint32_t)p;
        threefry2x32(s->k0, s->k1, &y0, &y1, s->rounds);
        uniforms[p] = (uint16_t)y0;
        uniforms[positions + p] = (uint16_t)(y0 >> 16);
        uniforms[2 * positions + p] = (uint16_t)y1;
        uniforms[3 * positions + p] = (uint16_t)(y1 >> 16);
    }
    for (int i = 0; i < TILE_WORDS / 2; i++) s->words[TILE_WORDS / 2 + i] = (uint32_t)uniforms[2 * i] << 16 | uniforms[2 * i + 1];
    s->next = TILE_WORDS / 2;
}

static inline uint32_t stream_next(Stream *s) {
    if (s->next == TILE_WORDS) draw_tile(s);
    return s->words[s->next++];
}

static Stream first, second;

int main(int argc, char **argv) {
    int mixed = 1, rounds = 13, uniform_bits = 32;
    long check = 0;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (!strcmp(argv[i], "--unmixed")) mixed = 0;
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--uniform-bits") && i + 1 < argc) uniform_bits = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--check") && i + 1 < argc) check = atol(argv[++i]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (i >= argc || (uniform_bits != 16 && uniform_bits != 32)) {
        fprintf(stderr, "usage: tiled_stream [--unmixed] [--rounds R] [--uniform-bits 16|32] [--check N] SEED [SEED2 [SHIFT]]\n");
        return 2;
    }
    int pair = i + 1 < argc;
    stream_init(&first, strtoull(argv[i], NULL, 0), mixed, rounds, uniform_bits);
    if (pair) {
        stream_init(&second, strtoull(argv[i + 1], NULL, 0), mixed, rounds, uniform_bits);
        long shift = i + 2 < argc ? atol(argv[i + 2]) : 0;
        for (long k = 0; k < shift; k++) stream_next(&second);
    }
    if (check) {
        for (long k = 0; k < check; k++) printf("%08x\n", stream_next(&first));
        return 0;
    }
    static uint32_t buffer[1 << 16];
    for (;;) {
        for (int k = 0; k < (1 << 16); k += 1 + pair) {
            buffer[k] = stream_next(&first);
            if (pair) buffer[k + 1] = stream_next(&second);
        }
        if (fwrite(buffer, sizeof buffer, 1, stdout) != 1) return 0;  /* the reader stopped */
    }
}
