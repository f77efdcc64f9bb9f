"""Run a benchmark module with prepare.FUSE_ROPE set: python .gpu/fuse.py on|off MODULE ARGS..."""
import runpy, sys
import runtime.prepare as prepare
prepare.FUSE_ROPE = sys.argv[1] == "on"
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
