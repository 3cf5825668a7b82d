/* torch_pallas.sample_tokens' noise (torch_pallas/kernels/token_sampling.py, steps 1 and 2 of its
 * contract) as a stream of 32-bit words on stdout, for PractRand's `RNG_test stdin32`, written
 * from the specification; bench/noise_batteries/run.py checks it bit for bit against the kernels
 * first.
 *
 * A row (seed, position) is keyed by Threefry-2x32-20 of the seed's words (high, low) under the
 * fixed key (0x9E3779B9, 0x243F6A88), whose output keys Threefry-2x32-20 of (0, position); its
 * vocabulary entry v gets the two output words of Threefry-2x32-20 of (0, v) under the row key,
 * xor-ed (jax.random.bits of the row key).
 *
 * The stream interleaves the rows (s, p), (s + 1, p), (s, p + 1), (s + 1, p + 1) word by word over
 * a vocabulary of V entries, then p += 2: what users number requests and tokens by, seeds and
 * positions one apart, and (s + 1, p) beside (s, p + 1).
 *
 * usage: sampler_stream [--vocabulary V] [--check N] SEED [POSITION]
 *   --check N prints the first N words of row (SEED, POSITION) alone in hex and stops.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int rotations[8] = {13, 15, 26, 6, 17, 29, 16, 24};

static inline uint32_t rotate_left(uint32_t x, int distance) { return x << distance | x >> (32 - distance); }

/* Random123's threefry2x32_R(20, counter = (*x0, *x1), key = (k0, k1)), in place. */
static inline void threefry2x32_20(uint32_t k0, uint32_t k1, uint32_t *x0, uint32_t *x1) {
    const uint32_t schedule[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    uint32_t a = *x0 + k0, b = *x1 + k1;
    for (int r = 0; r < 20; r++) {
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

static void row_key(uint64_t seed, uint32_t position, uint32_t key[2]) {
    uint32_t high = (uint32_t)(seed >> 32), low = (uint32_t)seed;
    threefry2x32_20(0x9E3779B9u, 0x243F6A88u, &high, &low);
    uint32_t y0 = 0, y1 = position;
    threefry2x32_20(high, low, &y0, &y1);
    key[0] = y0;
    key[1] = y1;
}

static inline uint32_t entry_bits(const uint32_t key[2], uint32_t v) {
    uint32_t y0 = 0, y1 = v;
    threefry2x32_20(key[0], key[1], &y0, &y1);
    return y0 ^ y1;
}

int main(int argc, char **argv) {
    uint32_t vocabulary = 128256;
    long check = 0;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (!strcmp(argv[i], "--vocabulary") && i + 1 < argc) vocabulary = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--check") && i + 1 < argc) check = atol(argv[++i]);
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (i >= argc) {
        fprintf(stderr, "usage: sampler_stream [--vocabulary V] [--check N] SEED [POSITION]\n");
        return 2;
    }
    uint64_t seed = strtoull(argv[i], NULL, 0);
    uint32_t position = i + 1 < argc ? (uint32_t)strtoul(argv[i + 1], NULL, 0) : 0;
    uint32_t keys[4][2];
    if (check) {
        row_key(seed, position, keys[0]);
        for (long k = 0; k < check; k++) printf("%08x\n", entry_bits(keys[0], (uint32_t)(k % vocabulary)));
        return 0;
    }
    static uint32_t buffer[1 << 16];
    int filled = 0;
    for (;; position += 2) {
        for (int r = 0; r < 4; r++) row_key(seed + (uint64_t)(r & 1), position + (uint32_t)(r >> 1), keys[r]);
        for (uint32_t v = 0; v < vocabulary; v++) {
            for (int r = 0; r < 4; r++) buffer[filled++] = entry_bits(keys[r], v);
            if (filled == (1 << 16)) {
                if (fwrite(buffer, sizeof buffer, 1, stdout) != 1) return 0;  /* the reader stopped */
                filled = 0;
            }
        }
    }
}
