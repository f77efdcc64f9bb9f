# occupancy of the qgemm product kernels' cubins: blocks an SM, and with compile-time clusters, active clusters
import ctypes, glob, re
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r: raise RuntimeError(f"{what}: CUDA error {r}")
ck(cu.cuInit(0), "init")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx"); ck(cu.cuCtxSetCurrent(ctx), "set")
class Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)]
for path in sorted(glob.glob(".gpu/occ/*.cubin")):
    image = open(path, "rb").read()
    name = re.search(rb"(_Z[0-9A-Za-z_]*kvactors_qgemm[0-9A-Za-z_]*)\x00", image).group(1)
    mod = ctypes.c_void_p(); ck(cu.cuModuleLoadData(ctypes.byref(mod), image), "load")
    f = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(f), mod, name), "func")
    n = ctypes.c_int(); ck(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), f, 128, 0), "occ")
    s = int(re.search(r"_s(\d+)_c(\d+)", path).group(2))
    line = f"{path}: {n.value} blocks an SM"
    if s:
        c = ctypes.c_int(); cfg = Config(s * 30, 1, 1, 128, 1, 1, 0, None, None, 0)
        r = cu.cuOccupancyMaxActiveClusters(ctypes.byref(c), f, ctypes.byref(cfg))
        line += f", cluster {s}: {c.value} clusters at once ({c.value * s} blocks; rc {r})"
    print(line)
