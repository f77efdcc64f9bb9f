import mlx.core as mx
from runtime import qgemm
dt = mx.float16
def packed(n, k, seed):
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.bfloat16)
    p = mx.quantize(w, group_size=64, bits=4)
    return tuple(a.astype(dt) if a.dtype != mx.uint32 else a for a in p)
qkv = [packed(n, 4096, 30 + i) for i, n in enumerate((4096, 1024, 1024))]
x = mx.random.normal((3, 50, 4096), key=mx.random.key(43)).astype(dt)
runs = [qgemm.qgemm_parts(x, qkv, 64, head_dim=128) for _ in range(4)]
mx.eval(runs)
print("cluster runs equal to the first:", [[mx.array_equal(a, b).item() for a, b in zip(r, runs[0])] for r in runs])
split = qgemm.splits
qgemm.cluster_split = lambda n, k: 0
qgemm.splits = lambda n, k: 4
ref = qgemm.qgemm_parts(x, qkv, 64, head_dim=128)
ref2 = qgemm.qgemm_parts(x, qkv, 64, head_dim=128)
plain = qgemm.qgemm_parts(x, qkv, 64)
mx.eval(ref, ref2, plain)
print("sum launch S=4 runs equal:", [mx.array_equal(a, b).item() for a, b in zip(ref, ref2)])
print("cluster vs sum launch:", [mx.array_equal(a, b).item() for a, b in zip(runs[0], ref)])
for i, (a, b, p) in enumerate(zip(runs[0], ref, plain)):
    pb = p.reshape(3, 50, -1, 128).transpose(0, 2, 1, 3)
    d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
    print(i, "max diff", d.max().item(), "count", (d > 0).sum().item(), "sum-launch heads vs plain", mx.array_equal(b, pb).item(), "cluster vs plain", mx.array_equal(a, pb).item())
    w = mx.dequantize(*qkv[i], group_size=64, bits=4).astype(mx.float32)
    f = (x.astype(mx.float32).reshape(150, 4096) @ w.T).reshape(3, 50, -1, 128).transpose(0, 2, 1, 3)
    print("   vs float32: cluster", (mx.abs(a.astype(mx.float32) - f).max() / mx.abs(f).max()).item(), "sum", (mx.abs(b.astype(mx.float32) - f).max() / mx.abs(f).max()).item())
    if (d > 0).sum().item():
        idx = mx.argmax(d.reshape(-1)).item(); print("   at", idx, a.reshape(-1)[idx].item(), b.reshape(-1)[idx].item(), f.reshape(-1)[idx].item())
