FUSE_ROPE = True  # the flag on: prepare.FUSE_ROPE swapped in by module_ab
