import statistics, time
import mlx.core as mx
from benchmarks.common import load_bench_model
from benchmarks.hot_chunk import served
from runtime import q4cache
from runtime.engine import Engine, Turn
from runtime.q4cache import merge_caches, route_for
model, tok, spec = load_bench_model("llama-8b-shape")
route = route_for(spec, None)
engine = Engine(model, tok, spec)
mx.random.seed(3)
own = served(engine, Turn("cold", "b", None, mx.random.randint(3, 1000, (4096,)).tolist(), max_tokens=1)).cache
real = q4cache._held_row
def run(fused):
    q4cache._held_row = real if fused else (lambda c: None)
    mx.synchronize(); t0 = time.perf_counter()
    c = merge_caches(spec, [own], route, room=72)
    t1 = time.perf_counter()
    mx.eval([x.state for x in c]); mx.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3
res = {True: [], False: []}
for i in range(40):
    res[i % 2 == 0].append(run(i % 2 == 0))
for k, v in res.items():
    v = v[2:]
    print("fused" if k else "a layer at a time", "build ms %.2f" % statistics.median(a for a, _ in v), "total ms %.2f" % statistics.median(b for _, b in v))
