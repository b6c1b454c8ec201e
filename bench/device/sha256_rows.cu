// SHA-256 of each row of a row-major matrix: one thread per row, row_bytes a multiple of 64.
// The same source builds as plain C++ (g++ -DHOST_TEST) to check it against hashlib off the GPU.
#ifdef HOST_TEST
#define __device__
#define __constant__ static const
#define __forceinline__ inline
#endif
#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

__constant__ unsigned int SHA_K[64] = {
  0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
  0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
  0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
  0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
  0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
  0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
  0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
  0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

__device__ __forceinline__ unsigned int sha_bswap(unsigned int x) {
  return (x >> 24) | ((x >> 8) & 0x0000ff00u) | ((x << 8) & 0x00ff0000u) | (x << 24);
}

__device__ __forceinline__ void sha_compress(unsigned int *h, unsigned int *w) {
  unsigned int a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
#pragma unroll
  for (int t = 0; t < 64; t++) {
    if (t >= 16) {
      unsigned int w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
      unsigned int s0 = ROTR(w15, 7) ^ ROTR(w15, 18) ^ (w15 >> 3);
      unsigned int s1 = ROTR(w2, 17) ^ ROTR(w2, 19) ^ (w2 >> 10);
      w[t & 15] = w[t & 15] + s0 + w[(t - 7) & 15] + s1;
    }
    unsigned int S1 = ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25);
    unsigned int ch = (e & f) ^ (~e & g);
    unsigned int t1 = hh + S1 + ch + SHA_K[t] + w[t & 15];
    unsigned int S0 = ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22);
    unsigned int mj = (a & b) ^ (a & c) ^ (b & c);
    unsigned int t2 = S0 + mj;
    hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

// row: 4-byte aligned pointer to row_bytes bytes (row_bytes % 64 == 0); out: 32 digest bytes
__device__ __forceinline__ void sha256_row(const unsigned int *row, unsigned long long row_bytes, unsigned char *out) {
  unsigned int h[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                       0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
  unsigned int w[16];
  unsigned long long nblocks = row_bytes / 64;
  for (unsigned long long blk = 0; blk < nblocks; blk++) {
    const unsigned int *p = row + blk * 16;
#pragma unroll
    for (int i = 0; i < 16; i++) w[i] = sha_bswap(p[i]);
    sha_compress(h, w);
  }
  unsigned long long bits = row_bytes * 8ull;
  w[0] = 0x80000000u;
#pragma unroll
  for (int i = 1; i < 14; i++) w[i] = 0u;
  w[14] = (unsigned int)(bits >> 32);
  w[15] = (unsigned int)(bits & 0xffffffffu);
  sha_compress(h, w);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    out[4 * i + 0] = (unsigned char)(h[i] >> 24);
    out[4 * i + 1] = (unsigned char)(h[i] >> 16);
    out[4 * i + 2] = (unsigned char)(h[i] >> 8);
    out[4 * i + 3] = (unsigned char)(h[i]);
  }
}

#ifdef HOST_TEST
extern "C" void sha256_rows_host(const unsigned char *data, unsigned long long row_bytes, unsigned long long nrows, unsigned char *out) {
  for (unsigned long long r = 0; r < nrows; r++)
    sha256_row((const unsigned int *)(data + r * row_bytes), row_bytes, out + 32 * r);
}
#else
extern "C" __global__ void sha256_rows(const unsigned char *data, unsigned long long row_bytes,
                                       unsigned long long nrows, unsigned char *out) {
  unsigned long long r = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= nrows) return;
  sha256_row((const unsigned int *)(data + r * row_bytes), row_bytes, out + 32 * r);
}
#endif
