"""Variants of runtime/q4sdpa.py for decomposing the one-row time: z (no key tiles), p (no query prologue)."""
import sys
src = open("runtime/q4sdpa.py").read()
def put(name, s):
    s = s.replace('"kvactors_q4_decode_', f'"kvactors_{name}_q4_decode_')
    open(f".gpu/q4sdpa_{name}.py", "w").write(s)
old = "const int tiles = base0 < hi ? (hi - base0 + step - 1) / step : 0;"
assert old in src
put("z", src.replace(old, "const int tiles = 0;"))
# p: warp 0 writes zero fragments; no query loads, no RoPE angles
a = src.index("    if (warp == 0) {\n        #pragma unroll\n        for (int i = 0; i < 2; ++i) {\n            const int row = g + 8 * i")
b = src.index("    // Each warp stages its tiles")
s = src[:a] + src[b:]
a = s.index("    if constexpr (ROPE) {\n        if (threadIdx.x < D / 2) {")
b = s.index("    __syncthreads();\n    float m[2] = {-INFINITY")
s = s[:a] + "    if (warp == 0) {\n      #pragma unroll\n      for (int ks = 0; ks < NS; ++ks) s_qa[ks][lane] = make_uint4(0x3c003c00u, 0u, 0x3c003c00u, 0u);\n    }\n" + s[b:]
put("p", s)
